"""A server error while reading a tensor names the tensor and where it lies."""

from __future__ import annotations

import pytest

from pysafetensors import SafetensorError, safe_open

from .rangeserver import RangeServer


def test_a_server_error_names_the_tensor_being_read(server: RangeServer) -> None:
    url = server.url("model.safetensors")
    with safe_open(url, "np", storage_options={"retries": 0}) as f:
        name = f.offset_keys()[-1]
        server.inject("model.safetensors", 404)
        with pytest.raises(SafetensorError) as info:
            f.get_tensor(name)
        assert info.value.tensor == name and info.value.offset is not None
        assert "404" in str(info.value) and f"reading tensor {name!r}" in str(info.value)
