"""Training ops (SPEC §9): batch_normalization_training and the backward ops, against the float64
reference of tests/training_reference.py (itself checked by tests/test_training_reference.py).

Covered here: every backward op in every dtype and backward activation, with poisoned out= and the
flag variants (batch norm training / global statistics, fused_add, same-rank parameters, channels
last; MVN's normalize_mean / normalize_variance / epsilon_mode); which gradients come back (None
when not asked for), their dtypes and shapes (a parameter's gradient in the parameter's dtype,
float32 parameters with half inputs, grad_fused_add rounded once); memory layouts (transposed,
negative, zero-stride, unaligned, strided) of every argument and ranks 1-8; zero-size inputs;
finite differences of simdnorm's own float64 forward ops; PyTorch's autograd in float32 and
bfloat16; batch statistics and running statistics (PyTorch's momentum and cumulative conventions
after several steps against torch.nn.BatchNorm2d, ONNX's formula, every running-statistics dtype);
large means and constant groups; long reductions; every ISA; 1 vs 2 threads bitwise; relu'(0) and
leaky_relu'(0); the error cases, and running statistics untouched when a call raises. The
random-layout fuzzer, each case in a child process, is tests/test_training_fuzz.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

import simdnorm
from cases import (LAYOUTS, WRITABLE_LAYOUTS, act_arg, bits, empty_past_line, layout_empty, make_out, rand_values,
                   isas_under_test)
from reference import (
    BF16,
    apply_activation,
    DTYPES,
    F16,
    F32,
    F64,
    assert_like_empty_like,
    check_close,
    check_mvn,
    compute_dtype,
    dtype_id,
    f64,
)
from training_reference import (
    AxisError,
    Problem,
    bn_backward_ref,
    bn_training_ref,
    check_grad,
    check_grads,
    fd_gradients,
    grad_tolerance,
    push_from_kinks,
    quiet,
    random_problem,
    running_update_ref,
)

DT = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
ACTS = [(None, None), ("relu", None), ("leaky_relu", None), ("leaky_relu", {"alpha": 0.3}), ("silu", None),
        ("gelu", None)]
ACT_IDS = ["none", "relu", "leaky", "leaky0.3", "silu", "gelu"]
U32 = float(np.finfo(np.float32).eps) / 2
U64 = float(np.finfo(np.float64).eps) / 2

# op variants: random_problem keyword arguments (shapes with lengths around the vector widths)
VARIANTS = {
    "batch_norm": [dict(shape=(3, 5, 37)), dict(shape=(3, 5, 37), fused_add=True),
                   dict(shape=(4, 19, 6), channel_axis=-1, fused_add=True),
                   dict(shape=(2, 3, 4, 9), scale=None, bias=None),
                   dict(shape=(3, 4, 9), same_rank=(1, 4, 9), fused_add="(4, 1)")],
    "batch_norm_eval": [dict(shape=(3, 5, 37)), dict(shape=(4, 19, 6), channel_axis=-1, fused_add=True)],
    "mvn": [dict(shape=(4, 6, 33), axes=(1, 2)),
            dict(shape=(4, 6, 33), axes=(0, 2), epsilon_mode="outside", epsilon=0.3),
            dict(shape=(4, 6, 33), axes=(2,), normalize_mean=False),
            dict(shape=(4, 6, 33), axes=(2,), normalize_mean=False, epsilon_mode="outside", epsilon=0.1),
            dict(shape=(4, 6, 33), axes=(1,), normalize_variance=False),
            dict(shape=(4, 6, 33), axes=(0, 1, 2), normalize_mean=False, normalize_variance=False),
            dict(shape=(5, 3, 20), axes=(-1, 0), scale="(20,)", bias="(3, 1)")],
    "layer_norm": [dict(shape=(4, 3, 45)), dict(shape=(4, 3, 45), axis=1), dict(shape=(6, 70), scale=None, bias=None)],
    "rms_norm": [dict(shape=(4, 3, 45)), dict(shape=(3, 4, 17), axis=1, epsilon=1e-3)],
    "instance_norm": [dict(shape=(2, 3, 5, 7)), dict(shape=(2, 6, 4, 3), channel_axis=-1)],
    "group_norm": [dict(shape=(2, 6, 35), num_groups=3), dict(shape=(3, 20, 8), num_groups=4, channel_axis=-1),
                   dict(shape=(2, 4, 3, 3), num_groups=1)],
}
CASES = [(op, i) for op in VARIANTS for i in range(len(VARIANTS[op]))]
CASE_IDS = [f"{op}-{i}" for op, i in CASES]


def make_problem(rng, op, variant, dtype, act=None, params=None, **override) -> Problem:
    kw = dict(VARIANTS[op][variant])
    kw.update(override)
    same_rank = kw.pop("same_rank", None)
    for name in ("scale", "bias", "fused_add"):  # "(a, b)": a parameter of that shape
        if isinstance(kw.get(name), str):
            kw[name] = rand_values(rng, eval(kw[name]), dtype, loc=0.3, scale=1.0)
    if same_rank is not None:
        kw["scale"] = rand_values(rng, same_rank, dtype, loc=1.0, scale=0.5)
        kw["bias"] = rand_values(rng, same_rank, dtype, loc=0.0, scale=1.0)
    p = random_problem(rng, op, activation=act, act_params=params, dtype=dtype, **kw)
    if p.eval_stats is not None:  # the given statistics, in the compute dtype
        p.eval_stats = tuple(a.astype(compute_dtype(dtype)) for a in p.eval_stats)
    return p


# ----------------------------------------------------------------------------------------------
# calling the package
# ----------------------------------------------------------------------------------------------


def act_of(p: Problem):
    return act_arg(p.activation, p.act_params)


def sn_forward(p: Problem, x=None, s=None, b=None, fa=None, *, stats=False):
    """simdnorm's forward op of the problem (x, s, b, fa default to the problem's arrays): the output,
    or with stats=True the statistics in the form the backward op takes."""
    x = p.x if x is None else x
    s = p.scale if s is None else s
    b = p.bias if b is None else b
    fa = p.fused_add if fa is None else fa
    k, eps, act = p.kw, p.epsilon, act_of(p)
    ca = k.get("channel_axis", 1)
    if p.op == "batch_norm":
        y, m, v = simdnorm.batch_normalization_training(x, s, b, epsilon=eps, channel_axis=ca, fused_add=fa,
                                                        activation=act)
        return (m, v) if stats else y
    if p.op == "batch_norm_eval":
        if stats:
            return p.eval_stats
        m, v = p.eval_stats
        y = simdnorm.batch_normalization(x, m, v, s, b, epsilon=eps, channel_axis=ca)
        if fa is not None or act is not None:  # the forward with fused_add: in float64, for the FD checks only
            z = f64(y) + (0.0 if fa is None else np.broadcast_to(f64(fa), x.shape))
            y = apply_activation(z, p.activation, p.act_params)
        return y
    if p.op == "mvn":
        r = simdnorm.mean_variance_normalization(x, k["axes"], s, b, normalize_mean=k.get("normalize_mean", True),
                                                 normalize_variance=k.get("normalize_variance", True), epsilon=eps,
                                                 epsilon_mode=k.get("epsilon_mode", "inside"), activation=act,
                                                 return_stats=True)
    elif p.op == "layer_norm":
        r = simdnorm.layer_norm(x, s, b, axis=k.get("axis", -1), epsilon=eps, activation=act, return_stats=True)
    elif p.op == "rms_norm":
        r = simdnorm.rms_norm(x, s, axis=k.get("axis", -1), epsilon=eps, activation=act, return_stats=True)
        return (r[2],) if stats else r[0]
    elif p.op == "instance_norm":
        r = simdnorm.instance_norm(x, s, b, epsilon=eps, channel_axis=ca, activation=act, return_stats=True)
    elif p.op == "group_norm":
        r = simdnorm.group_norm(x, k["num_groups"], s, b, epsilon=eps, channel_axis=ca, activation=act,
                                return_stats=True)
    else:
        raise ValueError(p.op)
    return tuple(r[1:]) if stats else r[0]


def sn_backward(p: Problem, dy, stats, *, x=None, s=None, b=None, fa=None, activation="problem", **flags):
    """simdnorm's backward op of the problem; flags: grad_input, grad_scale, grad_bias, out."""
    x = p.x if x is None else x
    s = p.scale if s is None else s
    b = p.bias if b is None else b
    fa = p.fused_add if fa is None else fa
    k, eps = p.kw, p.epsilon
    act = act_of(p) if activation == "problem" else activation
    ca = k.get("channel_axis", 1)
    common = dict(epsilon=eps, activation=act, **flags)
    if p.op in ("batch_norm", "batch_norm_eval"):
        extra = {} if fa is None else dict(fused_add=fa)
        return simdnorm.batch_normalization_backward(dy, x, stats[0], stats[1], s, b, channel_axis=ca,
                                                     training=p.op == "batch_norm", **extra, **common)
    if p.op == "mvn":
        return simdnorm.mean_variance_normalization_backward(
            dy, x, k["axes"], stats[0], stats[1], s, b, normalize_mean=k.get("normalize_mean", True),
            normalize_variance=k.get("normalize_variance", True), epsilon_mode=k.get("epsilon_mode", "inside"),
            **common)
    if p.op == "layer_norm":
        return simdnorm.layer_norm_backward(dy, x, stats[0], stats[1], s, b, axis=k.get("axis", -1), **common)
    if p.op == "rms_norm":
        return simdnorm.rms_norm_backward(dy, x, stats[0], s, axis=k.get("axis", -1), **common)
    if p.op == "instance_norm":
        return simdnorm.instance_norm_backward(dy, x, stats[0], stats[1], s, b, channel_axis=ca, **common)
    if p.op == "group_norm":
        return simdnorm.group_norm_backward(dy, x, k["num_groups"], stats[0], stats[1], s, b, channel_axis=ca,
                                            **common)
    raise ValueError(p.op)


def ref_stats(p: Problem):
    """The exact statistics rounded to the compute dtype (what a correct forward returns)."""
    ct = compute_dtype(p.x.dtype)
    return tuple(None if a is None else np.asarray(a).astype(ct) for a in p.stats())


def at_one_and_two_threads(threads, call, context=""):
    """call() at 1 thread, then at 2: the arrays it returns must be bitwise the same. The first's."""
    results = []
    for n in (1, 2):
        threads(n)
        results.append(call())
    for got, want in zip(results[1], results[0]):
        assert (got is None) == (want is None), context
        if got is not None:
            np.testing.assert_array_equal(bits(got), bits(want), err_msg=context)
    return results[0]


def f64_stats(stats):
    return tuple(None if a is None else f64(a) for a in stats)


def wanted(p: Problem):
    return ("input",) + (("scale",) if p.scale is not None else ()) + (("bias",) if p.bias is not None else ())


# ----------------------------------------------------------------------------------------------
# every backward op against the float64 reference
# ----------------------------------------------------------------------------------------------


@DT
@pytest.mark.parametrize("act,params", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("op,variant", CASES, ids=CASE_IDS)
def test_backward_matches_reference(rng, op, variant, dtype, act, params):
    p = make_problem(rng, op, variant, dtype, act, params)
    dy = rand_values(rng, p.x.shape, dtype, scale=1.0)
    stats = sn_forward(p, stats=True)
    ctx = f"{op} {VARIANTS[op][variant]} {dtype_id(dtype)} act={act} {params or ''}"
    ref = p.backward(dy, f64_stats(stats))
    out = make_out(p.x.shape, dtype)
    res = sn_backward(p, dy, stats, out=out)
    assert res[0] is out, f"a call with out= must return out as grad_input {ctx}"
    check_grads(res, ref, x=p.x, scale=p.scale, bias=p.bias, fused_add=p.fused_add, want=wanted(p), context=ctx)
    res2 = sn_backward(p, dy, stats)  # no out: a new array like np.empty_like(x), the same bits
    assert_like_empty_like(res2[0], p.x)
    np.testing.assert_array_equal(bits(res2[0]), bits(out))


@pytest.mark.parametrize("op,variant", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
def test_backward_with_reference_statistics(rng, op, variant, dtype):
    # statistics made by the reference (not by simdnorm's forward): the backward takes any
    # statistics of the right shape and dtype, and its result follows them
    p = make_problem(rng, op, variant, dtype, "gelu")
    dy = rand_values(rng, p.x.shape, dtype, scale=1.0)
    stats = ref_stats(p)
    res = sn_backward(p, dy, stats)
    check_grads(res, p.backward(dy, f64_stats(stats)), x=p.x, scale=p.scale, bias=p.bias, fused_add=p.fused_add,
                want=wanted(p), context=f"{op}-{variant}")


@pytest.mark.parametrize("op,variant", CASES, ids=CASE_IDS)
def test_backward_returns_what_is_asked(rng, op, variant):
    p = make_problem(rng, op, variant, F32, "silu")
    dy = rand_values(rng, p.x.shape, F32, scale=1.0)
    stats = sn_forward(p, stats=True)
    ref = p.backward(dy, f64_stats(stats))
    n = 4 if p.fused_add is not None else 3
    kw = dict(x=p.x, scale=p.scale, bias=p.bias, fused_add=p.fused_add)
    has = [("scale", p.scale is not None), ("bias", p.bias is not None and op != "rms_norm")]
    # each subset of the gradients that exist
    for gi in (True, False):
        for gs in ([True, False] if p.scale is not None else [None]):
            for gb in ([True, False] if has[1][1] else [None]):
                flags = dict(grad_input=gi)
                if gs is not None:
                    flags["grad_scale"] = gs
                if gb is not None:
                    flags["grad_bias"] = gb
                res = sn_backward(p, dy, stats, **flags)
                assert isinstance(res, tuple) and len(res) == n, (flags, type(res))
                want = (("input",) if gi else ()) + (("scale",) if gs else ()) + (("bias",) if gb else ())
                check_grads(res, ref, want=want, context=f"{op}-{variant} {flags}", **kw)
    # the defaults: grad_scale / grad_bias when that parameter was given
    res = sn_backward(p, dy, stats)
    check_grads(res, ref, want=wanted(p), context=f"{op}-{variant} defaults", **kw)
    if op == "rms_norm":
        assert res[2] is None, "rms_norm_backward: grad_bias is always None"


@pytest.mark.parametrize("fshape", [(3, 5, 37), (37,)], ids=["full", "broadcast"])
@pytest.mark.parametrize("fdtype", ["input", "float32"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
def test_grad_fused_add_rounded_once(rng, dtype, fdtype, fshape):
    # grad_fused_add = sum of grad_output * act'(pre) to fused_add's shape, accumulated in float32
    # and rounded once to fused_add's dtype (SPEC §9, §1)
    x = rand_values(rng, (3, 5, 37) if len(fshape) == 3 else (64, 5, 37), dtype)
    fa = rand_values(rng, fshape, dtype if fdtype == "input" else F32)
    dy = rand_values(rng, x.shape, dtype, scale=1.0)
    p = Problem("batch_norm", x, None, None, fa, kw=dict(channel_axis=1), activation="gelu")
    _, m, v = simdnorm.batch_normalization_training(x, fused_add=fa, activation="gelu")
    res = simdnorm.batch_normalization_backward(dy, x, m, v, fused_add=fa, activation="gelu")
    check_grads(res, p.backward(dy, (f64(m), f64(v))), x=x, fused_add=fa, want=("input",),
                context=f"fused_add {fshape} {fdtype}")


# Three values of grad_output far apart along the reduced axis, so that their float32 partial sums
# meet in the double merge: 1, half a unit in the last place of the 16-bit type at 1, and a value
# under float32's precision that tips the tie. Rounded through float32 first, the sum lands on the
# tie and rounds to 1.
_TIE_BREAKERS = {F16: (1.0, 2.0 ** -11, 2.0 ** -24), BF16: (1.0, 2.0 ** -8, 2.0 ** -40)}


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive", "negative"])
@pytest.mark.parametrize("op", ["batch_norm", "layer_norm"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
def test_half_parameter_gradients_rounded_once_from_the_double_sums(rng, dtype, op, sign):
    # grad_bias of a 16-bit bias: the double sum rounded once to its dtype (SPEC §9, §1)
    rows, channels = 3 * 256, 4
    dy = np.zeros((rows, channels))
    dy[::256] = np.multiply.outer(_TIE_BREAKERS[dtype], np.ones(channels)) * sign
    dy = dy.astype(dtype)
    x = rand_values(rng, dy.shape, dtype)
    scale, bias = (f64(rand_values(rng, (channels,), dtype)) + 1).astype(dtype), rand_values(rng, (channels,), dtype)
    if op == "batch_norm":
        _, mean, var = simdnorm.batch_normalization_training(x, scale, bias, channel_axis=1)
        _, _, grad_bias = simdnorm.batch_normalization_backward(dy, x, mean, var, scale, bias, channel_axis=1)
    else:
        _, mean, inv_std = simdnorm.layer_norm(x, scale, bias, return_stats=True)
        _, _, grad_bias = simdnorm.layer_norm_backward(dy, x, mean, inv_std, scale, bias)
    one, half_ulp, _ = _TIE_BREAKERS[dtype]
    # (the sum's nearest, 1 + an ulp, exact in every type: ml_dtypes before 0.4 cast float64 to
    # bfloat16 through float32, twice rounded)
    want = np.full(channels, sign * (one + 2 * half_ulp)).astype(dtype)
    assert np.float32(sign * math.fsum(_TIE_BREAKERS[dtype])).astype(dtype) != want[0]  # (the case is a tie)
    assert grad_bias.dtype == dtype and bits(grad_bias).tolist() == bits(want).tolist(), (grad_bias, want)


@pytest.mark.parametrize("op,variant", [c for c in CASES if c[0] in ("layer_norm", "group_norm", "batch_norm")],
                         ids=[f"{o}-{v}" for o, v in CASES if o in ("layer_norm", "group_norm", "batch_norm")])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
def test_backward_float32_parameters_with_half_input(rng, op, variant, dtype):
    # mixed precision: scale/bias (and fused_add) in float32 with float16/bfloat16 data; the
    # gradients of the parameters come back in the parameters' dtype
    p = make_problem(rng, op, variant, dtype, "gelu")
    for name in ("scale", "bias", "fused_add"):
        a = getattr(p, name)
        if a is not None:
            setattr(p, name, (f64(a) * 1.0009765625).astype(F32))  # values a half type cannot hold
    dy = rand_values(rng, p.x.shape, dtype, scale=1.0)
    stats = sn_forward(p, stats=True)
    res = sn_backward(p, dy, stats)
    check_grads(res, p.backward(dy, f64_stats(stats)), x=p.x, scale=p.scale, bias=p.bias, fused_add=p.fused_add,
                want=wanted(p), context=f"{op}-{variant} float32 params")


# ----------------------------------------------------------------------------------------------
# memory layouts of every argument
# ----------------------------------------------------------------------------------------------


def in_layout(a, layout):
    """An array of a's logical shape and dtype stored in `layout`; zero_stride replaces the values by
    ones broadcast along every other dim (the caller takes the returned array's values)."""
    a = np.asarray(a)
    if layout == "zero_stride":
        if a.ndim == 1:
            return np.broadcast_to(a[:1], a.shape)
        small = a[tuple(slice(0, 1) if d % 2 == 0 else slice(None) for d in range(a.ndim))]
        return np.broadcast_to(small, a.shape)
    v = layout_empty(a.shape, a.dtype, layout)
    v[...] = a
    return v


def strided_stats(stats):
    """The statistics as negative-stride views (same values)."""
    out = []
    for a in stats:
        if a is None:
            out.append(None)
            continue
        r = np.ascontiguousarray(a[tuple(slice(None, None, -1) for _ in range(a.ndim))])
        out.append(r[tuple(slice(None, None, -1) for _ in range(a.ndim))])
    return tuple(out)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op,variant", [(o, 0) for o in VARIANTS] + [("batch_norm", 2), ("group_norm", 1)],
                         ids=[f"{o}-0" for o in VARIANTS] + ["batch_norm-2", "group_norm-1"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_backward_layouts(rng, op, variant, layout, dtype):
    p = make_problem(rng, op, variant, dtype, "leaky_relu", {"alpha": 0.3}, fused_add=True) if op.startswith(
        "batch") else make_problem(rng, op, variant, dtype, "leaky_relu", {"alpha": 0.3})
    li = LAYOUTS.index(layout)
    p.x = in_layout(p.x, layout)
    dy = in_layout(rand_values(rng, p.x.shape, dtype, scale=1.0), LAYOUTS[(li + 3) % len(LAYOUTS)])
    # parameters: broadcast (zero stride), reversed or unaligned, in turn
    for j, name in enumerate(("scale", "bias", "fused_add")):
        a = getattr(p, name)
        if a is None:
            continue
        form = (li + j) % 3
        if form == 0:
            a = np.broadcast_to(a[(slice(0, 1),) * a.ndim], a.shape)
        elif form == 1:
            a = in_layout(a, "negative")
        else:
            a = in_layout(a, "unaligned")
        setattr(p, name, a)
    stats = sn_forward(p, stats=True)
    if li % 2:
        stats = strided_stats(stats)
    out_layout = WRITABLE_LAYOUTS[(li + 5) % len(WRITABLE_LAYOUTS)]
    out = make_out(p.x.shape, dtype, out_layout)
    ctx = f"{op}-{variant} x={layout} dy={LAYOUTS[(li + 3) % len(LAYOUTS)]} out={out_layout} {dtype_id(dtype)}"
    res = sn_backward(p, dy, stats, out=out)
    assert res[0] is out
    ref = p.backward(dy, f64_stats(stats))
    check_grads(res, ref, x=p.x, scale=p.scale, bias=p.bias, fused_add=p.fused_add, want=wanted(p), context=ctx)
    res = sn_backward(p, dy, stats)
    assert_like_empty_like(res[0], p.x)
    check_grad(res[0], ref.grad_input, ref.e_input, dtype=dtype, name="grad_input (new)", context=ctx)


# grad_input big enough for streaming stores (input, grad_output and grad_input over half the
# last-level cache), each array at its own phase against a 64-byte line: a run's whole vectors from
# its first aligned one are streamed, its edges in 4- and 16-byte pieces (float32 and float64 on
# AVX-512; 16-bit data store plainly, and run here at odd phases past the threshold). Checked
# against the float64 reference, and bitwise against the same groups in a call too small to stream
# (the first rows, images or channels; not channels last, whose sums are chunks of the whole).
STREAMED_BACKWARD = [
    # (op, shape with a placeholder 0 for the dim sized to pass the threshold, dtype, offsets in
    # bytes of x, grad_output and grad_input past a line, every ISA)
    ("layer_norm", (0, 768), F32, (16, 16, 16), True),
    ("layer_norm", (0, 768), F32, (0, 36, 4), False),
    ("layer_norm", (0, 768), F32, (16, 16, 2), False),  # grad_input not aligned to its items: plain stores
    ("layer_norm", (0, 777), F16, (6, 2, 10), True),
    ("layer_norm", (0, 1000), BF16, (16, 16, 16), False),
    ("layer_norm", (0, 300), F64, (8, 8, 8), False),
    ("rms_norm", (0, 768), F32, (16, 16, 16), False),
    ("instance_norm", (0, 16, 20, 20), F32, (16, 16, 48), False),
    ("instance_norm", (0, 16, 20, 20), F32, (16, 16, 1), False),
    ("group_norm", (0, 32, 14, 14), F32, (16, 0, 16), True),
    ("batch_norm", (4, 0, 56, 56), F32, (16, 16, 16), False),
    ("batch_norm", (4, 0, 14, 14), F16, (2, 2, 2), True),
    ("batch_norm_nhwc", (4, 14, 14, 0), F32, (16, 16, 36), False),
    ("batch_norm_nhwc", (4, 14, 14, 0), F64, (8, 0, 24), False),
    ("instance_norm_nhwc", (0, 20, 20, 40), F32, (16, 16, 12), False),
    ("group_norm_nhwc", (0, 14, 14, 64), F32, (0, 16, 4), False),
    ("mvn023", (4, 0, 56, 56), F32, (16, 16, 16), False),
]


@pytest.mark.parametrize("op,shape,dtype,offsets,every_isa", STREAMED_BACKWARD,
                         ids=[f"{o}-{dtype_id(d)}-{'-'.join(map(str, off))}" for o, _, d, off, _ in STREAMED_BACKWARD])
def test_backward_streamed_grad_input_at_line_phases(rng, threads, op, shape, dtype, offsets, every_isa):
    from simdnorm import _core
    from training_reference import (bn_backward_ref, group_norm_backward_ref, instance_norm_backward_ref,
                                    layer_norm_backward_ref, mvn_backward_ref, rms_norm_backward_ref)

    threads(1)
    grow = shape.index(0)
    per = int(np.prod([n for n in shape if n]))
    size = _core.stream_threshold_bytes() // (3 * np.dtype(dtype).itemsize * per) + 2
    shape = shape[:grow] + (size,) + shape[grow + 1:]
    x, dy, out = (empty_past_line(shape, dtype, o) for o in offsets)
    x[...] = rand_values(rng, shape, dtype, scale=2.0) + np.asarray(3.0, dtype)
    dy[...] = rand_values(rng, shape, dtype, scale=1.0)
    if op in ("instance_norm_nhwc", "group_norm_nhwc"):  # channels-last memory, NCHW views
        x, dy, out = (a.transpose(0, 3, 1, 2) for a in (x, dy, out))
        shape = x.shape
        op = op[:-len("_nhwc")]
        channels_last = True
    else:
        channels_last = op == "batch_norm_nhwc"
    ca = -1 if op == "batch_norm_nhwc" else 1
    channels = shape[ca]
    scale = rand_values(rng, (shape[-1] if op in ("layer_norm", "rms_norm") else channels,), dtype, scale=1.0)
    bias = rand_values(rng, scale.shape, dtype, scale=1.0)

    def run(x, dy, out, sl=slice(None)):
        """The op's backward over x (statistics of the forward), and its float64 reference."""
        if op in ("layer_norm", "rms_norm", "instance_norm", "group_norm"):
            if op == "layer_norm":
                _, m, s = simdnorm.layer_norm(x, scale, bias, return_stats=True)
                simdnorm.layer_norm_backward(dy, x, m, s, scale, bias, out=out)
                return lambda: layer_norm_backward_ref(dy, x, m, s, scale, bias)
            if op == "rms_norm":
                _, _, r = simdnorm.rms_norm(x, scale, return_stats=True)
                simdnorm.rms_norm_backward(dy, x, r, scale, out=out)
                return lambda: rms_norm_backward_ref(dy, x, r, scale)
            if op == "instance_norm":
                _, m, s = simdnorm.instance_norm(x, scale, bias, return_stats=True)
                simdnorm.instance_norm_backward(dy, x, m, s, scale, bias, out=out)
                return lambda: instance_norm_backward_ref(dy, x, m, s, scale, bias)
            _, m, s = simdnorm.group_norm(x, 8, scale, bias, return_stats=True)
            simdnorm.group_norm_backward(dy, x, 8, m, s, scale, bias, out=out)
            return lambda: group_norm_backward_ref(dy, x, 8, m, s, scale, bias)
        if op == "mvn023":
            _, m, s = simdnorm.mean_variance_normalization(x, (0, 2, 3), return_stats=True)
            simdnorm.mean_variance_normalization_backward(dy, x, (0, 2, 3), m, s, out=out)
            return lambda: mvn_backward_ref(dy, x, (0, 2, 3), m, s)
        sc, b = scale[sl], bias[sl]
        _, m, v = simdnorm.batch_normalization_training(x, sc, b, channel_axis=ca)
        simdnorm.batch_normalization_backward(dy, x, m, v, sc, b, channel_axis=ca, out=out)
        return lambda: bn_backward_ref(dy, x, m, v, sc, b, channel_axis=ca)

    axes = {"layer_norm": (x.ndim - 1,), "rms_norm": (x.ndim - 1,), "instance_norm": (2, 3),
            "group_norm": (2, 3), "mvn023": (0, 2, 3), "batch_norm": (0, 2, 3), "batch_norm_nhwc": (0, 1, 2)}[op]
    plan = _core.mvn_backward(x, dy, axes, None, None, None, None, None, out, None, None, 1e-5, True, True, False,
                              (0, 0.0, 0.0), True, False, 1, True, False)
    assert ("streaming-stores" in plan) == (np.dtype(dtype).itemsize >= 4), plan  # (16-bit: half-line vectors)
    # the same groups in a call too small to stream: the first rows or images, or the first channels
    part = (slice(None),) * (ca % x.ndim if op.startswith(("batch", "mvn")) else 0) + (slice(0, 2),)
    small = out[part].copy()
    previous = simdnorm.isa()
    try:
        for isa in isas_under_test() if every_isa else [previous]:
            simdnorm.set_isa(isa)
            run(x[part], dy[part], small, part[-1])
            out[...] = np.nan
            reference = run(x, dy, out)
            if not channels_last:  # (whose sums go in chunks of the whole tensor: its own bits)
                np.testing.assert_array_equal(bits(out[part]), bits(small), err_msg=f"isa={isa}")
        ref = reference()
        check_grad(out, ref.grad_input, ref.e_input, dtype=dtype, name="grad_input", context=f"{op} isa={isa}")
    finally:
        simdnorm.set_isa(previous)


# Batch, instance and group norm (and MVN over (0, 2, 3)) of NCHW data write group k's grad_input
# in the loop that sums group k + 1 (BackwardKernel::pair_run); a group alone takes the two passes
# apart. Their bits must be the same, on runs that end inside a vector, groups longer than one flush
# of the vector sums (1024 elements), and arrays off their 64-byte lines. (With an activation no
# group is paired: the batched call must still agree.)
PAIRED_GROUPS = [(op, shape, act) for op, shape in [("instance_norm", (2, 3, 41, 29)), ("group_norm", (2, 8, 5, 7)),
                                                    ("batch_norm", (3, 5, 6, 11)), ("batch_norm", (2, 3, 31, 39))]
                 for act in (None, "relu")] + [("mvn023", (3, 5, 6, 11), None)]


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("op,shape,act", PAIRED_GROUPS,
                         ids=[f"{o}-{'x'.join(map(str, s))}-{a}" for o, s, a in PAIRED_GROUPS])
def test_backward_groups_in_pairs_as_alone(rng, op, shape, act, dtype):
    x, dy = (empty_past_line(shape, dtype, o) for o in (4 * np.dtype(dtype).itemsize, 2 * np.dtype(dtype).itemsize))
    x[...] = rand_values(rng, shape, dtype, scale=2.0)
    dy[...] = rand_values(rng, shape, dtype, scale=1.0)
    c = shape[1]
    scale, bias = rand_values(rng, (c,), dtype, scale=1.0), rand_values(rng, (c,), dtype, scale=1.0)
    groups = 4

    def backward(x, dy, sc, b):
        """grad_input of op over x, with the statistics of its forward op, into a poisoned array."""
        out = np.full(x.shape, np.nan, x.dtype)
        if op == "instance_norm":
            _, m, s = simdnorm.instance_norm(x, sc, b, return_stats=True)
            simdnorm.instance_norm_backward(dy, x, m, s, sc, b, activation=act, out=out)
        elif op == "group_norm":
            g = groups * x.shape[1] // c
            _, m, s = simdnorm.group_norm(x, g, sc, b, return_stats=True)
            simdnorm.group_norm_backward(dy, x, g, m, s, sc, b, activation=act, out=out)
        elif op == "batch_norm":
            _, m, v = simdnorm.batch_normalization_training(x, sc, b)
            simdnorm.batch_normalization_backward(dy, x, m, v, sc, b, activation=act, out=out)
        else:
            _, m, s = simdnorm.mean_variance_normalization(x, (0, 2, 3), return_stats=True)
            simdnorm.mean_variance_normalization_backward(dy, x, (0, 2, 3), m, s, out=out)
        return out

    whole = backward(x, dy, scale, bias)
    if op in ("instance_norm", "group_norm"):  # a group: one image's channel, or its channels of a group
        per = 1 if op == "instance_norm" else c // groups
        parts = [(slice(n, n + 1), slice(k, k + per)) for n in range(shape[0]) for k in range(0, c, per)]
    else:  # a channel over the batch
        parts = [(slice(None), slice(k, k + 1)) for k in range(c)]
    for part in parts:
        alone = backward(x[part], dy[part], scale[part[1]], bias[part[1]])
        np.testing.assert_array_equal(bits(whole[part]), bits(alone), err_msg=f"{op} group {part}")


# Channels-last batch norm's rows of contiguous channels take loops of their own (BackwardKernel::
# lanes_sums, lanes_apply); a grad_output or grad_input whose channels lie apart in memory sends the
# call to the general loops, over the same plan. The bits must be the same: channel counts that end
# inside a vector, thread ranges that start and end inside a row, global statistics (training=False),
# the parameters' gradients, and the activations whose derivatives those loops take inline.
@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("channels", [3, 13, 64, 100])
@pytest.mark.parametrize("act", [None, "relu", simdnorm.Activation("leaky_relu", alpha=0.3)], ids=str)
def test_channels_last_rows_as_general_loops(rng, isa, threads, dtype, channels, act):
    shape = (3, 7, 9, channels)
    x = rand_values(rng, shape, dtype, scale=2.0) + np.asarray(1.5, dtype)
    dy = rand_values(rng, shape, dtype, scale=1.0)
    scale, bias = (rand_values(rng, (channels,), dtype, scale=1.0) for _ in range(2))

    def apart():
        """An array of shape whose channels are two elements apart."""
        return np.empty(shape[:-1] + (2 * channels,), dtype)[..., ::2]

    dy_apart = apart()
    dy_apart[...] = dy
    _, m, v = simdnorm.batch_normalization_training(x, scale, bias, channel_axis=-1)
    for n in (1, 2):
        threads(n)
        for training in (True, False):
            res = {}
            for name, dys, out in (("rows", dy, np.empty(shape, dtype)), ("general", dy_apart, np.empty(shape, dtype)),
                                   ("general apply", dy, apart())):
                out[...] = np.nan
                gs, gb = simdnorm.batch_normalization_backward(dys, x, m, v, scale, bias, channel_axis=-1,
                                                               training=training, activation=act, out=out)[1:]
                res[name] = (out, gs, gb)
            assert not np.isnan(res["rows"][0]).any()
            for other in ("general", "general apply"):
                for what, a, b in zip(("grad_input", "grad_scale", "grad_bias"), res["rows"], res[other]):
                    np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{what} {other} threads={n} {training=}")


# Channels-last rows from memory whose streamed grad_input would start or end rows in partial
# vectors (grad_input off a line, or rows that are not whole lines) are written as one run on
# grad_input's lines (BackwardKernel::lanes_apply_of), a vector across two rows (or, with fewer
# channels than a vector, several) taking each lane's channel. The bits must be the general loops'
# (grad_input with its channels apart): batch norm's second pass and its given-statistics write of
# grad_input alone with an inline activation, 1 and 2 threads. Channels-last group norm, whose
# plan changes with grad_input's channels apart, is held to the row-by-row loop instead (grad_input
# on a line, rows of whole lines: 64 channels).
@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
@pytest.mark.parametrize("channels", [3, 13, 64, 100])
@pytest.mark.parametrize("offset", [0, 16, 4 * 3])
def test_channels_last_rows_written_as_one_run(rng, threads, dtype, channels, offset):
    from simdnorm import _core

    rows = _core.stream_threshold_bytes() // (3 * np.dtype(dtype).itemsize * channels) + 3
    shape = (2, rows // 2 + 1, 1, channels)
    x = rand_values(rng, shape, dtype, scale=2.0) + np.asarray(1.5, dtype)
    dy = rand_values(rng, shape, dtype, scale=1.0)
    scale, bias = (rand_values(rng, (channels,), dtype, scale=1.0) for _ in range(2))
    groups = next(g for g in (4, 2, 1) if channels % g == 0 and channels // g > 1) if channels > 3 else 1
    _, m, v = simdnorm.batch_normalization_training(x, scale, bias, channel_axis=-1)
    _, gm, gi = simdnorm.group_norm(x, groups, scale, bias, channel_axis=-1, return_stats=True)
    def apart():
        return np.empty(shape[:-1] + (2 * channels,), dtype)[..., ::2]

    calls = {
        "bn training": (apart, lambda out: simdnorm.batch_normalization_backward(
            dy, x, m, v, scale, bias, channel_axis=-1, out=out)[0]),
        "bn given, grad_input alone, relu": (apart, lambda out: simdnorm.batch_normalization_backward(
            dy, x, m, v, scale, bias, channel_axis=-1, training=False, activation="relu", grad_scale=False,
            grad_bias=False, out=out)[0]),
    }
    if channels == 64 and offset != 0:
        calls["group norm"] = (lambda: empty_past_line(shape, dtype, 0), lambda out: simdnorm.group_norm_backward(
            dy, x, groups, gm, gi, scale, bias, channel_axis=-1, out=out)[0])
    for n in (1, 2):
        threads(n)
        for name, (reference_out, call) in calls.items():
            out, want = empty_past_line(shape, dtype, offset), reference_out()
            for o in (out, want):
                o[...] = np.nan
                call(o)
            assert not np.isnan(out).any(), (name, n)
            np.testing.assert_array_equal(bits(out), bits(want), err_msg=f"{name} threads={n}")


# Layer and RMS norm rows sharing their parameters go through blocks of one, two or four rows (four
# only where a block stays within half an L1, BackwardKernel::rows_stream; with 32 registers a block
# of two is written while the next is summed), the odd rows after. A row alone, or a grad_output
# whose rows' elements lie apart (the general loops), must give the same grad_input bits: row lengths
# on both sides of the four-row bound and past one flush of the vector sums (1024 elements), row
# counts that leave odd rows, a row without a y term (its dy zero: its block is written by itself),
# 1 and 2 threads; float32 rows from memory too (rows of 4 KB one a block, as in the caches; on
# AVX-512 others two), a few of their rows alone. (The parameters' sums take another order in the
# general loops.)
_ROW_BLOCK_CASES = [(dtype, n, "cache") for dtype in (F32, BF16, F64) for n in (100, 256, 300, 512, 1024, 1500)]
_ROW_BLOCK_CASES += [(F32, n, "memory") for n in (1024, 1500)]


@pytest.mark.parametrize("dtype,n,where", _ROW_BLOCK_CASES,
                         ids=lambda v: dtype_id(v) if isinstance(v, np.dtype) else v)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_row_blocks_as_rows_alone(rng, isa, threads, dtype, n, op, where):
    from simdnorm import _core

    rows = 7 if where == "cache" else _core.stream_threshold_bytes() // (3 * np.dtype(dtype).itemsize * n) + 3
    shape = (rows, n)
    x = rand_values(rng, shape, dtype, scale=2.0) + np.asarray(0.5, dtype)
    dy = rand_values(rng, shape, dtype, scale=1.0)
    dy[3] = 0
    pdt = F64 if dtype == F64 else F32
    scale, bias = (rand_values(rng, (n,), pdt, scale=1.0) for _ in range(2))
    dy_apart = np.empty((rows, 2 * n), dtype)[:, ::2]
    dy_apart[...] = dy

    def backward(x, dy):
        out = np.full(x.shape, np.nan, x.dtype)
        if op == "layer_norm":
            _, m, s = simdnorm.layer_norm(x, scale, bias, return_stats=True)
            simdnorm.layer_norm_backward(dy, x, m, s, scale, bias, out=out)
        else:
            _, _, s = simdnorm.rms_norm(x, scale, return_stats=True)
            simdnorm.rms_norm_backward(dy, x, s, scale, out=out)
        return out

    for t in (1, 2):
        threads(t)
        whole = backward(x, dy)
        assert not np.isnan(whole).any()
        for r in sorted({0, 1, 2, 3, 4, 5, 6, rows // 2, rows - 1}):
            np.testing.assert_array_equal(bits(whole[r]), bits(backward(x[r:r + 1], dy[r:r + 1])[0]),
                                          err_msg=f"grad_input row {r} threads={t}")
        np.testing.assert_array_equal(bits(whole), bits(backward(x, dy_apart)),
                                      err_msg=f"grad_input general loops threads={t}")


# out= for grad_input where it shares memory with an operand: the result is as if it did not
# (a temporary where the memory overlaps: the kernels decide by byte ranges, numpy exactly), out = the
# grad_output itself is in place; out as the input itself is refused (the backward reads it to the end),
# out overlapping the input otherwise is written through a temporary.
BACKWARD_CALLS = {
    "batch_norm": lambda dy, x, sc, b, **kw: simdnorm.batch_normalization_backward(
        dy, x, *simdnorm.batch_normalization_training(x, sc, b)[1:], sc, b, **kw),
    "layer_norm": lambda dy, x, sc, b, **kw: simdnorm.layer_norm_backward(
        dy, x, *simdnorm.layer_norm(x, np.tile(sc, 2), np.tile(b, 2), return_stats=True)[1:], np.tile(sc, 2),
        np.tile(b, 2), **kw),
    "instance_norm": lambda dy, x, sc, b, **kw: simdnorm.instance_norm_backward(
        dy, x, *simdnorm.instance_norm(x, sc, b, return_stats=True)[1:], sc, b, **kw),
    "group_norm": lambda dy, x, sc, b, **kw: simdnorm.group_norm_backward(
        dy, x, 2, *simdnorm.group_norm(x, 2, sc, b, return_stats=True)[1:], sc, b, **kw),
    # grad_fused_add is read from grad_output too (dy * act'(pre)), whatever grad_input overwrites
    "batch_norm fused_add": lambda dy, x, sc, b, **kw: _bn_fused_backward(dy, x, sc, b, np.cos(x), None, **kw),
    "batch_norm fused_add relu": lambda dy, x, sc, b, **kw: _bn_fused_backward(
        dy, x, sc, b, np.cos(x[:1, :, :, :1]), "relu", **kw),
}


def _bn_fused_backward(dy, x, sc, b, fa, act, **kw):
    _, mean, var = simdnorm.batch_normalization_training(x, sc, b, fused_add=fa, activation=act)
    return simdnorm.batch_normalization_backward(dy, x, mean, var, sc, b, fused_add=fa, activation=act, **kw)


@pytest.mark.parametrize("op", list(BACKWARD_CALLS))
def test_backward_out_sharing_memory_as_if_apart(rng, op):
    call = BACKWARD_CALLS[op]
    x = rand_values(rng, (3, 4, 5, 8), F32, scale=2.0)
    sc, b = rand_values(rng, (4,), F32, scale=1.0), rand_values(rng, (4,), F32, scale=1.0)
    # grad_output and out as views of one buffer (along its last dim); where they overlap, grad_input
    # is computed into a temporary laid out as the input (so are its bits), else straight into out
    cases = {
        "shifted": (10, lambda a: a[..., :8], lambda a: a[..., 2:], True),
        "reversed": (10, lambda a: a[..., :8], lambda a: a[..., ::-1][..., 2:], True),
        "in place": (8, lambda a: a, lambda a: a, False),
        "interleaved": (16, lambda a: a[..., 1::2], lambda a: a[..., ::2], False),  # byte ranges meet, elements not
    }
    for name, (width, dy_of, out_of, temporary) in cases.items():
        base = rand_values(rng, (3, 4, 5, width), F32, scale=1.0)
        # the same call with out apart: a new array like the input, or out's layout in a buffer of its own
        want = call(dy_of(base.copy()), x, sc, b, out=None if temporary else out_of(np.full_like(base, np.nan)))
        buf = base.copy()
        res = call(dy_of(buf), x, sc, b, out=out_of(buf))
        assert res[0].base is buf or res[0] is buf, name
        for got, ref in zip(res, want):
            np.testing.assert_array_equal(bits(got), bits(ref), err_msg=name)
    dy = rand_values(rng, x.shape, F32, scale=1.0)
    want = call(dy, x, sc, b, out=np.empty_like(x))
    out = np.zeros_like(x)  # the scale is read from memory grad_input overwrites
    out.ravel()[:4] = sc
    res = call(dy, x, out.ravel()[:4], b, out=out)
    for got, ref in zip(res, want):
        np.testing.assert_array_equal(bits(got), bits(ref))
    # out over the input's memory otherwise than as the input itself: as if apart
    for name, out_of in (("shifted", lambda a: a[..., 2:]), ("reversed", lambda a: a[..., ::-1][..., 2:]),
                         ("interleaved", lambda a: a[..., 1::2])):
        width = 16 if name == "interleaved" else 10
        base = rand_values(rng, x.shape[:-1] + (width,), F32, scale=2.0)
        xv = base[..., ::2] if name == "interleaved" else base[..., :8]
        want = call(dy, xv, sc, b)  # (before out overwrites it)
        res = call(dy, xv, sc, b, out=out_of(base))
        assert res[0].base is base, name
        for got, ref in zip(res, want):
            np.testing.assert_array_equal(bits(got), bits(ref), err_msg=name)
    with pytest.raises(simdnorm.DescriptorError, match="out: is the input"):
        call(dy, x, sc, b, out=x)
    with pytest.raises(simdnorm.DescriptorError, match="out: is the input"):
        call(dy, x, sc, b, out=x[...])  # (another array object, the same elements)


# Groups of short runs (small planes of NCHW data; instance norm's a run each) are written run by
# run, the last few elements of a run as part of its last whole vector, written again: not where
# grad_input is grad_output (in place), whose elements there are already overwritten. Planes that
# end inside a vector, every dtype.
@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("op", ["batch_norm", "group_norm", "instance_norm"])
@pytest.mark.parametrize("plane", [(7, 7), (3, 5), (1, 3), (2, 9)])
def test_backward_in_place_on_short_runs(rng, op, plane, dtype):
    call = BACKWARD_CALLS[op]
    shape = (3, 4) + plane
    x = rand_values(rng, shape, dtype, scale=2.0)
    sc, b = rand_values(rng, (4,), dtype, scale=1.0), rand_values(rng, (4,), dtype, scale=1.0)
    dy = rand_values(rng, shape, dtype, scale=1.0)
    want = call(dy, x, sc, b, out=np.full_like(x, np.nan))
    buf = dy.copy()
    res = call(buf, x, sc, b, out=buf)
    assert res[0] is buf
    for got, ref in zip(res, want):
        np.testing.assert_array_equal(bits(got), bits(ref))


# The backward's bits do not depend on where the arrays lie (a run's sums in lanes counted from its
# first element; a tail written as its last whole vector or masked alike): x, grad_output and out
# past a 64-byte line by any multiple of the itemsize, against the aligned call. Planes of 56 (batch
# norm's two passes, group and instance norm's short runs), layer norm rows of 8.
@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("op", list(BACKWARD_CALLS))
def test_backward_bits_do_not_depend_on_the_address(rng, op, dtype):
    call = BACKWARD_CALLS[op]
    shape = (6, 4, 7, 8)
    isz = np.dtype(dtype).itemsize
    xv, dv = rand_values(rng, shape, dtype, scale=2.0), rand_values(rng, shape, dtype, scale=1.0)
    sc, b = rand_values(rng, (4,), dtype, scale=1.0), rand_values(rng, (4,), dtype, scale=1.0)

    def placed(values, offset):
        a = empty_past_line(shape, dtype, offset)
        a[...] = values
        return a

    def run(kx, kd, ko):
        return call(placed(dv, kd), placed(xv, kx), sc, b, out=placed(np.full(shape, np.nan, dtype), ko))

    want = run(0, 0, 0)
    for k in range(isz, 64, 3 * isz):
        for kx, kd, ko in ((k, 0, 0), (0, k, 0), (0, 0, k), (k, k, k)):
            for name, got, ref in zip(("grad_input", "grad_scale", "grad_bias"), run(kx, kd, ko), want):
                np.testing.assert_array_equal(bits(got), bits(ref), err_msg=f"{name}: x, dy, out at {kx, kd, ko}")


# Batch norm's backward on small NCHW planes runs two passes in memory order, in chunks of the
# elements whose ends fall inside planes (9 x 301 x 49: two chunks, the split inside a plane): the
# reference's values, the same bits at 1 and 2 threads and in place (grad_output as out).
@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=dtype_id)
def test_batch_norm_backward_of_small_planes_split_in_chunks(rng, threads, dtype):
    from training_reference import bn_backward_ref

    shape = (9, 301, 7, 7)
    x = rand_values(rng, shape, dtype, scale=2.0) + np.asarray(3.0, dtype)
    dy = rand_values(rng, shape, dtype, scale=1.0)
    sc, b = rand_values(rng, (301,), F32, scale=1.0), rand_values(rng, (301,), F32, scale=1.0)
    _, mean, var = simdnorm.batch_normalization_training(x, sc, b)
    results = []
    for n in (1, 2):
        threads(n)
        results.append(simdnorm.batch_normalization_backward(dy, x, mean, var, sc, b, out=np.full_like(x, np.nan)))
    buf = dy.copy()
    results.append(simdnorm.batch_normalization_backward(buf, x, mean, var, sc, b, out=buf))
    for res in results[1:]:
        for got, want in zip(res, results[0]):
            np.testing.assert_array_equal(bits(got), bits(want))
    ref = bn_backward_ref(dy, x, mean, var, sc, b)
    check_grads(results[0], ref, x=x, scale=sc, bias=b, want=("input", "scale", "bias"))


# Group norm of channels-last data: a group's K channels are runs of K elements with their own
# statistics; up to 256 bytes their statistics are spread along them, the channels run as one
# dim, and each group's sums are its channels' added (K = 64 float32 channels is the last that
# does; 65 takes the runs of K). Against the float64 reference, 1 vs 2 threads bitwise; the
# channel axis last (the runs of a group) or at 1 of an NHWC buffer.
@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=dtype_id)
@pytest.mark.parametrize("k", [2, 3, 8, 40, 64, 65])
def test_group_norm_backward_channels_last_groups(rng, threads, dtype, k):
    from training_reference import group_norm_backward_ref

    groups = 3
    c = groups * k
    nhwc = rand_values(rng, (2, 5, 7, c), dtype, scale=2.0) + np.asarray(1.5, dtype)
    dy_nhwc = rand_values(rng, nhwc.shape, dtype, scale=1.0)
    sc, b = rand_values(rng, (c,), F32, scale=1.0), rand_values(rng, (c,), F32, scale=1.0)
    for ca, x, dy in ((3, nhwc, dy_nhwc), (1, nhwc.transpose(0, 3, 1, 2), dy_nhwc.transpose(0, 3, 1, 2))):
        _, mean, inv_std = simdnorm.group_norm(x, groups, sc, b, channel_axis=ca, return_stats=True)
        res = at_one_and_two_threads(threads, lambda: simdnorm.group_norm_backward(
            dy, x, groups, mean, inv_std, sc, b, channel_axis=ca, out=np.full_like(x, np.nan)), f"channel_axis={ca}")
        ref = group_norm_backward_ref(dy, x, groups, mean, inv_std, sc, b, channel_axis=ca)
        check_grads(res, ref, x=x, scale=sc, bias=b, want=("input", "scale", "bias"),
                    context=f"channel_axis={ca}")


# Channels-last instance and group norm whose statistics have 128 or more elements each: the two
# passes give every statistics element its own copy of its parameters (one sum slot pair an element,
# not two), and the parameters' sums add their statistics elements' (tests/test_plans.py checks
# which calls do). Over two chunks of the sums pass split inside a sample; against the float64
# reference, without an activation, with one inline (relu) and one out of line (silu), 1 vs 2
# threads bitwise.
@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=dtype_id)
@pytest.mark.parametrize("op", ["instance_norm", "group_norm"])
@pytest.mark.parametrize("act", [None, "relu", "silu"])
def test_channels_last_parameters_spread_over_statistics(rng, threads, dtype, op, act):
    from training_reference import group_norm_backward_ref, instance_norm_backward_ref

    c, groups = 200, 25
    x = (rand_values(rng, (5, 12, 12, c), dtype, scale=2.0) + np.asarray(1.5, dtype)).transpose(0, 3, 1, 2)
    dy = rand_values(rng, (5, 12, 12, c), dtype, scale=1.0).transpose(0, 3, 1, 2)
    sc, b = rand_values(rng, (c,), F32, scale=1.0), rand_values(rng, (c,), F32, scale=1.0)
    if op == "group_norm":
        forward = lambda: simdnorm.group_norm(x, groups, sc, b, return_stats=True)  # noqa: E731
        backward = lambda *st, **kw: simdnorm.group_norm_backward(dy, x, groups, *st, sc, b, **kw)  # noqa: E731
        reference = lambda *st: group_norm_backward_ref(dy, x, groups, *st, sc, b, activation=act)  # noqa: E731
    else:
        forward = lambda: simdnorm.instance_norm(x, sc, b, return_stats=True)  # noqa: E731
        backward = lambda *st, **kw: simdnorm.instance_norm_backward(dy, x, *st, sc, b, **kw)  # noqa: E731
        reference = lambda *st: instance_norm_backward_ref(dy, x, *st, sc, b, activation=act)  # noqa: E731
    _, mean, inv_std = forward()
    res = at_one_and_two_threads(threads, lambda: backward(
        mean, inv_std, activation=act, out=np.full((5, 12, 12, c), np.nan, dtype).transpose(0, 3, 1, 2)))
    check_grads(res, reference(mean, inv_std), x=x, scale=sc, bias=b, want=("input", "scale", "bias"))


# The backward lays out its statistics and parameters in the input's memory order, and writes
# the parameters' gradients back in their own (row-major) order: layer norm over the last two
# dims with (7, 40) parameters, on data whose memory runs 40 before 7, the normalized dims
# outermost (two passes) or innermost (groups). Against the float64 reference, 1 vs 2 threads
# bitwise.
@pytest.mark.parametrize("memory", [(2, 3, 0, 1), (0, 1, 3, 2)])
@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
def test_backward_in_the_input_memory_order(rng, threads, memory, dtype):
    from training_reference import layer_norm_backward_ref

    shape = (5, 6, 7, 40)
    phys = tuple(shape[d] for d in memory)
    back = tuple(np.argsort(memory))
    x = rand_values(rng, phys, dtype, scale=2.0).transpose(back) + np.asarray(0.5, dtype)
    dy = rand_values(rng, phys, dtype, scale=1.0).transpose(back)
    sc, b = rand_values(rng, (7, 40), F32, scale=1.0), rand_values(rng, (7, 40), F32, scale=1.0)
    _, m, s = simdnorm.layer_norm(x, sc, b, axis=-2, return_stats=True)
    res = at_one_and_two_threads(threads, lambda: simdnorm.layer_norm_backward(
        dy, x, m, s, sc, b, axis=-2, out=np.full(phys, np.nan, dtype).transpose(back)))
    check_grads(res, layer_norm_backward_ref(dy, x, m, s, sc, b, axis=-2), x=x, scale=sc, bias=b,
                want=("input", "scale", "bias"))


# Group norm of (N, C) data: each group one short row whose parameters are its own channels'. Rows
# go in pairs, each loading and summing its own parameters (an odd number of groups leaves a row
# alone); an activation takes each row apart. Against the float64 reference, 1 vs 2 threads bitwise.
@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=dtype_id)
@pytest.mark.parametrize("groups, k", [(5, 3), (7, 8), (4, 12), (3, 20)])
@pytest.mark.parametrize("act", [None, "gelu"])
def test_group_norm_backward_of_rows_with_their_own_parameters(rng, threads, dtype, groups, k, act):
    from training_reference import group_norm_backward_ref

    c = groups * k
    x = rand_values(rng, (3001, c), dtype, scale=2.0) + np.asarray(1.5, dtype)
    dy = rand_values(rng, x.shape, dtype, scale=1.0)
    sc, b = rand_values(rng, (c,), F32, scale=1.0), rand_values(rng, (c,), F32, scale=1.0)
    _, mean, inv_std = simdnorm.group_norm(x, groups, sc, b, return_stats=True)
    res = at_one_and_two_threads(threads, lambda: simdnorm.group_norm_backward(
        dy, x, groups, mean, inv_std, sc, b, activation=act, out=np.full_like(x, np.nan)))
    ref = group_norm_backward_ref(dy, x, groups, mean, inv_std, sc, b, activation=act)
    check_grads(res, ref, x=x, scale=sc, bias=b, want=("input", "scale", "bias"))


# Parameters that repeat within a group (bias (4, 2) under layer norm over the last six dims: each
# element reached by 1080 runs a group) have their float32 sum slots flushed into doubles every few
# dozen of those adds, not once per few dozen groups; dy broadcast along most dims (the same
# values added again and again) is where float32 sums drift most. (Found by the training fuzzer.)
@pytest.mark.parametrize("threads_n", [1, 2])
def test_param_sums_of_parameters_repeating_within_groups(rng, threads, threads_n):
    from training_reference import layer_norm_backward_ref

    threads(threads_n)
    shape = (4, 3, 15, 3, 3, 8, 4, 2)
    x = rand_values(rng, shape, F32, scale=0.01)
    dy = np.broadcast_to(rand_values(rng, (1, 1, 1, 3, 1, 1, 4, 2), F32, scale=1.0) + np.float32(0.7), shape)
    scale = rand_values(rng, (4, 2), F32, scale=1.0)
    bias = rand_values(rng, (4, 2), F32, scale=1.0)
    _, m, s = simdnorm.layer_norm(x, scale, bias, axis=-6, return_stats=True)
    res = simdnorm.layer_norm_backward(dy, x, m, s, scale, bias, axis=-6)
    ref = layer_norm_backward_ref(dy, x, m, s, scale, bias, axis=-6)
    check_grads(res, ref, x=x, scale=scale, bias=bias, want=("input", "scale", "bias"), context=f"threads={threads_n}")


@pytest.mark.parametrize("ndim", range(1, 9))
@pytest.mark.parametrize("op", ["batch_norm", "mvn", "layer_norm", "rms_norm", "instance_norm", "group_norm"])
def test_backward_every_rank(rng, op, ndim):
    # 1 to 8 dims where the op allows them; transposed (F order) input and a poisoned out
    if op == "instance_norm" and ndim < 3 or op == "group_norm" and ndim < 2:
        pytest.skip("needs (N, C, spatial...)")
    shape = tuple(int(s) for s in rng.integers(2, 4, size=ndim))
    kw = {}
    if op == "batch_norm":
        if ndim == 1:
            kw = dict(scale=rand_values(rng, (1,), F32, loc=1.0, scale=0.3), bias=rand_values(rng, (1,), F32))
        kw["channel_axis"] = -1 if ndim % 2 else 1
    elif op == "mvn":
        kw = dict(axes=tuple(range(0, ndim, 2)))
    elif op in ("layer_norm", "rms_norm"):
        kw = dict(axis=ndim // 2)
    elif op == "group_norm":
        shape = shape[:1] + (4,) + shape[2:]
        kw = dict(num_groups=2)
    p = random_problem(rng, op, shape=shape, activation="gelu", dtype=F32, **kw)
    p.x = in_layout(p.x, "transposed")
    dy = rand_values(rng, shape, F32, scale=1.0)
    stats = sn_forward(p, stats=True)
    out = make_out(shape, F32, "negative")
    res = sn_backward(p, dy, stats, out=out)
    check_grads(res, p.backward(dy, f64_stats(stats)), x=p.x, scale=p.scale, bias=p.bias, want=wanted(p),
                context=f"{op} ndim={ndim}")


def test_backward_zero_size(rng):
    # zero-size dims: empty grad_input; parameter gradients summed over nothing are 0
    x = np.empty((0, 3, 4), F32)
    dy = np.empty_like(x)
    s, b = rand_values(rng, (4,), F32), rand_values(rng, (4,), F32)
    _, m, inv = simdnorm.layer_norm(x, s, b, return_stats=True)
    gi, gs, gb = simdnorm.layer_norm_backward(dy, x, m, inv, s, b)
    assert gi.shape == x.shape and gs.shape == (4,) and gb.shape == (4,)
    np.testing.assert_array_equal(gs, 0)
    np.testing.assert_array_equal(gb, 0)


def test_backward_zero_size_with_empty_parameters(rng):
    # zero-size dims where the parameters are empty too (SPEC §1: valid, an empty output, no work)
    x = np.empty((2, 0, 3), F32)
    s, b = np.ones((0, 3), F32), np.zeros((0, 3), F32)
    _, m, inv = simdnorm.layer_norm(x, s, b, axis=1, return_stats=True)
    gi, gs, gb = simdnorm.layer_norm_backward(np.empty_like(x), x, m, inv, s, b, axis=1)
    assert gi.shape == (2, 0, 3) and gs.shape == (0, 3) and gb.shape == (0, 3)
    x = np.empty((0,), F32)
    s, b = np.ones(1, F32), np.zeros(0, F32)
    _, m, inv = simdnorm.mean_variance_normalization(x, 0, s, b, return_stats=True)
    gi, gs, gb = simdnorm.mean_variance_normalization_backward(np.empty_like(x), x, 0, m, inv, s, b)
    assert gi.shape == (0,) and gs.shape == (1,) and gb.shape == (0,)
    np.testing.assert_array_equal(gs, 0)
    x = np.empty((3, 0, 2), F32)  # batch norm, same-rank parameters with a zero dim
    s, b = np.ones((1, 0, 2), F32), np.zeros((1, 0, 2), F32)
    _, m, v = simdnorm.batch_normalization_training(x, s, b)
    gi, gs, gb = simdnorm.batch_normalization_backward(np.empty_like(x), x, m, v, s, b)
    assert gi.shape == x.shape and gs.shape == (1, 0, 2) and gb.shape == (1, 0, 2)


def test_parameter_gradient_overflow_is_inf_without_warning(rng):
    # a float16 parameter gradient beyond float16's range rounds to inf, quietly (the suite runs
    # with warnings as errors, as a user may)
    x = rng.normal(size=(20000, 4)).astype(F16)
    dy = np.full(x.shape, 4.0, F16)  # grad_bias = 80000 per column
    s, b = np.ones(4, F16), np.zeros(4, F16)
    _, m, inv = simdnorm.layer_norm(x, s, b, return_stats=True)
    _, _, gb = simdnorm.layer_norm_backward(dy, x, m, inv, s, b)
    assert gb.dtype == F16 and (gb == np.inf).all(), gb


@pytest.mark.parametrize("form", ["training", "backward_training", "backward_global", "1d"])
def test_same_rank_parameters_of_full_size(rng, form):
    # same-rank parameters with no dim of size 1: the statistics are taken over no dims (a count of
    # 1 each: mean x, variance 0); with training=False (given statistics) nothing is reduced at all.
    # SPEC §9 makes only a count of 1 *with running_var* an error.
    x = rand_values(rng, (4, 3), F32)
    full = rand_values(rng, (4, 3), F32, loc=1.0, scale=0.3)
    dy = rand_values(rng, (4, 3), F32)
    if form == "training":
        y, m, v = simdnorm.batch_normalization_training(x, full, full)
        np.testing.assert_array_equal(m, x)
        np.testing.assert_array_equal(v, 0)
        np.testing.assert_allclose(y, full, rtol=1e-6)
    elif form == "1d":
        y, m, v = simdnorm.batch_normalization_training(x[0], full[0])
        assert m.shape == (3,)
    else:
        training = form == "backward_training"
        mean, var = (x, np.zeros_like(x)) if training else (full * 0.5, full)
        p = Problem("batch_norm" if training else "batch_norm_eval", x, full, full, kw=dict(channel_axis=1),
                    eval_stats=(mean, var))
        res = simdnorm.batch_normalization_backward(dy, x, mean, var, full, full, training=training)
        check_grads(res, p.backward(dy, (f64(mean), f64(var))), x=x, scale=full, bias=full, context=form)


@pytest.mark.parametrize("training", [True, False], ids=["training", "given"])
@pytest.mark.parametrize("stats_form", ["1C11", "NC11", "C", "mixed"])
@pytest.mark.parametrize("param_form", ["none", "C", "1C11", "scale-C-bias-1C11"])
@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
def test_batch_norm_backward_statistics_in_either_form(rng, training, stats_form, param_form, dtype):
    # Each of mean, variance, scale and bias in either of the forward's forms (same-rank, or 1-D of
    # C at channel_axis), independently: the statistics' size-1 dims are the normalized ones.
    n, c = 3, 4
    x = rand_values(rng, (n, c, 2, 5), dtype, scale=2.0)
    dy = rand_values(rng, x.shape, dtype)
    sshape = {"1C11": (1, c, 1, 1), "NC11": (n, c, 1, 1), "C": (c,), "mixed": (c,)}[stats_form]
    mean = rand_values(rng, sshape, F32, scale=0.5)
    var = rand_values(rng, (1, c, 1, 1) if stats_form == "mixed" else sshape, F32, loc=1.0, scale=0.2)
    pshape = {"none": None, "C": (c,), "1C11": (1, c, 1, 1), "scale-C-bias-1C11": (c,)}[param_form]
    scale = None if pshape is None else rand_values(rng, pshape, dtype, loc=1.0, scale=0.3)
    bias = None if pshape is None else rand_values(rng, (1, c, 1, 1) if param_form.endswith("1C11") else pshape,
                                                      dtype, scale=0.3)
    res = simdnorm.batch_normalization_backward(dy, x, mean, var, scale, bias, training=training)
    ref = bn_backward_ref(dy, x, mean, var, scale, bias, training=training)
    check_grads(res, ref, x=x, scale=scale, bias=bias, want=("input",) + (("scale", "bias") if scale is not None
                                                                       else ()), context=f"{stats_form} {param_form}")
    # the same call on the statistics reshaped to the other form: the same bits
    if stats_form in ("1C11", "C"):
        other = (c,) if stats_form == "1C11" else (1, c, 1, 1)
        again = simdnorm.batch_normalization_backward(dy, x, mean.reshape(other), var.reshape(other), scale, bias,
                                                      training=training)
        for got, want in zip(again, res):
            if want is not None:
                np.testing.assert_array_equal(bits(got), bits(want))


# ----------------------------------------------------------------------------------------------
# finite differences of simdnorm's own float64 forward ops
# ----------------------------------------------------------------------------------------------


FD_CASES = [("batch_norm", 1), ("batch_norm", 2), ("batch_norm", 4), ("batch_norm_eval", 0), ("batch_norm_eval", 1),
            ("mvn", 0), ("mvn", 1), ("mvn", 2), ("mvn", 3), ("mvn", 4), ("mvn", 6), ("layer_norm", 1), ("rms_norm", 1),
            ("instance_norm", 1), ("group_norm", 0), ("group_norm", 1)]
FD_SHAPES = {"batch_norm": (3, 4, 5), "batch_norm_eval": (3, 4, 5), "mvn": (3, 4, 5), "layer_norm": (2, 3, 5),
             "rms_norm": (2, 3, 5), "instance_norm": (2, 3, 5), "group_norm": (2, 6, 4)}


@pytest.mark.parametrize("act,params", [a for a in ACTS if a[1] is None], ids=["none", "relu", "leaky", "silu", "gelu"])
@pytest.mark.parametrize("op,variant", FD_CASES, ids=[f"{o}-{v}" for o, v in FD_CASES])
def test_backward_matches_finite_differences_of_forward(rng, op, variant, act, params):
    kw = dict(VARIANTS[op][variant])
    shape = FD_SHAPES[op]
    if kw.get("channel_axis") == -1:
        shape = shape[:1] + shape[2:] + shape[1:2]
    ov = dict(shape=shape)
    if "same_rank" in kw:
        ov["same_rank"] = (1,) + shape[1:]
    for name in ("scale", "bias", "fused_add"):
        if isinstance(kw.get(name), str):
            ov[name] = True if name != "fused_add" else np.ascontiguousarray(rng.normal(size=shape[1:2] + (1,)))
    if op == "mvn" and variant == 6:
        ov.update(axes=(-1, 0), scale=np.ascontiguousarray(rng.uniform(0.5, 2, size=shape[-1:])),
                  bias=np.ascontiguousarray(rng.normal(size=(shape[1], 1))))
    if op == "group_norm" and variant == 1:
        ov.update(shape=(2, 4, 6), num_groups=3)
    for _ in range(50):
        p = make_problem(rng, op, variant, F64, act, params, **ov)
        if act not in ("relu", "leaky_relu") or np.min(np.abs(p.pre_activation())) > 1e-3:
            break
    w = rng.normal(size=p.x.shape)
    stats = sn_forward(p, stats=True)
    res = sn_backward(p, w, stats)
    fd = fd_gradients(p, w, forward=lambda: sn_forward(p), h=1e-5)
    ctx = f"{op}-{variant} act={act}"
    names = [("x", 0, "grad_input"), ("scale", 1, "grad_scale"), ("bias", 2, "grad_bias"),
             ("fused_add", 3, "grad_fused_add")]
    for key, i, name in names:
        if key not in fd:
            continue
        got = np.asarray(res[i])
        want = fd[key]
        scale = max(float(np.max(np.abs(want))), 1e-3)
        err = float(np.max(np.abs(got - want)))
        assert got.shape == want.shape, (name, got.shape, want.shape, ctx)
        assert err <= 1e-6 * scale, f"{name}: max |simdnorm - finite difference| = {err:.3g} (scale {scale:.3g}) {ctx}"


# ----------------------------------------------------------------------------------------------
# PyTorch's autograd
# ----------------------------------------------------------------------------------------------


TORCH_CASES = [("batch_norm", 0), ("batch_norm", 1), ("batch_norm", 2), ("batch_norm_eval", 0), ("layer_norm", 0),
               ("layer_norm", 1), ("rms_norm", 0), ("rms_norm", 1), ("instance_norm", 0), ("instance_norm", 1),
               ("group_norm", 0), ("group_norm", 1)]


@pytest.mark.parametrize("act,params", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("tdtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op,variant", TORCH_CASES, ids=[f"{o}-{v}" for o, v in TORCH_CASES])
def test_backward_matches_torch_autograd(rng, op, variant, tdtype, act, params):
    torch = pytest.importorskip("torch", reason="PyTorch not installed: the autograd cross-check needs it")
    from test_training_reference import torch_grads

    dtype = F32 if tdtype == "float32" else BF16
    p = make_problem(rng, op, variant, dtype, act, params)
    if dtype == BF16:  # PyTorch rounds the pre-activation value to bfloat16 first: stay off the kink
        push_from_kinks(p, 0.05)
    dy = rand_values(rng, p.x.shape, dtype, scale=1.0)
    tg, _ = torch_grads(torch, p, dy, getattr(torch, tdtype))
    stats = sn_forward(p, stats=True)
    res = sn_backward(p, dy, stats)
    ref = p.backward(dy, f64_stats(stats))
    ctx = f"{op}-{variant} {tdtype} act={act} {params or ''}"
    for key, i, name, r, e in (("x", 0, "grad_input", ref.grad_input, ref.e_input),
                               ("scale", 1, "grad_scale", ref.grad_scale, ref.e_scale),
                               ("bias", 2, "grad_bias", ref.grad_bias, ref.e_bias),
                               ("fused_add", 3, "grad_fused_add", ref.grad_fused_add, ref.e_fused_add)):
        if key not in tg:
            continue
        got, want = f64(res[i]), tg[key]
        if dtype == F32:  # both within the float32 error bound of the float64 result
            tol = 2 * grad_tolerance(r, e, F32)
        else:  # PyTorch's bfloat16 tolerance (1.6e-2), relative to each value and to the largest
            tol = 1.6e-2 * np.abs(want) + 3e-2 * float(np.max(np.abs(want)))
        bad = ~(np.abs(got - want) <= tol)
        assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.size} differ from PyTorch beyond tolerance {ctx}; "
                               f"first at {np.argwhere(bad)[0]}: simdnorm {got[bad][0]!r} torch {want[bad][0]!r}")


# ----------------------------------------------------------------------------------------------
# batch_normalization_training: batch statistics and output
# ----------------------------------------------------------------------------------------------


def check_batch_stats(m, v, x, r, ctx, stat_rtol=None):
    ct = compute_dtype(np.asarray(x).dtype)
    assert isinstance(m, np.ndarray) and isinstance(v, np.ndarray), ctx
    assert m.dtype == ct and v.dtype == ct, (m.dtype, v.dtype, ct, ctx)
    assert m.shape == r.stat_shape and v.shape == r.stat_shape, (m.shape, v.shape, r.stat_shape, ctx)
    rt = (1e-5 if ct == F32 else 1e-12) if stat_rtol is None else stat_rtol
    std = np.sqrt(r.var)
    with quiet():
        em = np.abs(f64(m) - r.mean)
        ev = np.abs(f64(v) - r.var)
    assert (em <= rt * (np.abs(r.mean) + std) + 1e-300).all(), \
        f"mean off: got {m.ravel()[:4]} want {r.mean.ravel()[:4]} {ctx}"
    assert (ev <= 4 * rt * (r.var + rt * r.mean ** 2) + 1e-300).all(), \
        f"variance off: got {v.ravel()[:4]} want {r.var.ravel()[:4]} {ctx}"


TRAIN_VARIANTS = [
    dict(shape=(4, 5, 37)),
    dict(shape=(4, 37, 5), channel_axis=-1),
    dict(shape=(3, 4, 9), same_rank=(1, 4, 9)),   # DirectML's same-rank parameters
    dict(shape=(3, 4, 9), same_rank=(1, 4, 1)),
    dict(shape=(2, 3, 4, 5, 6), channel_axis=2),
    dict(shape=(50,), same_rank=(1,)),             # 1-D input: a same-rank parameter
    dict(shape=(6, 7), scale=None, bias=None),
]


@DT
@pytest.mark.parametrize("act", [None, "relu", "gelu", "tanh", "hard_swish"])
@pytest.mark.parametrize("fused", [None, "full", "broadcast"])
@pytest.mark.parametrize("vi", range(len(TRAIN_VARIANTS)))
def test_batch_normalization_training_forward(rng, vi, fused, act, dtype):
    kw = dict(TRAIN_VARIANTS[vi])
    shape = kw.pop("shape")
    sr = kw.pop("same_rank", None)
    ca = kw.pop("channel_axis", 1)
    nd = len(shape)
    if sr is not None:
        s, b = rand_values(rng, sr, dtype, loc=1.0, scale=0.5), rand_values(rng, sr, F32)
    elif "scale" in kw:
        s = b = None
    else:
        c = shape[ca % nd]
        s, b = rand_values(rng, (c,), dtype, loc=1.0, scale=0.5), rand_values(rng, (c,), dtype)
    fa = None
    if fused == "full":
        fa = rand_values(rng, shape, dtype)
    elif fused == "broadcast":
        fa = rand_values(rng, shape[-1:], F32)
    x = rand_values(rng, shape, dtype, loc=1.5, scale=2.0)
    out = make_out(shape, dtype)
    ctx = f"{shape} ca={ca} params={None if s is None else s.shape} fused={fused} act={act} {dtype_id(dtype)}"
    res = simdnorm.batch_normalization_training(x, s, b, epsilon=1e-3, channel_axis=ca, fused_add=fa, activation=act,
                                                out=out)
    assert isinstance(res, tuple) and len(res) == 3, ctx
    y, m, v = res
    assert y is out, ctx
    r = bn_training_ref(x, s, b, epsilon=1e-3, channel_axis=ca, fused_add=fa)
    check_batch_stats(m, v, x, r, ctx)
    check_close(y, r.pre, r.zscale, act, dtype=dtype, context=ctx)
    y2, m2, v2 = simdnorm.batch_normalization_training(x, s, b, epsilon=1e-3, channel_axis=ca, fused_add=fa,
                                                       activation=act)
    assert_like_empty_like(y2, x)
    np.testing.assert_array_equal(bits(y2), bits(y))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
def test_batch_normalization_training_layouts(rng, layout, dtype):
    shape = (3, 6, 5, 7)
    x = in_layout(rand_values(rng, shape, dtype, loc=-1.0, scale=3.0), layout)
    s = in_layout(rand_values(rng, (6,), dtype, loc=1.0, scale=0.5), "negative")
    b = np.broadcast_to(rand_values(rng, (1,), dtype), (6,))
    fa = in_layout(rand_values(rng, shape, dtype), "unaligned_strided")
    out = make_out(shape, dtype, WRITABLE_LAYOUTS[LAYOUTS.index(layout) % len(WRITABLE_LAYOUTS)])
    y, m, v = simdnorm.batch_normalization_training(x, s, b, fused_add=fa, activation="silu", out=out)
    assert y is out
    r = bn_training_ref(x, s, b, fused_add=fa)
    check_batch_stats(m, v, x, r, layout)
    check_close(y, r.pre, r.zscale, "silu", dtype=dtype, context=layout)


def test_batch_normalization_training_in_place(rng):
    # out is input works for the forward (SPEC §6); it just cannot be differentiated afterwards
    x = rand_values(rng, (4, 3, 10), F32)
    x0 = x.copy()
    y, m, v = simdnorm.batch_normalization_training(x, out=x)
    assert y is x
    r = bn_training_ref(x0)
    check_close(y, r.pre, r.zscale, dtype=F32)
    check_batch_stats(m, v, x0, r, "in place")



# out= sharing memory with an operand of the forward-training call: the result is as if it did not.
# The kernel declines byte ranges that meet and numpy decides exactly; fused_add, read after out is
# written, is tested before the call. Each case against the same call with out apart, bitwise.
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused_add"])
def test_batch_normalization_training_out_sharing_memory_as_if_apart(rng, fused):
    shape = (3, 4, 5, 8)
    sc, b = rand_values(rng, (4,), F32), rand_values(rng, (4,), F32)

    def call(x, out, scale=sc, bias=b, fa=None):
        return simdnorm.batch_normalization_training(x, scale, bias, fused_add=fa, activation="relu", out=out)

    fa_ref = rand_values(rng, shape, F32) if fused else None
    cases = {  # the buffer's shape, x's view, out's view: x and out share the buffer
        "shifted": ((3, 4, 5, 10), lambda a: a[..., :8], lambda a: a[..., 2:]),
        "reversed": ((3, 4, 5, 10), lambda a: a[..., :8], lambda a: a[..., ::-1][..., 2:]),
        "next sample": ((4, 4, 5, 8), lambda a: a[:3], lambda a: a[1:]),
        "next channel": ((3, 5, 5, 8), lambda a: a[:, :4], lambda a: a[:, 1:]),
        "interleaved": ((3, 4, 5, 16), lambda a: a[..., 1::2], lambda a: a[..., ::2]),  # bytes meet, elements not
        "in place": (shape, lambda a: a, lambda a: a),
    }
    for name, (buffer, x_of, out_of) in cases.items():
        base = rand_values(rng, buffer, F32)
        want = call(x_of(base.copy()), None, fa=fa_ref)
        buf = base.copy()
        got = call(x_of(buf), out_of(buf), fa=fa_ref)
        assert got[0].base is buf or got[0] is buf, name
        for g, w in zip(got, want):
            np.testing.assert_array_equal(bits(g), bits(w), err_msg=name)
    x = rand_values(rng, shape, F32)
    want = call(x, None, fa=fa_ref)
    out = np.zeros_like(x)  # scale and bias read from memory the output overwrites
    out.ravel()[:4], out.ravel()[-4:] = sc, b
    got = call(x, out, out.ravel()[:4], out.ravel()[-4:], fa=fa_ref)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(w), err_msg="scale and bias in out")
    if fused:  # fused_add read from out's memory
        fa = np.zeros((2,) + shape, F32)
        fa[1] = fa_ref
        got = call(x, fa[1, ::-1][::-1], fa=fa[1])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(bits(g), bits(w), err_msg="fused_add is out")

def test_batch_normalization_training_count_one_and_zero(rng):
    # a count of 1 without running statistics: variance 0, the output is bias
    x = rand_values(rng, (1, 4), F32)
    s, b = rand_values(rng, (4,), F32), rand_values(rng, (4,), F32)
    y, m, v = simdnorm.batch_normalization_training(x, s, b)
    np.testing.assert_array_equal(m, x[0])
    np.testing.assert_array_equal(v, 0)
    np.testing.assert_allclose(y[0], b, rtol=1e-6)
    # a count of 0: empty output, NaN statistics, running statistics untouched
    x = np.empty((0, 4, 3), F32)
    rm, rv = rand_values(rng, (4,), F32), rand_values(rng, (4,), F32, loc=2.0, scale=0.1)
    rm0, rv0 = rm.copy(), rv.copy()
    y, m, v = simdnorm.batch_normalization_training(x, running_mean=rm, running_var=rv)
    assert y.shape == (0, 4, 3)
    assert m.shape == (4,) and v.shape == (4,)
    assert np.isnan(m).all() and np.isnan(v).all()
    np.testing.assert_array_equal(bits(rm), bits(rm0))
    np.testing.assert_array_equal(bits(rv), bits(rv0))


# ----------------------------------------------------------------------------------------------
# running statistics
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum0.1", "cumulative"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_running_stats_match_torch_batchnorm2d(rng, momentum, layout):
    torch = pytest.importorskip("torch", reason="PyTorch not installed: the BatchNorm2d cross-check needs it")
    C = 5
    tbn = torch.nn.BatchNorm2d(C, momentum=momentum, eps=1e-5)
    tbn.train()
    with torch.no_grad():
        tbn.weight.copy_(torch.tensor(rng.uniform(0.5, 2.0, size=C), dtype=torch.float32))
        tbn.bias.copy_(torch.tensor(rng.normal(size=C), dtype=torch.float32))
    w, b = tbn.weight.detach().numpy().copy(), tbn.bias.detach().numpy().copy()
    rm, rv = np.zeros(C, F32), np.ones(C, F32)
    ids = (id(rm), id(rv))
    for step in range(1, 5):
        x = rand_values(rng, (4, C, 6, 7), F32, loc=step - 2.0, scale=1.0 + step)
        ty = tbn(torch.from_numpy(x)).detach().numpy()
        kw = dict(momentum="cumulative", num_batches_tracked=step) if momentum is None else dict(momentum=momentum)
        if layout == "nhwc":
            xin = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
            y, m, v = simdnorm.batch_normalization_training(xin, w, b, channel_axis=-1, running_mean=rm,
                                                            running_var=rv, **kw)
            y = y.transpose(0, 3, 1, 2)
        else:
            y, m, v = simdnorm.batch_normalization_training(x, w, b, running_mean=rm, running_var=rv, **kw)
        assert (id(rm), id(rv)) == ids
        np.testing.assert_allclose(y, ty, rtol=1e-5, atol=2e-5, err_msg=f"output, step {step}")
        np.testing.assert_allclose(rm, tbn.running_mean.numpy(), rtol=2e-6, atol=1e-6,
                                   err_msg=f"running_mean, step {step}")
        np.testing.assert_allclose(rv, tbn.running_var.numpy(), rtol=2e-6, atol=1e-6,
                                   err_msg=f"running_var, step {step}")
        assert int(tbn.num_batches_tracked) == step


@pytest.mark.parametrize("rdtype", ["float32", "float64", "input"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("convention,momentum", [("pytorch", None), ("pytorch", 0.3), ("pytorch", "cumulative"),
                                                 ("onnx", None), ("onnx", 0.8)])
def test_running_stats_formula(rng, convention, momentum, dtype, rdtype):
    shape = (3, 4, 11)
    rdt = {"float32": F32, "float64": F64, "input": dtype}[rdtype]
    rm = rand_values(rng, (4,), rdt)
    rv = rand_values(rng, (4,), rdt, loc=2.0, scale=0.3)
    for step in range(1, 4):
        x = rand_values(rng, shape, dtype, loc=1.0, scale=2.0)
        kw = dict(momentum_convention=convention)
        if momentum is not None:
            kw["momentum"] = momentum
        if momentum == "cumulative":
            kw["num_batches_tracked"] = step
        r = bn_training_ref(x)
        want_m, want_v = running_update_ref(rm, rv, r.mean, r.var, r.count, momentum=momentum,
                                            momentum_convention=convention, num_batches_tracked=step)
        simdnorm.batch_normalization_training(x, running_mean=rm, running_var=rv, **kw)
        assert rm.dtype == rdt and rv.dtype == rdt
        for name, got, want in (("running_mean", rm, want_m), ("running_var", rv, want_v)):
            # updated in float32 (float64 for float64 data), rounded once to the running dtype
            crt = 1e-12 if compute_dtype(dtype) == F64 and rdt == F64 else 1e-5
            tol = crt * (np.abs(want) + 1.0) + {F16: 1e-3, BF16: 8e-3}.get(np.dtype(rdt), 0.0) * np.abs(want)
            assert (np.abs(f64(got) - want) <= tol).all(), f"{name} step {step}: got {got} want {want} " \
                f"({convention} momentum={momentum} {dtype_id(dtype)} running {rdtype})"
            # the next step starts from what is stored


# Contiguous float32/float64 running buffers are updated by one kernel call (aligned: the unit's
# typed loop, a byte off: element by element), any others by numpy: the same float64 arithmetic in
# the same order, so the same bits (buffers alike but for their strides). float32 and float64 data:
# batch statistics of either type.
@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "a-byte-off"])
@pytest.mark.parametrize("rdtype", [F32, F64], ids=dtype_id)
@pytest.mark.parametrize("convention,momentum", [("pytorch", 0.1), ("pytorch", "cumulative"), ("onnx", 0.8)])
def test_running_stats_contiguous_as_strided(isa, rng, convention, momentum, rdtype, offset, dtype):
    x = rand_values(rng, (6, 33, 5), dtype, loc=1.0, scale=2.0)
    start = [rand_values(rng, (33,), rdtype, loc=loc, scale=0.3) for loc in (0.0, 2.0)]
    kw = dict(momentum_convention=convention, momentum=momentum)
    if momentum == "cumulative":
        kw["num_batches_tracked"] = 3
    # (a byte past their dtype's alignment: the sanitizer build checks the stores)
    dense = [np.empty(33 * a.itemsize + 64, np.uint8) for a in start]
    dense = [b[(-b.ctypes.data) % 64 + offset:][:33 * a.itemsize].view(rdtype) for a, b in zip(start, dense)]
    for a, b in zip(dense, start):
        a[...] = b
    strided = [np.empty((33, 2), rdtype)[:, 1] for _ in start]
    for a, b in zip(strided, start):
        a[...] = b
    simdnorm.batch_normalization_training(x, running_mean=dense[0], running_var=dense[1], **kw)
    simdnorm.batch_normalization_training(x, running_mean=strided[0], running_var=strided[1], **kw)
    for a, b in zip(dense, strided):
        assert not np.array_equal(a, start[0]) and not np.array_equal(a, start[1])
        np.testing.assert_array_equal(bits(a), bits(np.ascontiguousarray(b)))


def test_running_stats_same_rank_shape(rng):
    # running statistics take the statistics' shape: with same-rank scale/bias, that shape
    x = rand_values(rng, (5, 3, 4), F32)
    s = rand_values(rng, (1, 3, 4), F32, loc=1.0, scale=0.2)
    rm, rv = np.zeros((1, 3, 4), F32), np.ones((1, 3, 4), F32)
    _, m, v = simdnorm.batch_normalization_training(x, s, running_mean=rm, running_var=rv, momentum=0.5)
    r = bn_training_ref(x, s)
    want_m, want_v = running_update_ref(np.zeros((1, 3, 4)), np.ones((1, 3, 4)), r.mean, r.var, r.count, momentum=0.5)
    np.testing.assert_allclose(rm, want_m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rv, want_v, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# accuracy: large means, constant groups, long reductions
# ----------------------------------------------------------------------------------------------


LARGE = [("batch_norm", dict(shape=(4, 3, 500))), ("batch_norm", dict(shape=(500, 4), channel_axis=-1)),
         ("layer_norm", dict(shape=(8, 3000))), ("group_norm", dict(shape=(2, 4, 1000), num_groups=2)),
         ("instance_norm", dict(shape=(2, 3, 800))), ("mvn", dict(shape=(1500, 6), axes=(0,))),
         ("rms_norm", dict(shape=(8, 2000)))]


@pytest.mark.parametrize("ratio", [1e2, 1e4])
@pytest.mark.parametrize("op,kw", LARGE, ids=[f"{o}-{i}" for i, (o, _) in enumerate(LARGE)])
def test_large_mean_float32(rng, op, kw, ratio):
    # data with mean 1e4 and std 1: the saved mean and inv_std must be used (never E[x^2] - E[x]^2,
    # nor sum(g x) - mean sum(g) in float32); y may be off by a few ulp of |x| inv_std (the fold
    # x inv_std - mean inv_std), nothing more
    p = random_problem(rng, op, activation="gelu", dtype=F32, loc=ratio, spread=1.0, **kw)
    dy = rand_values(rng, p.x.shape, F32, scale=1.0)
    stats = sn_forward(p, stats=True)
    for s in stats:
        assert np.isfinite(s).all()
    res = sn_backward(p, dy, stats)
    ref = p.backward(dy, f64_stats(stats), rt=4 * U32 * 16, rt_fold=2 * U32)
    check_grads(res, ref, x=p.x, scale=p.scale, bias=p.bias, want=wanted(p), context=f"{op} ratio={ratio}")


@pytest.mark.parametrize("op,kw", LARGE[:4], ids=[f"{o}-{i}" for i, (o, _) in enumerate(LARGE[:4])])
def test_large_mean_float64(rng, op, kw):
    p = random_problem(rng, op, activation="silu", dtype=F64, loc=1e8, spread=1.0, **kw)
    dy = rand_values(rng, p.x.shape, F64, scale=1.0)
    stats = sn_forward(p, stats=True)
    res = sn_backward(p, dy, stats)
    ref = p.backward(dy, f64_stats(stats), rt=1e-12, rt_fold=2 * U64)
    check_grads(res, ref, x=p.x, scale=p.scale, bias=p.bias, want=wanted(p), context=f"{op} float64 mean 1e8")


# Data of any magnitude its dtype holds: a standard deviation of 1e25 (inv_std 1e-25, whose square
# is below float32's range) and of 1e-25 with epsilon 0 (inv_std 1e25, whose square is above it);
# float64's likewise at 1e170. grad_input must not pass through inv_std squared.
EXTREME = [(F32, 1e25, 1e-5), (F32, 1e-25, 0.0), (BF16, 1e25, 1e-5), (F64, 1e170, 1e-5), (F64, 1e-170, 0.0)]


@pytest.mark.parametrize("dtype,spread,eps", EXTREME, ids=[f"{dtype_id(d)}-{s:g}" for d, s, _ in EXTREME])
@pytest.mark.parametrize("op,kw", LARGE, ids=[f"{o}-{i}" for i, (o, _) in enumerate(LARGE)])
def test_extreme_magnitudes(rng, op, kw, dtype, spread, eps):
    p = random_problem(rng, op, dtype=dtype, loc=0.0, spread=spread, epsilon=eps, **kw)
    dy = rand_values(rng, p.x.shape, dtype, scale=1.0)
    stats = sn_forward(p, stats=True)
    res = sn_backward(p, dy, stats)
    ref = p.backward(dy, f64_stats(stats))
    check_grads(res, ref, x=p.x, scale=p.scale, bias=p.bias, want=wanted(p), context=f"{op} spread {spread:g}")


def test_large_mean_batch_statistics(rng):
    x = (1e4 + rng.normal(size=(64, 3, 300))).astype(F32)
    _, m, v = simdnorm.batch_normalization_training(x)
    r = bn_training_ref(x)
    np.testing.assert_allclose(m, r.mean, rtol=4 * U32)
    np.testing.assert_allclose(v, r.var, rtol=1e-4)  # E[x^2] - E[x]^2 would be off by ~1e3


def _constant_problem(rng, op, dtype, mode="inside"):
    if op == "group_norm":
        p = random_problem(rng, op, shape=(2, 6, 20), num_groups=3, activation="gelu", dtype=dtype)
        p.x[0, 2:4] = 2.5  # group 1 of sample 0
        p.x[1, 4:6] = -0.75
    elif op == "batch_norm":
        p = random_problem(rng, op, shape=(3, 4, 10), fused_add=True, activation="silu", dtype=dtype)
        p.x[:, 1] = 1.25  # channel 1
    elif op == "instance_norm":
        p = random_problem(rng, op, shape=(2, 3, 10), activation="relu", dtype=dtype)
        p.x[1, 2] = -3.0
    elif op == "layer_norm":
        p = random_problem(rng, op, shape=(3, 40), activation="leaky_relu", dtype=dtype)
        p.x[1] = 7.0
    elif op == "rms_norm":  # the "variance" of RMS norm is mean(x^2): 0 only for a zero row
        p = random_problem(rng, op, shape=(3, 40), activation="gelu", dtype=dtype)
        p.x[2] = 0.0
    else:
        p = random_problem(rng, "mvn", shape=(3, 40), axes=(1,), epsilon_mode=mode, epsilon=0.01, activation="silu",
                           dtype=dtype)
        p.x[0] = -2.0
    return p


@pytest.mark.parametrize("dtype", [F32, F16, F64], ids=dtype_id)
@pytest.mark.parametrize("op", ["group_norm", "batch_norm", "instance_norm", "layer_norm", "rms_norm", "mvn-inside",
                                "mvn-outside"])
def test_constant_group(rng, op, dtype):
    # a group of equal values (variance 0): y = 0 there, grad_input = inv_std (g - M(g)), finite
    name, _, mode = op.partition("-")
    p = _constant_problem(rng, name, dtype, mode or "inside")
    dy = rand_values(rng, p.x.shape, dtype, scale=1.0)
    stats = sn_forward(p, stats=True)
    res = sn_backward(p, dy, stats)
    for i, g in enumerate(res):
        if g is not None:
            assert np.isfinite(f64(g)).all(), f"gradient {i} not finite {op} {dtype_id(dtype)}"
    check_grads(res, p.backward(dy, f64_stats(stats)), x=p.x, scale=p.scale, bias=p.bias, fused_add=p.fused_add,
                want=wanted(p), context=f"constant group {op}")


def test_long_reduction_float32(rng):
    # 2**20 elements per channel: float32 partial sums merged in double stay accurate
    x = rand_values(rng, (256, 2, 4096), F32, loc=3.0, scale=1.0)
    dy = rand_values(rng, x.shape, F32, loc=0.5, scale=1.0)
    s, b = np.array([1.5, -0.75], F32), np.array([0.25, 0.5], F32)
    _, m, v = simdnorm.batch_normalization_training(x, s, b)
    r = bn_training_ref(x, s, b)
    check_batch_stats(m, v, x, r, "long", stat_rtol=1e-6)
    res = simdnorm.batch_normalization_backward(dy, x, m, v, s, b)
    p = Problem("batch_norm", x, s, b)
    check_grads(res, p.backward(dy, (f64(m), f64(v)), rt=2e-6), x=x, scale=s, bias=b, context="2**20 per channel")


# ----------------------------------------------------------------------------------------------
# relu'(0) = 0, leaky_relu'(0) = alpha
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("act,params,slope", [("relu", None, 0.0), ("leaky_relu", None, 0.01),
                                              ("leaky_relu", {"alpha": 0.3}, 0.3)])
@pytest.mark.parametrize("op", ["layer_norm", "batch_norm", "group_norm"])
def test_activation_derivative_at_zero(rng, op, act, params, slope):
    # symmetric data: the middle element normalizes to exactly 0, bias 0: the pre-activation value
    # is exactly 0 there, and the gradient of bias counts dy there times act'(0)
    row = np.array([-2.0, -1.0, 0.0, 1.0, 2.0], F32)
    if op == "layer_norm":
        x = np.stack([row, row * 3])
        p = Problem(op, x, None, np.zeros(5, F32), kw=dict(axis=-1), activation=act, act_params=params)
    elif op == "batch_norm":
        x = np.stack([row, row * 2], axis=1).reshape(5, 2, 1)  # (N=5, C=2, 1)
        p = Problem(op, x, None, np.zeros(2, F32), kw=dict(channel_axis=1), activation=act, act_params=params)
    else:
        x = np.stack([row, -row, row * 4, row]).reshape(1, 4, 5)  # groups of channels (0,1), (2,3)
        p = Problem(op, x, None, np.zeros(4, F32), kw=dict(num_groups=2), activation=act, act_params=params)
    dy = rand_values(rng, x.shape, F32, loc=1.0, scale=0.5)
    stats = sn_forward(p, stats=True)
    ref = p.backward(dy, f64_stats(stats))
    assert np.count_nonzero(p.pre_activation() == 0) >= 2
    res = sn_backward(p, dy, stats)
    check_grads(res, ref, x=x, bias=p.bias, want=("input", "bias"), context=f"{op} {act} at 0 (slope {slope})")


# silu' and gelu' to a few ulps over their whole range, the tails included: read through the fused
# add's gradient (of x's shape: dy * act'(pre) itself), with x = mean = bias = 0 and the fused add
# the points, so that pre is each point exactly. gelu' = Phi + p phi takes Phi from erfc below 0
# (1 + erf cancelled there: at p = -5.5 the result was 20% off, at -8.4 in float64 wholly), and
# near each derivative's root (-1.2785, -0.7518) the error is bounded in absolute terms instead.
@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_smooth_derivatives_to_a_few_ulps(dtype, act):
    p = np.concatenate([np.linspace(-30, 30, 24001), -np.geomspace(1e-30, 100, 2001), np.geomspace(1e-30, 100, 2001),
                        np.linspace(-100, -70, 3001)])  # (float32 silu' changes formula at -80)
    if dtype == F64:  # (silu' results are normal doubles down to -708)
        p = np.concatenate([p, np.linspace(-705, -100, 6051)])
    p = p.astype(dtype).reshape(-1, 1)  # (N, C = 1)
    z = np.zeros_like(p)
    one = np.ones(1, dtype)
    _, _, _, got = simdnorm.batch_normalization_backward(
        np.ones_like(p), z, np.zeros(1, dtype), one - np.asarray(1e-5, dtype), one, np.zeros(1, dtype),
        training=False, fused_add=p, activation=act)
    x = p.astype(np.float64).ravel()
    if act == "silu":
        e = np.exp(-np.abs(x))  # (s and 1 - s each without cancellation or overflow)
        s, rest = np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)), np.where(x >= 0, e / (1.0 + e), 1.0 / (1.0 + e))
        want = s * (1.0 + x * rest)
        root = -1.2784645
    else:
        want = 0.5 * np.vectorize(math.erfc)(-x / math.sqrt(2.0)) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        root = -0.7517915
    err = np.abs(got.astype(np.float64).ravel() - want)
    tiny = np.finfo(dtype).tiny
    ulps = err / np.maximum(np.spacing(np.abs(want).astype(dtype)).astype(np.float64), np.finfo(dtype).smallest_subnormal)
    away = np.abs(x - root) > 0.25
    worst = np.argmax(np.where(away & (np.abs(want) > tiny), ulps, 0))
    assert ulps[away & (np.abs(want) > tiny)].max() <= 24, (x[worst], got.ravel()[worst], want[worst])
    assert err[~away].max() <= 4 * np.finfo(dtype).eps, err[~away].max()


# ----------------------------------------------------------------------------------------------
# 1 vs 2 threads: bitwise identical
# ----------------------------------------------------------------------------------------------


THREAD_CASES = [("batch_norm", dict(shape=(8, 16, 40, 40), fused_add=True)),
                ("batch_norm", dict(shape=(8, 40, 40, 16), channel_axis=-1)),
                ("batch_norm_eval", dict(shape=(8, 16, 40, 40))),
                ("mvn", dict(shape=(16, 40, 400), axes=(0, 2))),
                ("mvn", dict(shape=(40, 8, 600), axes=(2,), epsilon_mode="outside", epsilon=0.1)),
                ("layer_norm", dict(shape=(512, 384))),
                ("layer_norm", dict(shape=(2, 200000))),
                ("rms_norm", dict(shape=(512, 384))),
                ("instance_norm", dict(shape=(4, 16, 60, 60))),
                ("group_norm", dict(shape=(4, 32, 40, 40), num_groups=8)),
                ("group_norm", dict(shape=(2, 40, 40, 32), num_groups=4, channel_axis=-1)),
                # no activation: channels-last rows' own loops (lanes_sums, lanes_apply), layer norm's
                # rows_stream without a derivative call
                ("batch_norm", dict(shape=(8, 40, 40, 24), channel_axis=-1, activation=None)),
                ("layer_norm", dict(shape=(512, 388), activation=None))]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
@pytest.mark.parametrize("op,kw", THREAD_CASES, ids=[f"{o}-{i}" for i, (o, _) in enumerate(THREAD_CASES)])
def test_backward_one_vs_two_threads_bitwise(rng, threads, op, kw, dtype):
    kw = {"activation": "gelu", **kw}
    p = random_problem(rng, op, dtype=dtype, **kw)
    if p.eval_stats is not None:
        p.eval_stats = tuple(a.astype(F32) for a in p.eval_stats)
    dy = rand_values(rng, p.x.shape, dtype, scale=1.0)
    results = []
    for n in (1, 2):
        threads(n)
        stats = sn_forward(p, stats=True)
        results.append((stats, sn_backward(p, dy, stats)))
    (s1, r1), (s2, r2) = results
    for a, b in zip(s1, s2):
        if a is not None:
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"forward statistics {op} {kw}")
    for i, (a, b) in enumerate(zip(r1, r2)):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"gradient {i} {op} {kw} 1 vs 2 threads")
    if dtype == F32 and op in ("batch_norm", "group_norm", "layer_norm"):  # and right, on a split input
        check_grads(r2, p.backward(dy, f64_stats(s2)), x=p.x, scale=p.scale, bias=p.bias, fused_add=p.fused_add,
                    want=wanted(p), context=f"{op} {kw} 2 threads")


ISA_CASES = [("batch_norm", 1), ("batch_norm_eval", 1), ("mvn", 1), ("mvn", 3), ("layer_norm", 0), ("rms_norm", 0),
             ("instance_norm", 1), ("group_norm", 1)]


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
def test_backward_every_isa(isa, rng, dtype):
    # every instruction set this machine has (simdnorm.set_isa), against the reference
    for op, variant in ISA_CASES:
        for act, params in (("gelu", None), ("leaky_relu", {"alpha": 0.3}), ("silu", None)):
            p = make_problem(rng, op, variant, dtype, act, params)
            dy = rand_values(rng, p.x.shape, dtype, scale=1.0)
            stats = sn_forward(p, stats=True)
            res = sn_backward(p, dy, stats, out=make_out(p.x.shape, dtype))
            check_grads(res, p.backward(dy, f64_stats(stats)), x=p.x, scale=p.scale, bias=p.bias,
                        fused_add=p.fused_add, want=wanted(p), context=f"isa={isa} {op}-{variant} {act}")
    x = rand_values(rng, (6, 5, 41), dtype, loc=2.0)
    y, m, v = simdnorm.batch_normalization_training(x, activation="gelu")
    r = bn_training_ref(x)
    check_batch_stats(m, v, x, r, f"isa={isa}")
    check_close(y, r.pre, r.zscale, "gelu", dtype=dtype, context=f"isa={isa}")


@pytest.mark.parametrize("layout", ["nchw", "nhwc", "same_rank"])
def test_batch_normalization_training_one_vs_two_threads_bitwise(rng, threads, layout):
    if layout == "nhwc":
        x, ca, pshape = rand_values(rng, (8, 40, 40, 16), F32), -1, (16,)
    elif layout == "same_rank":
        x, ca, pshape = rand_values(rng, (8, 16, 40, 40), F32), 1, (1, 16, 40, 1)
    else:
        x, ca, pshape = rand_values(rng, (8, 16, 40, 40), F32), 1, (16,)
    s, b = rand_values(rng, pshape, F32), rand_values(rng, pshape, F32)
    fa = rand_values(rng, x.shape, F32)
    outs = []
    for n in (1, 2):
        threads(n)
        rm, rv = np.zeros(pshape, F32), np.ones(pshape, F32)
        y, m, v = simdnorm.batch_normalization_training(x, s, b, channel_axis=ca, fused_add=fa, activation="relu",
                                                        running_mean=rm, running_var=rv, momentum=0.1)
        outs.append((y, m, v, rm, rv))
    for name, a, c in zip(("out", "mean", "variance", "running_mean", "running_var"), *outs):
        np.testing.assert_array_equal(bits(a), bits(c), err_msg=f"{name} 1 vs 2 threads ({layout})")


# NCHW planes of up to 400 elements with 2 rows or more outside them are summed as lane groups
# (a channel's runs one sequence, or lanes when each run is under two vectors), normalized as
# runs past 64 elements; longer planes and single rows run as rows. Both sides of each bound,
# with and without scale and bias: batch norm training and MVN over (0, 2) against the float64
# reference, the same bits at 1 and 2 threads.
@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("n, plane", [(8, 64), (8, 65), (8, 196), (8, 400), (8, 401), (2, 9), (3, 100), (1, 100),
                                      (70, 100)])
@pytest.mark.parametrize("affine", [True, False])
def test_planes_around_the_lane_group_bounds(rng, threads, dtype, n, plane, affine):
    shape = (n, 5, plane)
    x = rand_values(rng, shape, dtype, loc=1.5, scale=2.0)
    s, b = (rand_values(rng, (5,), dtype, loc=1.0, scale=0.5), rand_values(rng, (5,), dtype)) if affine else (None, None)
    runs = []
    for t in (1, 2):
        threads(t)
        runs.append(simdnorm.batch_normalization_training(x, s, b, out=make_out(shape, dtype)) +
                    simdnorm.mean_variance_normalization(x, (0, 2), out=make_out(shape, dtype), return_stats=True))
    for a, c in zip(*runs):
        np.testing.assert_array_equal(bits(a), bits(c), err_msg="1 vs 2 threads")
    ctx = f"{shape} {dtype_id(dtype)} affine={affine}"
    y, m, v, z, zm, zi = runs[0]
    r = bn_training_ref(x, s, b)
    check_batch_stats(m, v, x, r, ctx)
    check_close(y, r.pre, r.zscale, dtype=dtype, context=ctx)
    check_mvn(z, x, (0, 2), stats=(zm, zi), context=ctx)


# Batch norm's backward over small NCHW planes writes grad_input as one stream over the planes back
# to back, its vectors on grad_input's lines, a vector across two planes taking each lane's
# coefficients from its plane (BackwardKernel::const_rows_stream); planes apart in memory go plane
# by plane. The same bits either way, for planes around the vector widths, at any offset of
# grad_input, and against the float64 reference, with each ISA's kernels.
@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("plane", [4, 7, 8, 15, 16, 17, 33, 49, 100])
@pytest.mark.parametrize("training", [True, False])
def test_backward_planes_back_to_back_as_apart(rng, isa, dtype, plane, training):
    shape = (3, 7, plane)
    x = rand_values(rng, shape, dtype, loc=1.5, scale=2.0)
    dy = rand_values(rng, shape, dtype)
    s, b = rand_values(rng, (7,), dtype, loc=1.0, scale=0.5), rand_values(rng, (7,), dtype)
    _, m, v = simdnorm.batch_normalization_training(x, s, b)
    apart = np.full(shape[:2] + (plane + 5,), np.nan, dtype)[..., :plane]
    want = simdnorm.batch_normalization_backward(dy, x, m, v, s, b, training=training, out=apart)
    ctx = f"{shape} {dtype_id(dtype)} training={training}"
    check_grads(want, bn_backward_ref(dy, x, m, v, s, b, training=training), x=x, scale=s, bias=b, context=ctx)
    size = np.dtype(dtype).itemsize
    for offset in list(range(0, 64, size)) + [size // 2]:  # (the last: not on an element boundary)
        out = empty_past_line(shape, dtype, offset)
        out[...] = np.nan
        got = simdnorm.batch_normalization_backward(dy, x, m, v, s, b, training=training, out=out)
        assert got[0] is out
        for name, a, c in zip(("grad_input", "grad_scale", "grad_bias"), got, want):
            np.testing.assert_array_equal(bits(a), bits(c), err_msg=f"{name} {ctx} offset {offset}")


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------


def _simple(rng, op, dtype=F32, act=None):
    shape = {"group_norm": (2, 4, 5), "instance_norm": (2, 3, 5)}.get(op, (3, 4, 5))
    kw = dict(num_groups=2) if op == "group_norm" else {}
    p = random_problem(rng, op, shape=shape, activation=act, dtype=dtype, **kw)
    if p.eval_stats is not None:
        p.eval_stats = tuple(a.astype(F32) for a in p.eval_stats)
    return p


ALL_OPS = ("batch_norm", "batch_norm_eval", "mvn", "layer_norm", "rms_norm", "instance_norm", "group_norm")


@pytest.mark.parametrize("op", ALL_OPS)
def test_error_grad_of_absent_parameter(rng, op):
    p = _simple(rng, op)
    p.scale = None
    p.bias = None
    dy = rand_values(rng, p.x.shape, F32)
    stats = sn_forward(p, stats=True)
    with pytest.raises(ValueError):
        sn_backward(p, dy, stats, grad_scale=True)
    if op != "rms_norm":
        with pytest.raises(ValueError):
            sn_backward(p, dy, stats, grad_bias=True)
    else:  # rms_norm has no bias: asking for its gradient is an error too
        with pytest.raises((ValueError, TypeError)):
            sn_backward(p, dy, stats, grad_bias=True)
    res = sn_backward(p, dy, stats)
    assert res[1] is None and res[2] is None


@pytest.mark.parametrize("op", ALL_OPS)
def test_error_grad_output_shape_and_dtype(rng, op):
    p = _simple(rng, op)
    stats = sn_forward(p, stats=True)
    with pytest.raises(ValueError):
        sn_backward(p, rand_values(rng, p.x.shape[:-1] + (p.x.shape[-1] + 1,), F32), stats)
    with pytest.raises(ValueError):
        sn_backward(p, rand_values(rng, p.x.shape[1:], F32), stats)  # broadcastable is not enough
    for dt in (F64, F16, np.int32):
        with pytest.raises(TypeError):
            sn_backward(p, rand_values(rng, p.x.shape, F32).astype(dt), stats)


@pytest.mark.parametrize("op", ALL_OPS)
def test_error_out(rng, op):
    p = _simple(rng, op)
    dy = rand_values(rng, p.x.shape, F32)
    stats = sn_forward(p, stats=True)
    x0 = p.x.copy()
    with pytest.raises(ValueError):  # the input is needed to the end
        sn_backward(p, dy, stats, out=p.x)
    np.testing.assert_array_equal(bits(p.x), bits(x0))
    for bad in (make_out(p.x.shape, F64), make_out(p.x.shape[:-1] + (1,), F32)):
        before = bad.copy()
        with pytest.raises((TypeError, ValueError)):
            sn_backward(p, dy, stats, out=bad)
        np.testing.assert_array_equal(bits(bad), bits(before))
    ro = make_out(p.x.shape, F32)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        sn_backward(p, dy, stats, out=ro)


@pytest.mark.parametrize("name", ["tanh", "sigmoid", "elu", "hard_swish", "softplus", "nope"])
@pytest.mark.parametrize("op", ALL_OPS)
def test_error_activation_not_differentiable_here(rng, op, name):
    p = _simple(rng, op)
    dy = rand_values(rng, p.x.shape, F32)
    stats = sn_forward(p, stats=True)
    with pytest.raises(ValueError, match="relu.*leaky_relu.*silu.*gelu|gelu.*silu"):
        sn_backward(p, dy, stats, activation=name)


@pytest.mark.parametrize("op", ["layer_norm", "batch_norm"])
def test_error_identity_is_not_in_the_backward_list(rng, op):
    # SPEC §9: "None, relu, leaky_relu, silu, gelu (ValueError naming those for any other)"
    p = _simple(rng, op)
    dy = rand_values(rng, p.x.shape, F32)
    stats = sn_forward(p, stats=True)
    with pytest.raises(ValueError):
        sn_backward(p, dy, stats, activation="identity")


@pytest.mark.parametrize("op", ["batch_norm", "mvn", "layer_norm", "rms_norm", "instance_norm", "group_norm"])
def test_error_statistics_of_wrong_shape(rng, op):
    p = _simple(rng, op)
    dy = rand_values(rng, p.x.shape, F32)
    stats = sn_forward(p, stats=True)
    bad = tuple(None if s is None else np.concatenate([s.ravel(), s.ravel()[:1]]) for s in stats)
    with pytest.raises(ValueError):
        sn_backward(p, dy, bad)


def test_error_batch_normalization_training(rng):
    x = rand_values(rng, (4, 3, 5), F32)
    r = np.zeros(3, F32)
    with pytest.raises(ValueError):
        simdnorm.batch_normalization_training(x, running_mean=r)
    with pytest.raises(ValueError):
        simdnorm.batch_normalization_training(x, running_var=np.ones(3, F32))
    with pytest.raises((ValueError, TypeError)):
        simdnorm.batch_normalization_training(x, running_mean=r, running_var=np.ones(3, F32), momentum="cumulative")
    with pytest.raises(ValueError):
        simdnorm.batch_normalization_training(x, running_mean=r, running_var=np.ones(3, F32), momentum="cumulative",
                                              num_batches_tracked=0)
    with pytest.raises(ValueError):
        simdnorm.batch_normalization_training(x, running_mean=r, running_var=np.ones(3, F32),
                                              momentum_convention="tensorflow")
    with pytest.raises(ValueError):  # scale and bias of different shapes
        simdnorm.batch_normalization_training(x, np.ones(3, F32), np.ones((1, 3, 1), F32))
    with pytest.raises(AxisError):  # a 1-D input needs a same-rank parameter
        simdnorm.batch_normalization_training(rand_values(rng, (5,), F32))
    with pytest.raises(ValueError):  # running statistics of the wrong shape
        simdnorm.batch_normalization_training(x, running_mean=np.zeros(4, F32), running_var=np.ones(4, F32))
    with pytest.raises(TypeError):
        simdnorm.batch_normalization_training(x, running_mean=np.zeros(3, np.int32), running_var=np.ones(3, np.int32))
    ro_m, ro_v = np.zeros(3, F32), np.ones(3, F32)
    ro_m.flags.writeable = False
    with pytest.raises(ValueError):
        simdnorm.batch_normalization_training(x, running_mean=ro_m, running_var=ro_v)
    with pytest.raises(ValueError):
        simdnorm.batch_normalization_training(x, epsilon=-1.0)
    with pytest.raises(ValueError):  # fused_add that would enlarge the input
        simdnorm.batch_normalization_training(x, fused_add=rand_values(rng, (2, 4, 3, 5), F32))


def test_running_stats_untouched_when_the_call_raises(rng):
    x = rand_values(rng, (4, 3, 5), F32)
    rm, rv = rand_values(rng, (3,), F32), rand_values(rng, (3,), F32, loc=2.0, scale=0.1)
    rm0, rv0 = rm.copy(), rv.copy()
    bad_calls = [
        dict(activation="no_such_activation"),
        dict(out=np.empty((4, 3, 5), F64)),
        dict(out=np.empty((4, 3, 6), F32)),
        dict(fused_add=np.ones((4, 3, 6), F32)),
        dict(momentum="cumulative"),
        dict(momentum_convention="nope"),
        dict(epsilon=float("nan")),
    ]
    for kw in bad_calls:
        with pytest.raises((ValueError, TypeError)):
            simdnorm.batch_normalization_training(x, running_mean=rm, running_var=rv, **kw)
        np.testing.assert_array_equal(bits(rm), bits(rm0), err_msg=str(kw))
        np.testing.assert_array_equal(bits(rv), bits(rv0), err_msg=str(kw))
    # a per-channel count of 1 with running_var: the unbiased variance is undefined
    x1 = rand_values(rng, (1, 3), F32)
    with pytest.raises(ValueError):
        simdnorm.batch_normalization_training(x1, running_mean=rm, running_var=rv)
    np.testing.assert_array_equal(bits(rm), bits(rm0))
    np.testing.assert_array_equal(bits(rv), bits(rv0))
    x1 = rand_values(rng, (4, 3, 5), F32)  # same-rank statistics of count 1 (nothing reduced but N=1)
    with pytest.raises(ValueError):
        simdnorm.batch_normalization_training(x1[:1], np.ones((1, 3, 5), F32), running_mean=np.zeros((1, 3, 5), F32),
                                              running_var=np.ones((1, 3, 5), F32))


def test_count_one_with_running_var_onnx_convention(rng):
    # SPEC §9 states the count-1 rule for running_var without naming a convention: ONNX's update
    # (population variance) is no exception
    rm, rv = rand_values(rng, (3,), F32), rand_values(rng, (3,), F32, loc=2.0, scale=0.1)
    rm0, rv0 = rm.copy(), rv.copy()
    with pytest.raises(ValueError):
        simdnorm.batch_normalization_training(rand_values(rng, (1, 3), F32), running_mean=rm, running_var=rv,
                                              momentum_convention="onnx")
    np.testing.assert_array_equal(bits(rm), bits(rm0))
    np.testing.assert_array_equal(bits(rv), bits(rv0))


def test_error_backward_input_dtype_and_rank(rng):
    x = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    with pytest.raises(TypeError):
        simdnorm.layer_norm_backward(x, x, np.zeros((2, 3, 1), F32), np.ones((2, 3, 1), F32))
    x9 = rand_values(rng, (1,) * 9, F32)
    with pytest.raises(ValueError):
        simdnorm.layer_norm_backward(x9, x9, np.zeros((1,) * 9, F32), np.ones((1,) * 9, F32))


def test_error_zero_dim_parameters_of_training_and_backward_ops(rng):
    """A 0-d fused_add was taken by batch_normalization_training (and refused by its backward and
    its descriptor); a 0-d statistic of a backward op was refused as 'expected 1 to 9 dimensions'.
    Every op's 0-d parameter is the same clear error."""
    x = rand_values(rng, (2, 3, 4), F32)
    c, zero = np.ones(3, F32), np.array(0.5, F32)
    ln_stats = (np.zeros((2, 3, 1), F32), np.ones((2, 3, 1), F32))
    calls = {
        "training fused_add": lambda: simdnorm.batch_normalization_training(x, fused_add=zero),
        "training scale": lambda: simdnorm.batch_normalization_training(x, zero),
        "bn backward mean": lambda: simdnorm.batch_normalization_backward(x, x, zero, c),
        "bn backward fused_add": lambda: simdnorm.batch_normalization_backward(x, x, c, c, fused_add=zero),
        "layer backward mean": lambda: simdnorm.layer_norm_backward(x, x, zero, ln_stats[1]),
        "mvn backward inv_std": lambda: simdnorm.mean_variance_normalization_backward(x, x, (2,), ln_stats[0], zero),
        "rms backward scale": lambda: simdnorm.rms_norm_backward(x, x, ln_stats[1], zero),
    }
    for what, call in calls.items():
        with pytest.raises(simdnorm.DescriptorError, match="0 dimensions .*tensors must have 1 to 8 dimensions"):
            call()
            pytest.fail(what)


def test_exported():
    for name in ("batch_normalization_training", "batch_normalization_backward",
                 "mean_variance_normalization_backward", "layer_norm_backward", "rms_norm_backward",
                 "instance_norm_backward", "group_norm_backward"):
        assert callable(getattr(simdnorm, name)), name
        assert name in simdnorm.__all__, name


# From memory, the two passes go slab by slab (ops/backward.cpp, run_slabs): a slab of whole
# samples (whole statistics elements) is summed, then written while it is in the L2 (a sample too
# large for it: in the L3); without
# statistics terms (batch norm with global statistics) the sums pass writes grad_input itself
# (sums_write), in chunks that may end inside a run (global statistics over 100 channels). A tail
# slab shorter than the others, statistics taken from the parameters' sums (instance norm) or lanes
# folded into groups (group norm of channels-last data): every gradient against the reference,
# and 1 vs 2 threads bitwise.
def backward_plans(fn):
    """The plans (as text) of the backward kernel calls fn makes, which run as explain instead."""
    import simdnorm._training as training

    real, plans = training._core, []

    class Explain:
        def __getattr__(self, name):
            return getattr(real, name)

        def mvn_backward(self, *args):
            args = list(args)
            args[19] = True
            plans.append(real.mvn_backward(*args))

    training._core = Explain()
    try:
        fn()
    finally:
        training._core = real
    return plans


def on_one_and_two_threads(run, threads):
    """run()'s results on 1 thread, checked bitwise against run() on 2."""
    threads(1)
    one = run()
    threads(2)
    two = run()
    assert len(one) == len(two)
    for a, b in zip(one, two):
        if a is not None:
            np.testing.assert_array_equal(bits(a), bits(b))
    return one


SLABS = ["group_norm_nhwc", "group_norm_nhwc_large", "instance_norm_nhwc", "instance_norm_nhwc_flipped", "mvn12_nhwc",
         "bn_global_nhwc", "bn_global_nchw"]


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("op", SLABS)
def test_backward_slabs_against_reference_and_threads(rng, threads, op, dtype):
    from simdnorm import _core
    from training_reference import bn_backward_ref, group_norm_backward_ref, instance_norm_backward_ref, mvn_backward_ref

    rng_state = rng.bit_generator.state  # (run() draws batch norm's statistics: the same each call)
    # (_large: a sample's x and dy pass the L2, a slab of one sample each, read again from the L3)
    inner = (12, 10, 100) if op.startswith("bn_global") else (64, 48, 64) if op.endswith("_large") else (16, 8, 64)
    n = _core.stream_threshold_bytes() // (3 * np.dtype(dtype).itemsize * int(np.prod(inner))) + 3
    x = rand_values(rng, (n, *inner), dtype, scale=2.0) + np.asarray(3.0, dtype)
    dy = rand_values(rng, x.shape, dtype, scale=1.0)
    c = inner[-1]
    scale, bias = (rand_values(rng, (c,), dtype, scale=1.0) for _ in range(2))
    fused = rand_values(rng, x.shape, dtype, scale=1.0)
    if op == "bn_global_nchw":
        x, dy = (np.ascontiguousarray(a.transpose(0, 3, 1, 2)) for a in (x, dy))
    if op.endswith("_flipped"):  # samples in reverse memory order, rows reversed, a gap past each sample
        op = op[:-len("_flipped")]
        x, dy = (np.concatenate([a, a[:, :1]], axis=1)[::-1, -2::-1] for a in (x, dy))
    ca = 1 if op == "bn_global_nchw" else -1
    op = op.replace("_large", "")

    def run():
        if op == "group_norm_nhwc":
            _, m, s = simdnorm.group_norm(x, 16, scale, bias, channel_axis=-1, return_stats=True)
            res = simdnorm.group_norm_backward(dy, x, 16, m, s, scale, bias, channel_axis=-1)
            return res, lambda: group_norm_backward_ref(dy, x, 16, m, s, scale, bias, channel_axis=-1)
        if op == "instance_norm_nhwc":
            _, m, s = simdnorm.instance_norm(x, scale, bias, channel_axis=-1, return_stats=True)
            res = simdnorm.instance_norm_backward(dy, x, m, s, scale, bias, channel_axis=-1)
            return res, lambda: instance_norm_backward_ref(dy, x, m, s, scale, bias, channel_axis=-1)
        if op == "mvn12_nhwc":  # no parameters: the statistics' own sums
            _, m, s = simdnorm.mean_variance_normalization(x, (1, 2), return_stats=True)
            res = simdnorm.mean_variance_normalization_backward(dy, x, (1, 2), m, s)
            return res, lambda: mvn_backward_ref(dy, x, (1, 2), m, s)
        rng.bit_generator.state = rng_state
        mean = rand_values(rng, (c,), dtype, scale=1.0)
        var = (np.abs(rand_values(rng, (c,), dtype, scale=1.0)) + np.asarray(0.5, dtype)).astype(dtype)
        # (NHWC: with a fused add and an activation, whose derivative is taken where the add is)
        kw = {} if ca == 1 else {"fused_add": fused, "activation": "silu"}
        res = simdnorm.batch_normalization_backward(dy, x, mean, var, scale, bias, channel_axis=ca, training=False,
                                                    **kw)
        return res, lambda: bn_backward_ref(dy, x, mean, var, scale, bias, channel_axis=ca, training=False, **kw)

    threads(1)
    one, reference = run()
    plans = backward_plans(run)
    # (global statistics: one pass, the sums pass writing grad_input; a fused add's ga, a call of its
    # own before it, has no sums)
    assert ("sums-write" if op.startswith("bn_global") else "slabs=") in plans[-1], plans
    threads(2)
    two = run()[0]
    assert len(one) == len(two)
    for a, b in zip(one, two):
        if a is not None:
            np.testing.assert_array_equal(bits(a), bits(b))
    ref = reference()
    if len(one) == 4:  # the fused add's gradient: ga
        check_grad(one[3], ref.grad_fused_add, ref.e_fused_add, dtype=dtype, name="grad_fused_add", context=op)
    check_grad(one[0], ref.grad_input, ref.e_input, dtype=dtype, name="grad_input", context=op)
    if op != "mvn12_nhwc":
        check_grad(one[1], ref.grad_scale, ref.e_scale, name="grad_scale", context=op)
        check_grad(one[2], ref.grad_bias, ref.e_bias, name="grad_bias", context=op)


# Batch statistics of NCHW data with small planes go in blocks of channels (each summed, then
# written from the L2). 8x8 planes of 64 samples: blocks of 8 (float64) to 32 channels (16-bit),
# so the sums' flushes (every 32 runs) span samples; a block's channels reversed in memory, and
# grad_input alone; 1 and 2 threads bitwise, against the float64 reference.
@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("flipped", [False, True], ids=["forward", "flipped"])
def test_backward_channel_blocks_against_reference_and_threads(rng, threads, dtype, flipped):
    from training_reference import bn_backward_ref

    x = rand_values(rng, (64, 40, 8, 8), dtype, scale=2.0) + np.asarray(3.0, dtype)
    dy = rand_values(rng, x.shape, dtype, scale=1.0)
    if flipped:
        x, dy = x[:, ::-1], dy[:, ::-1]
    pdt = F64 if dtype == F64 else F32
    scale, bias = (rand_values(rng, (40,), pdt, scale=1.0) for _ in range(2))
    _, m, v = simdnorm.batch_normalization_training(x, scale, bias)
    for params in (True, False):
        def run():
            return simdnorm.batch_normalization_backward(dy, x, m, v, scale, bias, grad_scale=params,
                                                         grad_bias=params)

        plans = backward_plans(run)
        assert plans[-1].startswith("two-pass ") and " slabs=" in plans[-1], plans
        one = on_one_and_two_threads(run, threads)
        ref = bn_backward_ref(dy, x, m, v, scale, bias)
        check_grad(one[0], ref.grad_input, ref.e_input, dtype=dtype, name="grad_input", context=str(dtype))
        if params:
            check_grad(one[1], ref.grad_scale, ref.e_scale, name="grad_scale", context=str(dtype))
            check_grad(one[2], ref.grad_bias, ref.e_bias, name="grad_bias", context=str(dtype))
        else:
            assert one[1] is None and one[2] is None


# Batch norm of a few rows of many channels ((N, C) data, small N) goes by chunks of channels, each
# summed, its coefficients set, its grad_input written and its parameters' gradients stored before
# the next (column_chunks); with parameters, each chunk in one sweep of the kernel's (rows a
# multiple of 4 KB apart: up to 8 of them). Chunks of 6720 channels, the last
# shorter; the channels reversed in memory (the sweep's loads and stores go one way: the chunks'
# two passes there); training and global statistics, with and without
# parameters, an activation; against the float64 reference into poisoned outputs, and 1 vs 2
# threads bitwise.
@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("flipped", [False, True], ids=["forward", "flipped"])
@pytest.mark.parametrize("shape, lanes, sweep", [((3, 20000), 6720, True), ((8, 4096), 4096, True),
                                                 ((32, 1024), 1024, False)], ids=["3x20000", "8x4096", "32x1024"])
def test_backward_column_chunks_against_reference_and_threads(rng, threads, dtype, flipped, shape, lanes, sweep):
    from training_reference import bn_backward_ref

    x = rand_values(rng, shape, dtype, scale=2.0) + np.asarray(3.0, dtype)
    dy = rand_values(rng, x.shape, dtype, scale=1.0)
    if flipped:
        x, dy = x[:, ::-1], dy[:, ::-1]
    pdt = F64 if dtype == F64 else F32
    scale, bias = (rand_values(rng, (shape[1],), pdt, scale=1.0) for _ in range(2))
    _, m, v = simdnorm.batch_normalization_training(x, scale, bias)
    for training, params, act in ((True, True, None), (True, False, None), (False, True, None), (True, True, "relu")):
        p = (scale, bias) if params else (None, None)

        def run():
            out = np.full(x.shape, np.nan, dtype)
            got = simdnorm.batch_normalization_backward(dy, x, m, v, *p, training=training, activation=act, out=out)
            assert got[0] is out
            return got

        plans = backward_plans(run)
        assert f" column_chunks={lanes}" in plans[-1], plans
        # (the sweep: with parameters, whose sums the group sums derive from (or none: global
        # statistics), x and dy along the lanes as grad_input: the flipped ones take the chunks' two
        # passes)
        assert (" sweep" in plans[-1]) == (sweep and params and not flipped), plans
        one = on_one_and_two_threads(run, threads)
        ref = bn_backward_ref(dy, x, m, v, *p, training=training, activation=act)
        context = f"{dtype_id(dtype)} training={training} params={params} act={act}"
        check_grad(one[0], ref.grad_input, ref.e_input, dtype=dtype, name="grad_input", context=context)
        if params:
            check_grad(one[1], ref.grad_scale, ref.e_scale, name="grad_scale", context=context)
            check_grad(one[2], ref.grad_bias, ref.e_bias, name="grad_bias", context=context)


# An activation whose derivative the kernels call out of line (silu, gelu) is taken once an element:
# grouped (batch norm of NCHW data with training statistics: a channel's planes), each group's
# sums pass saves its ga = dy * act'(pre) for its apply (saved-ga); else ga is written into
# grad_input first (float32 and float64 data), then the backward without the activation reads it
# there. Either
# way the result is, bit for bit, the identity backward of ga, which the fused add's gradient
# returns (fused_add of x's shape: ga itself, in float32 exactly): grad_input, the parameters'
# gradients, training and global statistics, in place over grad_output too. Relu (inline) and a
# call without grad_input keep the two passes; 16-bit data save their ga where grouped and keep
# the two passes where not (grad_input cannot hold ga in float32).
@pytest.mark.parametrize("dtype", [F32, F64, BF16], ids=dtype_id)
@pytest.mark.parametrize("act", ["silu", "gelu", "relu"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_out_of_line_derivative_taken_once(rng, threads, dtype, act, layout):
    shape = (3, 16, 7, 9) if layout == "nchw" else (3, 7, 9, 16)
    ca = 1 if layout == "nchw" else 3
    x = rand_values(rng, shape, dtype, scale=2.0) + np.asarray(0.5, dtype)
    dy = rand_values(rng, shape, dtype, scale=1.0)
    pdt = F64 if dtype == F64 else F32
    scale, bias = (rand_values(rng, (16,), pdt, scale=1.0) for _ in range(2))
    fa = rand_values(rng, shape, dtype, scale=1.0)
    once = act != "relu"
    for training in (True, False):
        kw = dict(channel_axis=ca, training=training)
        # (grouped: training statistics of NCHW data; global statistics take one pass, sums-write)
        saved = once and layout == "nchw" and training
        first = once and not saved and dtype != BF16
        _, m, v = simdnorm.batch_normalization_training(x, scale, bias, fused_add=fa, activation=act, channel_axis=ca)
        plans = backward_plans(lambda: simdnorm.batch_normalization_backward(
            dy, x, m, v, scale, bias, activation=act, fused_add=fa, **kw))
        assert ("saved-ga" in plans[-1]) == saved and ("derivative-first" in plans[-1]) == first, plans
        assert not any("derivative-first" in p or "saved-ga" in p for p in backward_plans(
            lambda: simdnorm.batch_normalization_backward(dy, x, m, v, scale, bias, activation=act, grad_input=False,
                                                          **kw))), plans
        if not once or dtype == BF16:
            continue
        for n in (1, 2):
            threads(n)
            gi, gs, gb, ga = simdnorm.batch_normalization_backward(dy, x, m, v, scale, bias, activation=act,
                                                                   fused_add=fa, **kw)
            want = simdnorm.batch_normalization_backward(ga, x, m, v, scale, bias, **kw)
            for name, a, b in zip(("grad_input", "grad_scale", "grad_bias"), (gi, gs, gb), want):
                np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{name} threads={n} {training=}")
            dy2 = dy.copy()  # in place over grad_output
            simdnorm.batch_normalization_backward(dy2, x, m, v, scale, bias, activation=act, fused_add=fa, out=dy2,
                                                  **kw)
            np.testing.assert_array_equal(bits(dy2), bits(gi), err_msg=f"in place threads={n} {training=}")


# Runs whose statistics and parameters are constant along them (NCHW planes) take silu' and gelu'
# inline (kernels/backward.h: run_derivative), other layouts through a call: the same arithmetic,
# so the same bits. A fused add of zeros (pre + 0 is pre) sends the same call to the gathered runs,
# whose derivative is the call's, and returns ga: the identity backward of that ga is, bit for bit,
# the inline call's gradients (grouped with training statistics, one pass with global ones; planes
# of a few lines and of many; 1 and 2 threads).
@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("shape", [(3, 16, 7, 9), (2, 8, 48, 40)], ids=["short_planes", "long_planes"])
def test_inline_derivative_bits_of_the_called_one(rng, threads, dtype, act, shape):
    x = rand_values(rng, shape, dtype, scale=2.0) + np.asarray(0.5, dtype)
    dy = rand_values(rng, shape, dtype, scale=1.0)
    pdt = F64 if dtype == F64 else F32
    scale, bias = (rand_values(rng, (shape[1],), pdt, scale=1.0) for _ in range(2))
    _, m, v = simdnorm.batch_normalization_training(x, scale, bias, activation=act)
    for training in (True, False):
        for n in (1, 2):
            threads(n)
            got = simdnorm.batch_normalization_backward(dy, x, m, v, scale, bias, activation=act, training=training)
            *_, ga = simdnorm.batch_normalization_backward(dy, x, m, v, scale, bias, activation=act,
                                                           fused_add=np.zeros_like(x), training=training)
            want = simdnorm.batch_normalization_backward(ga, x, m, v, scale, bias, training=training)
            for name, a, b in zip(("grad_input", "grad_scale", "grad_bias"), got, want):
                np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{name} threads={n} {training=}")


# Grouped, with silu or gelu each group's sums pass saves its ga (the compute type) for its apply,
# and the derivative is taken once an element ("saved-ga"): groups of runs (NCHW group norm, its
# channels reversed and every other row, MVN whose parameters repeat along the group, summed in
# chunks), layer norm's rows in blocks, and a group past the buffer's bound (2^18 elements), which
# 16-bit data take in two passes (float32 and float64: ga written first). Against the float64
# reference, 1 vs 2 threads bitwise; relu (inline) saves nothing.
@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64], ids=dtype_id)
@pytest.mark.parametrize("act", ["silu", "gelu", "relu"])
@pytest.mark.parametrize("case", ["group_nchw", "group_strided", "mvn_chunks", "layer_rows", "past_bound"])
def test_groups_save_their_ga(rng, threads, dtype, act, case):
    from training_reference import group_norm_backward_ref, layer_norm_backward_ref, mvn_backward_ref

    shape = {"group_nchw": (4, 32, 9, 11), "group_strided": (4, 32, 18, 11), "mvn_chunks": (6, 50, 60),
             "layer_rows": (64, 300), "past_bound": (2, 2, 400, 350)}[case]
    x = rand_values(rng, shape, dtype, scale=2.0) + np.asarray(0.5, dtype)
    dy = rand_values(rng, shape, dtype, scale=1.0)
    if case == "group_strided":
        x, dy = x[:, ::-1, ::2], dy[:, ::-1, ::2]
    if case == "mvn_chunks":
        # (each parameter reached by 50 runs a group: summed in chunks of 32 runs, kFlushRuns)
        sc, b = rand_values(rng, shape[-1:], F32, scale=1.0), rand_values(rng, shape[-1:], F32, scale=1.0)
        _, m, s = simdnorm.mean_variance_normalization(x, (1, 2), sc, b, activation=act, return_stats=True)
        run = lambda: simdnorm.mean_variance_normalization_backward(  # noqa: E731
            dy, x, (1, 2), m, s, sc, b, activation=act, out=np.full(x.shape, np.nan, dtype))
        ref = lambda: mvn_backward_ref(dy, x, (1, 2), m, s, sc, b, activation=act)  # noqa: E731
    elif case == "layer_rows":
        sc, b = rand_values(rng, shape[-1:], F32, scale=1.0), rand_values(rng, shape[-1:], F32, scale=1.0)
        _, m, s = simdnorm.layer_norm(x, sc, b, activation=act, return_stats=True)
        run = lambda: simdnorm.layer_norm_backward(  # noqa: E731
            dy, x, m, s, sc, b, activation=act, out=np.full(x.shape, np.nan, dtype))
        ref = lambda: layer_norm_backward_ref(dy, x, m, s, sc, b, activation=act)  # noqa: E731
    else:
        groups = 1 if case == "past_bound" else 8
        c = x.shape[1]
        sc, b = rand_values(rng, (c,), F32, scale=1.0), rand_values(rng, (c,), F32, scale=1.0)
        _, m, s = simdnorm.group_norm(x, groups, sc, b, activation=act, return_stats=True)
        run = lambda: simdnorm.group_norm_backward(  # noqa: E731
            dy, x, groups, m, s, sc, b, activation=act, out=np.full(x.shape, np.nan, dtype))
        ref = lambda: group_norm_backward_ref(dy, x, groups, m, s, sc, b, activation=act)  # noqa: E731
    plans = backward_plans(run)
    assert "groups groups=" in plans[-1], plans  # (a grouped plan, after derivative-first's prefix past the bound)
    assert ("saved-ga" in plans[-1]) == (act != "relu" and case != "past_bound"), plans
    res = at_one_and_two_threads(threads, run)
    check_grads(res, ref(), x=x, scale=sc, bias=b, want=("input", "scale", "bias"))


# Without statistics terms the sums pass writes grad_input as it goes (one pass: sums_write). Its
# grad_input must be the elementwise pass's, bit for bit (the call that asks for grad_input alone),
# and its parameter sums those of the sums pass alone (the call that asks for no grad_input), in
# the caches and from memory, for every loop that takes it: channels-last rows (lanes_sums), NCHW
# planes of a few lines (const_rows_sums_write) and longer (sums_run), strided runs, and a fused add
# with an activation (gathered runs, summed then written run by run). nhwc_lines: channels-last rows
# of whole lines whose grad_input starts 16 bytes past a line (streamed from memory: each row's
# first elements in a partial vector, then aligned ones).
@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("layout", ["nhwc", "nhwc_lines", "nchw", "nchw_long", "strided", "nhwc_fused_silu"])
@pytest.mark.parametrize("where", ["cache", "memory"])
def test_backward_sums_pass_writes_grad_input_without_statistics_terms(rng, threads, dtype, layout, where):
    from simdnorm import _core
    from training_reference import bn_backward_ref

    if where == "memory" and dtype in (F16, F64):
        pytest.skip("from memory: float32 and bfloat16 (the loops are the same for every dtype)")
    inner = {"nchw_long": (40, 40, 8), "nhwc_lines": (6, 10, 128)}.get(layout, (6, 10, 100))  # (planes of 1600: past kSumFlush)
    per = int(np.prod(inner))
    n = 2 if where == "cache" else _core.stream_threshold_bytes() // (3 * np.dtype(dtype).itemsize * per) + 2
    x = rand_values(rng, (n, *inner), dtype, scale=2.0) + np.asarray(3.0, dtype)
    dy = rand_values(rng, x.shape, dtype, scale=1.0)
    c = inner[-1]
    scale, bias, mean = (rand_values(rng, (c,), dtype, scale=1.0) for _ in range(3))
    var = (np.abs(rand_values(rng, (c,), dtype, scale=1.0)) + np.asarray(0.5, dtype)).astype(dtype)
    kw = {"channel_axis": -1, "training": False}
    if layout.startswith("nchw"):
        x, dy = (np.ascontiguousarray(a.transpose(0, 3, 1, 2)) for a in (x, dy))
        kw["channel_axis"] = 1
    elif layout == "strided":  # every other row, the channels reversed; grad_input laid out alike
        x, dy, kw["out"] = (np.concatenate([a, a], axis=2)[:, :, ::2, ::-1] for a in (x, dy, np.empty_like(x)))
    elif layout == "nhwc_fused_silu":
        kw.update(fused_add=rand_values(rng, x.shape, dtype, scale=1.0), activation="silu")
    elif layout == "nhwc_lines":
        buffer = np.empty(x.size + 64, dtype)
        start = (16 - buffer.ctypes.data % 64) % 64 // buffer.itemsize
        kw["out"] = buffer[start:start + x.size].reshape(x.shape)
        assert kw["out"].ctypes.data % 64 == 16
    kw.setdefault("out", np.empty_like(x))

    def call(**flags):
        out = kw.get("out") if flags.get("grad_input", True) else None
        args = {**kw, "out": out}
        if out is not None:
            out.fill(np.nan)  # (poisoned: every element must be written)
        res = simdnorm.batch_normalization_backward(dy, x, mean, var, scale, bias, **args, **flags)
        return tuple(r.copy() if r is out and r is not None else r for r in res)

    plans = backward_plans(lambda: call())
    assert "sums-write" in plans[-1], plans  # (a fused add's ga is a call of its own before, without sums)
    # (silu's ga, float32 and float64, is written into grad_input first, then read there in place:
    # derivative-first, not streamed)
    first = layout == "nhwc_fused_silu" and dtype in (F32, F64)
    assert ("derivative-first" in plans[-1]) == first, plans
    assert ("streaming-stores" in plans[-1]) == (where == "memory" and dtype in (F32, F64) and not first), plans
    assert all("sums-write" not in p for p in backward_plans(lambda: call(grad_scale=False, grad_bias=False))), plans
    threads(1)
    full = call()
    alone = call(grad_scale=False, grad_bias=False)[0]
    sums = call(grad_input=False, grad_scale=True, grad_bias=True)
    np.testing.assert_array_equal(bits(full[0]), bits(alone))
    np.testing.assert_array_equal(bits(full[1]), bits(sums[1]))
    np.testing.assert_array_equal(bits(full[2]), bits(sums[2]))
    threads(2)
    for a, b in zip(full, call()):
        if a is not None:
            np.testing.assert_array_equal(bits(a), bits(b))
    if where == "memory":  # (the same loops as in the caches, checked there against the reference)
        return
    ref = bn_backward_ref(dy, x, mean, var, scale, bias, **{k: v for k, v in kw.items() if k != "out"})
    check_grad(full[0], ref.grad_input, ref.e_input, dtype=dtype, name="grad_input", context=layout)
    check_grad(full[1], ref.grad_scale, ref.e_scale, name="grad_scale", context=layout)
    check_grad(full[2], ref.grad_bias, ref.e_bias, name="grad_bias", context=layout)


@pytest.mark.parametrize("op", ["instance_norm_nhwc", "bn_global_nchw"])
def test_backward_slabs_over_grad_output(rng, op):
    # grad_input written over grad_output (out=grad_output; over the input is refused), slab by
    # slab: each slab is summed before its grad_input overwrites it, and no slab reads another's
    # elements, so the result is the out-of-place call's, bit for bit
    from simdnorm import _core

    inner = (12, 10, 100) if op == "bn_global_nchw" else (16, 8, 64)
    n = _core.stream_threshold_bytes() // (3 * 4 * int(np.prod(inner))) + 3
    x = rand_values(rng, (n, *inner), F32, scale=2.0) + np.float32(3.0)
    dy = rand_values(rng, x.shape, F32, scale=1.0)
    c = inner[-1]
    scale, bias = (rand_values(rng, (c,), F32, scale=1.0) for _ in range(2))
    if op == "bn_global_nchw":
        x, dy = (np.ascontiguousarray(a.transpose(0, 3, 1, 2)) for a in (x, dy))
        mean = rand_values(rng, (c,), F32, scale=1.0)
        var = np.abs(rand_values(rng, (c,), F32, scale=1.0)) + np.float32(0.5)

        def call(dy, x, out):
            return simdnorm.batch_normalization_backward(dy, x, mean, var, scale, bias, training=False, out=out)
    else:
        _, mean, inv = simdnorm.instance_norm(x, scale, bias, channel_axis=-1, return_stats=True)

        def call(dy, x, out):
            return simdnorm.instance_norm_backward(dy, x, mean, inv, scale, bias, channel_axis=-1, out=out)

    want = call(dy, x, None)
    dyc = dy.copy()
    got = call(dyc, x, dyc)
    assert got[0] is dyc
    for a, b in zip(want, got):
        np.testing.assert_array_equal(bits(a), bits(b))


# Where the formula's grad_input takes no part of y (batch norm with given statistics: inv_std g;
# MVN without normalize_variance: g - M(g)), an infinite or NaN input element changes only what
# passes through y: grad_scale, and act'(pre) with an activation. Its grad_input is grad_output's
# (times the coefficients), not inf * 0. Every path that writes grad_input (NCHW planes, channels-last
# rows, rows, strided runs; written as summed or apart; grad_input alone), against the reference.
def _non_finite_layouts(shape, dtype):
    n, c, h, w = shape
    return {
        "nchw": lambda a: np.ascontiguousarray(a).astype(dtype),
        "nhwc": lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1)).astype(dtype).transpose(0, 3, 1, 2),
        "strided": lambda a: np.repeat(a.astype(dtype), 2, axis=3)[..., ::2],
    }


@DT
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "strided"])
@pytest.mark.parametrize("act", [None, "relu", "silu", "gelu"])
@pytest.mark.parametrize("params", ["both", "input_only"])
def test_non_finite_inputs_where_grad_input_takes_no_y(rng, threads, dtype, layout, act, params):
    from training_reference import mvn_backward_ref

    shape = (2, 24, 5, 7)
    base = rng.standard_normal(shape)
    put = _non_finite_layouts(shape, dtype)[layout]
    specials = [np.inf, -np.inf] + ([np.nan] if act is None else [])
    flat = rng.choice(base.size, size=3 * len(specials), replace=False)
    for k, i in enumerate(flat):
        base.flat[i] = specials[k % len(specials)]
    x, dy = put(base), put(rng.standard_normal(shape))
    sc = (rng.random(24) + 0.5).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    m = rng.standard_normal(24).astype(np.float32)
    v = (rng.random(24) + 0.5).astype(np.float32)
    flags = dict(grad_scale=False, grad_bias=False) if params == "input_only" else {}
    want = ("input",) if params == "input_only" else ("input", "scale", "bias")
    results = {1: [], 2: []}
    for n in (1, 2):
        threads(n)
        out = np.full_like(x, np.nan)
        got = simdnorm.batch_normalization_backward(dy, x, m, v, sc, b, training=False, activation=act, out=out,
                                                    **flags)
        check_grads(got, bn_backward_ref(dy, x, m, v, sc, b, training=False, activation=act), x=x, scale=sc,
                    bias=b, want=want, context=f"batch norm eval, {n} threads")
        assert np.isfinite(f64(got[0])).all(), "grad_input takes no y here"
        results[n].append(got)
        for axes in ((2, 3), (3,), (0, 2, 3)):
            s4 = sc.reshape(1, 24, 1, 1)
            b4 = b.reshape(1, 24, 1, 1)
            with quiet():
                mean = f64(x).mean(axis=axes, keepdims=True).astype(np.float32)
            got = simdnorm.mean_variance_normalization_backward(
                dy, x, axes, mean, None, s4, b4, normalize_variance=False, activation=act,
                out=np.full_like(x, np.nan), **flags)
            ref = mvn_backward_ref(dy, x, axes, mean, None, s4, b4, normalize_variance=False, activation=act)
            # (a group holding an infinite or NaN element has a non-finite mean, hence every y in it)
            check_grads(got, ref, x=x, scale=s4, bias=b4, want=want, context=f"MVN axes {axes}, {n} threads")
            results[n].append(got)
    for one, two in zip(results[1], results[2]):
        for a, c in zip(one, two):
            assert (a is None and c is None) or np.array_equal(bits(a), bits(c)), "1 vs 2 threads"


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("stats_shape", [(7,), (1,)])
def test_batch_norm_backward_of_a_1d_input_without_parameters(rng, training, stats_shape):
    # the forward op takes a 1-D input with 1-D statistics (elementwise, or one for all); its
    # backward must too, where no scale or bias says where the channels are: the statistics say
    x, g = rand_values(rng, (7,), np.float64), rand_values(rng, (7,), np.float64)
    mean = rand_values(rng, stats_shape, np.float64)
    var = np.abs(rand_values(rng, stats_shape, np.float64)) + 0.5
    out = np.full(7, np.nan)
    gi = simdnorm.batch_normalization_backward(g, x, mean, var, epsilon=1e-3, training=training, out=out)[0]
    u = 1 / np.sqrt(var + 1e-3)
    y = (x - mean) * u
    if not training:
        want = g * u
    elif stats_shape == (7,):  # each element its own group: M(g) = g, M(g y) = g y
        want = u * (g - g - y * g * y)
    else:
        want = u * (g - g.mean() - y * (g * y).mean())
    assert gi is out
    np.testing.assert_allclose(gi, want, rtol=1e-12, atol=1e-12)


@DT
@pytest.mark.parametrize("training", [True, False], ids=["training", "global"])
@pytest.mark.parametrize("layout", ["contiguous", "unaligned", "negative"])
def test_batch_norm_many_channels_against_reference(rng, threads, training, layout, dtype):
    """(N, C) batch norm with thousands of channels: the statistics and parameters folded in chunks
    (one-after-another float runs in one loop, others gathered), the coefficients in one loop, one
    partial's parameter sums taken as they are. Against the float64 reference with the parameters
    and statistics in each layout, 1 vs 2 threads bitwise, and bitwise as with compact ones."""
    n, c = 3, 2051  # (chunks of 256 and a partial one; vectors and a tail)
    x = rand_values(rng, (n, c), dtype, scale=2.0) + np.asarray(3.0, dtype)
    dy = rand_values(rng, (n, c), dtype, scale=1.0)
    pdt = np.float64 if dtype == F64 else np.float32
    compact = [rand_values(rng, (c,), pdt, scale=1.0) for _ in range(3)]
    compact.append(np.abs(rand_values(rng, (c,), pdt, scale=1.0)) + np.asarray(0.5, pdt))
    scale, bias, mean, var = (in_layout(a, layout) for a in compact)

    def run(scale=scale, bias=bias, mean=mean, var=var):
        return simdnorm.batch_normalization_backward(dy, x, mean, var, scale, bias, training=training)

    got = at_one_and_two_threads(threads, run, layout)
    check_grads(got, bn_backward_ref(dy, x, mean, var, scale, bias, training=training), x=x, scale=scale, bias=bias,
                context=layout)
    # (compact statistics take one float32 fold, the others the general one: the same bits)
    for a, b in zip(got, run(*compact)):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=layout)


@pytest.mark.parametrize("shape,ca", [((2, 3000), 1), ((4, 6, 5, 5), 1), ((3, 5, 7), -1)])
def test_parameter_sums_of_negative_zeros_are_positive_zeros(rng, threads, shape, ca):
    """A parameter's gradient that sums only -0 terms comes back +0, its sums started from +0 however
    the work is split (one partial's sums are taken as they are, several merged from +0)."""
    x = rand_values(rng, shape, F32)
    dy = np.full(shape, -0.0, F32)
    c = shape[ca]
    s = rand_values(rng, (c,), F32, scale=1.0)
    _, m, v = simdnorm.batch_normalization_training(x, s, s, channel_axis=ca)
    for n in (1, 2):
        threads(n)
        for training in (True, False):
            _, gs, gb = simdnorm.batch_normalization_backward(dy, x, m, v, s, s, channel_axis=ca, training=training)
            assert not np.signbit(gs).any() and not np.signbit(gb).any(), (n, training)
            assert not gs.any() and not gb.any()


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
@pytest.mark.parametrize("ca", [1, 3])
def test_backward_binding_splits_groups_itself(rng, dtype, ca):
    """_core.mvn_backward's groups (the torch route's group norm): the channel dim of x, grad_output,
    grad_input and the (C,) parameters split into (G, C/G) by the binding, the statistics as (N, G),
    give the bits of the same call on the split views; a split that cannot be is a ValueError."""
    from simdnorm import _core
    from simdnorm._api import group_split, split_view

    shape = (2, 6, 5, 4) if ca == 1 else (2, 5, 4, 6)
    x, dy = rand_values(rng, shape, dtype), rand_values(rng, shape, dtype)
    scale, bias = rand_values(rng, (6,), F32), rand_values(rng, (6,), F32)
    _, mean, inv_std = simdnorm.group_norm(x, 3, scale, bias, channel_axis=ca, return_stats=True)
    _, c, g, k, pshape, axes = group_split(x, 3, ca)
    common = (1e-5, True, True, False, (0, 0.0, 0.0), True, False)
    sshape = tuple(1 if d in axes else s for d, s in enumerate(split_view(x, ca, g, k).shape))
    want = [np.full(shape, np.nan, dtype), np.zeros(6, F32), np.zeros(6, F32)]
    _core.mvn_backward(split_view(x, ca, g, k), split_view(dy, ca, g, k), axes, mean.reshape(sshape),
                       inv_std.reshape(sshape), scale.reshape(pshape), bias.reshape(pshape), None,
                       split_view(want[0], ca, g, k), want[1], want[2], *common, -1, False, False)
    got = [np.full(shape, np.nan, dtype), np.zeros(6, F32), np.zeros(6, F32)]
    _core.mvn_backward(x, dy, axes, mean, inv_std, scale, bias, None, got[0], got[1], got[2], *common, ca, False,
                       False, g)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(bits(a), bits(b))
    for bad_groups, bad_ca, fused in ((4, ca, None), (0, ca, None), (3, -1, None), (3, ca, x)):
        with pytest.raises(ValueError, match="groups"):
            _core.mvn_backward(x, dy, axes, mean, inv_std, None, None, fused, got[0], None, None, *common, bad_ca,
                               False, False, bad_groups)
    with pytest.raises(ValueError, match="inv_std"):  # (statistics of another shape than (N, G))
        _core.mvn_backward(x, dy, axes, mean, inv_std[:, :2], scale, bias, None, got[0], None, None, *common, ca,
                           False, False, g)
