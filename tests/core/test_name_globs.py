"""Globs over tensor names: one set lookup and one compiled expression, fnmatch's answers."""

from __future__ import annotations

import fnmatch
import random

from pysafetensors._name_globs import glob_matcher
from pysafetensors._reshard import select_names

NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.10.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
    "a]b",
    "a[b",
    "back\\slash",
    "new\nline",
    "ünïcode.weight",
    "",
    "*",
    "?",
]

GLOBS = [
    "*",
    "model.layers.*",
    "model.layers.?.*",
    "*.weight",
    "model.norm.weight",
    "[!m]*",
    "[a-l]*",
    "a]b",
    "a[[]b",
    "back\\slash",
    "new*",
    "*[0-9]*",
    "ünïcode.*",
    "",
    "[*]",
    "[?]",
    "model.*.q_proj.*",
    "nothing.like.this",
]


def test_matches_what_fnmatchcase_matches() -> None:
    rng = random.Random(0)
    for size in range(len(GLOBS) + 1):
        for _ in range(20):
            globs = rng.sample(GLOBS, size)
            accept = glob_matcher(globs)
            for name in NAMES:
                expected = any(fnmatch.fnmatchcase(name, g) for g in globs)
                assert accept(name) is expected, (globs, name)


def test_many_exact_names_and_globs_select_in_one_pass() -> None:
    # 1,000 exact names among 100,000 and a few globs: the same selection as fnmatchcase's,
    # in the file's order (each glob tried per name took ~30 s for this).
    names = [f"model.layers.{i // 100}.experts.{i % 100}.weight" for i in range(100_000)]
    picked = names[::100]
    globs = [*picked, "model.layers.999.*", "model.layers.5?.experts.7.weight"]
    chosen = select_names(names, globs)
    expected = [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in globs[-2:])]
    position = {name: i for i, name in enumerate(names)}
    assert chosen == sorted(set(picked) | set(expected), key=position.__getitem__)
