"""The functional API's error paths (SPEC sections 1-6) and the Python layer's routing: every error
has the right type and a message naming the argument and the rule, and ``out`` (poisoned first) is
untouched after every error. Also: inputs (lists; DLPack: test_dlpack.py), out semantics (returned, in place,
overlap), return_stats shapes and memory order of the result."""

from __future__ import annotations

import array
import math
import re
import textwrap
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

import simdnorm
from cases import BF16, F16, F32, F64, AxisError
from simdnorm import _api

POISON = 1536.0  # exact in float16 and bfloat16 too

bn = simdnorm.batch_normalization
mvn = simdnorm.mean_variance_normalization


def poisoned(shape, dtype=F32):
    return np.full(shape, POISON, dtype)


def assert_poisoned(out):
    assert np.all(out.astype(np.float64) == POISON), "out was written before the error"


def assert_close(actual, desired):
    """Same math on data at another address: MVN statistics may round differently (the kernels'
    vector head depends on the input's alignment), so equal to a few ulp, not bitwise."""
    np.testing.assert_allclose(actual, desired, rtol=1e-5, atol=1e-6)


def bn_args(shape=(2, 4, 3, 5), dtype=F32, pdtype=None, rng=None):
    rng = rng or np.random.default_rng(0)
    pdtype = pdtype or dtype
    c = shape[1] if len(shape) > 1 else shape[0]
    x = rng.standard_normal(shape).astype(dtype)
    mean = rng.standard_normal(c).astype(pdtype)
    var = (rng.random(c) + 0.5).astype(pdtype)
    scale = rng.standard_normal(c).astype(pdtype)
    bias = rng.standard_normal(c).astype(pdtype)
    return x, mean, var, scale, bias


def ref_bn(x, mean, var, scale, bias, eps=1e-5, ca=1):
    shape = [1] * x.ndim
    shape[ca] = -1
    m, v, s, b = (np.asarray(a, np.float64).reshape(shape) for a in (mean, var, scale, bias))
    return s * (x.astype(np.float64) - m) / np.sqrt(v + eps) + b


def ref_mvn(x, axes, eps=1e-5):
    x = x.astype(np.float64)
    mu = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)
    return (x - mu) / np.sqrt(var + eps), mu, 1 / np.sqrt(var + eps)


@pytest.fixture(autouse=True)
def _fresh_plan_caches():
    _api.clear_plan_caches()
    yield


# Each entry: name, a call taking (x, out) that is valid for a float32 (2, 4, 3, 5) input.
def _calls():
    c = 4
    p = np.ones(c, F32)
    return [
        ("batch_normalization", lambda x, **k: bn(x, p, p, p, p, **k)),
        ("mean_variance_normalization", lambda x, **k: mvn(x, (2, 3), **k)),
        ("layer_norm", lambda x, **k: simdnorm.layer_norm(x, **k)),
        ("rms_norm", lambda x, **k: simdnorm.rms_norm(x, **k)),
        ("instance_norm", lambda x, **k: simdnorm.instance_norm(x, p, p, **k)),
        ("group_norm", lambda x, **k: simdnorm.group_norm(x, 2, p, p, **k)),
    ]


CALLS = _calls()
CALL_IDS = [c[0] for c in CALLS]


# ----------------------------------------------------------------------------------------------
# input dtype and rank (SPEC section 1)
# ----------------------------------------------------------------------------------------------

BAD_DTYPES = [np.int32, np.int64, np.uint8, np.bool_, np.complex64, object, np.dtype(">f4"), np.dtype(">f2")]


@pytest.mark.parametrize("name,call", CALLS, ids=CALL_IDS)
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=lambda d: np.dtype(d).str)
def test_unsupported_input_dtype_is_type_error(name, call, dtype):
    x = np.ones((2, 4, 3, 5)).astype(dtype)
    out = poisoned(x.shape)
    shown = re.escape(np.dtype(dtype).str if not np.dtype(dtype).isnative else str(np.dtype(dtype)))
    with pytest.raises(TypeError, match=rf"input: dtype {shown}.* not supported; accepted: float32, float16, "
                                        r"bfloat16 .*float64"):
        call(x)
    with pytest.raises(TypeError, match="input: dtype"):
        call(x, out=out)
    assert_poisoned(out)


def test_non_native_byte_order_is_named():
    x = np.ones((2, 4), np.dtype(">f4"))
    with pytest.raises(TypeError, match=r"non-native byte order"):
        bn(x, np.ones(4, F32), np.ones(4, F32))


# ml_dtypes takes most of a second to import, so `import simdnorm` does not import it: until something
# has, no array holds bfloat16. Then bfloat16 arrays are recognised by the functions (Python) and the
# binding (C++); a DLPack bfloat16 tensor, whose result is such an array, imports it. In a child
# process, whose modules start empty.
def test_bfloat16_recognised_without_importing_ml_dtypes_first():
    import os
    import subprocess
    import sys

    code = textwrap.dedent("""
        import sys
        import numpy as np
        import simdnorm
        from dlpack_producers import BFLOAT, Producer
        assert "ml_dtypes" not in sys.modules, "import simdnorm imported ml_dtypes"
        x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
        want = simdnorm.layer_norm(x)
        try:
            simdnorm.layer_norm(x.astype(np.int16))
        except TypeError as e:
            assert "bfloat16" in str(e), e
        assert "ml_dtypes" not in sys.modules, "a float32 call or a refused dtype imported ml_dtypes"
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # x truncated to bfloat16, as raw bits
        got = simdnorm.layer_norm(Producer(bits, dtype=(BFLOAT, 16, 1)))
        assert got.dtype.name == "bfloat16" and "ml_dtypes" in sys.modules, got.dtype
        import ml_dtypes
        xb = x.astype(ml_dtypes.bfloat16)
        out = np.full(x.shape, 1536.0, ml_dtypes.bfloat16)
        simdnorm.layer_norm(xb, out=out)
        for y in (got, out):
            assert np.abs(y.astype(np.float32) - want).max() < 0.05, np.abs(y.astype(np.float32) - want).max()
        print("ok")
    """)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


@pytest.mark.parametrize("name,call", CALLS, ids=CALL_IDS)
def test_rank_zero_and_nine_are_value_errors(name, call):
    with pytest.raises(ValueError, match=r"input: 0 dimensions.*1 to 8 dimensions"):
        call(np.float32(1.0))
    x9 = np.ones((1,) * 9, F32)
    with pytest.raises(ValueError, match=r"input: 9 dimensions .*1 to 8 dimensions"):
        call(x9)


def test_no_silent_cast_of_a_list_input():
    # a list of floats becomes float64 (np.asarray), of ints int64: refused, never cast
    y = mvn([[1.0, 2.0, 3.0]], -1)
    assert y.dtype == F64
    with pytest.raises(TypeError, match="input: dtype int64 is not supported"):
        mvn([[1, 2, 3]], -1)


# ----------------------------------------------------------------------------------------------
# batch-norm parameters (SPEC section 2)
# ----------------------------------------------------------------------------------------------

def test_bn_param_shape_error_names_param_and_both_rules():
    x, m, v, s, b = bn_args()
    out = poisoned(x.shape)
    for name in ("mean", "variance", "scale", "bias"):
        args = dict(mean=m, variance=v, scale=s, bias=b)
        args[name] = np.ones((1, 4), F32)
        with pytest.raises(ValueError, match=rf"^{name}: shape \(1, 4\) does not fit the input's shape "
                                             r"\(2, 4, 3, 5\): .*the input's 4 dims, each equal to the input's or 1 "
                                             r".*or be 1-D of length C = input.shape\[channel_axis\] = 4"):
            bn(x, args["mean"], args["variance"], args["scale"], args["bias"], out=out)
        assert_poisoned(out)


@pytest.mark.parametrize("pshape", [(4,), (1, 4, 1, 1), (2, 4, 3, 5), (1, 1, 1, 1), (2, 1, 3, 1), (1, 4, 3, 1)])
def test_bn_param_shapes_accepted(pshape):
    x, *_ = bn_args()
    rng = np.random.default_rng(1)
    m = rng.standard_normal(pshape).astype(F32)
    v = (rng.random(pshape) + 0.5).astype(F32)
    y = bn(x, m, v)
    mm, vv = (a.reshape(1, 4, 1, 1) if a.ndim == 1 else a for a in (m, v))
    np.testing.assert_allclose(y, (x - mm) / np.sqrt(vv + 1e-5), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("pshape", [(5,), (3,), (4, 1, 1), (1, 4, 1, 1, 1), (2, 4, 3, 2), (2, 4)])
def test_bn_param_shapes_rejected(pshape):
    x, *_ = bn_args()
    with pytest.raises(ValueError, match=r"^mean: shape .* does not fit"):
        bn(x, np.ones(pshape, F32), np.ones(4, F32))


def test_bn_channel_axis_selects_c():
    x, m, v, s, b = bn_args((2, 3, 5, 4))  # C=4 at the last axis, 3 at axis 1
    m, v, s, b = (np.ones(4, F32) * k for k in (0.5, 2.0, 3.0, -1.0))
    y = bn(x, m, v, s, b, channel_axis=-1)
    np.testing.assert_allclose(y, ref_bn(x, m, v, s, b, ca=-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"mean: .*C = input.shape\[channel_axis\] = 3 \(channel_axis=1\)"):
        bn(x, m, v, s, b)
    y3 = bn(x, m[:3], v[:3], s[:3], b[:3], channel_axis=1)
    np.testing.assert_allclose(y3, ref_bn(x, m[:3], v[:3], s[:3], b[:3], ca=1), rtol=1e-5, atol=1e-5)


def test_bn_one_dim_input_uses_first_rule():
    x = np.arange(6, dtype=F32)
    y = bn(x, np.ones(6, F32), np.ones(6, F32))  # channel_axis=1 is ignored for 1-D input
    np.testing.assert_allclose(y, (x - 1) / np.sqrt(1 + 1e-5), rtol=1e-6)
    y1 = bn(x, np.ones(1, F32), np.ones(1, F32))
    np.testing.assert_allclose(y1, y, rtol=1e-6)
    with pytest.raises(ValueError,
                       match=r"mean: shape \(3,\) .*with a 1-D input a parameter must be 1-D of length 6 or 1"):
        bn(x, np.ones(3, F32), np.ones(6, F32))


@pytest.mark.parametrize("ca", [4, -5, 7])
def test_bn_channel_axis_out_of_range(ca):
    x, m, v, s, b = bn_args()
    out = poisoned(x.shape)
    with pytest.raises(AxisError,
                       match=rf"channel_axis: axis {ca} is out of range for an input of 4 dims \(valid: -4 to 3\)"):
        bn(x, m, v, s, b, channel_axis=ca, out=out)
    assert_poisoned(out)


@pytest.mark.parametrize("ca", [1.0, "1", None, True])
def test_bn_channel_axis_type(ca):
    x, m, v, s, b = bn_args()
    bn(x, m, v, s, b, channel_axis=1)  # cache a plan for channel_axis=1: True must not hit it
    with pytest.raises(TypeError, match="channel_axis: expected an int"):
        bn(x, m, v, s, b, channel_axis=ca)


@pytest.mark.parametrize("xdt,pdt,ok", [
    (F32, F32, True), (F16, F16, True), (F16, F32, True), (BF16, BF16, True), (BF16, F32, True),
    (F64, F64, True), (F64, F32, True), (F32, F16, False), (F32, F64, False), (F16, BF16, False),
    (BF16, F16, False), (F16, F64, False), (F32, np.dtype(np.int32), False),
])
def test_bn_param_dtypes(xdt, pdt, ok):
    x = np.ones((2, 3, 4), xdt)
    p = np.ones(3, pdt)
    out = poisoned(x.shape, xdt)
    if ok:
        assert bn(x, p, p, p, p, out=out) is out
        return
    with pytest.raises(TypeError, match=rf"^mean: dtype {pdt} is not accepted with a {xdt} input; a parameter's dtype "
                                        rf"must be the input's \({xdt}\) or float32"):
        bn(x, p, p, p, p, out=out)
    assert_poisoned(out)
    with pytest.raises(TypeError, match=r"^scale: dtype"):
        bn(x, np.ones(3, F32), np.ones(3, F32), p, out=out)
    assert_poisoned(out)


def test_param_lists_become_compute_type():
    x16 = np.ones((2, 3, 4), F16)
    y = bn(x16, [0.0, 1.0, 2.0], [1, 1, 1], [1, 2, 3], (0, 0, 0))
    assert y.dtype == F16
    x64 = np.ones((2, 3), F64)
    y = bn(x64, [0.5, 0.5, 0.5], [1.0, 1.0, 1.0])
    np.testing.assert_allclose(y, 0.5 / np.sqrt(1 + 1e-5))


def test_missing_and_bad_param_types():
    x, m, v, s, b = bn_args()
    with pytest.raises(TypeError, match=r"mean: cannot convert"):
        bn(x, ["a", "b", "c", "d"], v)
    with pytest.raises(TypeError):
        bn(x, m)  # variance is required


# ----------------------------------------------------------------------------------------------
# epsilon, epsilon_mode, activation
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,call", CALLS, ids=CALL_IDS)
@pytest.mark.parametrize("eps", [math.nan, math.inf, -math.inf, -1e-5, np.float32("nan"),
                                 # past float64: float() raises OverflowError; 10**5000 has no str() either
                                 10 ** 400, -10 ** 400, 10 ** 5000, Fraction(10 ** 400, 3)],
                         ids=lambda e: f"{type(e).__name__}~{'-' * (e < 0)}2**{abs(int(e)).bit_length()}" if
                         isinstance(e, (int, Fraction)) else repr(e))
def test_bad_epsilon_is_value_error(name, call, eps):
    x = np.ones((2, 4, 3, 5), F32)
    out = poisoned(x.shape)
    with pytest.raises(ValueError, match=r"^epsilon: .* is not allowed; epsilon must be finite and >= 0"):
        call(x, epsilon=eps, out=out)
    assert_poisoned(out)


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("eps", [3.5e38, 1e39, 2.0 ** 252, 1e300])
def test_epsilon_up_to_where_it_keeps_1_over_std_normal(dtype, eps):
    # SPEC: epsilon finite and >= 0. The kernels add it in double and multiply by 1 / std in the
    # compute type: data computed in float32 take any epsilon up to 2**252 (2**126 outside the
    # root), where 1 / sqrt(epsilon) (1 / epsilon) is still a normal float32; past it, a clear
    # error (1 / std would lose its bits: 0 past 2**276), and float64 data take any. The result,
    # about (x - mean) / sqrt(epsilon), rounds to the output type, down to 0 where it underflows.
    rng = np.random.default_rng(int(math.log10(eps)))
    x, mean, var, scale, bias = bn_args((2, 4, 3, 5), dtype, F32, rng)
    if dtype != F64 and eps > 2.0 ** 252:
        out = poisoned(x.shape, dtype)
        for call in (lambda: mvn(x, (1, 2, 3), epsilon=eps, out=out), lambda: bn(x, mean, var, epsilon=eps, out=out),
                     lambda: simdnorm.layer_norm_backward(x, x, mean[:1], var[:1], epsilon=eps)):
            with pytest.raises(ValueError, match=r"^epsilon: 1e\+300 is past 2\*\*252 \(7.237e\+75\), where "
                                                 r"1 / sqrt\(epsilon\) leaves float32's normal range"):
                call()
        assert_poisoned(out)
        return
    tiny = float(np.finfo(F64 if dtype == F64 else F32).smallest_subnormal) if dtype in (F32, F64) else 2.0 ** -24

    def check(got, want, context):
        got = got.astype(np.float64)
        bound = (1e-12 if dtype == F64 else 1e-2 if dtype == BF16 else 1e-3 if dtype == F16 else 1e-6) * np.abs(
            want).max() + 2 * tiny
        assert np.isfinite(got).all() and np.abs(got - want).max() <= bound, (context, np.abs(got - want).max(), bound)

    out = poisoned(x.shape, dtype)
    check(mvn(x, (1, 2, 3), epsilon=eps, out=out), ref_mvn(x, (1, 2, 3), eps)[0], "mvn")
    out = poisoned(x.shape, dtype)
    check(bn(x, mean, var, scale, bias, epsilon=eps, out=out), ref_bn(x, mean, var, scale, bias, eps), "bn")
    y, m, v = simdnorm.batch_normalization_training(x, epsilon=eps)
    check(y, ref_mvn(x, (0, 2, 3), eps)[0], "bn training")
    dy = rng.standard_normal(x.shape).astype(dtype)
    gx = simdnorm.batch_normalization_backward(dy, x, mean, var, training=False, epsilon=eps)[0]
    check(gx, dy.astype(np.float64) / np.sqrt(var.astype(np.float64).reshape(1, 4, 1, 1) + eps), "bn backward")
    y, m, inv = simdnorm.layer_norm(x, epsilon=eps, return_stats=True)  # (float32 statistics: 0 past 1e-45)
    sdt = F64 if dtype == F64 else F32
    want = 1 / np.sqrt(x.astype(np.float64).var(axis=-1, keepdims=True) + eps)
    np.testing.assert_allclose(inv, want, rtol=1e-12 if dtype == F64 else 1e-6,
                               atol=2 * float(np.finfo(sdt).smallest_subnormal))


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=lambda d: np.dtype(d).name)
def test_epsilon_outside_the_root_up_to_2_to_the_126_in_float32(dtype):
    x = np.random.default_rng(3).standard_normal((3, 40)).astype(dtype)
    for eps in (2.0 ** 126, 3e38):
        if dtype != F64 and eps > 2.0 ** 126:
            with pytest.raises(ValueError, match=r"^epsilon: 3e\+38 is past 2\*\*126 \(8.507e\+37\), where "
                                                 r"1 / epsilon leaves float32's normal range"):
                mvn(x, 1, epsilon=eps, epsilon_mode="outside")
            with pytest.raises(ValueError, match=r"past 2\*\*126"):
                simdnorm.mean_variance_normalization_backward(x, x, 1, np.zeros((3, 1), F32), np.ones((3, 1), F32),
                                                              epsilon=eps, epsilon_mode="outside")
            continue
        xd = x.astype(np.float64)
        want = (xd - xd.mean(1, keepdims=True)) / (xd.std(1, keepdims=True) + eps)
        got = mvn(x, 1, epsilon=eps, epsilon_mode="outside").astype(np.float64)
        rt = 1e-12 if dtype == F64 else 1e-2 if dtype == BF16 else 1e-6
        assert np.abs(got - want).max() <= rt * np.abs(want).max(), (eps, np.abs(got - want).max())


@pytest.mark.parametrize("name,call", CALLS, ids=CALL_IDS)
@pytest.mark.parametrize("eps", ["1e-5", None, [1e-5], 1j, 1 + 0j, True, False, np.True_, Decimal(1)],
                         ids=repr)
def test_epsilon_type(name, call, eps):
    """Refused whether or not a plan for an equal value (1.0 == True == 1+0j == Decimal(1), 0.0 ==
    False) is cached."""
    x = np.ones((2, 4, 3, 5), F32)
    for cached in (False, True):
        if cached:
            call(x, epsilon=1.0)
            call(x, epsilon=0.0)
        out = poisoned(x.shape)
        with pytest.raises(TypeError, match=r"^epsilon: expected a real number"):
            call(x, epsilon=eps, out=out)
        assert_poisoned(out)


def test_zero_epsilon_allowed():
    x = np.arange(8, dtype=F32).reshape(2, 4)
    y = mvn(x, -1, epsilon=0)
    np.testing.assert_allclose(y, ref_mvn(x, -1, 0.0)[0], rtol=1e-5)


@pytest.mark.parametrize("mode", ["Inside", "", "both", None, 1])
def test_bad_epsilon_mode(mode):
    x = np.ones((2, 3), F32)
    out = poisoned(x.shape)
    with pytest.raises(ValueError, match=r"^epsilon_mode: .* is not valid; use 'inside' .* or 'outside'"):
        mvn(x, -1, epsilon_mode=mode, out=out)
    assert_poisoned(out)


def test_epsilon_mode_outside():
    x = np.random.default_rng(3).standard_normal((3, 7)).astype(F32)
    y = mvn(x, -1, epsilon=0.5, epsilon_mode="outside")
    ref = (x - x.mean(-1, keepdims=True)) / (x.std(-1, keepdims=True) + 0.5)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,call", CALLS, ids=CALL_IDS)
def test_activation_errors(name, call):
    x = np.ones((2, 4, 3, 5), F32)
    out = poisoned(x.shape)
    with pytest.raises(ValueError, match=r"activation: unknown name 'swish'; valid names: identity, linear, relu, "
                                         r"leaky_relu, .*hard_swish"):
        call(x, activation="swish", out=out)
    with pytest.raises(TypeError, match=r"activation: expected None, an activation name \(str\) or "
                                        r"simdnorm.Activation, got int"):
        call(x, activation=3, out=out)
    with pytest.raises(TypeError, match=r"activation: expected None"):
        call(x, activation={"name": "relu"}, out=out)  # unhashable: the uncached path
    assert_poisoned(out)


def test_activation_forms_agree():
    x, m, v, s, b = bn_args()
    y1 = bn(x, m, v, s, b, activation="relu")
    y2 = bn(x, m, v, s, b, activation=simdnorm.Activation("relu"))
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_allclose(y1, np.maximum(ref_bn(x, m, v, s, b), 0), rtol=1e-5, atol=1e-5)
    y3 = bn(x, m, v, s, b, activation=simdnorm.Activation("clip", min=-0.5, max=0.5))
    np.testing.assert_allclose(y3, np.clip(ref_bn(x, m, v, s, b), -0.5, 0.5), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# axes (SPEC section 3)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("axes,exc,msg", [
    (4, AxisError, r"axes: axis 4 is out of range for an input of 4 dims \(valid: -4 to 3\)"),
    (-5, AxisError, r"axes: axis -5 is out of range"),
    ((1, 9), AxisError, r"axes: axis 9 is out of range"),
    ((), ValueError, r"axes: empty; give at least one axis"),
    ([], ValueError, r"axes: empty"),
    ((1, 1), ValueError, r"axes: axis 1 appears twice \(as 1 and 1\)"),
    ((1, -3), ValueError, r"axes: axis 1 appears twice \(as 1 and -3\)"),
    (1.0, TypeError, r"axes: expected an int or a sequence of ints, got float"),
    ((1.0,), TypeError, r"axes: expected ints, got float"),
    ((True,), TypeError, r"axes: expected ints, got bool"),
    (True, TypeError, r"axes: expected an int or a sequence of ints, got bool"),
    ("12", TypeError, r"axes: expected an int or a sequence of ints, got str"),
    (None, TypeError, r"axes: expected an int or a sequence of ints, got NoneType"),
    (np.array([[1]]), TypeError, r"axes: expected an int or a 1-D sequence of ints, got a 2-D array"),
    # SPEC: a sequence of ints; numpy's axis= refuses these too. A dict gave its keys as the axes.
    ({1: 2}, TypeError, r"^axes: expected an int or a sequence of ints, got dict; pass the axes as a tuple or a list$"),
    ({3, 1}, TypeError, r"^axes: expected an int or a sequence of ints, got set; pass the axes as a tuple"),
    (frozenset({2}), TypeError, r"^axes: expected an int or a sequence of ints, got frozenset; pass the axes"),
    ({1: 0, 3: 0}.keys(), TypeError, r"^axes: expected an int or a sequence of ints, got dict_keys; pass the axes"),
    ((a for a in (1, 2)), TypeError, r"^axes: expected an int or a sequence of ints, got generator; pass the axes"),
    (iter([2, 3]), TypeError, r"^axes: expected an int or a sequence of ints, got list_iterator; pass the axes"),
])
def test_axes_errors(axes, exc, msg):
    x = np.ones((2, 4, 3, 5), F32)
    mvn(x, 1)  # cached plans for 1 and (1,) must not let (1.0,) or (True,) through
    mvn(x, (1,))
    out = poisoned(x.shape)
    with pytest.raises(exc, match=msg):
        mvn(x, axes, out=out)
    assert_poisoned(out)


def test_axes_list_and_tuple_plans_are_cached():
    x = np.ones((2, 3, 4), F32)
    mvn(x, [1, 2])
    mvn(x, (1, 2))
    n = len(_api._MVN_CACHE)
    mvn(x, [1, 2])
    mvn(x, (1, 2))
    assert len(_api._MVN_CACHE) == n
    with pytest.raises(TypeError, match=r"axes: expected ints, got float"):
        mvn(x, [1.0, 2])


@pytest.mark.parametrize("axes,same", [
    (range(1, 3), (1, 2)), (np.array([1, 2]), (1, 2)), (np.array([2, 0, 1], np.uint8)[::2], (2, 1)),
    (np.array([2, -2], np.int32), (2, -2)), (np.int64(2), 2), (np.uint16(1), 1), (array.array("b", [2, 1]), (2, 1)),
])
def test_axes_range_array_and_numpy_int_plans_are_cached(axes, same, monkeypatch):
    """A range, a 1-D integer array or a numpy integer validates as the tuple (or int) of its values:
    it shares that plan (it was validated on every call, ~7x the cost of a cached call)."""
    x = np.arange(24, dtype=F32).reshape(2, 3, 4)
    want = mvn(x, same)
    assert len(_api._MVN_CACHE) == 1

    def miss(*args):
        raise AssertionError("plan cache missed")

    monkeypatch.setattr(_api, "mvn_plan", miss)
    for _ in range(2):
        np.testing.assert_array_equal(mvn(x, axes), want)
    assert len(_api._MVN_CACHE) == 1


@pytest.mark.parametrize("axes,exc,msg", [
    (np.array([1.0, 2.0]), TypeError, r"^axes: expected ints, got float \(1.0\)"),
    (np.array([True, False]), TypeError, r"^axes: expected ints, got bool \(True\)"),
    (np.array([1, 2 ** 64 - 1], np.uint64), AxisError, r"^axes: axis 18446744073709551615 is out of range"),
    (np.array([[1, 2]]), TypeError, r"^axes: expected an int or a 1-D sequence of ints, got a 2-D array"),
    (np.array(1.0), TypeError, r"^axes: expected an int or a 1-D sequence of ints, got a 0-D array"),
    (np.array(True), TypeError, r"^axes: expected an int or a 1-D sequence of ints, got a 0-D array"),
    (np.bool_(True), TypeError, r"^axes: expected an int or a sequence of ints, got bool"),
    (range(0), ValueError, r"^axes: empty"),
    (range(1, 1), ValueError, r"^axes: empty"),
])
def test_axes_array_that_the_validator_refuses_never_hits_a_plan(axes, exc, msg):
    x = np.ones((2, 3, 4), F32)
    for good in ((1, 2), 1, [1, 2], ()):  # cached plans for their equals must not let these through
        try:
            mvn(x, good)
        except ValueError:
            pass
    for _ in range(2):
        with pytest.raises(exc, match=msg):
            mvn(x, axes)


def test_axis_error_is_also_value_error():
    x = np.ones((2, 3), F32)
    with pytest.raises(ValueError):
        mvn(x, 5)
    with pytest.raises(IndexError):
        mvn(x, 5)


@pytest.mark.parametrize("axes", [(0, 2, 3), (3, 0), [-1, 1], range(1, 4), np.array([2, 3]), np.int64(2),
                                  (np.int32(1),), array.array("b", [3, 1]), np.array(2), np.array(-1, np.int8)])
def test_axes_any_subset_any_order(axes):
    """Every form numpy's axis= takes: a 0-d integer array too."""
    x = np.random.default_rng(5).standard_normal((2, 4, 3, 5)).astype(F32)
    norm = tuple(sorted(int(a) % 4 for a in np.atleast_1d(np.asarray(list(axes) if isinstance(axes, range) else axes))))
    y, mu, inv = mvn(x, axes, return_stats=True)
    ry, rmu, rinv = ref_mvn(x, norm)
    np.testing.assert_allclose(y, ry, rtol=2e-5, atol=2e-5)
    assert mu.shape == rmu.shape and inv.shape == rinv.shape and mu.dtype == F32
    np.testing.assert_allclose(mu, rmu, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# MVN scale and bias
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pshape", [(5,), (3, 5), (1, 5), (4, 1, 1), (2, 4, 3, 5), (1, 1, 1, 1), (1, 3, 1)])
def test_mvn_param_shapes_accepted(pshape):
    x = np.random.default_rng(2).standard_normal((2, 4, 3, 5)).astype(F32)
    s = np.full(pshape, 2.0, F32)
    y = mvn(x, (2, 3), s, s)
    np.testing.assert_allclose(y, 2 * ref_mvn(x, (2, 3))[0] + 2, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("pshape", [(4,), (3,), (2, 5), (1, 2, 4, 3, 5), (4, 3, 2)])
def test_mvn_param_shapes_rejected(pshape):
    x = np.ones((2, 4, 3, 5), F32)
    out = poisoned(x.shape)
    for name in ("scale", "bias"):
        kw = {name: np.ones(pshape, F32)}
        with pytest.raises(ValueError, match=rf"^{name}: shape {re.escape(str(pshape))} does not broadcast to the "
                                             r"input's shape \(2, 4, 3, 5\) without enlarging it"):
            mvn(x, -1, out=out, **kw)
        assert_poisoned(out)


def test_mvn_param_dtype():
    x = np.ones((2, 3), F16)
    out = poisoned(x.shape, F16)
    with pytest.raises(TypeError, match=r"^bias: dtype float64 is not accepted with a float16 input"):
        mvn(x, -1, bias=np.ones(3, F64), out=out)
    assert_poisoned(out)


# ----------------------------------------------------------------------------------------------
# out (SPEC section 6)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,call", CALLS, ids=CALL_IDS)
def test_out_errors(name, call):
    x = np.ones((2, 4, 3, 5), F32)
    with pytest.raises(TypeError, match=r"^out: expected a numpy.ndarray, got list"):
        call(x, out=x.tolist())
    bad = poisoned(x.shape, F64)
    with pytest.raises(TypeError, match=r"^out: dtype float64 differs from the input's float32"):
        call(x, out=bad)
    assert_poisoned(bad)
    bad = poisoned((2, 4, 3, 6))
    with pytest.raises(ValueError, match=r"^out: shape \(2, 4, 3, 6\) differs from the input's \(2, 4, 3, 5\)"):
        call(x, out=bad)
    assert_poisoned(bad)
    ro = poisoned(x.shape)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"^out: the array is read-only; out must be writeable"):
        call(x, out=ro)
    assert_poisoned(ro)
    with pytest.raises(ValueError, match=r"^out: the array is read-only"):
        call(x, out=np.broadcast_to(np.float32(0), x.shape))


def test_out_dtype_error_is_also_value_error():
    x = np.ones((2, 3), F32)
    with pytest.raises(ValueError, match="out: dtype"):
        mvn(x, -1, out=np.zeros((2, 3), F16))


@pytest.mark.parametrize("name,call", CALLS, ids=CALL_IDS)
def test_out_is_returned_and_matches(name, call):
    x = np.random.default_rng(7).standard_normal((2, 4, 3, 5)).astype(F32)
    y = call(x)
    out = poisoned(x.shape)
    r = call(x, out=out)
    assert r is out
    np.testing.assert_array_equal(out, y)
    # a strided out (every other element of a bigger buffer)
    big = poisoned((2, 4, 3, 10))
    view = big[..., ::2]
    assert call(x, out=view) is view
    np.testing.assert_array_equal(view, y)
    assert np.all(big[..., 1::2] == POISON)


@pytest.mark.parametrize("name,call", CALLS, ids=CALL_IDS)
def test_in_place(name, call):
    x = np.random.default_rng(8).standard_normal((2, 4, 3, 5)).astype(F32)
    y = call(x)
    x2 = x.copy()
    assert call(x2, out=x2) is x2
    assert_close(x2, y)
    # a different view object of the same buffer and strides is in place too
    x3 = x.copy()
    assert call(x3, out=x3[...]) is not None
    assert_close(x3, y)


@pytest.mark.parametrize("name,call", CALLS, ids=CALL_IDS)
def test_overlapping_out_as_if_no_overlap(name, call):
    rng = np.random.default_rng(9)
    buf = rng.standard_normal((2, 4, 3, 6)).astype(F32)
    x = buf[..., :5]
    y = call(x.copy())
    out = buf[..., 1:]  # shifted by one element: overlaps x everywhere but not identically
    assert call(x, out=out) is out
    assert_close(out, y)
    # a reversed view of the input's memory
    buf = rng.standard_normal((2, 4, 3, 5)).astype(F32)
    y = call(buf.copy())
    out = buf[:, :, :, ::-1]
    assert call(buf, out=out) is out
    assert_close(out, y)


def test_param_overlapping_out():
    x = np.random.default_rng(10).standard_normal((4, 4)).astype(F32)
    scale = np.linspace(0.5, 2, 4).astype(F32)
    out = np.zeros((5, 4), F32)
    out[0] = scale
    y = mvn(x, -1, out[0])
    res = mvn(x, -1, out[0], out=out[1:])  # disjoint views of one buffer: no temporary needed
    assert_close(res, y)
    # the scale lives in the output: computed as if it did not
    sc = np.linspace(2, 3, 4).astype(F32)
    y2 = mvn(x, -1, sc)
    buf2 = np.empty((4, 4), F32)
    buf2[0] = sc
    r2 = mvn(x, -1, buf2[0], out=buf2)
    assert_close(r2, y2)
    # batch norm: mean is a row of out
    xb = np.random.default_rng(11).standard_normal((3, 4)).astype(F32)
    m = np.arange(4, dtype=F32)
    yb = bn(xb, m, np.ones(4, F32))
    ob = np.empty((3, 4), F32)
    ob[1] = m
    bn(xb, ob[1], np.ones(4, F32), out=ob)
    assert_close(ob, yb)


def test_in_place_with_a_parameter_inside_the_input():
    # out is the input, and a parameter is a row of the input: computed as if it were a copy
    rng = np.random.default_rng(18)
    x = rng.standard_normal((4, 6)).astype(F32)
    want = mvn(x, -1, x[1].copy(), x[2].copy())
    x2 = x.copy()
    assert mvn(x2, -1, x2[1], x2[2], out=x2) is x2
    assert_close(x2, want)
    xb = rng.standard_normal((5, 4)).astype(F32)
    xb[:, :] = np.abs(xb) + 0.5
    wantb = bn(xb, xb[0].copy(), xb[1].copy(), xb[2].copy(), xb[3].copy())
    xb2 = xb.copy()
    bn(xb2, xb2[0], xb2[1], xb2[2], xb2[3], out=xb2)
    assert_close(xb2, wantb)
    # the whole input as a full-size parameter, in place
    xf = np.abs(rng.standard_normal((3, 4)).astype(F32)) + 1
    wantf = bn(xf, np.zeros(4, F32), xf.copy())
    xf2 = xf.copy()
    bn(xf2, np.zeros(4, F32), xf2, out=xf2)
    assert_close(xf2, wantf)


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "fortran"])
def test_result_has_input_memory_order(layout):
    base = np.random.default_rng(12).standard_normal((2, 3, 4, 5)).astype(F32)
    x = {"channels_last": base.transpose(0, 2, 3, 1), "transposed": base.T,
         "fortran": np.asfortranarray(base)}[layout]
    c = x.shape[1]
    for y in (bn(x, np.zeros(c, F32), np.ones(c, F32)), mvn(x, -1), simdnorm.layer_norm(x),
              simdnorm.instance_norm(x), simdnorm.group_norm(x, 1)):
        assert y.strides == np.empty_like(x).strides
        assert type(y) is np.ndarray


def test_zero_size():
    x = np.ones((0, 4, 3), F32)
    assert bn(x, np.ones(4, F32), np.ones(4, F32)).shape == (0, 4, 3)
    y, mu, inv = mvn(x, -1, return_stats=True)
    assert y.shape == (0, 4, 3) and mu.shape == (0, 4, 1) and inv.shape == (0, 4, 1)
    y, mu, inv = simdnorm.group_norm(x, 2, return_stats=True)
    assert y.shape == (0, 4, 3) and mu.shape == (0, 2)


def test_ndarray_subclass_input_gives_ndarray():
    """A subclass is read as the ndarray it is, a masked array too when it masks nothing (one that
    masks an element is refused: test_hostile_inputs.py)."""
    x, mean, var, _, _ = bn_args()
    td = simdnorm.TensorDesc
    op = simdnorm.compile(simdnorm.BatchNormalizationDesc(td(F32, x.shape), td(F32, mean.shape), td(F32, var.shape)))
    want = ref_bn(x, mean, var, np.ones(mean.shape), np.zeros(mean.shape))
    for xm in (np.ma.masked_array(x), np.ma.masked_array(x, mask=np.zeros(x.shape, bool))):
        for y in (bn(xm, mean, var), op(xm, np.ma.masked_array(mean), var)):
            assert type(y) is np.ndarray
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
        y = mvn(xm, -1)
        assert type(y) is np.ndarray
        assert_close(y, ref_mvn(x, -1)[0])


def test_masked_out_that_masks_nothing_is_written():
    """out= a masked array whose mask is nomask or all False: every element written through its
    data, the array itself returned (one that masks an element is refused: test_hostile_inputs.py)."""
    x, mean, var, _, _ = bn_args()
    want = ref_bn(x, mean, var, np.ones(mean.shape), np.zeros(mean.shape))
    td = simdnorm.TensorDesc
    op = simdnorm.compile(simdnorm.BatchNormalizationDesc(td(F32, x.shape), td(F32, mean.shape), td(F32, var.shape)))
    for mask in (np.ma.nomask, np.zeros(x.shape, bool)):
        for run in (lambda o: bn(x, mean, var, out=o), lambda o: op(x, mean, var, out=o)):
            out = np.ma.masked_array(np.full(x.shape, np.nan, F32), mask=mask)
            assert run(out) is out
            np.testing.assert_allclose(out.data, want, rtol=1e-5, atol=1e-5)
        out = np.ma.masked_array(np.full(x.shape, np.nan, F32), mask=mask)
        assert simdnorm.layer_norm(x, out=out) is out
        assert_close(out.data, ref_mvn(x, -1)[0])


# (DLPack producers and torch tensors, in and out: tests/test_dlpack.py)


# ----------------------------------------------------------------------------------------------
# return_stats (SPEC sections 3-4)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=str)
def test_return_stats_shapes_and_dtypes(dtype):
    x = np.random.default_rng(13).standard_normal((2, 6, 3, 4)).astype(dtype)
    sd = F64 if dtype == F64 else F32
    y, mu, inv = mvn(x, (0, 2), return_stats=True)
    assert y.dtype == dtype and mu.shape == (1, 6, 1, 4) and inv.shape == (1, 6, 1, 4)
    assert mu.dtype == sd and inv.dtype == sd
    y, mu, inv = mvn(x, -1, normalize_mean=False, return_stats=True)
    assert mu is None and inv.shape == (2, 6, 3, 1)
    y, mu, inv = mvn(x, -1, normalize_variance=False, return_stats=True)
    assert inv is None and mu.shape == (2, 6, 3, 1)
    y, mu, inv = simdnorm.layer_norm(x, axis=-2, return_stats=True)
    assert mu.shape == (2, 6, 1, 1) and inv.shape == (2, 6, 1, 1)
    y, mu, inv = simdnorm.rms_norm(x, return_stats=True)
    assert mu is None and inv.shape == (2, 6, 3, 1) and inv.dtype == sd
    y, mu, inv = simdnorm.instance_norm(x, return_stats=True)
    assert mu.shape == (2, 6, 1, 1)
    y, mu, inv = simdnorm.instance_norm(x, channel_axis=-1, return_stats=True)
    assert mu.shape == (2, 1, 1, 4)
    y, mu, inv = simdnorm.group_norm(x, 3, return_stats=True)
    assert mu.shape == (2, 3) and inv.shape == (2, 3) and mu.dtype == sd
    y, mu, inv = simdnorm.group_norm(x, 2, channel_axis=-1, return_stats=True)
    assert mu.shape == (2, 2)
    out = np.empty_like(x)
    r = mvn(x, -1, out=out, return_stats=True)
    assert r[0] is out


STATS_CALLS = [c for c in CALLS if c[0] != "batch_normalization"] + [
    ("compiled_mvn", lambda x, **k: simdnorm.compile(
        simdnorm.MeanVarianceNormalizationDesc(simdnorm.TensorDesc(F32, x.shape), (2, 3)))(x, **k)),
]


@pytest.mark.parametrize("name,call", STATS_CALLS, ids=[c[0] for c in STATS_CALLS])
@pytest.mark.parametrize("value", ["no", "", 0.5, 1, 0, 1.0, None, np.float64(1.0), np.array(True), [True]], ids=repr)
def test_return_stats_type(name, call, value):
    """return_stats takes a bool (Python's or numpy's); anything else is refused before out is
    written (a truthy non-bool used to give a tuple), whether or not plans ran with True and False."""
    x = np.random.default_rng(19).standard_normal((2, 4, 3, 5)).astype(F32)
    for cached in (False, True):
        if cached:
            y = call(x)
            for good in (True, np.True_):
                r = call(x, return_stats=good)
                assert type(r) is tuple and len(r) == 3
                np.testing.assert_array_equal(r[0], y)
            for good in (False, np.False_):
                np.testing.assert_array_equal(call(x, return_stats=good), y)
        out = poisoned(x.shape)
        with pytest.raises(TypeError, match=rf"^return_stats: expected a bool, got {type(value).__name__} "):
            call(x, out=out, return_stats=value)
        assert_poisoned(out)


def test_return_stats_numpy_bool_values():
    x = np.random.default_rng(20).standard_normal((3, 4, 6)).astype(F32)
    ry, rmu, rinv = ref_mvn(x, -1)
    y, mu, inv = simdnorm.layer_norm(x, return_stats=np.True_)
    assert_close(y, ry)
    np.testing.assert_allclose(mu, rmu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inv, rinv, rtol=1e-5)
    y = mvn(x, -1, return_stats=np.False_)
    assert type(y) is np.ndarray
    assert_close(y, ry)


# ----------------------------------------------------------------------------------------------
# conveniences: their own rules and their routes onto MVN
# ----------------------------------------------------------------------------------------------

def test_layer_norm_and_rms_norm_values():
    x = np.random.default_rng(14).standard_normal((3, 4, 6)).astype(F32)
    s = np.linspace(0.5, 1.5, 24).astype(F32).reshape(4, 6)
    b = np.linspace(-1, 1, 24).astype(F32).reshape(4, 6)
    y, mu, inv = simdnorm.layer_norm(x, s, b, axis=1, return_stats=True)
    ry, rmu, rinv = ref_mvn(x, (1, 2))
    np.testing.assert_allclose(y, ry * s + b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(inv, rinv, rtol=1e-5)
    y, none, inv = simdnorm.rms_norm(x, s[0], return_stats=True)
    assert none is None
    rms = np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, x / rms * s[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inv, 1 / rms, rtol=1e-5)


@pytest.mark.parametrize("axis,exc", [(3, AxisError), (-4, AxisError), (1.0, TypeError), (True, TypeError)])
def test_layer_norm_axis_errors(axis, exc):
    x = np.ones((3, 4, 6), F32)
    simdnorm.layer_norm(x, axis=1)
    out = poisoned(x.shape)
    with pytest.raises(exc, match=r"^axis: "):
        simdnorm.layer_norm(x, axis=axis, out=out)
    with pytest.raises(exc, match=r"^axis: "):
        simdnorm.rms_norm(x, axis=axis, out=out)
    assert_poisoned(out)


def test_layer_norm_scale_shape_error():
    x = np.ones((3, 4, 6), F32)
    with pytest.raises(ValueError, match=r"^scale: shape \(4,\) does not broadcast"):
        simdnorm.layer_norm(x, np.ones(4, F32))


@pytest.mark.parametrize("fn", ["instance_norm", "group_norm"])
def test_per_channel_scale_shape(fn):
    x = np.ones((2, 4, 3, 5), F32)
    call = (lambda **k: simdnorm.instance_norm(x, **k)) if fn == "instance_norm" else \
        (lambda **k: simdnorm.group_norm(x, 2, **k))
    out = poisoned(x.shape)
    for name in ("scale", "bias"):
        for shape in [(1, 4, 1, 1), (5,), (4, 1)]:
            with pytest.raises(ValueError, match=rf"^{name}: shape {re.escape(str(shape))}; {fn} takes a per-channel "
                                                 rf"{name} of shape \(C,\) = \(4,\)"):
                call(out=out, **{name: np.ones(shape, F32)})
    assert_poisoned(out)


@pytest.mark.parametrize("fn", ["instance_norm", "group_norm"])
def test_channel_axis_rules_of_conveniences(fn):
    call = getattr(simdnorm, fn)
    args = (2,) if fn == "group_norm" else ()
    x = np.ones((2, 4, 3), F32)
    with pytest.raises(ValueError, match=rf"^channel_axis: 0 is the batch axis; {fn} takes"):
        call(x, *args, channel_axis=0)
    with pytest.raises(ValueError, match=r"^channel_axis: -3 is the batch axis"):
        call(x, *args, channel_axis=-3)
    with pytest.raises(AxisError, match=r"^channel_axis: axis 3 is out of range"):
        call(x, *args, channel_axis=3)
    with pytest.raises(ValueError, match=rf"^input: shape \(4,\); {fn} takes an input of shape \(N, C, ...\)"):
        call(np.ones(4, F32), *args)


def test_instance_norm_needs_spatial_dims():
    with pytest.raises(ValueError, match=r"^input: shape \(2, 4\) has no spatial dims; instance_norm"):
        simdnorm.instance_norm(np.ones((2, 4), F32))


def test_instance_norm_values_both_layouts():
    rng = np.random.default_rng(15)
    x = rng.standard_normal((2, 3, 4, 5)).astype(F32)
    s, b = np.array([1, 2, 3], F32), np.array([0, -1, 1], F32)
    y = simdnorm.instance_norm(x, s, b)
    ref = ref_mvn(x, (2, 3))[0] * s[:, None, None] + b[:, None, None]
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5)
    xl = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    yl = simdnorm.instance_norm(xl, s, b, channel_axis=-1)
    np.testing.assert_allclose(yl, ref.transpose(0, 2, 3, 1), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("g,exc,msg", [
    (3, ValueError, r"^num_groups: 3 does not divide the number of channels C = 8; C % num_groups must be 0"),
    (0, ValueError, r"^num_groups: 0; it must be >= 1 and divide the number of channels C = 8"),
    (-2, ValueError, r"^num_groups: -2; it must be >= 1"),
    (16, ValueError, r"^num_groups: 16 does not divide"),
    (2.0, TypeError, r"^num_groups: expected an int, got float"),
    (True, TypeError, r"^num_groups: expected an int, got bool"),
])
def test_group_norm_num_groups(g, exc, msg):
    x = np.ones((2, 8, 3), F32)
    simdnorm.group_norm(x, 2)
    simdnorm.group_norm(x, 1)
    out = poisoned(x.shape)
    with pytest.raises(exc, match=msg):
        simdnorm.group_norm(x, g, out=out)
    assert_poisoned(out)


def ref_group(x, g, s, b, ca, eps=1e-5):
    xc = np.moveaxis(x.astype(np.float64), ca, 1)
    n, c = xc.shape[:2]
    xg = xc.reshape(n, g, c // g, *xc.shape[2:])
    axes = tuple(range(2, xg.ndim))
    mu = xg.mean(axes, keepdims=True)
    var = xg.var(axes, keepdims=True)
    y = ((xg - mu) / np.sqrt(var + eps)).reshape(xc.shape)
    shp = [1] * xc.ndim
    shp[1] = c
    y = y * s.reshape(shp) + b.reshape(shp)
    return np.moveaxis(y, 1, ca), mu.reshape(n, g), (1 / np.sqrt(var + eps)).reshape(n, g)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "negative", "sliced", "channels_last_view",
                                    "zero_stride"])
def test_group_norm_any_layout_no_copy(layout):
    rng = np.random.default_rng(16)
    g, c = 3, 6
    if layout == "contiguous":
        x, ca = rng.standard_normal((2, c, 4, 5)).astype(F32), 1
    elif layout == "channels_last":
        x, ca = rng.standard_normal((2, 4, 5, c)).astype(F32), -1
    elif layout == "negative":
        x, ca = rng.standard_normal((2, c, 4, 5)).astype(F32)[:, ::-1, :, ::-1], 1
    elif layout == "sliced":
        x, ca = rng.standard_normal((2, 2 * c, 4, 9)).astype(F32)[:, ::2, :, 1::2], 1
    elif layout == "channels_last_view":
        x, ca = rng.standard_normal((2, c, 4, 5)).astype(F32).transpose(0, 2, 3, 1), -1
    else:
        x, ca = np.broadcast_to(rng.standard_normal((2, c, 1, 5)).astype(F32), (2, c, 4, 5)), 1
    s = rng.standard_normal(c).astype(F32)
    b = rng.standard_normal(c).astype(F32)
    y, mu, inv = simdnorm.group_norm(x, g, s, b, channel_axis=ca, return_stats=True)
    ry, rmu, rinv = ref_group(x, g, s, b, ca)
    np.testing.assert_allclose(y, ry, rtol=3e-5, atol=3e-5)
    np.testing.assert_allclose(mu, rmu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inv, rinv, rtol=1e-5)
    # into a strided out, and in place when writeable
    big = poisoned(x.shape[:-1] + (2 * x.shape[-1],))
    out = big[..., ::2]
    assert simdnorm.group_norm(x, g, s, b, channel_axis=ca, out=out) is out
    np.testing.assert_array_equal(out, y)
    if x.flags.writeable:
        x2 = x.copy()
        simdnorm.group_norm(x2, g, s, b, channel_axis=ca, out=x2)
        assert_close(x2, y)


def test_split_view_never_copies():
    x = np.arange(2 * 6 * 4, dtype=F32).reshape(2, 6, 4)[:, ::-1, ::2]
    v = _api.split_view(x, 1, 3, 2)
    assert v.shape == (2, 3, 2, 2) and np.shares_memory(v, x)
    np.testing.assert_array_equal(v.reshape(x.shape), x)


def test_bool_flags():
    x = np.random.default_rng(17).standard_normal((3, 5)).astype(F32)
    np.testing.assert_array_equal(mvn(x, -1, normalize_variance=0), mvn(x, -1, normalize_variance=False))
    with pytest.raises(TypeError, match=r"^normalize_mean: expected a bool, got str"):
        mvn(x, -1, normalize_mean="no")
    with pytest.raises(TypeError, match=r"^normalize_variance: expected a bool, got int \(2\)"):
        mvn(x, -1, normalize_variance=2)


def ref_mvn_flags(x, axes, nm, nv, eps=1e-5):
    """float64 MVN with normalize_mean / normalize_variance (SPEC section 3)."""
    x = x.astype(np.float64)
    d = x - x.mean(axis=axes, keepdims=True) if nm else x
    return d / np.sqrt((d * d).mean(axis=axes, keepdims=True) + eps) if nv else d


@pytest.mark.parametrize("flag", ["normalize_mean", "normalize_variance"])
@pytest.mark.parametrize("value", [1.0, 0.0, np.float64(1.0), np.float32(0.0), Decimal(1), Fraction(1), 1 + 0j, 0j,
                                   "no", None], ids=repr)
def test_bool_flag_type(flag, value):
    """Refused whether or not a plan for an equal accepted value (1.0 == True == Decimal(1) == 1+0j,
    0.0 == False == 0) is cached: the plan cache keys the flags with their class."""
    x = np.random.default_rng(18).standard_normal((2, 4, 3, 5)).astype(F32)
    for cached in (False, True):
        if cached:
            for good in (True, False, 1, 0, np.True_, np.False_):
                kw = dict(normalize_mean=True, normalize_variance=True)
                kw[flag] = good
                want = ref_mvn_flags(x, (2, 3), bool(kw["normalize_mean"]), bool(kw["normalize_variance"]))
                assert_close(mvn(x, (2, 3), **{flag: good}), want)
        out = poisoned(x.shape)
        with pytest.raises(TypeError, match=rf"^{flag}: expected a bool, got {type(value).__name__} "):
            mvn(x, (2, 3), out=out, **{flag: value})
        assert_poisoned(out)


def test_plan_cache_is_bounded():
    x = np.ones((2, 3), F32)
    for i in range(_api._CACHE_MAX + 10):
        mvn(x, -1, epsilon=1e-5 + i * 1e-9)
    assert len(_api._MVN_CACHE) <= _api._CACHE_MAX
