"""Runs one fuzz target under atheris (libFuzzer), instrumenting only pysafetensors.

Modes:

* default: the first invariant violation crashes the run (libFuzzer writes ``crash-<sha1>``),
  which is what a quick local run or CI wants.
* ``FUZZ_FINDINGS=<folder>``: record every violation (input + traceback, one file per distinct
  signature) and keep going, so a long run counts inputs and distinct bugs instead of stopping
  at the first one, as the reference's ``fuzz.py`` tallies errors.

Hangs and memory blow-ups are left to libFuzzer (``-timeout=``, ``-rss_limit_mb=``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import sys
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import atheris  # noqa: E402

with atheris.instrument_imports(include=["pysafetensors", "_harness"]):
    import _harness  # noqa: E402

    import pysafetensors  # noqa: E402, F401
    import pysafetensors._format  # noqa: E402, F401
    import pysafetensors._reader  # noqa: E402, F401
    import pysafetensors._slicing  # noqa: E402, F401
    import pysafetensors._sources  # noqa: E402, F401
    import pysafetensors._validate  # noqa: E402, F401

    # Written by other developers; instrumented when present.
    for _optional in ("pysafetensors._torch_pickle", "pysafetensors._streaming"):
        with contextlib.suppress(ImportError):
            __import__(_optional)

FINDINGS = os.environ.get("FUZZ_FINDINGS")
_seen: dict[str, int] = {}


def _signature(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    frames = [f for f in traceback.extract_tb(cause.__traceback__) if "pysafetensors" in f.filename]
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "-"
    text = str(exc).split(":")[0][:60]
    return f"{type(cause).__name__}@{where}:{text}"


def record(data: bytes, exc: BaseException) -> None:
    """Save a violating input (once per signature) and count repeats."""
    assert FINDINGS is not None
    sig = _signature(exc)
    _seen[sig] = _seen.get(sig, 0) + 1
    if _seen[sig] == 1:
        os.makedirs(FINDINGS, exist_ok=True)
        h = hashlib.sha1(sig.encode()).hexdigest()[:12]
        with open(os.path.join(FINDINGS, f"{h}.bin"), "wb") as f:
            f.write(data)
        with open(os.path.join(FINDINGS, f"{h}.txt"), "w") as f:
            f.write(sig + "\n\n" + "".join(traceback.format_exception(exc)))
        print(f"\n#FINDING {sig}", file=sys.stderr, flush=True)
    if sum(_seen.values()) % 1000 == 1 or _seen[sig] == 1:
        with open(os.path.join(FINDINGS, "summary.txt"), "w") as f:
            for s, n in sorted(_seen.items()):
                f.write(f"{n}\t{s}\n")


def main(
    check: Callable[[bytes], Any],
    *,
    structured: bool = False,
    setup: Callable[[], None] | None = None,
) -> None:
    """Start libFuzzer on ``check``; ``structured`` adds the safetensors-aware mutator."""

    def one(data: bytes) -> None:
        try:
            check(data)
        except _harness.Violation as exc:
            if FINDINGS is None:
                raise
            record(data, exc)

    def mutator(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        try:
            out = _harness.mutate_file(data, rng, lambda b: atheris.Mutate(b, max(len(b) + 64, 64)))
        except Exception:  # noqa: BLE001 - a mutator bug must not end the run
            out = atheris.Mutate(data, max_size)
        return out[:max_size]

    if setup is not None:
        setup()
    kwargs: dict[str, Any] = {"custom_mutator": mutator} if structured else {}
    atheris.Setup(sys.argv, one, **kwargs)
    atheris.Fuzz()
