"""Fuzz target: pysafetensors vs the reference ``safetensors`` wheel on the same bytes.

Both must accept with equal tensors (names, dtypes, shapes, bytes, metadata) or both reject.
Known, intentional differences (``docs/differences.md``, "Found by differential fuzzing") are
listed in ``_harness.KNOWN_DIFFERENCES``; anything else is a violation.
"""

import _driver
from _harness import Violation, differential, known_difference


def check(data: bytes) -> None:
    found = differential(data)
    if found is not None and not known_difference(*found):
        raise Violation(f"disagreement: ours={found[0]!r} reference={found[1]!r}")


if __name__ == "__main__":
    import safetensors  # noqa: F401

    _driver.main(check, structured=True)
