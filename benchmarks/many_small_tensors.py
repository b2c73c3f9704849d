"""Write a file of many tiny tensors (a MoE or LoRA checkpoint's shape) to time commands on.

Usage: ``python benchmarks/many_small_tensors.py OUT.safetensors [--count 20000]``, then e.g.
``time pysafetensors stats OUT.safetensors > /dev/null`` and the same with ``--histogram``.
The tensors are BF16 of shape (8, 16), normal values with a few zeros, in expert-like names.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from pysafetensors.numpy import save_file


def main() -> None:
    """Write the file named on the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="file to write")
    p.add_argument("--count", type=int, default=20_000, help="tensors (default 20,000)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    tensors = {}
    for i in range(args.count):
        values = rng.standard_normal((8, 16)) * 0.02
        values[0, : i % 4] = 0.0
        tensors[f"model.layers.{i // 256}.mlp.experts.{i % 256}.w{i % 3}.weight"] = values.astype(
            ml_dtypes.bfloat16
        )
    save_file(tensors, args.out)


if __name__ == "__main__":
    main()
