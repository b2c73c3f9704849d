"""pysafetensors.tensorflow against TensorFlow and the reference's safetensors.tensorflow."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
pytest.importorskip("safetensors.tensorflow")

import pysafetensors.tensorflow as ptf  # noqa: E402

from .cases import same_bits  # noqa: E402
from .suite import FrameworkSuite  # noqa: E402

_CODES = (
    "BOOL F4 U8 I8 F8_E5M2 F8_E4M3 F8_E4M3FNUZ F8_E5M2FNUZ I16 U16 F16 BF16 I32 U32 F32 C64 F64 "
    "I64 U64"
)
_REF_READS = "BOOL U8 I8 I16 U16 F16 BF16 I32 U32 F32 C64 F64 I64 U64"


class TestTensorFlow(FrameworkSuite):
    module = "tensorflow"
    aliases = ("tf", "tensorflow")
    supported = frozenset(_CODES.split())
    ref_load_file = frozenset(_REF_READS.split())
    ref_load = frozenset(_REF_READS.split()) - {"BF16"}
    ref_save = supported - {"F4"}

    def to_fw(self, arr: np.ndarray) -> Any:
        return tf.convert_to_tensor(arr)

    def to_np(self, tensor: Any) -> np.ndarray:
        assert isinstance(tensor, tf.Tensor)
        return np.asarray(tensor.numpy())


def test_variables_are_saved_by_value() -> None:
    var = tf.Variable([[1.0, 2.0]], dtype=tf.bfloat16)
    loaded = ptf.load(ptf.save({"v": var}))
    assert loaded["v"].dtype == tf.bfloat16
    assert same_bits(loaded["v"].numpy(), var.numpy())


def test_sparse_refused() -> None:
    sparse = tf.sparse.SparseTensor(indices=[[0, 0]], values=[1.0], dense_shape=[2, 2])
    with pytest.raises(ValueError, match="sparse"):
        ptf.save({"s": sparse})


def test_keras_variables_saved_as_the_reference_saves_them() -> None:
    # Keras 3 variables are neither tf.Tensor nor tf.Variable; the reference calls .numpy() on
    # every value, so they are saved (every Keras model's weights are such variables).
    import safetensors.tensorflow as ref

    keras = pytest.importorskip("keras")
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    assert not isinstance(layer.kernel, (tf.Tensor, tf.Variable))
    data = ptf.save({"kernel": layer.kernel, "bias": layer.bias})
    assert data == ref.save({"kernel": layer.kernel, "bias": layer.bias})
    np.testing.assert_array_equal(ptf.load(data)["kernel"].numpy(), layer.kernel.numpy())


def test_ragged_refused() -> None:
    from pysafetensors import SerializeError

    with pytest.raises(SerializeError, match=r"tensor `r` is ragged .* \.to_tensor\(\)") as info:
        ptf.save({"r": tf.ragged.constant([[1], [2, 3]])})
    assert info.value.tensor == "r"


@pytest.mark.parametrize("value", [b"abc", [b"a", b"bc"]])
def test_string_tensors_are_refused_as_an_unknown_dtype(value: Any) -> None:
    # Whatever the shape (the reference's 0-d case fails with an AttributeError).
    from pysafetensors import SerializeError

    with pytest.raises(SerializeError, match='Unknown dtype "object"'):
        ptf.save({"s": tf.constant(value)})


def test_the_reference_modules_names() -> None:
    import pysafetensors
    import pysafetensors.numpy as pnp
    from pysafetensors.tensorflow import _np2tf, _tf2np, numpy, safe_open

    assert safe_open is pysafetensors.safe_open and numpy is pnp
    tensors = _np2tf({"a": np.ones(2, np.float32)})
    assert isinstance(tensors["a"], tf.Tensor)
    assert isinstance(_tf2np(tensors)["a"], np.ndarray)


def test_reference_mutates_the_dict_and_we_do_not() -> None:
    import safetensors.tensorflow as ref

    tensors = {"a": tf.ones((3,))}
    ptf.save(tensors)
    assert isinstance(tensors["a"], tf.Tensor)
    ref.save(tensors)
    assert isinstance(tensors["a"], np.ndarray)  # the reference's documented quirk


def test_no_paddle_import_after_tensorflow() -> None:
    # Importing paddle 3.3 after TensorFlow 2.21 crashes the interpreter, so the suite must
    # import paddle first (test_paddle.py skips itself otherwise). Keep that visible.
    assert "tensorflow" in sys.modules


def test_graph_tensors_are_refused_as_symbolic() -> None:
    """A graph tensor (tf.function, tf.compat.v1 graphs) has no values: the reference fails
    with ``AttributeError: 'SymbolicTensor' object has no attribute 'numpy'``; ours said
    "expected tf.Tensor ... but received SymbolicTensor", which is a tf.Tensor."""
    import safetensors.tensorflow as ref

    from pysafetensors import SerializeError

    with tf.Graph().as_default():
        symbolic = tf.constant([1.0, 2.0]) * 2
        assert isinstance(symbolic, tf.Tensor)
        with pytest.raises(AttributeError, match="numpy"):
            ref.save({"x": symbolic})
        symbolic_text = r"tensor `x` is a symbolic \(graph\) tensor"
        with pytest.raises(SerializeError, match=symbolic_text) as info:
            ptf.save({"x": symbolic})
    assert info.value.tensor == "x" and "expected tf.Tensor" not in str(info.value)
