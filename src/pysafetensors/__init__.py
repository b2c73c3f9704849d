"""pysafetensors: the safetensors format in pure Python, byte-compatible with the reference.

The top level imports no framework. Framework functions live in ``pysafetensors.numpy``,
``pysafetensors.torch``, ``pysafetensors.flax``, ``pysafetensors.tensorflow``,
``pysafetensors.paddle`` and ``pysafetensors.mlx``; ``pysafetensors.parallel`` loads across
processes, ``pysafetensors.convert`` and ``pysafetensors.scan`` handle pickle checkpoints, and
``pysafetensors.tuning`` chooses the read and save strategies for the whole process.
"""

from __future__ import annotations

import contextlib

from ._api import TensorSpec, deserialize, serialize, serialize_file
from ._errors import (
    CheckpointError,
    ClosedFileError,
    DeviceError,
    DTypeNotSupportedError,
    HeaderDecodeError,
    HeaderError,
    HeaderSizeError,
    MetaTensorError,
    NestedTensorError,
    OffsetError,
    ReadError,
    RemoteError,
    RemoteNotFoundError,
    RemotePermissionError,
    SafetensorError,
    SerializeError,
    SharedTensorsError,
    SliceError,
    SliceTypeError,
    SliceValueError,
    TensorInfoError,
    TensorNotFoundError,
    UnsafePickleError,
    UnstorableDTypeError,
    WriteError,
)
from ._format import MAX_HEADER_SIZE
from ._metadata_edit import edit_metadata
from ._reader import SafeSlice, TensorMeta, safe_open
from ._reader import _safe_open_handle as _safe_open_handle  # the reference exports it too
from ._reshard import extract, merge, reshard
from ._sharded import MissingShardError, ShardedSafeOpen, ShardIndexError
from ._sharding import ShardPlan, save_sharded
from ._streaming import ShardedStreamingWriter, StreamingWriter
from ._writer import StaleFileWarning

__version__ = "0.1.0"

__all__ = [
    "MAX_HEADER_SIZE",
    "CheckpointError",
    "ClosedFileError",
    "DTypeNotSupportedError",
    "DeviceError",
    "HeaderDecodeError",
    "HeaderError",
    "HeaderSizeError",
    "MetaTensorError",
    "MissingShardError",
    "NestedTensorError",
    "OffsetError",
    "ReadError",
    "RemoteError",
    "RemoteNotFoundError",
    "RemotePermissionError",
    "SafeSlice",
    "SafetensorError",
    "SerializeError",
    "ShardIndexError",
    "ShardPlan",
    "ShardedSafeOpen",
    "ShardedStreamingWriter",
    "SharedTensorsError",
    "SliceError",
    "SliceTypeError",
    "SliceValueError",
    "StaleFileWarning",
    "StreamingWriter",
    "TensorInfoError",
    "TensorMeta",
    "TensorNotFoundError",
    "TensorSpec",
    "UnsafePickleError",
    "UnstorableDTypeError",
    "WriteError",
    "__version__",
    "deserialize",
    "edit_metadata",
    "extract",
    "merge",
    "reshard",
    "safe_open",
    "save_sharded",
    "serialize",
    "serialize_file",
]


# Show public names as pysafetensors.X in reprs and tracebacks.
def _set_module() -> None:
    for name in __all__:
        obj = globals()[name]
        if isinstance(obj, type) or callable(obj):
            with contextlib.suppress(AttributeError, TypeError):
                obj.__module__ = __name__


_set_module()
