"""The README's Python examples run as written, in order, and do what their comments say.

Every ```python block of README.md is executed in one namespace (later blocks use earlier
blocks' files and names), in a child process whose working directory is a fresh folder. Blocks
that need files the README assumes (a ``torch.save`` checkpoint to convert) get them from a
preamble here; the remote example's URL is pointed at a loopback range server. After some
blocks, checks compare the results with what the README's comments promise.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors.numpy import save_file

pytest.importorskip("torch")

README = Path(__file__).resolve().parents[2] / "README.md"
REMOTE_URL = "https://example.com/models/model.safetensors"

#: Code run right before the block containing the key (files the README takes as given).
PREAMBLES = {
    "convert_file(": """
import torch as _t
_sd = {"embed.weight": _t.randn(8, 4), "bias": _t.zeros(3)}
_sd["lm_head.weight"] = _sd["embed.weight"]          # tied, as in a real model
_t.save(_sd, "pytorch_model.bin")
import os as _os
_os.makedirs("src_dir", exist_ok=True)
_t.save({"w": _t.ones(2, 2)}, "src_dir/pytorch_model.bin")
import argparse as _argparse
class Config:  # pickled as __main__.Config, as a training script's own class is
    lr = 0.1
import sys as _sys
_sys.modules["__main__"].Config = Config  # where pickle looks the class up
_t.save(
    {"model": {"w": _t.ones(2)}, "args": _argparse.Namespace(lr=0.1), "config": Config()},
    "checkpoint.pt",
)
class Net(_t.nn.Module):  # a whole model, pickled with its class as __main__.Net
    def __init__(self):
        super().__init__()
        self.fc1 = _t.nn.Linear(4, 3)
        self.fc2 = _t.nn.Linear(3, 2)
_sys.modules["__main__"].Net = Net
_net = Net()
_t.save(_net, "model.pt")
""",
}

#: Checks run right after the block containing the key: the README's comments, verified.
CHECKS = {
    'metadata={"format": "np"}': """
assert tensors["weight"].shape == (2, 3) and str(tensors["weight"].dtype) == "bfloat16"
assert int(tensors["step"]) == 7
""",
    'missing, unexpected = load_model(model, "linear.safetensors")': """
assert (missing, unexpected) == (set(), [])  # the reference returns a set and a list
assert w.dtype == torch.bfloat16 and tuple(w.shape) == (4, 4)
""",
    "everything = f.get_tensors()": """
assert part.shape == (2, 2) and sorted(everything) == ["step", "weight"]
assert meta is not None
""",
    "deserialize(data)": """
_out = deserialize(data)
assert _out[0][0] == "a" and _out[0][1]["shape"] == [4] and _out[0][1]["dtype"] == "F32"
assert bytes(_out[0][1]["data"]) == a.tobytes()
""",
    "plan = save_sharded(": """
assert sorted(plan.filename_to_tensors) == [
    f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
]
assert (missing, unexpected) == (set(), [])
""",
    'f.shard_of("layers.3.weight")': """
with safe_open("ckpt", framework="pt") as _f:
    assert _f.metadata() == {"total_size": "2097152", "producer": "me"}
    assert _f.shard_of("layers.3.weight") == "ckpt/model-00002-of-00003.safetensors"
    assert _f.shard_metadata() == [{"format": "pt"}] * 3
assert torch.equal(w, state_dict["layers.3.weight"])
assert torch.equal(rows, state_dict["layers.5.weight"][:16])
assert sorted(tensors) == sorted(state_dict)
""",
    "with StreamingWriter(": """
with safe_open("big.safetensors", framework="np") as _f:
    assert _f.get_slice("embed").get_shape() == [32000, 4096]
with safe_open("streamed", framework="np") as _f:
    assert sorted(_f.keys()) == ["embed", "head"]
""",
    'reshard("ckpt", "ckpt-2MB"': """
import os as _os
assert _os.path.exists("merged.safetensors") and _os.path.exists("first-layers.safetensors")
with safe_open("first-layers.safetensors", framework="np") as _f:
    assert sorted(_f.keys()) == [f"layers.{i}.weight" for i in range(4)]
with safe_open("odd", framework="np") as _f:
    assert sorted(_f.keys()) == [f"layers.{i}.weight" for i in (1, 3, 5, 7)]
""",
    "part = load_shard(": """
assert sorted(part) == ["step", "weight"]
""",
    'rows = f.get_slice("embed.weight")[:128]': """
assert rows.shape == (128, 16)
""",
    "report = convert_file(": """
assert report.skipped_objects == {"args": "argparse.Namespace", "config": "__main__.Config"}
assert list(whole.modules.items())[:2] == [
    ("", "__main__.Net"),
    ("fc1", "torch.nn.modules.linear.Linear"),
]
assert whole.tensors == list(_net.state_dict())
with safe_open("model.safetensors", framework="pt") as _f:
    assert _f.keys() == ["model.w"]
with safe_open("dst_dir", framework="pt") as _f:
    assert _f.keys() == ["w"]
""",
}

_CHILD = """
import json, sys, traceback
blocks = json.load(open(sys.argv[1], encoding="utf-8"))
namespace = {"__name__": "__main__"}
for index, (title, code) in enumerate(blocks):
    try:
        exec(compile(code, f"README block {index} ({title})", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED block {index} ({title}):\\n{code}", file=sys.stderr)
        sys.exit(1)
    print("ok", index, title, flush=True)
"""


def readme_blocks() -> list[str]:
    """The ```python blocks of the README, in order."""
    text = README.read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_every_check_and_preamble_names_a_block() -> None:
    blocks = readme_blocks()
    assert len(blocks) >= 10
    for key in [*PREAMBLES, *CHECKS, REMOTE_URL]:
        assert sum(key in block for block in blocks) == 1, f"{key!r} is in no or several blocks"


def test_readme_python_examples_run(tmp_path: Path, range_server_class: Any) -> None:
    served = tmp_path / "served"
    served.mkdir()
    rng = np.random.default_rng(0)
    save_file(
        {"embed.weight": rng.standard_normal((20_000, 16)).astype(np.float32)},
        served / "model.safetensors",
    )
    server = range_server_class(served)
    try:
        program = []
        for block in readme_blocks():
            title = block.strip().splitlines()[-1][:60]
            for key, code in PREAMBLES.items():
                if key in block:
                    program.append((f"preamble: {title}", code))
            program.append((title, block.replace(REMOTE_URL, server.url("model.safetensors"))))
            for key, code in CHECKS.items():
                if key in block:
                    program.append((f"check: {title}", code))
        work = tmp_path / "work"
        work.mkdir()
        (tmp_path / "blocks.json").write_text(json.dumps(program), encoding="utf-8")
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, str(tmp_path / "blocks.json")],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert run.stdout.count("ok ") == len(program)
        # The remote example fetched the head of the file (64 KiB) and the rows it sliced.
        size = (served / "model.safetensors").stat().st_size
        assert 0 < server.bytes_sent("model.safetensors") < (64 << 10) + 128 * 64 + 1 < size // 4
    finally:
        server.close()
