"""The main job, end to end: save a model-shaped checkpoint, inspect it, load it back.

Run with ``make demo`` (which creates ``.venv`` and installs the project first). Everything is
written to a temporary folder that is removed at the end.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

import pysafetensors
from pysafetensors import safe_open
from pysafetensors.numpy import load_file, save_file

# A small LLaMA-shaped decoder: 4 layers, hidden 1024, MLP 2816, vocab 32000, bf16 (~234 MB).
HIDDEN, MLP, VOCAB, LAYERS, HEADS = 1024, 2816, 32000, 4, 16


def model_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random (never zero) weights with the names and shapes transformers uses."""

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    state = {"model.embed_tokens.weight": weight(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[p + f"self_attn.{proj}.weight"] = weight(HIDDEN, HIDDEN)
        state[p + "mlp.gate_proj.weight"] = weight(MLP, HIDDEN)
        state[p + "mlp.up_proj.weight"] = weight(MLP, HIDDEN)
        state[p + "mlp.down_proj.weight"] = weight(HIDDEN, MLP)
        state[p + "input_layernorm.weight"] = np.ones(HIDDEN, ml_dtypes.bfloat16)
        state[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, ml_dtypes.bfloat16)
    state["model.norm.weight"] = np.ones(HIDDEN, ml_dtypes.bfloat16)
    state["lm_head.weight"] = weight(VOCAB, HIDDEN)
    return state


def cli(*args: str) -> None:
    """Run the command-line tool as a user would."""
    print(f"\n$ pysafetensors {' '.join(args)}", flush=True)  # before the command's own output
    subprocess.run([sys.executable, "-m", "pysafetensors", *args], check=False)


def main() -> int:
    print(f"pysafetensors {pysafetensors.__version__}")
    rng = np.random.default_rng(0)
    state = model_state(rng)
    total = sum(a.nbytes for a in state.values())
    print(f"model: {len(state)} tensors, {total / 1e6:.1f} MB of bf16 weights")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"

        start = time.perf_counter()
        save_file(state, path, metadata={"format": "pt"})
        print(
            f"saved {path.name} ({path.stat().st_size / 1e6:.1f} MB) in "
            f"{time.perf_counter() - start:.2f} s"
        )

        cli("inspect", str(path), "--filter", "model.layers.0.*")
        cli("validate", str(path))

        with safe_open(path, framework="np") as f:
            print(f"\nopened: {len(f.keys())} tensors, metadata {f.metadata()}")
            rows = f.get_slice("lm_head.weight")[: VOCAB // 8]
            print(f"rank 0 of 8 rows of lm_head.weight: shape {rows.shape}, dtype {rows.dtype}")

        start = time.perf_counter()
        loaded = load_file(path, backend="pread")
        print(f"loaded every tensor (pread) in {time.perf_counter() - start:.2f} s")
        same = all(
            np.array_equal(loaded[k].view(np.uint16), v.view(np.uint16)) for k, v in state.items()
        )
        print(f"round trip exact: {same}")

        # Weights read straight into memory that is already there (a model's own arrays).
        weights = {name: np.ones_like(value) for name, value in state.items()}
        start = time.perf_counter()
        with safe_open(path, framework="np", backend="pread") as f:
            f.read_into(weights)
        elapsed = time.perf_counter() - start
        in_place = all(weights[k].tobytes() == v.tobytes() for k, v in state.items())
        print(f"read into existing arrays in {elapsed:.2f} s, exact: {in_place}")
        same = same and in_place

        try:
            import safetensors.numpy as reference
        except ImportError:
            reference = None
        if reference is not None:
            ref_path = Path(tmp) / "reference.safetensors"
            reference.save_file(
                {k: v for k, v in state.items()}, ref_path, metadata={"format": "pt"}
            )
            ours = hashlib.sha256(path.read_bytes()).hexdigest()
            theirs = hashlib.sha256(ref_path.read_bytes()).hexdigest()
            print(f"byte-identical to the reference implementation's file: {ours == theirs}")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
