"""Exit codes, messages and layout at the command line's edges: a conversion onto its own
source, a shard its index names but the folder lacks, table columns holding combining and
wide characters, and the values ``--lock-timeout`` takes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pysafetensors.numpy import save_file


def test_converting_a_checkpoint_onto_itself_is_a_usage_error(cli, tmp_path: Path) -> None:
    """docs/cli.md: an output that would overwrite the source is exit 2, as for extract and
    merge; convert exited 1."""
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.ones(3)}, path)
    before = path.read_bytes()
    r = cli("convert", path, path)
    assert r.code == 2 and "source and destination are the same file" in r.err, r
    assert path.read_bytes() == before


def test_a_missing_shard_is_named_with_the_index_that_lists_it(cli, sharded: Path) -> None:
    """Python's "[Errno 2] No such file or directory" named the file but not why it was
    looked for."""
    (sharded / "model-00002-of-00002.safetensors").unlink()
    for command in ("inspect", "hash", "stats"):
        r = cli(command, sharded)
        assert r.code == 2 and r.out == "", (command, r)
        assert "shard model-00002-of-00002.safetensors is missing" in r.err, r.err
        assert "model.safetensors.index.json names it" in r.err and "Errno" not in r.err
    r = cli("validate", sharded)  # a problem of the model, as before
    assert r.code == 1 and "ShardMissing" in r.out


def test_table_columns_count_what_a_terminal_shows(cli, tmp_path: Path) -> None:
    """``len`` counted ``e`` + a combining accent as two columns and a CJK character as one:
    the rows holding them were misaligned."""
    path = tmp_path / "names.safetensors"
    names = ["e\u0301", "plain", "\u6a21\u578b"]  # one column, five, four
    save_file({n: np.zeros(2, np.float32) for n in names}, path)
    lines = cli("inspect", path).out.splitlines()
    rows = {n: line for line in lines for n in names if line.startswith(n)}
    assert len(rows) == 3
    shown = {n: 1 if n == "e\u0301" else 5 if n == "plain" else 4 for n in names}
    # Where DTYPE starts, in terminal columns: the same on every row.
    starts = {
        shown[n] + (len(row) - len(n) - len(row[len(n) :].lstrip())) for n, row in rows.items()
    }
    assert len(starts) == 1, rows


def test_lock_timeout_takes_a_fraction_and_refuses_nonsense(cli, tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": np.ones(2, np.float32)}, path)
    assert cli("metadata", "set", path, "k=v", "--lock-timeout", "0.5").code == 0
    for bad in ("-1", "nan", "inf", "soon"):
        r = cli("metadata", "set", path, "k=w", "--lock-timeout", bad)
        assert r.code == 2 and "--lock-timeout" in r.err, (bad, r)
