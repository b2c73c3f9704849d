"""Fuzz target: the torch-free PyTorch checkpoint reader (zip and legacy pickle formats).

Skips (exits 0) while ``pysafetensors._torch_pickle`` does not exist.
"""

import sys

import _driver

if __name__ == "__main__":
    try:
        import pysafetensors._torch_pickle  # noqa: F401
    except ImportError:
        print("pysafetensors._torch_pickle not found: pickle target skipped")
        sys.exit(0)
    _driver.main(_driver._harness.check_pickle)
