"""Hypothesis property tests for batch_normalization and mean_variance_normalization: random shapes
(incl. zero-size dims), memory layouts (axis order, positive/negative steps, zero strides, odd byte
offsets), parameter shapes by the ops' broadcasting rules, parameter dtypes, axes subsets and flags,
activations and out= layouts, all against the float64 reference. Example counts are bounded to keep
the suite fast."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import simdnorm
from cases import act_arg, activation_draws, param_values, rand_values, scale_bias_values, unaligned_empty
from reference import (
    DTYPES,
    F32,
    assert_like_empty_like,
    check_bn,
    check_mvn,
    dtype_id,
)

bn = simdnorm.batch_normalization
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw, ndim):
    """(axis order in memory, per-axis step, byte offset, zero-stride axes)."""
    perm = tuple(draw(st.permutations(range(ndim))))
    steps = tuple(draw(st.lists(st.sampled_from([1, 1, 1, 2, -1, -2, 3]), min_size=ndim, max_size=ndim)))
    offset = draw(st.sampled_from([0, 0, 1, 3]))
    zero = tuple(draw(st.lists(st.booleans(), min_size=ndim, max_size=ndim)))
    return perm, steps, offset, zero


def build(shape, dtype, layout, values=None, rng=None, writable=False):
    """An array of logical `shape` laid out per `layout`, holding `values` (or random ones)."""
    perm, steps, offset, zero = layout
    dtype = np.dtype(dtype)
    nd = len(shape)
    if values is None:
        values = rand_values(rng, shape, dtype)
    if not writable and any(zero) and all(s > 0 for s in shape):
        # zero strides: broadcast a slice that has size 1 on those axes
        small = values[tuple(slice(0, 1) if z else slice(None) for z in zero)]
        return np.broadcast_to(small, shape)
    mem_shape = tuple(max(shape[p], 1) * abs(steps[p]) for p in perm)
    if offset:
        base = unaligned_empty(mem_shape, dtype, offset=offset)
    else:
        base = np.empty(mem_shape, dtype)
    v = base.transpose(np.argsort(perm))  # logical axis order, memory order per perm
    sl = []
    for d in range(nd):
        st_ = steps[d]
        sl.append(slice(None, shape[d] * st_, st_) if st_ > 0 else slice(None, None, st_))
    v = v[tuple(sl)]
    v = v[tuple(slice(0, shape[d]) for d in range(nd))]
    assert v.shape == tuple(shape), (v.shape, shape)
    v[...] = values
    return v


@st.composite
def bn_cases(draw):
    ndim = draw(st.integers(1, 5))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    if draw(st.integers(0, 9)) == 0:  # sometimes a zero-size dim
        i = draw(st.integers(0, ndim - 1))
        shape = shape[:i] + (0,) + shape[i + 1:]
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    channel_axis = draw(st.integers(-ndim, ndim - 1)) if ndim > 1 else 1
    x_layout = draw(layouts(ndim))
    params = {}
    for name in ("mean", "variance", "scale", "bias"):
        kinds = ["same_rank"] if ndim == 1 else ["1d", "same_rank"]
        if name in ("scale", "bias"):
            kinds = kinds + ["none"]
        kind = draw(st.sampled_from(kinds))
        pdt = np.dtype(draw(st.sampled_from([dtype, F32])))
        mask = tuple(draw(st.lists(st.booleans(), min_size=ndim, max_size=ndim)))
        reverse = draw(st.booleans())
        params[name] = (kind, pdt, mask, reverse)
    act, act_params = draw(activation_draws())
    epsilon = draw(st.sampled_from([0.0, 1e-5, 1e-3, 0.5]))
    out_kind = draw(st.sampled_from(["none", "none", "layout", "in_place"]))
    out_layout = draw(layouts(ndim))
    seed = draw(st.integers(0, 2**32 - 1))
    return dict(shape=shape, dtype=dtype, channel_axis=channel_axis, x_layout=x_layout, params=params,
                act=act, act_params=act_params, epsilon=epsilon, out_kind=out_kind, out_layout=out_layout,
                seed=seed)


def negative_step_view(a):
    """The same values behind a view whose innermost step is negative."""
    base = np.empty(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    v = base[..., ::-2]
    v[...] = a
    return v


def make_param(rng, name, spec, shape, channel_axis):
    kind, pdt, mask, reverse = spec
    if kind == "none":
        return None
    if kind == "1d":
        c = shape[channel_axis % len(shape)]
        p = param_values(rng, name, (c,), pdt)
    else:
        p = param_values(rng, name, tuple(s if m else 1 for s, m in zip(shape, mask)), pdt)
    return negative_step_view(p) if reverse and p.size else p


@SETTINGS
@given(bn_cases())
def test_batch_norm_property(case):
    rng = np.random.default_rng(case["seed"])
    shape, dtype, ca = case["shape"], case["dtype"], case["channel_axis"]
    in_place = case["out_kind"] == "in_place"
    x = build(shape, dtype, case["x_layout"], rng=rng, writable=in_place)
    x0 = np.array(x)
    p = {n: make_param(rng, n, spec, shape, ca) for n, spec in case["params"].items()}
    act = act_arg(case["act"], case["act_params"])
    kw = dict(epsilon=case["epsilon"], activation=act, channel_axis=ca)
    if case["out_kind"] == "none":
        y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], **kw)
        assert_like_empty_like(y, x)
    else:
        out = x if in_place else build(shape, dtype, case["out_layout"],
                                       values=np.full(shape, np.nan, dtype), writable=True)
        y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], out=out, **kw)
        assert y is out
    assert y.shape == shape and y.dtype == dtype
    check_bn(y, x0, p["mean"], p["variance"], p["scale"], p["bias"], epsilon=case["epsilon"],
             activation=case["act"], act_params=case["act_params"], channel_axis=ca,
             context=f"{dtype_id(dtype)} shape={shape} x strides={x.strides}")


@st.composite
def mvn_cases(draw):
    ndim = draw(st.integers(1, 5))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    if draw(st.integers(0, 14)) == 0:
        i = draw(st.integers(0, ndim - 1))
        shape = shape[:i] + (0,) + shape[i + 1:]
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    axes = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
    axes = [a - ndim if draw(st.booleans()) else a for a in axes]  # negative spellings, any order
    params = {}
    for name in ("scale", "bias"):
        if draw(st.booleans()):
            params[name] = None
            continue
        lead = draw(st.integers(0, ndim - 1))  # leading dims dropped (at least one dim remains)
        keep = tuple(draw(st.lists(st.booleans(), min_size=ndim - lead, max_size=ndim - lead)))
        pshape = tuple(s if k else 1 for s, k in zip(shape[lead:], keep))
        params[name] = (pshape, np.dtype(draw(st.sampled_from([dtype, F32]))), draw(st.booleans()))
    act, act_params = draw(activation_draws())
    return dict(
        shape=shape, dtype=dtype, axes=tuple(axes), x_layout=draw(layouts(ndim)), params=params,
        normalize_mean=draw(st.booleans()), normalize_variance=draw(st.booleans()),
        epsilon=draw(st.sampled_from([1e-5, 1e-3, 0.5])), epsilon_mode=draw(st.sampled_from(["inside", "outside"])),
        act=act, act_params=act_params,
        out_kind=draw(st.sampled_from(["none", "none", "layout", "in_place"])), out_layout=draw(layouts(ndim)),
        return_stats=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))


def make_sb(rng, name, spec):
    if spec is None:
        return None
    pshape, pdt, reverse = spec
    v = scale_bias_values(rng, pshape, pdt, name)
    return negative_step_view(v) if reverse and v.size else v


@SETTINGS
@given(mvn_cases())
def test_mvn_property(case):
    rng = np.random.default_rng(case["seed"])
    shape, dtype, axes = case["shape"], case["dtype"], case["axes"]
    in_place = case["out_kind"] == "in_place"
    x = build(shape, dtype, case["x_layout"], values=(rng.normal(1.5, 2.0, size=shape)).astype(dtype),
              writable=in_place)
    x0 = np.array(x)
    scale, bias = (make_sb(rng, n, case["params"][n]) for n in ("scale", "bias"))
    kw = dict(normalize_mean=case["normalize_mean"], normalize_variance=case["normalize_variance"],
              epsilon=case["epsilon"], epsilon_mode=case["epsilon_mode"])
    act = act_arg(case["act"], case["act_params"])
    if case["out_kind"] == "none":
        out = None
    else:
        out = x if in_place else build(shape, dtype, case["out_layout"], values=np.full(shape, np.nan, dtype),
                                       writable=True)
    res = simdnorm.mean_variance_normalization(x, axes, scale, bias, activation=act, out=out,
                                               return_stats=case["return_stats"], **kw)
    if case["return_stats"]:
        y, m, inv = res
        stats = (m, inv)
    else:
        y, stats = res, None
    if out is None:
        assert_like_empty_like(y, x)
    else:
        assert y is out
    if x0.size == 0:
        assert y.shape == shape
        return
    check_mvn(y, x0, axes, scale, bias, activation=case["act"], act_params=case["act_params"], stats=stats,
              context=f"{dtype_id(dtype)} shape={shape} axes={axes} x strides={x.strides}", **kw)
