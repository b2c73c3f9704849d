"""Generate seed corpora for the fuzz targets (no binary blobs are committed).

Usage: ``python fuzz/seeds.py OUTDIR`` writes ``OUTDIR/safetensors/*`` (valid files of every
dtype plus hand-built malformed files) and ``OUTDIR/pickle/*`` (torch checkpoints,
when torch is installed).
"""

from __future__ import annotations

import io
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import DTYPE_CODES, frame, nbytes_of  # noqa: E402


def valid_files() -> dict[str, bytes]:
    """Small valid files: every dtype, scalars, zero-size, several tensors, metadata."""
    out: dict[str, bytes] = {}
    shapes = {"F4": [2, 4], "F6_E2M3": [4], "F6_E3M2": [2, 4]}
    for i, code in enumerate(DTYPE_CODES):
        shape = shapes.get(code, [2, 3])
        size = nbytes_of(code, shape)
        assert size is not None
        hdr = {"t": {"dtype": code, "shape": shape, "data_offsets": [0, size]}}
        out[f"valid_{code}"] = frame(json.dumps(hdr).encode(), bytes(range(i, i + size)))
    hdr = {
        "__metadata__": {"format": "np", "k": "v"},
        "a": {"dtype": "F64", "shape": [], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]},
        "z": {"dtype": "U8", "shape": [0, 5], "data_offsets": [24, 24]},
        "c": {"dtype": "U8", "shape": [3, 1, 2], "data_offsets": [24, 30]},
    }
    out["valid_multi"] = frame(json.dumps(hdr).encode(), bytes(range(30)))
    out["valid_empty"] = frame(b"{}")
    out["valid_meta_null"] = frame(b'{"__metadata__":null}')
    from pysafetensors.numpy import save

    out["valid_saved"] = save(
        {"w": np.arange(24, dtype=np.float32).reshape(2, 3, 4), "i": np.arange(5, dtype=np.int64)},
        metadata={"m": "x"},
    )
    return out


def malformed_files() -> dict[str, bytes]:
    """Malformed safetensors files (lengths, JSON, entries, offsets, sizes), built by hand."""
    ok = b'{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    body = bytes(8)
    e = {
        "too_small": b"\x01\x02\x03",
        "len_past_end": struct.pack("<Q", 1000) + b"{}",
        "len_zero": struct.pack("<Q", 0),
        "bom": frame(b"\xef\xbb\xbf{}", pad=False),
        "nul_pad": frame(b"{}\x00\x00\x00\x00\x00\x00", pad=False),
        "not_object": frame(b"[]"),
        "deep": frame(b"[" * 300),
        "deep_extra": frame(b'{"t":{"dtype":"U8","shape":[],"data_offsets":[0,1],"x":'
                            + b"[" * 200 + b"]" * 200 + b"}}", b"x"),
        "trailing": frame(b"{}", b"xx"),
        "truncated": frame(ok, body)[:-2],
        "neg_offset": frame(b'{"t":{"dtype":"F32","shape":[2],"data_offsets":[-16,0]}}', body),
        "overlap": frame(b'{"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]},'
                         b'"b":{"dtype":"U8","shape":[16],"data_offsets":[8,24]}}', bytes(24)),
        "wrap": frame(b'{"t":{"dtype":"F32","shape":[4194305,4194305,211106198978564],'
                      b'"data_offsets":[0,16]}}', bytes(16)),
        "overflow_zero": frame(b'{"t":{"dtype":"U64","shape":[9223372036854775808,2,0],'
                               b'"data_offsets":[0,0]}}'),
        "zero_huge": frame(b'{"t":{"dtype":"F32","shape":[0,4611686018427387904],'
                           b'"data_offsets":[0,0]}}'),
        "ones": frame(b'{"t":{"dtype":"U8","shape":[' + b",".join([b"1"] * 200) + b'],'
                      b'"data_offsets":[0,1]}}', b"x"),
        "dtype_lower": frame(ok.replace(b"F32", b"f32"), body),
        "f6_bad": frame(b'{"t":{"dtype":"F6_E2M3","shape":[3],"data_offsets":[0,2]}}', b"xx"),
        "surrogate": frame(b'{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"),
        "dup_meta": frame(b'{"__metadata__":{},"__metadata__":{}}'),
        "meta_int": frame(b'{"__metadata__":{"a":1}}'),
        "meta_tensor": frame(b'{"__metadata__":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
                             b"x"),
        "dup_name": frame(b'{"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
                          b'"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', bytes(4)),
        "seq_entry": frame(b'{"t":["U8",[2],[0,2]]}', b"ab"),
        "tagged_dtype": frame(b'{"t":{"dtype":{"U8":null},"shape":[2],"data_offsets":[0,2]}}',
                              b"ab"),
        "neg_zero": frame(b'{"t":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'),
        "float_dim": frame(b'{"t":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}}', b"ab"),
        "nan": frame(b'{"__metadata__":{"a":NaN}}'),
    }  # fmt: skip
    return e


def pickle_files() -> dict[str, bytes]:
    """A few real torch checkpoints (zip and legacy, numpy values), if torch is installed."""
    try:
        import torch
    except ImportError:
        return {}
    out = {}
    sd = {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(3, dtype=torch.bfloat16),
        "i": torch.arange(4, dtype=torch.int64)[::2],
        "step": 3,
    }
    for legacy in (False, True):
        buf = io.BytesIO()
        torch.save(sd, buf, _use_new_zipfile_serialization=not legacy)
        out[f"ckpt_{'legacy' if legacy else 'zip'}"] = buf.getvalue()
    buf = io.BytesIO()
    torch.save({"t": torch.zeros(2, 2)}, buf, pickle_protocol=4)
    out["ckpt_p4"] = buf.getvalue()
    # Objects of classes the converter does not know (skipped with unknown="skip"), numpy
    # scalars and dtypes (decoded in both modes).
    import argparse

    import numpy as np

    buf = io.BytesIO()
    torch.save(
        {
            "w": torch.ones(2, 3),
            "args": argparse.Namespace(lr=0.1, mask=torch.zeros(2)),
            "metric": np.float64(0.5),
            "dtype": np.dtype(">i4"),
            "step": np.int64(3),
        },
        buf,
    )
    out["ckpt_unknown"] = buf.getvalue()
    # numpy arrays (decoded in both modes): a Trainer's RNG state, byte orders, Fortran order,
    # 0-d, empty and object arrays (the last skipped or refused).
    buf = io.BytesIO()
    torch.save(
        {
            "cpu": torch.ones(4, dtype=torch.uint8),
            "numpy": np.random.RandomState(0).get_state(),
            "be": np.arange(6, dtype=">f4").reshape(2, 3),
            "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
            "zero_d": np.array(1 + 2j),
            "empty": np.zeros((0, 3), dtype=np.bool_),
            "objects": np.array([1, None], dtype=object),
        },
        buf,
    )
    out["ckpt_numpy_arrays"] = buf.getvalue()
    return out


def main(outdir: str) -> None:
    for sub, files in (
        ("safetensors", {**valid_files(), **malformed_files()}),
        ("pickle", pickle_files()),
    ):
        os.makedirs(os.path.join(outdir, sub), exist_ok=True)
        for name, data in files.items():
            with open(os.path.join(outdir, sub, name), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main(sys.argv[1])
