"""The benchmark's input files: shapes, deterministic random contents, cached generation.

Files are written with the reference implementation so that the inputs do not depend on the
writer under test, and are filled with random bytes (never zeros) so that no layer of the
storage stack can compress or deduplicate them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

#: LLaMA-7B-like widths; four decoder layers plus embeddings and head give about 2 GiB in bf16.
HIDDEN = 4096
INTERMEDIATE = 11008
VOCAB = 32000


def llama_shapes(layers: int, hidden: int, inter: int, vocab: int) -> list[tuple[str, list[int]]]:
    """Tensor names and shapes of a LLaMA-shaped checkpoint (HF naming, bf16)."""
    out: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append((p + f"self_attn.{proj}.weight", [hidden, hidden]))
        out.append((p + "mlp.gate_proj.weight", [inter, hidden]))
        out.append((p + "mlp.up_proj.weight", [inter, hidden]))
        out.append((p + "mlp.down_proj.weight", [hidden, inter]))
        out.append((p + "input_layernorm.weight", [hidden]))
        out.append((p + "post_attention_layernorm.weight", [hidden]))
    out.append(("model.norm.weight", [hidden]))
    out.append(("lm_head.weight", [vocab, hidden]))
    return out


def lora_shapes(n: int) -> list[tuple[str, list[int]]]:
    """``n`` small adapter matrices (rank 16 by 256, alternating A/B), like a LoRA file."""
    out = []
    for i in range(n // 2):
        out.append((f"base_model.layers.{i}.lora_A.weight", [16, 256]))
        out.append((f"base_model.layers.{i}.lora_B.weight", [256, 16]))
    return out


def moe_shapes(n: int) -> list[tuple[str, list[int]]]:
    """``n`` tiny expert tensors: the header is what matters (a MoE checkpoint's index size)."""
    return [
        (f"model.layers.{i // 256}.mlp.experts.{i % 256}.w{i % 3}.weight", [8, 16])
        for i in range(n)
    ]


def specs(quick: bool) -> dict[str, list[tuple[str, list[int]]]]:
    """The files of a run, by key."""
    if quick:
        return {
            "llama": llama_shapes(2, 256, 688, 2000),
            "lora": lora_shapes(100),
            "moe": moe_shapes(2000),
        }
    return {
        "llama": llama_shapes(4, HIDDEN, INTERMEDIATE, VOCAB),
        "lora": lora_shapes(1000),
        "moe": moe_shapes(20000),
    }


def _random_arrays(
    shapes: list[tuple[str, list[int]]], seed: int
) -> Iterator[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    for name, shape in shapes:
        n = int(np.prod(shape)) if shape else 1
        # Random 16-bit patterns: bf16 values including some NaN/inf encodings, never zeros.
        yield name, rng.integers(1, 1 << 16, size=n, dtype=np.uint16).reshape(shape)


def ensure_file(folder: str, key: str, shapes: list[tuple[str, list[int]]]) -> str:
    """Create ``folder/key.safetensors`` unless an identical one is cached; return its path."""
    import torch
    from safetensors.torch import save_file

    path = os.path.join(folder, f"{key}.safetensors")
    stamp = path + ".shapes.json"
    want = json.dumps(shapes)
    if os.path.exists(path) and os.path.exists(stamp):
        with open(stamp) as f:
            if f.read() == want:
                return path
    os.makedirs(folder, exist_ok=True)
    tensors = {
        name: torch.from_numpy(arr).view(torch.bfloat16)
        for name, arr in _random_arrays(shapes, seed=len(key))
    }
    save_file(tensors, path)
    del tensors
    with open(stamp, "w") as f:
        f.write(want)
    return path


def module_like(path: str, device: str = "cpu") -> Any:
    """A module tree with a bf16 parameter per tensor of ``path``, of its name and shape, on
    ``device``, its memory written (as a constructed model's is): a model to ``load_model``
    the file into."""
    import torch

    from pysafetensors import safe_open

    root = torch.nn.Module()
    with safe_open(path, "pt") as f:
        for name in f.offset_keys():
            meta = f.get_tensor_meta(name)
            *parents, leaf = name.split(".")
            module = root
            for part in parents:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            value = torch.full(meta.shape, 0.5, dtype=torch.bfloat16, device=device)
            module.register_parameter(leaf, torch.nn.Parameter(value))
    return root
