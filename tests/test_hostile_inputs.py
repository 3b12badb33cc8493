"""The hostile-input catalogue: one table of invalid calls, each with its exception type and message
regex, and in every case a poisoned ``out`` (a view at an odd byte offset inside a padded, byte-
poisoned buffer) compared byte for byte afterwards: no error path writes anything.

tests/test_validation.py already covers, and this table does not repeat:
  * input dtypes int32/int64/uint8/bool/complex64/object/>f4/>f2 on all six functions
    (test_unsupported_input_dtype_is_type_error), ranks 0 and 9 without out
    (test_rank_zero_and_nine_are_value_errors);
  * batch-norm parameter shapes and the (input, parameter) dtype matrix (test_bn_param_*);
  * epsilon NaN/inf/-inf/negative/non-real on all six functions (test_bad_epsilon_is_value_error,
    test_epsilon_type), epsilon_mode;
  * axes out of range/duplicate/empty/float/bool/str/None/2-D (test_axes_errors);
  * unknown activation names and non-activation types (test_activation_errors);
  * out as a list, of the wrong dtype or shape, read-only, broadcast (test_out_errors);
  * the conveniences' own rules (num_groups, per-channel shapes, channel_axis 0).
tests/test_descriptors.py covers TensorDesc rules and compiled-operator argument mismatches.
What is here: the remaining dtypes (ml_dtypes' others, datetime, str, structured, longdouble, big-
endian float64, un-convertible Python objects), masked arrays that mask an element (input or
parameter: the mask would be ignored), None for a required parameter, ranks 0/9 with out and for
parameters, channel mismatches by channel_axis, parameter dtypes outside SPEC §2/§3 (bool, complex,
object, big-endian, the wrong half type) on every function, epsilon through the descriptor/compile
path, axes spelled in numpy types, bad activation parameters, out objects that are not arrays, are
read-only views or are masked arrays that mask an element (the mask would hide results), and
sizes/strides whose byte extent overflows 64-bit arithmetic (run in a subprocess each: a package
without that check crashes, which must show as a failure, not kill pytest).
"""

from __future__ import annotations

import fractions
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Optional

import ml_dtypes
import numpy as np
import pytest

import simdnorm
from cases import BF16, F16, F32, F64, AxisError
from simdnorm import (
    Activation,
    BatchNormalizationDesc,
    MeanVarianceNormalizationDesc,
    TensorDesc,
)

POISON = 0xA5
PAD = 64

bn = simdnorm.batch_normalization
mvn = simdnorm.mean_variance_normalization
ln = simdnorm.layer_norm
rms = simdnorm.rms_norm
inorm = simdnorm.instance_norm
gn = simdnorm.group_norm

SHAPE = (2, 4, 3, 5)
X = np.random.default_rng(0).standard_normal(SHAPE).astype(F32)
C4 = np.linspace(0.5, 2.0, 4).astype(F32)
ACCEPTED = r"accepted: float32, float16, bfloat16.*float64"
PARAM_RULE = r"a parameter's dtype must be the input's \({dt}\) or float32"


def p(shape=(4,), dtype=F32, value=1.0):
    return np.full(shape, value, dtype)


def x_as(dtype, shape=SHAPE):
    return np.ones(shape).astype(dtype)


# ----------------------------------------------------------------------------------------------
# poisoned out inside a padded buffer
# ----------------------------------------------------------------------------------------------

class Padded:
    """`array`: a view at an odd byte offset inside a uint8 buffer with PAD poisoned bytes either
    side; the whole buffer (padding and array) is poisoned and `untouched()` checks every byte."""

    def __init__(self, shape, dtype=F32, writeable=True):
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.buf = np.full(n + 2 * PAD + 1, POISON, np.uint8)
        self.array = np.ndarray(shape, dtype, buffer=self.buf, offset=PAD + 1)
        if not writeable:
            self.array.flags.writeable = False

    def untouched(self) -> bool:
        return bool((self.buf == POISON).all())


class Opaque:
    """An out that is not a writeable ndarray (bytearray, memoryview, read-only memory ...): the
    bytes it shows are compared afterwards."""

    def __init__(self, obj, raw):
        self.array, self.raw = obj, raw
        self.before = bytes(raw)

    def untouched(self) -> bool:
        return bytes(self.raw) == self.before


@dataclass
class Row:
    id: str
    call: Callable[..., Any]  # call(out=...) runs the op; out=None runs it without out
    exc: type
    msg: str
    out: Optional[Callable[[], Any]] = None  # the poisoned out to pass (default: like SHAPE, F32)
    without_out: bool = True  # also run it without out (same error expected)


ROWS: list = []


def row(id, call, exc, msg, out=None, without_out=True):
    ROWS.append(Row(id, call, exc, msg, out, without_out))


def out_like(shape=SHAPE, dtype=F32):
    return lambda: Padded(shape, dtype)


# ---- 1. input dtypes and objects (SPEC §1: TypeError naming the dtype and what is accepted) ------
for _dt, _name, _fn in [
    (np.int8, "int8", mvn), (np.uint64, "uint64", bn), (np.longdouble, None, ln), (np.complex128, "complex128", rms),
    ("datetime64[s]", r"datetime64\[s\]", inorm), ("timedelta64[ms]", r"timedelta64\[ms\]", gn),
    ("<U3", "<U3", mvn), ("S3", r"\|S3", bn), ([("a", "<f4")], r"\[\('a', '<f4'\)\]", ln),
    (">f8", r">f8 \(non-native byte order\)", mvn), (ml_dtypes.float8_e5m2, "float8_e5m2", bn),
    (ml_dtypes.float8_e4m3fn, "float8_e4m3fn", ln), (ml_dtypes.int4, "int4", mvn),
]:
    _d = np.dtype(_dt)
    if _name is None:
        if _d == F64:  # pragma: no cover - platforms where long double is double
            continue
        _name = str(_d)
    _call = {mvn: lambda x, **k: mvn(x, -1, **k), bn: lambda x, **k: bn(x, C4, C4, **k), ln: ln, rms: rms,
             inorm: inorm, gn: lambda x, **k: gn(x, 2, **k)}[_fn]
    row(f"dtype-{_d.str}-{_fn.__name__}", (lambda c, d: lambda **k: c(np.zeros(SHAPE, d), **k))(_call, _d),
        TypeError, rf"^input: dtype {_name} is not supported; {ACCEPTED}")

row("input-None", lambda **k: ln(None, **k), TypeError, rf"^input: dtype object is not supported; {ACCEPTED}")
row("input-object", lambda **k: mvn(object(), 0, **k), TypeError, r"^input: dtype object is not supported")
row("input-ragged-list", lambda **k: ln([[1.0, 2.0], [3.0]], **k), TypeError, r"^input: cannot convert list")
row("input-list-of-str", lambda **k: bn([["a", "b"]], [0.0], [1.0], **k), TypeError,
    r"^input: dtype <U1 is not supported")
row("input-list-of-complex", lambda **k: rms([[1j, 2.0]], **k), TypeError, r"^input: dtype complex128 is not supported")
_MASKED = r"a masked array with masked elements; simdnorm reads every element and would ignore the mask: pass"
_XM = np.ma.masked_array(X, mask=np.arange(X.size).reshape(SHAPE) == 7)
row("input-masked-layer_norm", lambda **k: ln(_XM, **k), TypeError, rf"^input: {_MASKED}")
row("input-masked-bn", lambda **k: bn(_XM, C4, C4, **k), TypeError, rf"^input: {_MASKED}")
row("compiled-input-masked", lambda **k: simdnorm.compile(_BND(1e-5))(_XM, C4, C4, **k), TypeError,
    rf"^input: {_MASKED}")
row("compiled-input-int", lambda **k: simdnorm.compile(MeanVarianceNormalizationDesc(TensorDesc(F32, SHAPE), -1))(
    x_as(np.int64), **k), TypeError, r"^input: dtype int64 does not match the compiled descriptor's float32")

# ---- 2. ranks 0 and 9 (SPEC §1), with out, and for parameters ------------------------------------
row("rank0-bn", lambda **k: bn(np.array(1.0, F32), p((1,)), p((1,)), **k), ValueError,
    r"^input: 0 dimensions .*1 to 8 dimensions", out=out_like(()))
row("rank0-mvn", lambda **k: mvn(np.array(1.0, F32), 0, **k), ValueError, r"^input: 0 dimensions", out=out_like(()))
row("rank9-mvn", lambda **k: mvn(np.ones((1,) * 9, F32), -1, **k), ValueError, r"^input: 9 dimensions .*1 to 8",
    out=out_like((1,) * 9))
row("rank9-bn", lambda **k: bn(np.ones((1,) * 8 + (2,), F32), p((1,)), p((1,)), **k), ValueError,
    r"^input: 9 dimensions", out=out_like((1,) * 8 + (2,)))
row("rank9-compiled", lambda **k: simdnorm.compile(MeanVarianceNormalizationDesc(TensorDesc(F32, (1,) * 9), 0))(
    np.ones((1,) * 9, F32), **k), ValueError, r"^input: 9 dimensions", out=out_like((1,) * 9))
row("param-rank0-mean", lambda **k: bn(X, 0.5, C4, **k), ValueError, r"^mean: 0 dimensions")
row("param-rank0-scale", lambda **k: mvn(X, -1, np.float32(2.0), **k), ValueError, r"^scale: 0 dimensions")
row("param-rank9-variance", lambda **k: bn(X, C4, p((1,) * 9), **k), ValueError, r"^variance: 9 dimensions")
row("param-rank9-bias", lambda **k: ln(X, bias=p((1,) * 9), **k), ValueError, r"^bias: 9 dimensions")

# ---- 3. shape and channel mismatches ----------------------------------------------------------------
BOTH_RULES = r"a parameter must either have the input's 4 dims, each equal to the input's or 1 .*or be 1-D of length C = input.shape\[channel_axis\]"
row("bn-channels-last-C", lambda **k: bn(X, C4, C4, channel_axis=-1, **k), ValueError,
    rf"^mean: shape \(4,\) does not fit the input's shape \(2, 4, 3, 5\): {BOTH_RULES} = 5 \(channel_axis=3\)")
row("bn-channel-axis-2", lambda **k: bn(X, p((3,)), p((4,)), channel_axis=2, **k), ValueError,
    rf"^variance: shape \(4,\) does not fit .*{BOTH_RULES} = 3 \(channel_axis=2\)")
row("bn-scale-C-by-1", lambda **k: bn(X, C4, C4, p((4, 1)), **k), ValueError, r"^scale: shape \(4, 1\) does not fit")
row("bn-bias-same-rank-wrong", lambda **k: bn(X, C4, C4, None, p((1, 4, 3, 2)), **k), ValueError,
    r"^bias: shape \(1, 4, 3, 2\) does not fit")
row("bn-1d-input-2d-param", lambda **k: bn(X[0, 0, 0], p((1, 5)), p((5,)), **k), ValueError,
    r"^mean: shape \(1, 5\) does not fit the input's shape \(5,\)", out=out_like((5,)))
row("mvn-bias-too-many-dims", lambda **k: mvn(X, -1, None, p((1, 2, 4, 3, 5)), **k), ValueError,
    r"^bias: shape \(1, 2, 4, 3, 5\) does not broadcast to the input's shape \(2, 4, 3, 5\) without enlarging it")
row("mvn-scale-enlarges", lambda **k: mvn(X, (2, 3), p((2, 1, 3, 6)), **k), ValueError,
    r"^scale: shape \(2, 1, 3, 6\) does not broadcast")
row("layer_norm-scale-wrong-last", lambda **k: ln(X, p((3,)), **k), ValueError, r"^scale: shape \(3,\) does not broadcast")
row("rms_norm-scale-2d", lambda **k: rms(X, p((5, 5)), **k), ValueError, r"^scale: shape \(5, 5\) does not broadcast")
row("instance_norm-channels-last-C", lambda **k: inorm(X, C4, channel_axis=-1, **k), ValueError,
    r"^scale: shape \(4,\); instance_norm takes a per-channel scale of shape \(C,\) = \(5,\)")
row("group_norm-channels-last-groups", lambda **k: gn(X, 2, channel_axis=-1, **k), ValueError,
    r"^num_groups: 2 does not divide the number of channels C = 5")

# ---- 4. parameter dtypes outside SPEC §2/§3 (the input's dtype or float32 only) ----------------------
for _i, (_fn, _name, _pdt, _xdt, _shown) in enumerate([
    ("bn", "mean", np.bool_, F32, "bool"), ("bn", "variance", np.complex64, F32, "complex64"),
    ("bn", "scale", object, F32, "object"), ("bn", "bias", ">f4", F32, r">f4 \(non-native byte order\)"),
    ("bn", "mean", BF16, F32, "bfloat16"), ("bn", "variance", F16, BF16, "float16"),
    ("bn", "scale", F64, F16, "float64"), ("mvn", "scale", np.int64, F32, "int64"),
    ("mvn", "bias", F16, F64, "float16"), ("mvn", "scale", F64, F32, "float64"),
    ("layer_norm", "scale", BF16, F16, "bfloat16"), ("layer_norm", "bias", "<U1", F32, "<U1"),
    ("rms_norm", "scale", F64, BF16, "float64"), ("instance_norm", "bias", np.int32, F32, "int32"),
    ("group_norm", "scale", np.uint8, F32, "uint8"), ("group_norm", "bias", F16, F64, "float16"),
]):
    def _mk(fn, name, pdt, xdt):
        x = np.ones(SHAPE, xdt)
        val = "1" if np.dtype(pdt).kind == "U" else 1
        par = np.full(SHAPE[-1:] if fn in ("mvn", "layer_norm", "rms_norm") else (4,), val, pdt)
        good = np.ones(par.shape, F32)
        kw = {n: (par if n == name else good) for n in (("mean", "variance", "scale", "bias") if fn == "bn" else
                                                       ("scale", "bias") if fn != "rms_norm" else ("scale",))}
        f = {"bn": lambda **k: bn(x, **kw, **k), "mvn": lambda **k: mvn(x, -1, **kw, **k),
             "layer_norm": lambda **k: ln(x, **kw, **k), "rms_norm": lambda **k: rms(x, **kw, **k),
             "instance_norm": lambda **k: inorm(x, **kw, **k), "group_norm": lambda **k: gn(x, 2, **kw, **k)}[fn]
        return f

    _xn = {F32: "float32", F16: "float16", BF16: "bfloat16", F64: "float64"}[_xdt]
    row(f"param-dtype-{_i}-{_fn}-{_name}-{np.dtype(_pdt).str}", _mk(_fn, _name, _pdt, _xdt), TypeError,
        rf"^{_name}: dtype {_shown} is not accepted with a {_xn} input; " + PARAM_RULE.format(dt=_xn),
        out=out_like(SHAPE, _xdt))
_C4M = np.ma.masked_array(C4, mask=[False, True, False, False])
row("param-masked-variance", lambda **k: bn(X, C4, _C4M, **k), TypeError, rf"^variance: {_MASKED}")
row("param-masked-instance_norm-scale", lambda **k: inorm(X, _C4M, **k), TypeError, rf"^scale: {_MASKED}")
row("compiled-param-masked-mean", lambda **k: simdnorm.compile(_BND(1e-5))(X, _C4M, C4, **k), TypeError,
    rf"^mean: {_MASKED}")
def _masked_after_a_call(**k):
    """A masked parameter is checked at every call, not remembered: masking an element of one that
    a compiled operator has accepted makes its next call raise."""
    op, mean = simdnorm.compile(_BND(1e-5)), np.ma.masked_array(C4.copy(), mask=False)
    op(X, mean, C4)
    mean[2] = np.ma.masked
    op(X, mean, C4, **k)


row("compiled-param-masked-after-a-call", _masked_after_a_call, TypeError, rf"^mean: {_MASKED}")
row("param-None-mean", lambda **k: bn(X, None, C4, **k), TypeError,
    r"^mean: expected an array, got None; mean is required$")
row("param-None-variance", lambda **k: bn(X, C4, None, **k), TypeError,
    r"^variance: expected an array, got None; variance is required$")
row("param-list-of-str", lambda **k: mvn(X, -1, ["a"] * 5, **k), TypeError, r"^scale: cannot convert list")
row("param-ragged-list", lambda **k: bn(X, [[1.0], [1.0, 2.0]], C4, **k), TypeError, r"^mean: cannot convert list")

# ---- 5. epsilon through the descriptor / compile path, and other real types ----------------------------
_BND = lambda eps: BatchNormalizationDesc(TensorDesc(F32, SHAPE), TensorDesc(F32, (4,)),
                                          TensorDesc(F32, (4,)), epsilon=eps)
_EPS = r"epsilon must be finite and >= 0"
row("eps-compile-nan", lambda **k: simdnorm.compile(_BND(float("nan")))(X, C4, C4, **k), ValueError, rf"^epsilon: nan .*{_EPS}")
row("eps-compile-inf", lambda **k: simdnorm.compile(MeanVarianceNormalizationDesc(TensorDesc(F32, SHAPE), -1,
    epsilon=np.inf))(X, **k), ValueError, rf"^epsilon: inf .*{_EPS}")
row("eps-desc-negative", lambda **k: _BND(-1e-3).validate(), ValueError, rf"^epsilon: -0.001 is not allowed; {_EPS}",
    without_out=False)
row("eps-fraction-negative", lambda **k: bn(X, C4, C4, epsilon=fractions.Fraction(-1, 10), **k), ValueError,
    r"^epsilon: Fraction\(-1, 10\) is not allowed")
row("eps-float16-inf", lambda **k: bn(X.astype(F16), C4, C4, epsilon=np.float16(np.inf), **k), ValueError,
    r"^epsilon: .*inf.* is not allowed", out=out_like(SHAPE, F16))

# ---- 6. axes spelled in numpy / Python types ----------------------------------------------------------
row("axes-huge-int", lambda **k: mvn(X, 2 ** 70, **k), AxisError, r"^axes: axis about 10\*\*21 is out of range")
# Ints past 4300 digits have no str() in Python >= 3.11: a message names them by their size, and the error is
# ours (it was ValueError "Exceeds the limit (4300 digits) for integer string conversion" from the message).
_G = 10 ** 5000
_RANGE = r" is out of range for an input of 4 dims \(valid: -4 to 3\)$"
row("axes-int-past-4300-digits", lambda **k: mvn(X, _G, **k), AxisError, rf"^axes: axis about 10\*\*5000{_RANGE}")
row("axes-item-past-4300-digits", lambda **k: mvn(X, (1, -_G), **k), AxisError, rf"^axes: axis about -10\*\*5000{_RANGE}")
row("axes-fraction-past-4300-digits", lambda **k: mvn(X, (fractions.Fraction(_G + 1, _G),), **k), TypeError,
    r"^axes: expected ints, got Fraction \(a Fraction too long to print\)$")
row("layer_norm-axis-past-4300-digits", lambda **k: ln(X, axis=_G, **k), AxisError, rf"^axis: axis about 10\*\*5000{_RANGE}")
row("rms_norm-axis-past-4300-digits", lambda **k: rms(X, axis=-_G, **k), AxisError, rf"^axis: axis about -10\*\*5000{_RANGE}")
row("bn-channel-axis-past-4300-digits", lambda **k: bn(X, C4, C4, channel_axis=_G, **k), AxisError,
    rf"^channel_axis: axis about 10\*\*5000{_RANGE}")
row("instance_norm-channel-axis-past-4300-digits", lambda **k: inorm(X, channel_axis=-_G, **k), AxisError,
    rf"^channel_axis: axis about -10\*\*5000{_RANGE}")
row("group_norm-channel-axis-past-4300-digits", lambda **k: gn(X, 2, channel_axis=_G, **k), AxisError,
    rf"^channel_axis: axis about 10\*\*5000{_RANGE}")
row("group_norm-groups-past-4300-digits", lambda **k: gn(X, _G, **k), ValueError,
    r"^num_groups: about 10\*\*5000 does not divide the number of channels C = 4; C % num_groups must be 0$")
row("group_norm-groups-negative-past-4300-digits", lambda **k: gn(X, -_G, **k), ValueError,
    r"^num_groups: about -10\*\*5000; it must be >= 1 and divide the number of channels C = 4$")
row("mvn-flag-past-4300-digits", lambda **k: mvn(X, 1, normalize_variance=_G, **k), TypeError,
    r"^normalize_variance: expected a bool, got int \(about 10\*\*5000\)$")
row("mvn-return-stats-past-4300-digits", lambda **k: mvn(X, 1, return_stats=_G, **k), TypeError,
    r"^return_stats: expected a bool, got int \(about 10\*\*5000\)$")
row("mvn-epsilon-mode-past-4300-digits", lambda **k: mvn(X, 1, epsilon_mode=_G, **k), ValueError,
    r"^epsilon_mode: about 10\*\*5000 is not valid")
row("eps-fraction-past-4300-digits", lambda **k: mvn(X, 1, epsilon=fractions.Fraction(-_G - 1, _G), **k), ValueError,
    r"^epsilon: a Fraction too long to print is not allowed; epsilon must be finite and >= 0$")
row("compiled-axes-past-4300-digits", lambda **k: simdnorm.compile(MeanVarianceNormalizationDesc(TensorDesc(F32, SHAPE),
    _G)), AxisError, rf"^axes: axis about 10\*\*5000{_RANGE}", without_out=False)
row("compiled-channel-axis-past-4300-digits", lambda **k: simdnorm.compile(BatchNormalizationDesc(
    TensorDesc(F32, SHAPE), TensorDesc(F32, (4,)), TensorDesc(F32, (4,)), channel_axis=-_G)), AxisError,
    rf"^channel_axis: axis about -10\*\*5000{_RANGE}", without_out=False)
row("compiled-return-stats-past-4300-digits", lambda **k: simdnorm.compile(MeanVarianceNormalizationDesc(
    TensorDesc(F32, SHAPE), 1))(X, return_stats=_G, **k), TypeError,
    r"^return_stats: expected a bool, got int \(about 10\*\*5000\)$")
row("desc-dtype-past-4300-digits", lambda **k: TensorDesc(_G, SHAPE).validate(), TypeError,
    r"^tensor.dtype: about 10\*\*5000 is not a numpy dtype", without_out=False)
row("axes-all-plus-one", lambda **k: mvn(X, (0, 1, 2, 3, 4), **k), AxisError, r"^axes: axis 4 is out of range")
row("axes-float-array", lambda **k: mvn(X, np.array([1.5]), **k), TypeError, r"^axes: expected ints, got float")
row("axes-bool-array", lambda **k: mvn(X, np.array([True, False]), **k), TypeError, r"^axes: expected ints, got bool")
row("axes-nested", lambda **k: mvn(X, [[1]], **k), TypeError, r"^axes: expected ints, got list")
row("axes-empty-array", lambda **k: mvn(X, np.array([], np.int64), **k), ValueError, r"^axes: empty")
row("axes-np-duplicate", lambda **k: mvn(X, (np.int64(1), np.int32(-3)), **k), ValueError,
    r"^axes: axis 1 appears twice")
row("layer_norm-axis-tuple", lambda **k: ln(X, axis=(1, 2), **k), TypeError, r"^axis: expected an int, got tuple")
row("instance_norm-channel-axis-float", lambda **k: inorm(X, channel_axis=1.0, **k), TypeError,
    r"^channel_axis: expected an int, got float")
row("compiled-axes-set", lambda **k: simdnorm.compile(MeanVarianceNormalizationDesc(TensorDesc(F32, SHAPE),
    {3, 2})), TypeError, r"^axes: expected an int or a sequence of ints, got set; pass the axes", without_out=False)
row("compiled-sizes-set", lambda **k: simdnorm.compile(MeanVarianceNormalizationDesc(TensorDesc(F32, {4, 2}), 1)),
    TypeError, r"^input.sizes: expected a sequence of ints, got set$", without_out=False)
row("layer_norm-axis-set", lambda **k: ln(X, axis={1}, **k), TypeError, r"^axis: expected an int, got set")
row("group_norm-channel-axis-dict", lambda **k: gn(X, 2, channel_axis={1: 1}, **k), TypeError,
    r"^channel_axis: expected an int, got dict")
row("compiled-axes-out-of-range", lambda **k: simdnorm.compile(MeanVarianceNormalizationDesc(TensorDesc(F32, SHAPE),
    (5,))), AxisError, r"^axes: axis 5 is out of range", without_out=False)

# ---- 7. activations: unknown names, bad parameters (SPEC §5: ValueError listing the valid ones) --------
_NAMES = r"valid names: identity, linear, relu, .*hard_swish"
for _i, (_act, _exc, _msg) in enumerate([
    (lambda: "", ValueError, rf"^activation: unknown name ''; {_NAMES}"),
    (lambda: "relu6", ValueError, rf"^activation: unknown name 'relu6'; {_NAMES}"),
    (lambda: Activation("leaky_relu", alpha=float("inf")), ValueError,
     r"^activation 'leaky_relu': parameter 'alpha' is inf; it must be finite"),
    (lambda: Activation("elu", alpha=float("nan")), ValueError, r"^activation 'elu': parameter 'alpha' is nan"),
    (lambda: Activation("softplus", steepness=-np.inf), ValueError, r"^activation 'softplus': parameter 'steepness'"),
    (lambda: Activation("celu", alpha=0.0), ValueError, r"^activation 'celu': parameter 'alpha' is 0.0; it must be non-zero"),
    (lambda: Activation("shrink", threshold=-0.5), ValueError, r"^activation 'shrink': parameter 'threshold' .* >= 0"),
    (lambda: Activation("clip", min=2.0, max=1.0), ValueError, r"^activation 'clip': min=2.0 > max=1.0"),
    (lambda: Activation("clip", min=float("nan")), ValueError, r"^activation 'clip': min is NaN"),
    (lambda: Activation("linear", gamma=1.0), ValueError,
     r"^activation 'linear': unknown parameter\(s\) 'gamma'; 'linear' takes alpha=1.0, beta=0.0"),
    (lambda: Activation("hard_sigmoid", alpha=True), TypeError, r"parameter 'alpha' must be a real number, got bool"),
    (lambda: Activation("scaled_elu", alpha="1"), TypeError, r"parameter 'alpha' must be a real number, got str"),
    (lambda: Activation("thresholded_relu", alpha=1j), TypeError, r"must be a real number, got complex"),
    (lambda: Activation(None), TypeError, rf"^activation: the name must be a str, got NoneType; {_NAMES}"),
    (lambda: ("relu",), TypeError, r"^activation: expected None, an activation name \(str\) or simdnorm.Activation"),
    (lambda: Activation, TypeError, r"^activation: expected None, an activation name .* got type"),
]):
    _fn = [lambda a, **k: bn(X, C4, C4, activation=a(), **k), lambda a, **k: mvn(X, (1, 2), activation=a(), **k),
           lambda a, **k: gn(X, 2, activation=a(), **k), lambda a, **k: rms(X, activation=a(), **k)][_i % 4]
    row(f"activation-{_i}", (lambda f, a: lambda **k: f(a, **k))(_fn, _act), _exc, _msg)
row("activation-desc", lambda **k: BatchNormalizationDesc(TensorDesc(F32, SHAPE), TensorDesc(F32, (4,)),
    TensorDesc(F32, (4,)), activation="nope").validate(), ValueError, r"^activation: unknown name 'nope'",
    without_out=False)


# ---- 8. out: not an array, wrong shape/dtype, read-only (SPEC §6: a clear error, nothing written) -------
def _opaque_bytearray():
    raw = bytearray([POISON]) * X.nbytes
    return Opaque(raw, raw)


def _opaque_memoryview():
    raw = bytearray([POISON]) * X.nbytes
    return Opaque(memoryview(raw).cast("f", SHAPE), raw)


def _readonly_view():
    pad = Padded(SHAPE)
    pad.array = pad.array[...]
    pad.array.flags.writeable = False
    return pad


def _frombuffer():
    a = np.frombuffer(bytes([POISON]) * X.nbytes, F32).reshape(SHAPE)  # read-only: immutable memory
    return Opaque(a, memoryview(a).cast("B"))


def _masked_out():
    """A masked array over the padded buffer (no copy), one element masked."""
    pad = Padded(SHAPE)
    pad.array = np.ma.masked_array(pad.array, mask=np.arange(X.size).reshape(SHAPE) == 5)
    return pad


OUT_ROWS = [
    ("bytearray", lambda **k: ln(X, **k), TypeError, r"^out: expected a numpy.ndarray, got bytearray", _opaque_bytearray),
    ("memoryview", lambda **k: bn(X, C4, C4, **k), TypeError, r"^out: expected a numpy.ndarray, got memoryview",
     _opaque_memoryview),
    ("numpy-scalar", lambda **k: mvn(X, -1, **k), TypeError, r"^out: expected a numpy.ndarray, got float32",
     lambda: Opaque(np.float32(POISON), bytearray(b"x"))),
    ("rank0", lambda **k: rms(X, **k), ValueError, r"^out: shape \(\) differs from the input's \(2, 4, 3, 5\)",
     out_like(())),
    ("transposed-shape", lambda **k: gn(X, 2, **k), ValueError, r"^out: shape \(5, 3, 4, 2\) differs", out_like(SHAPE[::-1])),
    ("extra-dim", lambda **k: inorm(X, **k), ValueError, r"^out: shape \(1, 2, 4, 3, 5\) differs", out_like((1,) + SHAPE)),
    ("big-endian", lambda **k: ln(X, **k), TypeError,
     r"^out: dtype >f4 \(non-native byte order\) differs from the input's float32", out_like(SHAPE, ">f4")),
    ("bf16-for-f16", lambda **k: mvn(X.astype(F16), -1, **k), TypeError,
     r"^out: dtype bfloat16 differs from the input's float16", out_like(SHAPE, BF16)),
    ("f16-for-bf16", lambda **k: bn(X.astype(BF16), C4, C4, **k), TypeError,
     r"^out: dtype float16 differs from the input's bfloat16", out_like(SHAPE, F16)),
    ("readonly-view", lambda **k: gn(X, 4, **k), ValueError, r"^out: the array is read-only", _readonly_view),
    ("readonly-frombuffer", lambda **k: bn(X, C4, C4, **k), ValueError, r"^out: the array is read-only", _frombuffer),
    ("return-stats-wrong-dtype", lambda **k: ln(X, return_stats=True, **k), TypeError, r"^out: dtype float64 differs",
     out_like(SHAPE, F64)),
    ("compiled-list", lambda **k: simdnorm.compile(_BND(1e-5))(X, C4, C4, **k), TypeError,
     r"^out: expected a numpy.ndarray, got list", lambda: Opaque(X.tolist(), bytearray(b"x"))),
    ("masked-layer_norm", lambda **k: ln(X, **k), TypeError, r"^out: a masked array with masked elements; its mask",
     _masked_out),
    ("masked-bn", lambda **k: bn(X, C4, C4, **k), TypeError, r"^out: a masked array with masked elements", _masked_out),
    ("compiled-masked", lambda **k: simdnorm.compile(_BND(1e-5))(X, C4, C4, **k), TypeError,
     r"^out: a masked array with masked elements", _masked_out),
    ("compiled-readonly", lambda **k: simdnorm.compile(MeanVarianceNormalizationDesc(TensorDesc(F32, SHAPE), (1, 3)))(
        X, **k), ValueError, r"^out: the array is read-only", lambda: Padded(SHAPE, writeable=False)),
]
for _id, _call, _exc, _msg, _out in OUT_ROWS:
    row(f"out-{_id}", _call, _exc, _msg, out=_out, without_out=False)


@pytest.mark.parametrize("r", ROWS, ids=[r.id for r in ROWS])
def test_hostile_input(r):
    out = (r.out or out_like())()
    with pytest.raises(r.exc, match=r.msg):
        r.call(out=out.array)
    assert out.untouched(), f"{r.id}: out (or the padding around it) was written before the error"
    if r.without_out:
        with pytest.raises(r.exc, match=r.msg):
            r.call()


def test_catalogue_ids_unique():
    ids = [r.id for r in ROWS]
    assert len(ids) == len(set(ids))


# ----------------------------------------------------------------------------------------------
# byte extents that overflow 64-bit arithmetic: rejected before any work (one subprocess per case)
# ----------------------------------------------------------------------------------------------

# Each case builds arrays with np.lib.stride_tricks.as_strided over a tiny buffer (numpy checks
# neither the strides nor the memory); without the package's own check the op would read or write
# at data + 2**62 and crash: the subprocess reports that as a failure of this test.
OVERFLOW_DRIVER = r"""
import json, sys
import numpy as np
import simdnorm
from numpy.lib.stride_tricks import as_strided

case = sys.argv[1]
F32 = np.float32
POISON = 0xA5
tiny = np.full(64, POISON, np.uint8)          # the memory every hostile view starts in
t32 = tiny[:32].view(F32)
out_buf = np.full(256, POISON, np.uint8)      # a poisoned out (or the hostile out's memory)
good_out = out_buf[:12].view(F32)
H = 2 ** 62

def hostile(shape, strides, writeable=False):
    return as_strided(t32, shape=shape, strides=strides, writeable=writeable)

x3 = np.array([1.0, 2.0, 4.0], F32)
c3 = np.ones(3, F32)
if case == "bn-input-stride":        # extent 2 * 2**62 = 2**63
    name, call = "input", lambda: simdnorm.batch_normalization(hostile((3,), (H,)), c3, c3, out=good_out)
elif case == "bn-input-negative":    # extent -3 * 2**62
    name, call = "input", lambda: simdnorm.batch_normalization(hostile((4,), (-H,)), np.ones(4, F32),
                                                               np.ones(4, F32), out=out_buf[:16].view(F32))
elif case == "mvn-input-sum":        # each dim fits, their sum does not: (2**62 - 4) * 3
    name, call = "input", lambda: simdnorm.mean_variance_normalization(
        hostile((2, 2, 2), (H - 4, H - 4, H - 4)), -1, out=out_buf[:32].view(F32).reshape(2, 2, 2))
elif case == "layer_norm-input":
    name, call = "input", lambda: simdnorm.layer_norm(hostile((3, 3), (H, 4)), out=out_buf[:36].view(F32).reshape(3, 3))
elif case == "bn-out-stride":
    name, call = "out", lambda: simdnorm.batch_normalization(
        x3, c3, c3, out=as_strided(out_buf[:4].view(F32), shape=(3,), strides=(H,), writeable=True))
elif case == "mvn-out-stride":
    name, call = "out", lambda: simdnorm.mean_variance_normalization(
        np.ones((3, 2), F32), 0, out=as_strided(out_buf[:4].view(F32), shape=(3, 2), strides=(H, 4), writeable=True))
elif case == "bn-mean-stride":
    name, call = "mean", lambda: simdnorm.batch_normalization(np.ones((2, 3), F32), hostile((3,), (H,)), c3,
                                                              out=out_buf[:24].view(F32).reshape(2, 3))
elif case == "layer_norm-scale-stride":
    name, call = "scale", lambda: simdnorm.layer_norm(np.ones((2, 3), F32), hostile((3,), (H,)),
                                                      out=out_buf[:24].view(F32).reshape(2, 3))
elif case == "compiled-input":
    op = simdnorm.compile(simdnorm.BatchNormalizationDesc(*[simdnorm.TensorDesc(F32, (3,))] * 3))
    name, call = "input", lambda: op(hostile((3,), (H,)), c3, c3, out=good_out)
else:
    raise SystemExit(f"unknown case {case}")
try:
    call()
    res = {"raised": None}
except Exception as e:
    res = {"raised": type(e).__name__, "value_error": isinstance(e, (ValueError, OverflowError)), "msg": str(e)}
res["name"] = name
res["untouched"] = bool((tiny == POISON).all() and (out_buf == POISON).all())
print(json.dumps(res))
"""

OVERFLOW_CASES = ["bn-input-stride", "bn-input-negative", "mvn-input-sum", "layer_norm-input", "bn-out-stride",
                  "mvn-out-stride", "bn-mean-stride", "layer_norm-scale-stride", "compiled-input"]


def run_driver(driver: str, arg: str, tmp_path) -> subprocess.CompletedProcess:
    """The driver script run in a child process with argv[1] = arg, on one simdnorm thread."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(driver))
    env = dict(os.environ)
    env.setdefault("SIMDNORM_NUM_THREADS", "1")
    try:
        return subprocess.run([sys.executable, str(script), arg], capture_output=True, text=True, timeout=300,
                              env=env, check=False)
    except subprocess.TimeoutExpired:  # pragma: no cover - reported as a failure
        pytest.fail(f"{arg}: the call did not return within 300 s (it ran on the hostile strides)")


@pytest.mark.parametrize("case", OVERFLOW_CASES)
def test_byte_extent_overflow_is_rejected(case, tmp_path):
    r = run_driver(OVERFLOW_DRIVER, case, tmp_path)
    assert r.returncode == 0, (
        f"{case}: the process died (exit {r.returncode}): the op ran on a view whose byte extent overflows "
        f"int64 instead of rejecting it\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["raised"] is not None, f"{case}: no error for a byte extent that overflows int64"
    assert res["value_error"], f"{case}: {res['raised']} is not a ValueError/OverflowError: {res['msg']}"
    assert res["name"] in res["msg"], f"{case}: the message does not name {res['name']!r}: {res['msg']}"
    assert res["untouched"], f"{case}: memory was written before the error"


# Every array argument of every op (forward, training, backward, moments), one at a time, in float32
# and float16: that argument replaced by a view of its shape whose byte extent overflows int64, the
# others valid. One process per op runs its cases in turn, printing each before the call, so a crash
# names its case.
EVERY_ARGUMENT_DRIVER = r"""
import json, sys
import numpy as np
import simdnorm
from numpy.lib.stride_tricks import as_strided

op = sys.argv[1]
H = 2 ** 62
AXES = (0, 2)

def hostile(a, writeable):
    # a's shape; its first dim of size >= 3 two steps of 2**62 bytes wide (the extent 2**63)
    big = next(d for d in range(a.ndim) if a.shape[d] >= 3)
    strides = [H if d == big else a.itemsize for d in range(a.ndim)]
    return as_strided(np.zeros(64, a.dtype), shape=a.shape, strides=strides, writeable=writeable)

def cases(dt):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 3, 2)).astype(dt)
    dy = rng.standard_normal(x.shape).astype(dt)
    c = np.linspace(0.5, 2.0, 3).astype(dt)
    fa = rng.standard_normal(x.shape).astype(dt)
    out = np.empty_like(x)
    if op == "batch_normalization":
        return dict(input=x, mean=c, variance=c, scale=c, bias=c, out=out), \
            lambda a: simdnorm.batch_normalization(a["input"], a["mean"], a["variance"], a["scale"], a["bias"],
                                                   out=a["out"])
    if op == "mean_variance_normalization":
        return dict(input=x, scale=c.reshape(1, 3, 1), bias=c.reshape(1, 3, 1), out=out), \
            lambda a: simdnorm.mean_variance_normalization(a["input"], AXES, a["scale"], a["bias"], out=a["out"])
    if op in ("layer_norm", "rms_norm", "instance_norm", "group_norm"):
        fn = getattr(simdnorm, op)
        w = np.ones(2, dt) if op in ("layer_norm", "rms_norm") else c
        w = np.concatenate([w, w[:1]]) if op in ("layer_norm", "rms_norm") else w  # (3,): a dim of size 3
        xx = rng.standard_normal((2, 3, 3)).astype(dt) if op in ("layer_norm", "rms_norm") else x
        args = dict(input=xx, scale=w, out=np.empty_like(xx))
        if op != "rms_norm":
            args["bias"] = w
        lead = (3,) if op == "group_norm" else ()
        return args, lambda a: fn(a["input"], *lead, a["scale"], *([a["bias"]] if "bias" in a else []),
                                  out=a["out"])
    if op.startswith("batch_normalization_training"):  # (with fused_add, numpy reads and writes some)
        added = dict(fused_add=fa) if op.endswith("fused_add") else {}
        return dict(input=x, scale=c, bias=c, **added, running_mean=np.zeros(3, np.float32),
                    running_var=np.ones(3, np.float32), out=out), \
            lambda a: simdnorm.batch_normalization_training(
                a["input"], a["scale"], a["bias"], fused_add=a.get("fused_add"), running_mean=a["running_mean"],
                running_var=a["running_var"], out=a["out"])
    if op.startswith("batch_normalization_backward"):
        training = op.endswith("training")
        _, mean, var = simdnorm.batch_normalization_training(x, c, c)
        return dict(grad_output=dy, input=x, mean=mean, variance=var, scale=c, bias=c, fused_add=fa, out=out), \
            lambda a: simdnorm.batch_normalization_backward(
                a["grad_output"], a["input"], a["mean"], a["variance"], a["scale"], a["bias"],
                training=training, fused_add=a["fused_add"], out=a["out"])
    if op == "mean_variance_normalization_backward":
        s3 = c.reshape(1, 3, 1)
        _, mean, inv = simdnorm.mean_variance_normalization(x, AXES, s3, s3, return_stats=True)
        return dict(grad_output=dy, input=x, mean=mean, inv_std=inv, scale=s3, bias=s3, out=out), \
            lambda a: simdnorm.mean_variance_normalization_backward(
                a["grad_output"], a["input"], AXES, a["mean"], a["inv_std"], a["scale"], a["bias"], out=a["out"])
    if op in ("layer_norm_backward", "rms_norm_backward", "instance_norm_backward", "group_norm_backward"):
        name = op[:-9]
        xx = rng.standard_normal((3, 3, 3)).astype(dt)
        w = np.linspace(0.5, 2.0, 3).astype(dt)
        lead = (3,) if name == "group_norm" else ()
        res = getattr(simdnorm, name)(xx, *lead, w, *([] if name == "rms_norm" else [w]), return_stats=True)
        stats = dict(inv_std=res[2]) if name == "rms_norm" else dict(mean=res[1], inv_std=res[2])
        params = dict(scale=w) if name == "rms_norm" else dict(scale=w, bias=w)
        args = dict(grad_output=np.ones_like(xx), input=xx, **stats, **params, out=np.empty_like(xx))
        fn = getattr(simdnorm, op)
        order = ["grad_output", "input"] + list(stats) + list(params)
        return args, lambda a: fn(*[a[k] for k in order[:2]], *lead, *[a[k] for k in order[2:]], out=a["out"])
    if op == "moments":
        return dict(input=x), lambda a: simdnorm.moments(a["input"], AXES)
    raise SystemExit(f"unknown op {op}")

for dt in (np.float32, np.float16):
    args, call = cases(dt)
    call(args)  # the valid call runs
    for name in args:
        a = dict(args)
        a[name] = hostile(args[name], name in ("out", "running_mean", "running_var"))
        print(json.dumps({"case": f"{np.dtype(dt).name} {name}"}), flush=True)
        try:
            call(a)
            res = {"raised": None}
        except Exception as e:
            res = {"raised": type(e).__name__, "value_error": isinstance(e, (ValueError, OverflowError)),
                   "msg": str(e)}
        res["name"] = name.replace("input", "input")
        print(json.dumps(res), flush=True)
"""

EVERY_ARGUMENT_OPS = ["batch_normalization", "mean_variance_normalization", "layer_norm", "rms_norm",
                      "instance_norm", "group_norm", "batch_normalization_training", "batch_normalization_training_fused_add",
                      "batch_normalization_backward_training", "batch_normalization_backward_given",
                      "mean_variance_normalization_backward", "layer_norm_backward", "rms_norm_backward",
                      "instance_norm_backward", "group_norm_backward", "moments"]


@pytest.mark.parametrize("op", EVERY_ARGUMENT_OPS)
def test_byte_extent_overflow_every_array_argument(op, tmp_path):
    r = run_driver(EVERY_ARGUMENT_DRIVER, op, tmp_path)
    lines = [json.loads(line) for line in r.stdout.strip().splitlines()]
    started = [line["case"] for line in lines if "case" in line]
    assert r.returncode == 0, (f"{op}: the process died (exit {r.returncode}) in case {started[-1:]}: the op ran "
                               f"on a view whose byte extent overflows int64\n{r.stderr[-3000:]}")
    results = [line for line in lines if "case" not in line]
    assert len(results) == len(started) >= 2, (op, started)
    for case, res in zip(started, results):
        assert res["raised"] is not None, f"{op} {case}: no error for a byte extent that overflows int64"
        assert res["value_error"], f"{op} {case}: {res['raised']} is not a ValueError: {res['msg']}"
        assert res["name"] in res["msg"], f"{op} {case}: the message does not name {res['name']!r}: {res['msg']}"


@pytest.mark.parametrize("op", ["batch_normalization", "layer_norm", "batch_normalization_training",
                                "batch_normalization_training_fused_add", "layer_norm_backward"])
def test_an_out_with_a_zero_stride_is_refused(op):
    # several elements on one location: threads would race for it (numpy's ufuncs write them in
    # turn); refused before anything is written. Without elements it is just an empty out.
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(F32)
    c = np.ones(4, F32)
    call = {
        "batch_normalization": lambda o: bn(x, c, c, channel_axis=-1, out=o),
        "layer_norm": lambda o: ln(x, out=o),
        "batch_normalization_training": lambda o: simdnorm.batch_normalization_training(x, channel_axis=-1, out=o),
        "batch_normalization_training_fused_add": lambda o: simdnorm.batch_normalization_training(
            x, channel_axis=-1, fused_add=x, out=o),
        "layer_norm_backward": lambda o: simdnorm.layer_norm_backward(x, x, *ln(x, return_stats=True)[1:], out=o),
    }[op]
    buf = np.full(4, 7.0, F32)
    out = np.lib.stride_tricks.as_strided(buf, shape=(3, 4), strides=(0, 4), writeable=True)
    with pytest.raises(ValueError, match=r"out: strides\[0\] is 0 with size 3"):
        call(out)
    assert (buf == 7.0).all()
    if op == "layer_norm":
        empty = np.lib.stride_tricks.as_strided(buf, shape=(0, 4), strides=(0, 4), writeable=True)
        assert ln(x[:0], out=empty) is empty
