"""Descriptors (SPEC section 7): TensorDesc, BatchNormalizationDesc, MeanVarianceNormalizationDesc,
Activation; ``validate()`` enforces every rule of the seeds' "Tensor constraints" / "Tensor support"
as SPEC extends them, raising DescriptorError naming the field and the rule; ``simdnorm.compile``
plans once and checks, per call, only that the arrays match the descriptors."""

from __future__ import annotations

import dataclasses
import math
import pickle
import re
import subprocess
import sys
import warnings
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import simdnorm
from cases import BF16, F16, F32, F64, AxisError, run_in_threads
from simdnorm import (
    Activation,
    BatchNormalizationDesc as BND,
    DescriptorError,
    MeanVarianceNormalizationDesc as MVND,
    TensorDesc as TD,
)

POISON = 1536.0  # exact in float16 and bfloat16 too
X = (2, 4, 3, 5)


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def td(shape=X, dtype=F32, strides=None):
    return TD(dtype, shape, strides)


def bnd(**kw):
    args = dict(input=td(), mean=td((4,)), variance=td((4,)), scale=None, bias=None)
    args.update(kw)
    return BND(**args)


def mvnd(**kw):
    args = dict(input=td(), axes=(2, 3))
    args.update(kw)
    return MVND(**args)


def assert_invalid(d, exc, msg):
    """validate() raises exc, a DescriptorError, with a message matching msg; so does compile."""
    with pytest.raises(exc, match=msg) as info:
        d.validate()
    assert isinstance(info.value, DescriptorError)
    with pytest.raises(DescriptorError, match=msg):
        simdnorm.compile(d)


# ----------------------------------------------------------------------------------------------
# TensorDesc
# ----------------------------------------------------------------------------------------------

def test_tensor_desc_normalizes():
    d = TD("float32", [2, np.int64(3)], [3, 1])
    assert d.dtype is F32 or d.dtype == F32
    assert d.sizes == (2, 3) and d.strides == (3, 1)
    assert all(type(s) is int for s in d.sizes + d.strides)
    assert d.ndim == 2 and d.byte_strides() == (12, 4)
    assert TD(ml_dtypes.bfloat16, (3,)).dtype == BF16
    assert TD(np.float32, np.array([2, 3])).sizes == (2, 3)
    assert d == TD(np.float32, (2, 3), (3, 1)) and hash(d) == hash(TD(np.float32, (2, 3), (3, 1)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.sizes = (1,)


def test_bfloat16_named_before_ml_dtypes_is_imported():
    """A descriptor is made before any array exists: "bfloat16" by name is ml_dtypes' bfloat16
    even in a process that has not imported ml_dtypes (numpy knows the name only after)."""
    code = (
        "import sys, simdnorm\n"
        "assert 'ml_dtypes' not in sys.modules\n"
        "d = simdnorm.TensorDesc('bfloat16', (2, 3))\n"
        "d.validate()\n"
        "import ml_dtypes, numpy as np\n"
        "assert d.dtype == np.dtype(ml_dtypes.bfloat16)\n"
        "e = simdnorm.TensorDesc(ml_dtypes.bfloat16, (2, 3))\n"
        "assert d == e and hash(d) == hash(e)\n"
        "op = simdnorm.compile(simdnorm.MeanVarianceNormalizationDesc(d, (1,)))\n"
        "assert op(np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3)).dtype == d.dtype\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_broadcast_input_gets_a_packed_default_output(rng):
    """Without an output descriptor the output is the input's, or packed where the input's strides
    broadcast or overlap (no output may): as np.empty_like lays out such an input's result."""
    x = np.broadcast_to(rng.standard_normal((1, 4, 5)).astype(np.float32), (3, 4, 5))
    xd = TD.from_array(x, strides=True)
    assert xd.strides == (0, 5, 1)
    m, v = np.zeros(4, np.float32), np.ones(4, np.float32)
    bn = simdnorm.BatchNormalizationDesc(xd, TD("float32", (4,)), TD("float32", (4,)))
    mvn = simdnorm.MeanVarianceNormalizationDesc(xd, 2)
    for d in (bn, mvn):
        assert d.output == TD("float32", x.shape)
        d.validate()
    np.testing.assert_array_equal(simdnorm.compile(bn)(x, m, v), simdnorm.batch_normalization(x, m, v))
    np.testing.assert_array_equal(simdnorm.compile(mvn)(x), simdnorm.mean_variance_normalization(x, 2))
    overlapping = TD("float32", (3, 4), (1, 1))
    assert simdnorm.MeanVarianceNormalizationDesc(overlapping, 1).output == TD("float32", (3, 4))
    transposed = TD("float32", (4, 3), (1, 4))
    assert simdnorm.MeanVarianceNormalizationDesc(transposed, 1).output is transposed
    with pytest.raises(simdnorm.DescriptorError, match="output.strides"):  # (given, it is checked)
        simdnorm.MeanVarianceNormalizationDesc(xd, 2, output=xd).validate()


def test_tensor_desc_from_array():
    a = np.ones((4, 6), F16)[:, ::-2]
    d = TD.from_array(a)
    assert d == TD(F16, (4, 3)) and d.strides is None
    ds = TD.from_array(a, strides=True)
    assert ds.strides == (6, -2)
    odd = np.ones(8, np.uint8)[1:].view(np.uint8)
    with pytest.raises(DescriptorError, match=r"strides: .* not multiples of the item size"):
        TD.from_array(np.lib.stride_tricks.as_strided(np.ones(8, F32), (3,), (6,)), strides=True)
    assert TD.from_array(odd).sizes == (7,)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.float64])
@pytest.mark.parametrize("strides", [None, (60, 15, 5, 1), (0, 0, 0, 0), (-60, 15, -5, 1), (1, 2, 8, 24)])
def test_tensor_desc_valid(dtype, strides):
    assert td(dtype=dtype, strides=strides).validate() is None
    assert td(shape=(0, 4), dtype=dtype).validate() is None


@pytest.mark.parametrize("desc,exc,msg", [
    (TD(np.int32, (2,)), TypeError, r"^t: dtype int32 is not supported; accepted: float32, float16, bfloat16"),
    (TD(np.bool_, (2,)), TypeError, r"^t: dtype bool is not supported"),
    (TD(np.complex64, (2,)), TypeError, r"^t: dtype complex64 is not supported"),
    (TD(">f4", (2,)), TypeError, r"^t: dtype >f4 \(non-native byte order\) is not supported"),
    (TD("nonsense", (2,)), TypeError, r"^t.dtype: 'nonsense' is not a numpy dtype"),
    (TD(None, (2,)), TypeError, r"^t.dtype: None is not a numpy dtype"),
    (TD(F32, ()), ValueError, r"^t: 0 dimensions \(shape \(\)\); tensors must have 1 to 8 dimensions"),
    (TD(F32, (1,) * 9), ValueError, r"^t: 9 dimensions .*1 to 8 dimensions"),
    (TD(F32, (2, -1)), ValueError, r"^t.sizes\[1\]: -1 is negative; sizes must be >= 0"),
    (TD(F32, (2, 1.5)), TypeError, r"^t.sizes\[1\]: expected an int, got float"),
    (TD(F32, (True, 2)), TypeError, r"^t.sizes\[0\]: expected an int, got bool"),
    (TD(F32, 5), TypeError, r"^t.sizes: expected a sequence of ints, got int"),
    (TD(F32, (2, 3), (1,)), ValueError, r"^t.strides: 1 strides for 2 sizes; give one stride per dim, or None"),
    (TD(F32, (2, 3), (1, 2.0)), TypeError, r"^t.strides\[1\]: expected an int, got float"),
    (TD(F32, (2, 3), 3), TypeError, r"^t.strides: expected None \(packed\) or a sequence of ints, got int"),
    # a set's order is not the caller's ({4, 2} iterates as 2, 4), a dict gives its keys: not sequences
    (TD(F32, {4, 2}), TypeError, r"^t.sizes: expected a sequence of ints, got set$"),
    (TD(F32, {2: 3}), TypeError, r"^t.sizes: expected a sequence of ints, got dict$"),
    (TD(F32, (n for n in (2, 3))), TypeError, r"^t.sizes: expected a sequence of ints, got generator$"),
    (TD(F32, (2, 3), frozenset({1, 3})), TypeError, r"^t.strides: expected None \(packed\) or a sequence of ints, "
                                                    r"got frozenset$"),
])
def test_tensor_desc_invalid(desc, exc, msg):
    with pytest.raises(exc, match=msg) as info:
        desc.validate("t")
    assert isinstance(info.value, DescriptorError) and isinstance(info.value, ValueError)


I64_MAX = 2 ** 63 - 1


@pytest.mark.parametrize("desc,msg", [
    # sizes, strides, element count and byte extent are int64 in numpy and in the kernels
    (TD(F32, (2, 10 ** 30)), r"^t.sizes\[1\]: about 10\*\*30 does not fit in int64; a size must be at most 2\*\*63 - 1$"),
    (TD(F32, (2, 10 ** 5000)), r"^t.sizes\[1\]: about 10\*\*5000 does not fit in int64"),
    (TD(F32, (0, 2 ** 63)), r"^t.sizes\[1\]: 9223372036854775808 does not fit in int64"),  # no element, still a size
    (TD(F32, (2, 2 ** 62)), r"^t: sizes \(2, 4611686018427387904\) hold 9223372036854775808 elements of 4 bytes = "
                            r"36893488147419103232 bytes, past int64 \(2\*\*63 - 1\); numpy makes no array that large"),
    (TD(F64, (2 ** 30, 2 ** 30)), r"^t: sizes \(1073741824, 1073741824\) hold 1152921504606846976 elements of 8 bytes"),
    (TD(F32, (2 ** 31,) * 3), r"^t: sizes .* hold about 10\*\*28 elements of 4 bytes = about 10\*\*28 bytes, past int64"),
    (TD(F32, (2, 3), (2 ** 70, 1)), r"^t.strides\[0\]: about 10\*\*21 elements of 4 bytes do not fit in int64 \(about "
                                    r"10\*\*21 bytes\); a stride in bytes must be within -2\*\*63 to 2\*\*63 - 1$"),
    (TD(F32, (2, 3), (1, 2 ** 61)), r"^t.strides\[1\]: 2305843009213693952 elements of 4 bytes .*\(9223372036854775808 "
                                    r"bytes\)"),
    (TD(F16, (2, 3), (1, -2 ** 62 - 1)), r"^t.strides\[1\]: -4611686018427387905 elements of 2 bytes do not fit"),
    (TD(F32, (1, 3), (-10 ** 5000, 1)), r"^t.strides\[0\]: about -10\*\*5000 elements"),
    (TD(F32, (0, 3), (2 ** 70, 1)), r"^t.strides\[0\]: about 10\*\*21 elements"),  # no element, still a stride
    (TD(F32, (3, 3), (2 ** 60, 2 ** 60)), r"^t: the byte extent of sizes \(3, 3\) with strides \(1152921504606846976, "
                                          r"1152921504606846976\) is 18446744073709551620 bytes .* at most 2\*\*63 - 9 bytes"),
    (TD(F32, (2, 3), (-2 ** 61, 1)), r"^t: the byte extent .* is 9223372036854775820 bytes"),
    (TD(F64, (2, 2), (2 ** 59, 2 ** 59)), r"^t: the byte extent .* is 9223372036854775816 bytes"),
    (TD(F16, (2,), (2 ** 62 - 4,)), r"^t: the byte extent .* is 9223372036854775802 bytes"),  # only the 8-byte room
    (TD(F32, (1,) * 8 + (10 ** 5000,)), r"^t: 9 dimensions \(shape \(1, 1, 1, 1, 1, 1, 1, 1, about 10\*\*5000\)\)"),
    (TD(F32, (2, -10 ** 5000)), r"^t.sizes\[1\]: about -10\*\*5000 is negative; sizes must be >= 0$"),
])
def test_tensor_desc_beyond_int64_is_refused(desc, msg):
    """numpy's shapes and strides, and the kernels' sizes, counts and byte offsets, are int64: a
    descriptor past them matches no array and would make the kernels' arithmetic wrap."""
    with pytest.raises(DescriptorError, match=msg) as info:
        desc.validate("t")
    assert type(info.value) is DescriptorError


@pytest.mark.parametrize("desc", [
    TD(F32, (0, I64_MAX)),  # no element: a size up to int64's maximum
    TD(F64, (2 ** 30, 2 ** 30 - 1)),  # count * itemsize just under 2**63
    TD(np.int8, (I64_MAX,)),  # a parameter's dtype is checked by the op: 1 byte each
    TD(F32, (1, 3), (2 ** 61 - 1, 1)),  # a size-1 dim: any stride whose bytes fit in int64
    TD(F16, (1, 3), (-2 ** 62, 1)),  # -2**63 bytes
    TD(F16, (2,), (2 ** 62 - 5,)),  # extent + 8 bytes of room = 2**63 - 1
    TD(F32, (0, 3), (2 ** 61 - 1, 2 ** 61 - 1)),  # no element: no extent
    TD(F32, (2 ** 30, 2 ** 30), (0, 0)),  # broadcast: 2**62 bytes as numpy counts them, 4 reached
])
def test_tensor_desc_at_the_int64_limits_is_accepted(desc):
    desc._check("t", "param")


def test_compile_refuses_sizes_and_strides_beyond_int64():
    with pytest.raises(DescriptorError, match=r"^input: sizes \(2, 4611686018427387904\) hold 9223372036854775808 "):
        simdnorm.compile(MVND(TD(F32, (2, 2 ** 62)), (1,)))
    with pytest.raises(DescriptorError, match=r"^output.strides\[0\]: about 10\*\*21 elements of 4 bytes do not fit"):
        simdnorm.compile(MVND(td(), (2, 3), output=td(strides=(2 ** 70, 1, 1, 1))))
    with pytest.raises(DescriptorError, match=r"^mean.sizes\[0\]: about 10\*\*30 does not fit in int64"):
        simdnorm.compile(bnd(mean=td((10 ** 30,))))
    with pytest.raises(DescriptorError, match=r"^scale: the byte extent of sizes \(2, 4, 3, 5\)"):
        simdnorm.compile(bnd(scale=td(strides=(2 ** 61 - 1, 1, 1, 1))))


# ----------------------------------------------------------------------------------------------
# BatchNormalizationDesc
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    {},
    dict(scale=td((4,)), bias=td((4,))),
    dict(mean=td((1, 4, 1, 1)), variance=td(X), scale=td((2, 1, 3, 1)), bias=td((1, 1, 1, 1))),
    dict(input=td((2, 3, 5, 4)), mean=td((4,)), variance=td((4,)), output=td((2, 3, 5, 4)), channel_axis=-1),
    dict(input=td(dtype=F16), mean=td((4,), F16), variance=td((4,), F32), output=td(dtype=F16)),
    dict(input=td(dtype=BF16), mean=td((4,), BF16), variance=td((4,), F32), output=td(dtype=BF16)),
    dict(input=td(dtype=F64), mean=td((4,), F64), variance=td((4,), F32), output=td(dtype=F64)),
    dict(output=td(strides=(1, 2, 8, 24))),
    dict(spatial=False, epsilon=0.0, activation="relu"),
    dict(activation=Activation("elu", alpha=0.5), epsilon=1),
    dict(input=td((6,)), mean=td((6,)), variance=td((1,)), channel_axis=1),  # 1-D: first rule
])
def test_bn_desc_valid(kw):
    assert bnd(**kw).validate() is None


@pytest.mark.parametrize("kw,exc,msg", [
    # seeds: all tensors the same DataType (SPEC: parameters may also be float32)
    (dict(mean=td((4,), F16)), TypeError,
     r"^mean: dtype float16 is not accepted with a float32 input; a parameter's dtype must be the input's "
     r"\(float32\) or float32"),
    (dict(input=td(dtype=F16), mean=td((4,), BF16), variance=td((4,), F16), output=td(dtype=F16)), TypeError,
     r"^mean: dtype bfloat16 is not accepted with a float16 input"),
    (dict(scale=td((4,), F64)), TypeError, r"^scale: dtype float64 is not accepted"),
    (dict(bias=td((4,), np.int8)), TypeError, r"^bias: dtype int8 is not accepted"),
    (dict(output=td(dtype=F16)), TypeError,
     r"^output: dtype float16 differs from the input's float32; the output must have the input's dtype"),
    # seeds: InputTensor and OutputTensor must have the same Sizes
    (dict(output=td((2, 4, 3, 6))), ValueError,
     r"^output: sizes \(2, 4, 3, 6\) differ from the input's \(2, 4, 3, 5\); the output must have the input's sizes"),
    (dict(output=td(strides=(60, 15, 0, 1))), ValueError,
     r"^output.strides\[2\]: 0 on a dim of size 3; the output cannot broadcast"),
    (dict(output=td(strides=(1, 1, 1, 1))), ValueError,
     r"^output.strides: \(1, 1, 1, 1\) on sizes \(2, 4, 3, 5\) give two elements the same address; the output's "
     r"elements cannot overlap$"),
    # seeds: the same DimensionCount (SPEC: or 1-D of length C); each dim the input's or 1
    (dict(mean=td((1, 4))), ValueError,
     r"^mean: shape \(1, 4\) does not fit the input's shape \(2, 4, 3, 5\): a parameter must either have the "
     r"input's 4 dims, each equal to the input's or 1 \(broadcast\), or be 1-D of length C = "
     r"input.shape\[channel_axis\] = 4 \(channel_axis=1\)"),
    (dict(variance=td((2, 4, 3, 2))), ValueError, r"^variance: shape \(2, 4, 3, 2\) does not fit"),
    (dict(scale=td((5,))), ValueError, r"^scale: shape \(5,\) does not fit"),
    (dict(mean=td((3,)), channel_axis=2), ValueError, r"^variance: shape \(4,\) does not fit.* = 3 \(channel_axis=2\)"),
    # dims: 1 to 8 for every tensor
    (dict(input=td(()), output=td(())), ValueError, r"^input: 0 dimensions"),
    (dict(mean=td((1,) * 9)), ValueError, r"^mean: 9 dimensions"),
    (dict(input=td(dtype=np.int16), output=td(dtype=np.int16)), TypeError, r"^input: dtype int16 is not supported"),
    (dict(channel_axis=4), AxisError, r"^channel_axis: axis 4 is out of range for an input of 4 dims"),
    (dict(channel_axis=1.0), TypeError, r"^channel_axis: expected an int, got float"),
    (dict(channel_axis=10 ** 5000), AxisError, r"^channel_axis: axis about 10\*\*5000 is out of range for an input of 4"),
    (dict(spatial=-10 ** 5000), TypeError, r"^spatial: expected a bool, got int \(about -10\*\*5000\)$"),
    (dict(epsilon=-1.0), ValueError, r"^epsilon: -1.0 is not allowed; epsilon must be finite and >= 0"),
    (dict(epsilon=math.nan), ValueError, r"^epsilon: nan is not allowed"),
    (dict(epsilon=math.inf), ValueError, r"^epsilon: inf is not allowed"),
    (dict(epsilon="small"), TypeError, r"^epsilon: expected a real number, got str"),
    # an int or Fraction past float64 (float() raises OverflowError): a bad epsilon like any other
    (dict(epsilon=10 ** 400), ValueError, r"^epsilon: an int of about 10\*\*400 \(beyond float64's range\) is not "
                                         r"allowed; epsilon must be finite and >= 0$"),
    (dict(epsilon=-10 ** 5000), ValueError, r"^epsilon: an int of about -10\*\*5000 \(beyond float64's range\)"),
    (dict(epsilon=Fraction(-10 ** 400)), ValueError, r"^epsilon: a Fraction beyond float64's range \(about -1.8e308\) "
                                                    r"is not allowed"),
    (dict(activation="relu6"), ValueError, r"^activation: unknown name 'relu6'; valid names: identity, linear, relu"),
    (dict(activation=7), TypeError, r"^activation: expected None, an activation name"),
    (dict(spatial="yes"), TypeError, r"^spatial: expected a bool, got str"),
    (dict(mean=None), TypeError, r"^mean: expected a TensorDesc, got NoneType"),
    (dict(mean=np.ones(4, F32)), TypeError, r"^mean: expected a TensorDesc, got ndarray"),
    (dict(scale=(4,)), TypeError, r"^scale: expected None or a TensorDesc, got tuple"),
    (dict(input="x"), TypeError, r"^input: expected a TensorDesc, got str"),
])
def test_bn_desc_invalid(kw, exc, msg):
    assert_invalid(bnd(**kw), exc, msg)


def test_bn_desc_output_defaults_to_input_and_is_frozen():
    d = bnd()
    assert d.output is d.input
    assert d.spatial is True and d.channel_axis == 1 and d.epsilon == 1e-5 and d.activation is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.epsilon = 1.0
    assert d == bnd() and hash(d) == hash(bnd())
    assert issubclass(DescriptorError, ValueError)


# ----------------------------------------------------------------------------------------------
# MeanVarianceNormalizationDesc
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    {},
    dict(axes=1), dict(axes=[0, 2, 3]), dict(axes=(-1, 0)), dict(axes=np.array([1, 2])),
    dict(scale=td((5,)), bias=td((3, 5))),
    dict(scale=td((1, 4, 1, 1)), bias=None),
    dict(scale=None, bias=td((4, 3, 1))),  # SPEC: scale and bias optional independently
    dict(input=td(dtype=F16), scale=td((5,), F32), bias=td((5,), F16), output=td(dtype=F16)),
    dict(normalize_mean=False, normalize_variance=False, epsilon_mode="outside", activation="gelu"),
])
def test_mvn_desc_valid(kw):
    d = mvnd(**kw)
    assert d.validate() is None


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(axes=()), ValueError, r"^axes: empty"),
    (dict(axes=(4,)), AxisError, r"^axes: axis 4 is out of range for an input of 4 dims \(valid: -4 to 3\)"),
    (dict(axes=(1, -3)), ValueError, r"^axes: axis 1 appears twice \(as 1 and -3\); each axis may appear once"),
    (dict(axes=(1.5,)), TypeError, r"^axes: expected ints, got float"),
    (dict(axes="1"), TypeError, r"^axes: expected an int or a sequence of ints, got str"),
    (dict(axes={2, 3}), TypeError, r"^axes: expected an int or a sequence of ints, got set; pass the axes as a tuple "
                                   r"or a list$"),
    (dict(axes={1: 2}), TypeError, r"^axes: expected an int or a sequence of ints, got dict; pass the axes"),
    (dict(scale=td((4,))), ValueError,
     r"^scale: shape \(4,\) does not broadcast to the input's shape \(2, 4, 3, 5\) without enlarging it: it needs "
     r"at most the input's 4 dims, aligned to the right as in numpy broadcasting, each equal to the input's or 1"),
    (dict(bias=td((1, 2, 4, 3, 5))), ValueError, r"^bias: shape \(1, 2, 4, 3, 5\) does not broadcast"),
    (dict(scale=td((5,), F64)), TypeError, r"^scale: dtype float64 is not accepted with a float32 input"),
    (dict(output=td((2, 4, 3))), ValueError, r"^output: sizes \(2, 4, 3\) differ from the input's"),
    (dict(output=td(dtype=F64)), TypeError, r"^output: dtype float64 differs from the input's float32"),
    (dict(output=td(strides=(15, 5, 1, 3))), ValueError,
     r"^output.strides: \(15, 5, 1, 3\) on sizes \(2, 4, 3, 5\) give two elements the same address"),
    (dict(output=td(strides=(-60, 12, 3, -2))), ValueError, r"^output.strides: \(-60, 12, 3, -2\) .* same address"),
    (dict(epsilon_mode="INSIDE"), ValueError, r"^epsilon_mode: 'INSIDE' is not valid; use 'inside'"),
    (dict(normalize_mean="yes"), TypeError, r"^normalize_mean: expected a bool"),
    (dict(normalize_mean=10 ** 5000), TypeError, r"^normalize_mean: expected a bool, got int \(about 10\*\*5000\)$"),
    (dict(axes=(2, 10 ** 5000)), AxisError, r"^axes: axis about 10\*\*5000 is out of range for an input of 4 dims"),
    (dict(epsilon_mode=-10 ** 5000), ValueError, r"^epsilon_mode: about -10\*\*5000 is not valid; use 'inside'"),
    (dict(epsilon=-0.1), ValueError, r"^epsilon: -0.1 is not allowed"),
    (dict(epsilon=10 ** 400), ValueError, r"^epsilon: an int of about 10\*\*400 \(beyond float64's range\) is not "
                                         r"allowed"),
    (dict(activation="nope"), ValueError, r"^activation: unknown name 'nope'"),
    (dict(input=td(dtype=np.uint16), output=td(dtype=np.uint16)), TypeError, r"^input: dtype uint16 is not supported"),
])
def test_mvn_desc_invalid(kw, exc, msg):
    assert_invalid(mvnd(**kw), exc, msg)


def test_mvn_desc_axes_normalized_and_hashable():
    d = mvnd(axes=[3, 2])
    assert d.axes == (3, 2)
    hash(d)
    assert mvnd(axes=2).axes == 2


# ----------------------------------------------------------------------------------------------
# compile
# ----------------------------------------------------------------------------------------------

def arrays(rng, shape=X, dtype=F32):
    x = rng.standard_normal(shape).astype(dtype)
    c = shape[1]
    m, s, b = (rng.standard_normal(c).astype(dtype) for _ in range(3))
    v = (rng.random(c) + 0.5).astype(dtype)
    return x, m, v, s, b


def test_compile_rejects_non_descriptors():
    with pytest.raises(TypeError, match=r"^compile: expected a BatchNormalizationDesc, MeanVarianceNormalizationDesc, "
                                        r"BatchNormalizationTrainingDesc, .*, got TensorDesc"):
        simdnorm.compile(td())


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=str)
def test_compiled_bn_matches_functional(dtype):
    rng = np.random.default_rng(0)
    x, m, v, s, b = arrays(rng, dtype=dtype)
    d = BND(td(dtype=dtype), td((4,), dtype), td((4,), dtype), td((4,), dtype), td((4,), dtype),
            epsilon=1e-3, activation="silu")
    op = simdnorm.compile(d)
    assert op.desc is d
    y = op(x, m, v, s, b)
    ref = simdnorm.batch_normalization(x, m, v, s, b, epsilon=1e-3, activation="silu")
    assert y.dtype == dtype
    np.testing.assert_array_equal(bits(y), bits(ref))
    out = np.full(X, POISON, dtype)
    assert op(x, m, v, s, b, out=out) is out
    np.testing.assert_array_equal(bits(out), bits(ref))
    # in place and any strides of the input when the descriptor gives none
    xt = np.asfortranarray(x)
    np.testing.assert_array_equal(bits(op(xt, m, v, s, b)), bits(ref))
    x2 = x.copy()
    op(x2, m, v, s, b, out=x2)
    np.testing.assert_array_equal(bits(x2), bits(ref))


def test_compiled_bn_checks_arrays_against_descriptors():
    rng = np.random.default_rng(1)
    x, m, v, s, b = arrays(rng)
    op = simdnorm.compile(BND(td(), td((4,)), td((4,)), td((4,))))
    out = np.full(X, POISON, F32)
    cases = [
        ((x.astype(F16), m, v, s), TypeError,
         r"^input: dtype float16 does not match the compiled descriptor's float32"),
        ((x[:, :, :, :4], m, v, s), ValueError,
         r"^input: shape \(2, 4, 3, 4\) does not match the compiled descriptor's sizes \(2, 4, 3, 5\)"),
        ((x, m[:3], v, s), ValueError, r"^mean: shape \(3,\) does not match"),
        ((x, m, v.astype(F64), s), TypeError, r"^variance: dtype float64 does not match"),
        ((x, m, v, None), ValueError, r"^scale: the descriptor has a scale tensor of sizes \(4,\); pass an array"),
        ((x, m, v, s, b), ValueError, r"^bias: the descriptor has no bias tensor; pass None"),
        ((x, m, v, "s"), TypeError, r"^scale: cannot convert str to a float32 array"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            op(*args, out=out)
        assert np.all(out == POISON)
    with pytest.raises(ValueError, match=r"^out: shape"):
        op(x, m, v, s, out=np.full((2, 4, 3, 6), POISON, F32))
    with pytest.raises(TypeError, match=r"^out: dtype float64 differs"):
        op(x, m, v, s, out=np.full(X, POISON, F64))
    # a parameter given as a list takes the descriptor's dtype; a list input is np.asarray'd (float64)
    y = op(x, m, v, s)
    np.testing.assert_array_equal(op(x, m.tolist(), v, s), y)
    with pytest.raises(TypeError, match=r"^input: dtype float64 does not match"):
        op(x.tolist(), m, v, s)


def test_compiled_explicit_strides_are_checked():
    rng = np.random.default_rng(2)
    x, m, v, s, b = arrays(rng)
    xt = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)  # channels-last memory
    strides = tuple(st // 4 for st in xt.strides)
    d = BND(td(strides=strides), td((4,)), td((4,)), output=td(strides=strides))
    op = simdnorm.compile(d)
    y = op(xt, m, v)
    np.testing.assert_array_equal(y, simdnorm.batch_normalization(x, m, v))
    with pytest.raises(ValueError, match=r"^input: strides \(240, 60, 20, 4\) \(bytes\) do not match the compiled "
                                         r"descriptor's strides \(60, 1, 20, 4\) \(elements\) = "
                                         r"\(240, 4, 80, 16\) bytes"):
        op(x, m, v)
    out = np.full(X, POISON, F32)
    with pytest.raises(ValueError, match=r"^out: strides \(240, 60, 20, 4\) \(bytes\) do not match the compiled "
                                         r"output descriptor's"):
        op(xt, m, v, out=out)
    assert np.all(out == POISON)
    good = np.empty_like(xt)
    assert op(xt, m, v, out=good) is good


def test_compiled_mvn():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(X).astype(F32)
    s = rng.standard_normal((3, 5)).astype(F32)
    d = MVND(td(), [-2, -1], td((3, 5)), None, epsilon=1e-3, epsilon_mode="outside", activation="tanh")
    op = simdnorm.compile(d)
    ref = simdnorm.mean_variance_normalization(x, (2, 3), s, epsilon=1e-3, epsilon_mode="outside",
                                               activation="tanh", return_stats=True)
    y, mu, inv = op(x, s, return_stats=True)
    for a, r in zip((y, mu, inv), ref):
        np.testing.assert_array_equal(a, r)
    assert mu.shape == (2, 4, 1, 1)
    out = np.full(X, POISON, F32)
    assert op(x, s, out=out) is out
    np.testing.assert_array_equal(out, y)
    with pytest.raises(ValueError, match=r"^bias: the descriptor has no bias tensor; pass None"):
        op(x, s, s, out=out)
    with pytest.raises(ValueError, match=r"^scale: the descriptor has a scale tensor"):
        op(x, out=out)
    np.testing.assert_array_equal(out, y)
    # overlap: out shifted against the input inside one buffer
    buf = rng.standard_normal((2, 4, 3, 6)).astype(F32)
    want = op(buf[..., :5].copy(), s)
    o = buf[..., 1:]
    op(buf[..., :5], s, out=o)
    np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)  # another input address: equal to a few ulp


# Output layouts (sizes, strides): each element its own address or not. The sufficient test (dims of
# size > 1 by |stride|, each |stride| past the span of those before) proves the first four; the next
# two fail it and are decided by their offsets (e.g. (3, 2) by (2, 3): 0, 3, 2, 5, 4, 7).
DISJOINT_OUTPUTS = [((4, 6), (6, 1)), ((4, 6), (1, 4)), ((4, 6), (-1, -4)), ((2, 1, 3), (3, 0, 1)),
                    ((3, 2), (2, 3)), ((2, 3, 2), (8, 2, -3))]
OVERLAPPING_OUTPUTS = [((4, 6), (1, 1)), ((3, 2), (1, 2)), ((2, 3, 4), (1, 2, 5)), ((4, 2, 3), (2, 3, 1)),
                       ((6, 4), (1, -3))]


@pytest.mark.parametrize("sizes,strides", OVERLAPPING_OUTPUTS, ids=str)
def test_output_whose_elements_overlap_is_refused(sizes, strides):
    """The kernels would write an element twice (two results, one address); only the output is held
    to this (inputs and parameters are read: they may overlap)."""
    msg = (rf"^output.strides: {re.escape(str(strides))} on sizes {re.escape(str(sizes))} give two elements the "
           r"same address; the output's elements cannot overlap$")
    assert_invalid(MVND(td(sizes), 0, output=td(sizes, strides=strides)), DescriptorError, msg)
    assert_invalid(BND(td(sizes), td((sizes[1],)), td((sizes[1],)), output=td(sizes, strides=strides)),
                   DescriptorError, msg)
    # read-only operands may overlap
    MVND(td(sizes, strides=strides), 0, td(sizes, strides=strides), output=td(sizes)).validate()
    BND(td(sizes, strides=strides), td(sizes, strides=strides), td((sizes[1],), strides=(0,)),
        output=td(sizes)).validate()


def test_output_not_proven_disjoint_is_refused():
    # (2**20, 3, 2) by (8, 2, 3) does not overlap (blocks of 8: 0, 3, 2, 5, 4, 7), but it fails the
    # sufficient test with more elements than the exact one takes
    sizes, strides = (1 << 20, 3, 2), (8, 2, 3)
    assert_invalid(MVND(td(sizes), 0, output=td(sizes, strides=strides)), DescriptorError,
                   r"^output.strides: \(8, 2, 3\) on sizes \(1048576, 3, 2\) could not be proven non-overlapping "
                   r"\(the sufficient test fails, and the exact one takes up to 4194304 elements\); the output's "
                   r"elements cannot overlap$")
    MVND(td((1 << 18, 3, 2)), 0, output=td((1 << 18, 3, 2), strides=strides)).validate()  # 1.5M: decided


@pytest.mark.parametrize("sizes,strides", DISJOINT_OUTPUTS, ids=str)
@pytest.mark.parametrize("dtype", [F32, F16, F64], ids=str)
def test_output_with_disjoint_elements_compiles_and_runs(sizes, strides, dtype):
    """Accepted, and the compiled operators write exactly those elements (out= of those strides over a
    poisoned buffer), matching the float64 reference; the buffer's other elements stay poisoned."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal(sizes).astype(dtype)
    c = sizes[1]
    m, s = rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)
    v = (rng.random(c) + 0.5).astype(dtype)
    off = [st * (n - 1) for n, st in zip(sizes, strides)]
    lo, hi = sum(o for o in off if o < 0), sum(o for o in off if o > 0)
    isz = np.dtype(dtype).itemsize
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == F16 else dict(rtol=1e-5, atol=1e-6)
    xd = x.astype(np.float64)
    shape1 = [1] * len(sizes)
    shape1[1] = c
    r = (s.reshape(shape1) * (xd - m.reshape(shape1)) / np.sqrt(v.reshape(shape1) + 1e-5)).astype(np.float64)
    mu, var = xd.mean(axis=0, keepdims=True), xd.var(axis=0, keepdims=True)
    cases = [(simdnorm.compile(MVND(td(sizes, dtype), 0, output=td(sizes, dtype, strides))), (x,),
              (xd - mu) / np.sqrt(var + 1e-5)),
             (simdnorm.compile(BND(td(sizes, dtype), td((c,), dtype), td((c,), dtype), td((c,), dtype),
                                   output=td(sizes, dtype, strides))), (x, m, v, s), r)]
    for op, args, want in cases:
        buf = np.full(hi - lo + 1, POISON, dtype)
        out = np.lib.stride_tricks.as_strided(buf[-lo:], sizes, tuple(st * isz for st in strides))
        assert op(*args, out=out) is out
        np.testing.assert_allclose(out.astype(np.float64), want, **tol)
        written = np.zeros(buf.size, bool)
        idx = np.indices(sizes).reshape(len(sizes), -1)
        written[-lo + np.asarray(strides) @ idx] = True
        assert np.all(buf[~written] == POISON)
        # without out=, a new result of the descriptor's layout (it was np.empty_like(x)'s), which
        # out= then takes, and the same values
        new = op(*args)
        assert new.strides == out.strides and new.dtype == out.dtype and new.flags.writeable
        assert np.array_equal(new, out, equal_nan=True)
        assert op(*args, out=new) is new


def test_compiled_in_place_with_parameter_inside_input():
    rng = np.random.default_rng(6)
    x = np.abs(rng.standard_normal((5, 4)).astype(F32)) + 0.5
    op = simdnorm.compile(BND(td((5, 4)), td((4,)), td((4,)), td((4,)), td((4,))))
    want = op(x, x[0].copy(), x[1].copy(), x[2].copy(), x[3].copy())
    x2 = x.copy()
    assert op(x2, x2[0], x2[1], x2[2], x2[3], out=x2) is x2
    np.testing.assert_allclose(x2, want, rtol=1e-6, atol=1e-6)
    opm = simdnorm.compile(MVND(td((5, 4)), -1, td((4,)), td((4,))))
    want = opm(x, x[0].copy(), x[1].copy())
    x3 = x.copy()
    opm(x3, x3[0], x3[1], out=x3)
    np.testing.assert_allclose(x3, want, rtol=1e-5, atol=1e-6)


def test_compiled_op_repr_and_desc():
    d = mvnd()
    op = simdnorm.compile(d)
    assert op.desc is d and "mean_variance_normalization" in repr(op)


def test_descriptor_pickled_compiles_to_the_same_operator():
    """compile()'s docstring: an operator does not pickle, its descriptor does; the descriptor sent
    through pickle (as to a worker process) compiles to an operator giving the same bits."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal(X).astype(F32)
    s = rng.standard_normal((3, 5)).astype(F32)
    mean, var = rng.standard_normal(4).astype(F32), rng.random(4).astype(F32) + 0.5
    cases = [(MVND(td(), (2, 3), td((3, 5)), None, epsilon=1e-3, epsilon_mode="outside",
                   activation=Activation("leaky_relu", alpha=0.2)), (x, s)),
             (BND(td(), td((4,)), td((4,)), epsilon=1e-2, activation="tanh"), (x, mean, var))]
    for d, args in cases:
        d2 = pickle.loads(pickle.dumps(d))
        assert d2 == d and d2 is not d
        np.testing.assert_array_equal(bits(simdnorm.compile(d2)(*args)), bits(simdnorm.compile(d)(*args)))


# ----------------------------------------------------------------------------------------------
# Activation
# ----------------------------------------------------------------------------------------------

def test_activation_defaults_and_identity():
    a = Activation("leaky_relu")
    assert a.name == "leaky_relu" and dict(a.params) == {"alpha": 0.01}
    assert a == Activation("leaky_relu", alpha=0.01) and hash(a) == hash(Activation("LEAKY_RELU"))
    assert a != Activation("leaky_relu", alpha=0.02) and a != "leaky_relu"
    assert repr(a) == "Activation('leaky_relu', alpha=0.01)"
    assert repr(Activation("relu")) == "Activation('relu')"
    assert dict(Activation("scaled_elu").params) == {"alpha": 1.67326, "gamma": 1.0507}
    assert dict(Activation("linear").params) == {"alpha": 1.0, "beta": 0.0}
    assert dict(Activation("parametric_softplus").params) == {"alpha": 1.0, "beta": 1.0}
    assert dict(Activation("clip").params) == {"min": -math.inf, "max": math.inf}
    assert dict(Activation("shrink").params) == {"bias": 0.0, "threshold": 0.5}
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.name = "relu"
    assert list(simdnorm.ACTIVATIONS) == [
        "identity", "linear", "relu", "leaky_relu", "thresholded_relu", "elu", "celu", "scaled_elu", "sigmoid",
        "hard_sigmoid", "tanh", "scaled_tanh", "softplus", "parametric_softplus", "softsign", "shrink", "gelu",
        "clip", "silu", "hard_swish"]


def test_activation_core_tuple_order():
    # the kernel receives (kind index in ACTIVATIONS order, p0, p1)
    names = list(simdnorm.ACTIVATIONS)
    for name in names:
        a = Activation(name)
        assert a._core[0] == names.index(name)
    assert Activation("scaled_elu", alpha=2.0, gamma=3.0)._core == (7, 2.0, 3.0)
    assert Activation("clip", min=-1, max=2)._core == (17, -1.0, 2.0)
    assert Activation("softplus", steepness=2)._core == (12, 2.0, 0.0)


@pytest.mark.parametrize("args,kw,exc,msg", [
    (("swish",), {}, ValueError, r"^activation: unknown name 'swish'; valid names: identity, linear, relu, "
                                 r"leaky_relu, thresholded_relu, elu, celu, scaled_elu, sigmoid, hard_sigmoid, tanh, "
                                 r"scaled_tanh, softplus, parametric_softplus, softsign, shrink, gelu, clip, silu, "
                                 r"hard_swish$"),
    ((3,), {}, TypeError, r"^activation: the name must be a str, got int"),
    (("relu",), dict(alpha=0.5), ValueError, r"^activation 'relu': unknown parameter\(s\) 'alpha'; 'relu' takes no "
                                             r"parameters"),
    (("elu",), dict(beta=1.0), ValueError, r"^activation 'elu': unknown parameter\(s\) 'beta'; 'elu' takes alpha=1.0"),
    (("hard_sigmoid",), dict(gamma=1.0), ValueError, r"'hard_sigmoid' takes alpha=0.2, beta=0.5"),
    (("softplus",), dict(steepness=0.0), ValueError, r"^activation 'softplus': parameter 'steepness' is 0.0; it must "
                                                     r"be > 0"),
    (("softplus",), dict(steepness=-1), ValueError, r"'steepness' is -1.0; it must be > 0"),
    (("celu",), dict(alpha=0), ValueError, r"'alpha' is 0.0; it must be non-zero"),
    (("shrink",), dict(threshold=-0.1), ValueError, r"'threshold' is -0.1; it must be >= 0"),
    (("clip",), dict(min=1.0, max=0.0), ValueError, r"^activation 'clip': min=1.0 > max=0.0; it must be min <= max"),
    (("clip",), dict(min=math.nan), ValueError, r"^activation 'clip': min is NaN"),
    (("elu",), dict(alpha=math.inf), ValueError, r"^activation 'elu': parameter 'alpha' is inf; it must be finite"),
    (("linear",), dict(beta=math.nan), ValueError, r"parameter 'beta' is nan; it must be finite"),
    (("linear",), dict(alpha="2"), TypeError,
     r"^activation 'linear': parameter 'alpha' must be a real number, got str"),
    (("linear",), dict(alpha=True), TypeError, r"parameter 'alpha' must be a real number, got bool"),
    # SPEC section 5: applied in float32, so every parameter (clip's excepted) finite there ...
    (("linear",), dict(alpha=1e300), ValueError, r"^activation 'linear': parameter 'alpha' is 1e\+300, beyond "
                                                 r"float32's largest finite value; activations are applied in float32, "
                                                 r"so it must be finite there: \|alpha\| <= 3.4028234663852886e\+38$"),
    (("linear",), dict(beta=-3.5e38), ValueError, r"^activation 'linear': parameter 'beta' is -3.5e\+38, beyond"),
    (("softplus",), dict(steepness=1e39), ValueError, r"'steepness' is 1e\+39, beyond float32's largest finite value"),
    (("leaky_relu",), dict(alpha=np.float64(-1e39)), ValueError, r"'alpha' is -1e\+39, beyond float32's largest"),
    (("scaled_elu",), dict(gamma=1e39), ValueError, r"^activation 'scaled_elu': parameter 'gamma' is 1e\+39, beyond"),
    (("scaled_elu",), dict(alpha=2e19, gamma=-2e19), ValueError,
     r"^activation 'scaled_elu': gamma \* alpha is -4e\+38, beyond float32's largest finite value"),
    (("hard_sigmoid",), dict(beta=1e39), ValueError, r"'beta' is 1e\+39, beyond"),
    (("shrink",), dict(threshold=1e39), ValueError, r"'threshold' is 1e\+39, beyond"),
    (("parametric_softplus",), dict(alpha=2 ** 200), ValueError, r"'alpha' is 1.6069\d*e\+60, beyond"),
    # ... and past float64 (float() raises OverflowError) a ValueError too
    (("leaky_relu",), dict(alpha=10 ** 400), ValueError,
     r"^activation 'leaky_relu': parameter 'alpha' is an int of about 10\*\*400 \(beyond float64's range\); "
     r"activations are applied in float32, so it must be finite there: \|alpha\| <= 3.4028234663852886e\+38$"),
    (("linear",), dict(beta=-10 ** 5000), ValueError, r"'beta' is an int of about -10\*\*5000 \(beyond float64's"),
    (("softplus",), dict(steepness=Fraction(10 ** 400)), ValueError,
     r"'steepness' is a Fraction beyond float64's range \(about 1.8e308\); activations are applied in float32"),
    (("celu",), dict(alpha=-2 ** 1024), ValueError, r"'alpha' is an int of about -10\*\*308 \(beyond float64's"),
    # ... and a divisor non-zero in float32 with a finite reciprocal there
    (("celu",), dict(alpha=1e-46), ValueError,
     r"^activation 'celu': parameter 'alpha' is 1e-46, which rounds to 0 in float32; the formula divides by it "
     r"\(x / alpha\): \|alpha\| in float32 must be at least 2.938737278354183e-39 \(1/alpha finite in float32\)$"),
    (("celu",), dict(alpha=-1e-40), ValueError, r"'alpha' is -1e-40, which has a reciprocal that overflows float32; "
                                                r"the formula divides by it"),
    (("celu",), dict(alpha=2.0 ** -128), ValueError, r"'alpha' is 2.93873\d*e-39, which has a reciprocal that "
                                                     r"overflows float32"),
    (("softplus",), dict(steepness=1e-46), ValueError, r"^activation 'softplus': parameter 'steepness' is 1e-46, which "
                                                       r"rounds to 0 in float32; the formula divides by it"),
    (("softplus",), dict(steepness=np.float64(1e-39)), ValueError, r"'steepness' is 1e-39, which has a reciprocal"),
])
def test_activation_invalid(args, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        Activation(*args, **kw)


def test_activation_accepts_numpy_scalars_and_inf_clip():
    a = Activation("clip", min=np.float32(-1), max=math.inf)
    assert a.params["max"] == math.inf and type(a.params["min"]) is float
    Activation("clip", min=-math.inf, max=-math.inf)
    Activation("softplus", steepness=0.25)


def test_activation_parameters_at_the_float32_limits_are_accepted():
    """The largest float32 for any parameter, beyond it for clip (it rounds to +-inf, a one-sided
    clip), and for a divisor the smallest float32 with a finite reciprocal (2**-128 + 2**-149)."""
    f32_max = float(np.finfo(np.float32).max)
    tiny = 2.0 ** -128 + 2.0 ** -149
    with np.errstate(over="ignore", divide="ignore"):
        assert np.isfinite(np.float32(1) / np.float32(tiny))
        assert np.isinf(np.float32(1) / np.nextafter(np.float32(tiny), np.float32(0)))
    assert Activation("linear", alpha=f32_max, beta=-f32_max).params == {"alpha": f32_max, "beta": -f32_max}
    assert Activation("clip", min=-1e39, max=1e300).params == {"min": -1e39, "max": 1e300}
    # past float64 too (float() raises OverflowError): +-inf, as they round in float32
    assert Activation("clip", min=-10 ** 400, max=Fraction(10 ** 400)).params == {"min": -math.inf, "max": math.inf}
    assert Activation("clip", min=10 ** 5000).params == {"min": math.inf, "max": math.inf}
    for name, p in (("celu", "alpha"), ("softplus", "steepness")):
        for v in (tiny, f32_max, np.float32(tiny)):
            assert Activation(name, **{p: v}).params[p] == float(v)
    assert Activation("celu", alpha=-tiny).params["alpha"] == -tiny


def test_compiled_param_memo_follows_the_arrays():
    # called again with the same parameter arrays (the usual inference loop): new values in the same
    # arrays, other arrays, and lists must all be seen
    rng = np.random.default_rng(4)
    x, m, v, s, b = arrays(rng)
    op = simdnorm.compile(BND(td(), td((4,)), td((4,)), td((4,)), td((4,))))
    bn = simdnorm.batch_normalization
    np.testing.assert_array_equal(op(x, m, v, s, b), bn(x, m, v, s, b))
    m[:] = rng.standard_normal(4)
    np.testing.assert_array_equal(op(x, m, v, s, b), bn(x, m, v, s, b))
    m2 = m + 1
    np.testing.assert_array_equal(op(x, m2, v, s, b), bn(x, m2, v, s, b))
    lst = [0.0, 1.0, 2.0, 3.0]
    np.testing.assert_array_equal(op(x, lst, v, s, b), bn(x, np.array(lst, F32), v, s, b))
    lst[0] = 5.0
    np.testing.assert_array_equal(op(x, lst, v, s, b), bn(x, np.array(lst, F32), v, s, b))
    # a remembered array still cannot be swapped for a mismatching one
    with pytest.raises(ValueError, match=r"^mean: shape \(5,\) does not match"):
        op(x, np.ones(5, F32), v, s, b)


def _set_strides(a, strides):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2.4 deprecates setting strides
        try:
            a.strides = strides
        except AttributeError:  # pragma: no cover - a numpy that no longer allows it
            pytest.skip("this numpy cannot set an array's strides in place")


def _reshape_in_place(a, shape):
    a.shape = shape


def _retype_in_place(a, dtype):
    a.dtype = dtype


# (name, descriptor, parameter name, arrays -> args, mutation, error message). Each mutation is of the
# same array object the operator was just called with; a fresh operator refuses the mutated array.
_C3 = (2, 3, 3, 3)  # C == H == W: a (3,) parameter reshaped to (3, 1) still broadcasts, along H
_IN_PLACE_CASES = [
    ("bn mean.shape", BND(td(_C3), td((3,)), td((3,))), "mean",
     lambda p: p.__setitem__("mean", np.array([0.0, 10.0, 20.0], F32)),
     lambda p: _reshape_in_place(p["mean"], (3, 1)),
     DescriptorError, r"^mean: shape \(3, 1\) does not match the compiled descriptor's sizes \(3,\)"),
    ("bn variance.shape", BND(td(_C3), td((3,)), td((3,))), "variance",
     lambda p: p.__setitem__("variance", np.array([1.0, 4.0, 9.0], F32)),
     lambda p: _reshape_in_place(p["variance"], (1, 1, 1, 3)),
     DescriptorError, r"^variance: shape \(1, 1, 1, 3\) does not match"),
    # float16 data, a float16 scale of shape (1, 3, 1, 2) retyped in place to float32, (1, 3, 1, 1): a
    # dtype the kernel takes (mixed precision) but the descriptor does not; pairs of bits read as one
    ("bn scale.dtype", BND(td((2, 3, 3, 2), F16), td((3,), F16), td((3,), F16), td((1, 3, 1, 2), F16),
                           output=td((2, 3, 3, 2), F16)), "scale",
     lambda p: p.__setitem__("scale", np.ones((1, 3, 1, 2), F16)),
     lambda p: _retype_in_place(p["scale"], F32),
     TypeError, r"^scale: dtype float32 does not match the compiled descriptor's float16"),
    ("bn mean.strides", BND(td(_C3), td((3,), strides=(2,)), td((3,))), "mean",
     lambda p: p.__setitem__("mean", np.array([0.0, 5.0, 10.0, 15.0, 20.0, 25.0], F32)[::2]),
     lambda p: _set_strides(p["mean"], (4,)),
     DescriptorError, r"^mean: strides \(4,\) \(bytes\) do not match the compiled descriptor's strides \(2,\)"),
    ("mvn scale.shape", MVND(td((2, 3, 3)), (2,), td((3, 1))), "scale",
     lambda p: p.__setitem__("scale", np.array([[1.0], [2.0], [3.0]], F32)),
     lambda p: _reshape_in_place(p["scale"], (1, 3)),
     DescriptorError, r"^scale: shape \(1, 3\) does not match the compiled descriptor's sizes \(3, 1\)"),
]


@pytest.mark.parametrize("case", _IN_PLACE_CASES, ids=[c[0] for c in _IN_PLACE_CASES])
def test_compiled_param_changed_in_place_is_checked_again(case):
    """numpy lets an array's shape, dtype and strides be reassigned in place: the operator, called
    again with the same (now mismatching) array object, must refuse it as a fresh operator does,
    not apply it along another axis (or as other bits) with the old check's blessing."""
    _, desc, name, make, mutate, exc, msg = case
    dt = desc.input.dtype
    x = np.random.default_rng(9).standard_normal(desc.input.sizes).astype(dt)
    params = {}
    make(params)
    if isinstance(desc, BND):
        params.setdefault("mean", np.zeros(3, dt))
        params.setdefault("variance", np.ones(3, dt))
    op = simdnorm.compile(desc)
    first = op(x, **params)
    np.testing.assert_array_equal(op(x, **params), first)  # the same arrays again: fine
    with warnings.catch_warnings():  # (numpy 2.5 deprecates setting an array's shape: still possible)
        warnings.simplefilter("ignore", DeprecationWarning)
        mutate(params)
    for fresh in (False, True):
        call = simdnorm.compile(desc) if fresh else op
        out = np.full(x.shape, POISON, dt)
        with pytest.raises(exc, match=msg) as info:
            call(x, **params, out=out)
        assert isinstance(info.value, DescriptorError)
        assert np.all(out == POISON), "out was written before the error"
        with pytest.raises(exc, match=msg):
            call(x, **params)


def test_compiled_op_from_many_threads():
    rng = np.random.default_rng(5)
    op = simdnorm.compile(BND(td(), td((4,)), td((4,)), td((4,)), td((4,))))
    sets = [arrays(rng) for _ in range(8)]
    want = [simdnorm.batch_normalization(*a) for a in sets]

    def work(i):
        for _ in range(200):
            np.testing.assert_array_equal(op(*sets[i]), want[i])

    run_in_threads(work, len(sets))
