"""The compact-header fast path agrees with the generic parser on every input.

``_canonical_header`` may only ever return the generic parser's result or decline (None). The
tests feed it headers written by the reference and by this library, then thousands of small
corruptions of such headers: each must be declined, or parsed to exactly what the generic path
returns, and never accepted where the generic path refuses.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import numpy as np
import pytest

from pysafetensors import _format as fmt
from pysafetensors._errors import SafetensorError
from pysafetensors.numpy import save

ref_np = pytest.importorskip("safetensors.numpy")


def _split(blob: bytes) -> tuple[str, int, int]:
    n = struct.unpack("<Q", blob[:8])[0]
    return blob[8 : 8 + n].decode("utf-8"), n, len(blob) - 8 - n


def _generic(text: str, n: int, data_size: int) -> Any:
    try:
        return fmt._parse_generic(text, n, data_size, "")
    except SafetensorError as exc:
        return type(exc)


def _tensors(rng: random.Random) -> dict[str, np.ndarray]:
    dtypes = [np.float32, np.float16, np.int8, np.int64, np.uint16, np.bool_, np.float64]
    out = {}
    for i in range(rng.randint(1, 12)):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
        dt = rng.choice(dtypes)
        out[f"layer.{i}.{rng.choice(['w', 'bias', 'weight', 'x' * 30])}"] = np.ones(shape, dt)
    return out


def _headers() -> list[bytes]:
    rng = random.Random(1234)
    blobs = []
    for i in range(40):
        tensors = _tensors(rng)
        meta = {"format": "pt", "k": str(i)} if i % 3 == 0 else None
        blobs.append(save(tensors, metadata=meta))
        blobs.append(ref_np.save(tensors, metadata={"format": "np"} if i % 4 == 0 else None))
    return blobs


HEADERS = _headers()


def test_writers_headers_take_the_fast_path_and_agree() -> None:
    for blob in HEADERS:
        text, n, data_size = _split(blob)
        fast = fmt._canonical_header(text, n, data_size)
        assert fast is not None, text
        assert fast == fmt._parse_generic(text, n, data_size, "")
        assert list(fast.tensors) == list(fmt._parse_generic(text, n, data_size, "").tensors)


def test_metadata_only_first_and_exact() -> None:
    blob = save({"a": np.zeros(2, np.float32)}, metadata={"x": "1", "y": "2"})
    text, n, data_size = _split(blob)
    header = fmt._canonical_header(text, n, data_size)
    assert header is not None and header.metadata == {"x": "1", "y": "2"}
    # A repeated metadata key (serde keeps the last) is left to the generic path.
    dup = text.replace('"y":"2"', '"x":"2"')
    assert fmt._canonical_header(dup, n, data_size) is None
    assert fmt._parse_generic(dup, n, data_size, "").metadata == {"x": "2"}


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('"shape":[', '"shape": ['),  # other spacing
        ('{"dtype"', '{"dtype" '),
        ('"data_offsets":[0,', '"data_offsets":[00,'),  # not a JSON integer
        # Numbers are matched loosely and held to their canonical form afterwards:
        ('"data_offsets":[0,8]', '"data_offsets":[0,08]'),  # a leading zero in an end
        ('"data_offsets":[8,', '"data_offsets":[08,'),  # ... in a begin
        ('"shape":[2]', '"shape":[02]'),  # ... in a dimension
        ('"shape":[2]', '"shape":[2,]'),  # a trailing comma
        ('"shape":[2]', '"shape":[,2]'),  # a leading comma
        ('"shape":[2]', '"shape":[1,,2]'),  # an empty dimension
        ('"shape":[2]', '"shape":[' + "0" * 21 + "2]"),  # over 20 digits
        ('"F32"', '"F33"'),  # unknown dtype
        ('"a"', '"b"'),  # a repeated name
        ('"a"', '"__metadata__"'),
    ],
)
def test_unusual_forms_are_declined(old: str, new: str) -> None:
    blob = save({"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)})
    text, n, data_size = _split(blob)
    changed = text.replace(old, new, 1)
    assert changed != text
    assert fmt._canonical_header(changed, n, data_size) is None
    # The generic parser decides such a header (and refuses the number forms JSON lacks).
    generic = _generic(changed, n, data_size)
    assert generic is not None


def test_zero_size_and_sub_byte_tensors_use_the_generic_path() -> None:
    for tensors in ({"a": np.zeros((0, 3), np.float32), "b": np.ones(2, np.float32)},):
        text, n, data_size = _split(save(tensors))
        assert fmt._canonical_header(text, n, data_size) is None
        assert fmt.parse_header(text.encode(), data_size).tensors.keys() == tensors.keys()


ALPHABET = '{}[],:"0123456789 \\abF_\x01'


def _mutate(text: str, rng: random.Random) -> str:
    i = rng.randrange(len(text) + 1)
    op = rng.randrange(4)
    if op == 0:  # insert
        return text[:i] + rng.choice(ALPHABET) + text[i:]
    if op == 1 and i < len(text):  # delete
        return text[:i] + text[i + 1 :]
    if op == 2 and i < len(text):  # replace
        return text[:i] + rng.choice(ALPHABET) + text[i + 1 :]
    j = rng.randrange(len(text) + 1)  # move a span
    a, b = sorted((i, j))
    span = text[a:b][:12]
    k = rng.randrange(len(text) + 1)
    return text[:k] + span + text[k:]


def test_corruptions_are_declined_or_agree() -> None:
    rng = random.Random(99)
    accepted = 0
    for trial in range(6000):
        text, n, data_size = _split(HEADERS[trial % len(HEADERS)])
        for _ in range(rng.randint(1, 3)):
            text = _mutate(text, rng)
        # Keep the offsets' total plausible half the time, so that more mutants get far.
        size = data_size if trial % 2 else data_size + rng.randint(-4, 4)
        fast = fmt._canonical_header(text, n, size)
        if fast is None:
            continue
        accepted += 1
        slow = _generic(text, n, size)
        assert fast == slow, text
        assert list(fast.tensors) == list(slow.tensors)
    # Some mutants (within names, digits that keep sizes consistent) stay valid.
    assert accepted > 50


def test_large_header_agrees() -> None:
    tensors = {
        f"model.layers.{i // 64}.experts.{i % 64}.w{i % 3}": np.ones((2, 3), np.float16)
        for i in range(5000)
    }
    text, n, data_size = _split(save(tensors, metadata={"format": "pt"}))
    fast = fmt._canonical_header(text, n, data_size)
    assert fast is not None
    assert fast == fmt._parse_generic(text, n, data_size, "")


@pytest.mark.parametrize(
    "dtypes", [(np.float16, np.float16, np.float16), (np.float16, np.float32, np.float16)]
)
def test_a_size_that_disagrees_with_its_shape_is_refused(dtypes: tuple[Any, ...]) -> None:
    # One dtype and several dtypes take different size checks; a shape that no longer fits
    # its offsets (the total unchanged) must fall to the generic path, which refuses it.
    tensors = {f"t{i}": np.ones((2, 4), dt) for i, dt in enumerate(dtypes)}
    text, n, data_size = _split(save(tensors))
    assert fmt._canonical_header(text, n, data_size) is not None
    for changed in (
        text.replace('"t0":{"dtype":"F16","shape":[2,4]', '"t0":{"dtype":"F16","shape":[2,2]'),
        text.replace('"t2":{"dtype":"F16","shape":[2,4]', '"t2":{"dtype":"F16","shape":[4,4]'),
    ):
        assert changed != text
        assert fmt._canonical_header(changed, n, data_size) is None
        refused = _generic(changed, n, data_size)
        assert isinstance(refused, type) and issubclass(refused, SafetensorError)
        with pytest.raises(SafetensorError, match="t0|t2"):
            fmt.parse_header(changed.encode(), data_size)


@pytest.mark.parametrize("meta", ["{}", "null", '{"a":"b","c":""}'])
def test_metadata_forms_agree(meta: str) -> None:
    text = '{"__metadata__":' + meta + ',"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}  '
    fast = fmt._canonical_header(text, len(text), 8)
    assert fast is not None
    assert fast == fmt._parse_generic(text, len(text), 8, "")


def test_metadata_without_tensors_is_left_to_the_generic_path() -> None:
    text = '{"__metadata__":{"a":"b"}}'
    assert fmt._canonical_header(text, len(text), 0) is None
    assert fmt.parse_header(text.encode(), 0).metadata == {"a": "b"}


@pytest.mark.parametrize(
    "name",
    [
        "caf\u00e9.w\u00e8ight",  # non-ASCII
        "a\u00a0b",  # a no-break space: not printable, yet a plain JSON string character
        "\u2028line",  # a line separator, which JSON strings may hold raw
        ":{dtype:",  # the structure's own texts inside a name (no quote: still one piece)
        "],data_offsets:[0,8]},",
        "",
        " ",
        "\x7f",
    ],
)
def test_names_of_any_kind_take_the_fast_path(name: str) -> None:
    text = (
        '{"' + name + '":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        '"z":{"dtype":"F32","shape":[],"data_offsets":[8,12]}}'
    )
    fast = fmt._canonical_header(text, len(text.encode()), 12)
    assert fast is not None
    assert fast == fmt._parse_generic(text, len(text.encode()), 12, "")
    assert list(fast.tensors) == [name, "z"]


@pytest.mark.parametrize("char", ["\x00", "\x01", "\t", "\n", "\x1f"])
def test_control_characters_in_names_are_left_to_the_generic_path(char: str) -> None:
    text = '{"a' + char + '":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    assert fmt._canonical_header(text, len(text), 8) is None
    assert _generic(text, len(text), 8) is not None


@pytest.mark.parametrize(
    "entry",
    [
        # An extra string member shifts the pieces by four; two of them by eight, and five
        # (here over three entries) by a multiple of ten: the fixed pieces no longer line up.
        '"x":{"dtype":"F32","k":"v","shape":[2],"data_offsets":[0,8]}',
        '"x":{"dtype":"F32","k":"v","l":"w","shape":[2],"data_offsets":[0,8]}',
        '"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"a":"1","b":"2","c":"3","d":"4",'
        '"e":"5"}',
        '"x":{"shape":[2],"dtype":"F32","data_offsets":[0,8]}',  # fields in another order
        '"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}',  # three offsets
        '"x":{"dtype":"F32","shape":[2],"data_offsets":[0]}',
        '"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"x":{"dtype":"F32","shape":[2],'
        '"data_offsets":[0,8]}',  # a repeated name
        '"x":{"dtype":"F32","shape":2,"data_offsets":[0,8]}',
        '"x":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}',
    ],
)
def test_misplaced_pieces_are_declined(entry: str) -> None:
    text = "{" + entry + "}"
    assert fmt._canonical_header(text, len(text), 8) is None
    assert _generic(text, len(text), 8) is not None


def test_a_compact_header_builds_its_entries_once_on_first_use(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening and listing names never builds the per-entry records; the first read does, once."""
    import pysafetensors

    calls = []
    real = fmt._tensor_infos

    def counting(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(fmt, "_tensor_infos", counting)
    tensors = {f"layer.{i}.weight": np.full((3, 2), i, np.float32) for i in range(50)}
    path = tmp_path / "m.safetensors"
    path.write_bytes(save(tensors, metadata={"format": "np"}))
    with pysafetensors.safe_open(path, "np") as f:
        assert f.keys() == sorted(tensors)
        assert f.offset_keys() == sorted(tensors)  # the writers' order: same dtype, by name
        assert len(f) == 50
        assert f.metadata() == {"format": "np"}
        assert f.header.data_size == 50 * 24
        assert calls == []
        np.testing.assert_array_equal(f.get_tensor("layer.7.weight"), tensors["layer.7.weight"])
        assert calls == [1]
        assert "layer.3.weight" in f
        assert f.get_slice("layer.9.weight")[1:].tolist() == [[9.0, 9.0], [9.0, 9.0]]
        loaded = f.get_tensors()
        assert calls == [1]
    assert all(np.array_equal(loaded[k], v) for k, v in tensors.items())


def test_a_deferred_header_matches_the_generic_one_however_it_is_read() -> None:
    text, n, data_size = _split(HEADERS[0])
    fast = fmt._canonical_header(text, n, data_size)
    generic = fmt._parse_generic(text, n, data_size, "")
    assert fast is not None
    assert list(fast.names) == list(generic.names) == list(generic.tensors)
    assert fast.data_size == generic.data_size == data_size
    assert fast.data_start == generic.data_start == 8 + n
    assert repr(fast) == repr(generic)
    assert fast == generic
    assert fast != "a header"
    with pytest.raises(TypeError):
        hash(fast)


def test_a_deferred_header_pickles_and_copies_as_its_entries() -> None:
    import copy
    import pickle

    text, n, data_size = _split(HEADERS[3])
    for make in (
        lambda: fmt._canonical_header(text, n, data_size),
        lambda: fmt._parse_generic(text, n, data_size, ""),
    ):
        header = make()
        assert header is not None
        for other in (pickle.loads(pickle.dumps(header)), copy.copy(header), copy.deepcopy(header)):
            assert other == header
            assert list(other.names) == list(header.names)
            assert other.data_size == header.data_size


def test_threads_racing_to_build_the_entries_all_get_them() -> None:
    import threading

    tensors = {f"w{i}": np.ones((i % 7 + 1, 3), np.float16) for i in range(2000)}
    text, n, data_size = _split(save(tensors))
    expected = fmt._parse_generic(text, n, data_size, "").tensors
    for _ in range(20):
        header = fmt._canonical_header(text, n, data_size)
        assert header is not None
        barrier = threading.Barrier(8)
        seen: list[Any] = []

        def read(header: Any, barrier: threading.Barrier, seen: list[Any]) -> None:
            barrier.wait()
            seen.append(header.tensors)

        threads = [threading.Thread(target=read, args=(header, barrier, seen)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(seen) == 8
        assert all(list(s.items()) == list(expected.items()) for s in seen)
        assert header.tensors is header.tensors  # kept once built
