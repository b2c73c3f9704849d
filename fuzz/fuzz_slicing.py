"""Fuzz target: ``_slicing.plan_slice`` against numpy indexing, any dtype, shape and index."""

import random

import _driver
from _harness import DTYPE_CODES, random_index


def check(data: bytes) -> None:
    if len(data) < 4:
        return
    rng = random.Random(data)
    dtype = DTYPE_CODES[data[0] % len(DTYPE_CODES)]
    ndim = data[1] % 5
    shape = tuple(b % 7 for b in data[2 : 2 + ndim])
    if len(shape) < ndim:
        return
    if rng.random() < 0.05:
        shape = (*shape, rng.choice([2**40, 2**62]))
        shape = (0, *shape)
    for _ in range(4):
        _driver._harness.check_plan(dtype, shape, random_index(rng, ndim, shape))


if __name__ == "__main__":
    _driver.main(check)
