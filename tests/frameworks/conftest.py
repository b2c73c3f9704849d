"""Parametrize the framework suite's per-dtype tests from each framework's class attributes."""

from __future__ import annotations

import pytest

from .suite import codes_for


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "codes(attr): run once per dtype code listed in the test class's attr"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("codes")
    if marker is None or metafunc.cls is None:
        return
    codes = codes_for(metafunc.cls, marker.args[0])
    metafunc.parametrize("code", codes)
