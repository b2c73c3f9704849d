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


def test_a_stall_mid_body_counts_what_arrived(server: RangeServer, data_dir) -> None:
    """A server that sends half a range and then nothing: the timeout's error says how much
    came, and the source counts it. The response's buffered reader filled all it was given
    before returning, so the count was lost: "after 0 of 4128900 bytes"."""
    import numpy as np

    from pysafetensors.numpy import save_file

    save_file(
        {"a": np.zeros(4, np.uint8), "b": np.ones(4 << 20, np.uint8)},
        data_dir / "stalling.safetensors",
    )
    from pysafetensors._remote import HTTPSource

    source = HTTPSource(server.url("stall/stalling.safetensors"), retries=0, timeout=0.5)
    try:
        source.stats.reset()
        with pytest.raises(SafetensorError) as info:
            source.readinto(source.size - (4 << 20), memoryview(bytearray(4 << 20)))
        came = source.stats.bytes_fetched
    finally:
        source.close()
    text = str(info.value)
    assert info.value.kind == "Truncated", text
    got, total = (int(n) for n in text.split("after ")[1].split(" bytes")[0].split(" of "))
    # Half the range came; what a receive of at most 1 MiB was filling is not counted.
    assert 1 << 20 <= got <= total // 2, text
    assert came >= got
