"""Fuzz target: the streaming writer, fed fuzzed tensor sequences; the result must read back.

Skips (exits 0) while ``pysafetensors._streaming`` does not exist.
"""

import sys

import _driver

if __name__ == "__main__":
    if _driver._harness.streaming_module() is None:
        print("pysafetensors._streaming not found: streaming target skipped")
        sys.exit(0)
    _driver.main(_driver._harness.check_streaming)
