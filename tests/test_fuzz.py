"""Fuzzing harness: hypothesis draws shapes, memory layouts (axis order, steps of either sign, zero
strides, byte offsets, strides that are not multiples of the item size), dtypes, axes, parameters,
activations and `out` kinds; every array of a call (input, parameters, out) is a strided view at
some byte offset inside ONE poisoned uint8 arena. After each call:

  * every byte of the arena outside out's elements is unchanged (padding, gaps inside strided
    views, the input and the parameters: no stray write, whatever the layout or the thread split);
  * out's elements hold the float64 reference (tests/reference.py) within its tolerance (an
    element left unwritten still holds the poison, which the reference rejects);
  * out=None gives np.empty_like's dtype, shape and order; out=... returns out; statistics match.

out kinds: new, a separate view, the input itself (in place), a view overlapping the input's
memory, and a view whose memory holds one of the parameters (both must act as if there were no
overlap, SPEC §6). Covered: batch_normalization (both parameter rules, channel_axis, parameter
dtypes, activations, epsilon), mean_variance_normalization (any axes subset in any spelling,
normalize_mean/variance, epsilon_mode, scale/bias broadcast, return_stats), the compiled operators,
and layer_norm, rms_norm, instance_norm, group_norm. Rarely an input large enough to be split over
threads (1-3 threads drawn per example).

Examples per test: SIMDNORM_FUZZ_EXAMPLES (env) overrides the CI defaults below; see
docs/RELIABILITY.md for long runs and for replaying a failure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import simdnorm
from cases import act_arg, activation_draws
from reference import (
    DTYPES,
    F32,
    assert_like_empty_like,
    check_bn,
    check_close,
    check_mvn,
    compute_dtype,
    dtype_id,
    f64,
    mvn_terms,
)

_ENV = os.environ.get("SIMDNORM_FUZZ_EXAMPLES", "").strip()


def _examples(ci_default: int) -> int:
    return int(_ENV) if _ENV else ci_default


def fuzz_settings(ci_default: int):
    # CI (no SIMDNORM_FUZZ_EXAMPLES): the same examples every run, and a failure is reported as found
    # (shrinking can take minutes on a busy 2-core machine); a long run searches afresh and shrinks
    phases = tuple(Phase) if _ENV else (Phase.explicit, Phase.reuse, Phase.generate)
    return settings(max_examples=_examples(ci_default), deadline=None, print_blob=True, derandomize=not _ENV,
                    phases=phases,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


PATTERN = np.array([0xA5, 0x5A, 0xC3, 0x3C, 0x96, 0x69, 0xF0, 0x0F], np.uint8)  # poison, 8-byte period
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# ----------------------------------------------------------------------------------------------
# The arena: strided views at drawn byte offsets inside one poisoned buffer
# ----------------------------------------------------------------------------------------------

@dataclass
class Layout:
    perm: tuple            # memory order of the dims, outermost first
    steps: tuple           # per dim: element step (>= 1) ...
    signs: tuple           # ... and direction (+1 / -1)
    zero: tuple            # per dim: stride 0 (inputs and parameters only)
    odd_stride: bool       # innermost stride = itemsize * step + 1 byte (not a multiple of the itemsize)
    misalign: int          # byte offset of the region start from a 64-byte boundary


@st.composite
def layouts(draw, ndim, allow_zero=True):
    perm = tuple(draw(st.permutations(range(ndim))))
    steps = tuple(draw(st.lists(st.sampled_from([1, 1, 1, 2, 3]), min_size=ndim, max_size=ndim)))
    signs = tuple(draw(st.lists(st.sampled_from([1, 1, -1]), min_size=ndim, max_size=ndim)))
    if allow_zero and draw(st.integers(0, 4)) == 0:
        zero = tuple(draw(st.lists(st.booleans(), min_size=ndim, max_size=ndim)))
    else:
        zero = (False,) * ndim
    odd = draw(st.integers(0, 9)) == 0
    misalign = draw(st.sampled_from([0, 0, 0, 1, 2, 3, 4, 6, 8, 12, 16, 32]))
    return Layout(perm, steps, signs, zero, odd, misalign)


CONTIGUOUS = None  # Layout None: C order, aligned


def strides_for(shape, itemsize, lay: Optional[Layout]):
    nd = len(shape)
    if lay is None:
        lay = Layout(tuple(range(nd)), (1,) * nd, (1,) * nd, (False,) * nd, False, 0)
    strides = [0] * nd
    inner = itemsize * 1 + (1 if lay.odd_stride else 0)
    for d in reversed(lay.perm):
        n = max(shape[d], 1)
        strides[d] = inner * lay.steps[d] * lay.signs[d]
        inner = inner * lay.steps[d] * n
    for d in range(nd):
        if lay.zero[d]:
            strides[d] = 0
    return tuple(strides)


def span(shape, strides, itemsize):
    """(lo, hi): byte range of the elements relative to element [0, ..., 0]."""
    if any(n == 0 for n in shape):
        return 0, itemsize
    lo = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))
    hi = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides)) + itemsize
    return lo, hi


@dataclass
class Region:
    shape: tuple
    dtype: np.dtype
    strides: tuple
    offset: int            # byte offset of element [0, ..., 0] in the arena
    lo: int
    hi: int


@dataclass
class Arena:
    regions: dict = field(default_factory=dict)
    cursor: int = 64

    def add(self, name, shape, dtype, lay: Optional[Layout], gap=16, overlap=None):
        """Place a region; overlap=(other name, byte shift) puts it over another region's memory."""
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        st_ = strides_for(shape, dtype.itemsize, lay)
        lo, hi = span(shape, st_, dtype.itemsize)
        if overlap is not None:
            other = self.regions[overlap[0]]
            start = other.offset + other.lo + overlap[1]
            start = max(start, 0)
        else:
            start = (self.cursor + gap + 63) // 64 * 64 + (lay.misalign if lay is not None else 0)
        self.regions[name] = Region(shape, dtype, st_, start - lo, lo, hi)
        self.cursor = max(self.cursor, start + (hi - lo))

    def build(self):
        total = self.cursor + 64
        raw = np.empty(total + 64, np.uint8)
        base = (-raw.ctypes.data) % 64  # the arena itself starts on a 64-byte boundary
        self.buf = raw[base:base + total]
        self.buf[:] = np.resize(PATTERN, total)
        self.views = {n: np.ndarray(r.shape, r.dtype, buffer=self.buf, offset=r.offset, strides=r.strides)
                      for n, r in self.regions.items()}
        return self.views

    def element_mask(self, name):
        """Bytes of the arena that belong to the elements of region `name`."""
        r = self.regions[name]
        marker = np.zeros(self.buf.size, np.uint8)
        m = np.ndarray(r.shape, UINT[r.dtype.itemsize], buffer=marker, offset=r.offset, strides=r.strides)
        m[...] = np.iinfo(m.dtype).max
        return marker == 0xFF


def fill(view, values):
    """Write values into a (possibly zero-stride, non-contiguous) view; return what it now reads."""
    if view.size:
        view[...] = values
    return np.array(view)


def check_arena(arena: Arena, before: np.ndarray, out_name: Optional[str], ctx: str):
    changed = arena.buf != before
    if out_name is not None:
        changed &= ~arena.element_mask(out_name)
    if changed.any():
        where = np.flatnonzero(changed)
        owners = [n for n, r in arena.regions.items()
                  if r.offset + r.lo <= where[0] < r.offset + r.hi]
        raise AssertionError(f"{changed.sum()} bytes outside out were written, first at arena byte {where[0]} "
                             f"(inside regions {owners or 'none: padding'}) {ctx}")


# ----------------------------------------------------------------------------------------------
# drawing values and shapes
# ----------------------------------------------------------------------------------------------

def values(rng, shape, dtype, kind):
    if kind == "variance":
        v = rng.uniform(0.25, 4.0, size=shape)
    elif kind == "scale":
        v = rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    elif kind in ("mean", "bias"):
        v = rng.normal(0.0, 1.0, size=shape)
    else:  # data: (loc, scale)
        loc, sc = kind
        v = rng.normal(loc, sc, size=shape)
    return np.asarray(v).astype(dtype)


@st.composite
def shapes(draw, min_ndim=1, max_ndim=5, zero_ok=True):
    big = draw(st.integers(0, 24)) == 0  # now and then an input that the thread pool splits
    nd = draw(st.integers(min_ndim, max_ndim))
    if big:
        base = [2, 3, 131, 97][-nd:] if nd <= 4 else [2, 3, 5, 61, 47][:nd]
        shape = list(base) + [1] * (nd - len(base))
        shape = [max(1, s + draw(st.integers(-1, 1))) for s in shape]
    else:
        sizes = st.sampled_from([1, 1, 2, 2, 3, 4, 5, 7]) if nd > 3 else st.integers(1, 9)
        shape = list(draw(st.lists(sizes, min_size=nd, max_size=nd)))
        if draw(st.integers(0, 4)) == 0:  # one long dim: SIMD heads, bodies and tails
            shape[draw(st.integers(0, nd - 1))] = draw(st.integers(10, 70))
    if zero_ok and draw(st.integers(0, 19)) == 0:
        shape[draw(st.integers(0, nd - 1))] = 0
    return tuple(shape)


@st.composite
def activations(draw):
    name, params = draw(activation_draws(none_weight=4))
    as_object = draw(st.booleans())
    return name, params, as_object


DATA_KINDS = [(0.0, 1.0), (1.5, 2.0), (-20.0, 3.0), (300.0, 30.0), (0.0, 0.01)]


@st.composite
def common(draw, ndim):
    """What every case draws: dtype, input layout, data kind, out kind and layout, threads, seed."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    return dict(
        dtype=dtype,
        x_layout=draw(st.one_of(st.none(), layouts(ndim))),
        x_readonly=draw(st.booleans()),
        data=draw(st.sampled_from(DATA_KINDS)),
        out_kind=draw(st.sampled_from(["new", "new", "separate", "separate", "in_place", "overlap_input",
                                       "overlap_param"])),
        out_layout=draw(st.one_of(st.none(), layouts(ndim, allow_zero=False))),
        overlap_shift=draw(st.integers(-24, 24)),
        threads=draw(st.sampled_from([1, 2, 2, 3])),
        seed=draw(st.integers(0, 2 ** 32 - 1)),
        gap=draw(st.sampled_from([0, 1, 7, 16, 64])),
        # now and then a few NaN (and for batch norm +-inf) input elements: they must stay in their
        # element (batch norm) or normalization group (MVN), SPEC §2-§3
        specials=draw(st.integers(1, 3)) if draw(st.integers(0, 7)) == 0 else 0,
    )


def quiet():
    """The float64 references meet NaN and inf on purpose (specials): no numpy warnings for them."""
    return np.errstate(invalid="ignore", over="ignore", divide="ignore")


def check_stats_nan_aware(stats, x0, axes, mean, inv, ctx, dtype=None):
    """Statistics against the float64 reference (like reference.check_stats), where a group holding
    a NaN must have NaN statistics and the others must be within tolerance."""
    ct = compute_dtype(x0.dtype if dtype is None else dtype)
    rt = 1e-5 if ct == F32 else 1e-12
    got_mean, got_inv = stats
    kept = tuple(1 if d in axes else n for d, n in enumerate(x0.shape))
    xs = f64(x0)
    for name, got, want in (("mean", got_mean, mean), ("inv_std", got_inv, inv)):
        if want is None:
            assert got is None, f"{name} must be None {ctx}"
            continue
        assert got.dtype == ct and got.shape == kept, (name, got.dtype, got.shape, kept, ctx)
        g = f64(got)
        with quiet():
            if name == "mean":
                std = np.sqrt(np.mean((xs - mean) ** 2, axis=axes, keepdims=True))
                ok = np.abs(g - mean) <= rt * (np.abs(mean) + std) + 1e-300
            else:
                ok = (np.abs(g - want) <= 4 * rt * np.abs(want)) | (np.isinf(want) & (g == want))
        ok |= np.isnan(want) & np.isnan(g)
        assert ok.all(), f"{name}: {np.sum(~ok)} of {ok.size} wrong; got {g[~ok][:4]} want {want[~ok][:4]} {ctx}"


# ----------------------------------------------------------------------------------------------
# running one case
# ----------------------------------------------------------------------------------------------

class Case:
    """Lays out input, parameters and out in an arena, runs `call`, checks the arena."""

    def __init__(self, c, shape, special_values=(np.nan,)):
        self.c = c
        self.special_values = special_values
        self.shape = shape
        self.rng = np.random.default_rng(c["seed"])
        self.arena = Arena()
        self.params = {}  # name -> (shape, dtype, layout, kind)
        self.out_name = None

    def param(self, name, shape, dtype, lay, kind):
        self.params[name] = (tuple(shape), np.dtype(dtype), lay, kind)

    def run(self, call, ctx):
        c, a = self.c, self.arena
        dt = c["dtype"]
        x_lay = c["x_layout"]
        in_place = c["out_kind"] == "in_place" and (x_lay is None or not any(x_lay.zero))
        a.add("x", self.shape, dt, x_lay, c["gap"])
        for n, (shp, pdt, lay, _) in self.params.items():
            a.add(n, shp, pdt, lay, c["gap"])
        kind = c["out_kind"]
        if kind == "in_place" and not in_place:
            kind = "separate"
        if kind == "overlap_param" and not self.params:
            kind = "overlap_input"
        if kind in ("separate", "overlap_input", "overlap_param"):
            if kind == "overlap_input":
                ov = ("x", c["overlap_shift"])
            elif kind == "overlap_param":
                ov = (sorted(self.params)[c["seed"] % len(self.params)], c["overlap_shift"])
            else:
                ov = None
            a.add("out", self.shape, dt, c["out_layout"], c["gap"], overlap=ov)
        views = a.build()
        x = views["x"]
        xv = values(self.rng, self.shape, dt, c["data"])
        if c["specials"] and xv.size:
            flat = xv.reshape(-1)
            for i in self.rng.integers(0, flat.size, c["specials"]):
                flat[i] = self.rng.choice(self.special_values)
        fill(x, xv)
        for n, (shp, pdt, _, pk) in self.params.items():
            fill(views[n], values(self.rng, shp, pdt, pk))
        if in_place:
            out, self.out_name = x, "x"
        elif "out" in views:
            out, self.out_name = views["out"], "out"
        else:
            out = None
        # the overlapping placements wrote their values over each other: take what memory holds now
        x0 = np.array(x)
        p0 = {n: np.array(views[n]) for n in self.params}
        if c["x_readonly"] and not in_place:
            x.flags.writeable = False
        before = a.buf.copy()
        prev = simdnorm.set_num_threads(c["threads"])
        try:
            res = call(x, {n: views[n] for n in self.params}, out)
        finally:
            simdnorm.set_num_threads(prev)
        full_ctx = (f"{ctx} {dtype_id(dt)} shape={self.shape} x.strides={x.strides} out={kind}"
                    f"{'' if out is None else ' out.strides=' + str(out.strides)} threads={c['threads']}")
        check_arena(a, before, self.out_name, full_ctx)
        y = res[0] if isinstance(res, tuple) else res
        if out is None:
            assert_like_empty_like(y, x0)
        else:
            assert y is out, "a call with out= must return out"
        return res, x0, p0, full_ctx


# ----------------------------------------------------------------------------------------------
# batch normalization
# ----------------------------------------------------------------------------------------------

@st.composite
def bn_cases(draw):
    shape = draw(shapes())
    nd = len(shape)
    c = draw(common(nd))
    c["channel_axis"] = draw(st.integers(-nd, nd - 1)) if nd > 1 else draw(st.sampled_from([1, 0, -1]))
    c["params"] = {}
    for name in ("mean", "variance", "scale", "bias"):
        rules = ["same_rank"] if nd == 1 else ["1d", "1d", "same_rank"]
        if name in ("scale", "bias"):
            rules.append("none")
        rule = draw(st.sampled_from(rules))
        keep = tuple(draw(st.lists(st.booleans(), min_size=nd, max_size=nd)))
        pdt = draw(st.sampled_from(["input", "input", "float32"]))
        c["params"][name] = (rule, keep, pdt, draw(st.one_of(st.none(), layouts(1 if rule == "1d" else nd))))
    c["epsilon"] = draw(st.sampled_from([0.0, 1e-5, 1e-3, 0.5, 2.0]))
    c["act"] = draw(activations())
    c["compiled"] = draw(st.integers(0, 4)) == 0
    return shape, c


@fuzz_settings(150)
@given(bn_cases())
def test_fuzz_batch_normalization(case):
    shape, c = case
    nd = len(shape)
    ca = c["channel_axis"]
    act, params, as_obj = c["act"]
    # +-inf inputs too, except where the float64 reference itself says NaN at infinity (inf/inf,
    # -inf * 0: softsign, and gelu/silu/hard_swish at -inf) while the limit is the right answer
    specials = (np.nan,) if act in ("softsign", "gelu", "silu", "hard_swish") else (np.nan, np.inf, -np.inf)
    run = Case(c, shape, special_values=specials)
    for name, (rule, keep, pdt, lay) in c["params"].items():
        if rule == "none":
            continue
        pshape = (shape[ca % nd],) if rule == "1d" else tuple(s if k else 1 for s, k in zip(shape, keep))
        run.param(name, pshape, c["dtype"] if pdt == "input" else F32, lay, name)
    kw = dict(epsilon=c["epsilon"], activation=act_arg(act, params, as_object=as_obj), channel_axis=ca)

    def call(x, p, out):
        args = [p.get(n) for n in ("mean", "variance", "scale", "bias")]
        if c["compiled"]:
            td = lambda a: None if a is None else simdnorm.TensorDesc(a.dtype, a.shape)
            op = simdnorm.compile(simdnorm.BatchNormalizationDesc(td(x), *map(td, args), **kw))
            return op(x, *args, out=out)
        return simdnorm.batch_normalization(x, *args, out=out, **kw)

    y, x0, p0, ctx = run.run(call, "batch_normalization" + (" compiled" if c["compiled"] else ""))
    with quiet():
        check_bn(y, x0, p0.get("mean"), p0.get("variance"), p0.get("scale"), p0.get("bias"), epsilon=c["epsilon"],
                 activation=act, act_params=params, channel_axis=ca, context=ctx)


# ----------------------------------------------------------------------------------------------
# mean-variance normalization
# ----------------------------------------------------------------------------------------------

@st.composite
def sb_shape(draw, shape):
    """A scale/bias shape broadcastable to `shape` without enlarging it: fewer leading dims, any 1s."""
    nd = len(shape)
    lead = draw(st.integers(0, nd - 1))
    keep = draw(st.lists(st.booleans(), min_size=nd - lead, max_size=nd - lead))
    return tuple(s if k else 1 for s, k in zip(shape[lead:], keep))


@st.composite
def mvn_cases(draw):
    shape = draw(shapes(max_ndim=6))
    nd = len(shape)
    c = draw(common(nd))
    axes = draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True))
    spelled = [a - nd if draw(st.booleans()) else a for a in axes]
    form = draw(st.sampled_from(["tuple", "list", "int", "array", "numpy_ints"]))
    if form == "int" and len(spelled) == 1:
        c["axes"] = spelled[0]
    elif form == "list":
        c["axes"] = list(spelled)
    elif form == "array":
        c["axes"] = np.array(spelled, np.int64)
    elif form == "numpy_ints":
        c["axes"] = tuple(np.int32(a) for a in spelled)
    else:
        c["axes"] = tuple(spelled)
    c["norm_axes"] = tuple(sorted(a % nd for a in axes))
    c["params"] = {}
    for name in ("scale", "bias"):
        if draw(st.booleans()):
            pshape = draw(sb_shape(shape))
            pdt = draw(st.sampled_from(["input", "float32"]))
            c["params"][name] = (pshape, pdt, draw(st.one_of(st.none(), layouts(len(pshape)))))
    c["normalize_mean"] = draw(st.booleans())
    c["normalize_variance"] = draw(st.sampled_from([True, True, False]))
    c["epsilon"] = draw(st.sampled_from([1e-5, 1e-3, 0.5]))
    c["epsilon_mode"] = draw(st.sampled_from(["inside", "outside"]))
    c["act"] = draw(activations())
    c["return_stats"] = draw(st.booleans())
    c["compiled"] = draw(st.integers(0, 4)) == 0
    return shape, c


@fuzz_settings(150)
@given(mvn_cases())
def test_fuzz_mean_variance_normalization(case):
    shape, c = case
    run = Case(c, shape)
    for name, (pshape, pdt, lay) in c["params"].items():
        run.param(name, pshape, c["dtype"] if pdt == "input" else F32, lay, name)
    act, params, as_obj = c["act"]
    kw = dict(normalize_mean=c["normalize_mean"], normalize_variance=c["normalize_variance"], epsilon=c["epsilon"],
              epsilon_mode=c["epsilon_mode"])

    def call(x, p, out):
        s, b = p.get("scale"), p.get("bias")
        activation = act_arg(act, params, as_object=as_obj)
        if c["compiled"]:
            td = lambda a: None if a is None else simdnorm.TensorDesc(a.dtype, a.shape)
            op = simdnorm.compile(simdnorm.MeanVarianceNormalizationDesc(
                td(x), c["axes"], td(s), td(b), activation=activation, **kw))
            return op(x, s, b, out=out, return_stats=c["return_stats"])
        return simdnorm.mean_variance_normalization(x, c["axes"], s, b, activation=activation,
                                                    out=out, return_stats=c["return_stats"], **kw)

    res, x0, p0, ctx = run.run(call, f"mvn axes={c['axes']!r}" + (" compiled" if c["compiled"] else ""))
    y, stats = (res[0], res[1:]) if c["return_stats"] else (res, None)
    if x0.size == 0:
        assert y.shape == shape
        if stats is not None:
            kept = tuple(1 if d in c["norm_axes"] else n for d, n in enumerate(shape))
            assert all(s is None or s.shape == kept for s in stats)
        return
    with quiet():
        check_mvn(y, x0, c["norm_axes"], p0.get("scale"), p0.get("bias"), activation=act, act_params=params,
                  context=ctx, **kw)
        if stats is not None:
            _, _, mean, inv = mvn_terms(x0, c["norm_axes"], normalize_mean=c["normalize_mean"],
                                        normalize_variance=c["normalize_variance"], epsilon=c["epsilon"],
                                        epsilon_mode=c["epsilon_mode"])
            check_stats_nan_aware(stats, x0, c["norm_axes"], mean, inv, ctx)


# ----------------------------------------------------------------------------------------------
# the conveniences
# ----------------------------------------------------------------------------------------------

@st.composite
def convenience_cases(draw):
    which = draw(st.sampled_from(["layer_norm", "rms_norm", "instance_norm", "group_norm"]))
    if which == "group_norm":
        g, k = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        base = draw(shapes(min_ndim=2, max_ndim=5))
        nd = len(base)
        ca = draw(st.sampled_from([1, -1] + list(range(2, nd))))
        shape = list(base)
        shape[ca % nd] = g * k
        shape = tuple(shape)
        extra = dict(num_groups=g, channel_axis=ca)
    elif which == "instance_norm":
        shape = draw(shapes(min_ndim=3, max_ndim=5))
        nd = len(shape)
        extra = dict(channel_axis=draw(st.sampled_from([1, -1] + list(range(2, nd)))))
    else:
        shape = draw(shapes(max_ndim=5))
        nd = len(shape)
        extra = dict(axis=draw(st.integers(-nd, nd - 1)))
    nd = len(shape)
    c = draw(common(nd))
    c["which"] = which
    c["extra"] = extra
    c["params"] = {}
    names = ("scale",) if which == "rms_norm" else ("scale", "bias")
    for name in names:
        if draw(st.booleans()):
            if which in ("layer_norm", "rms_norm"):
                a = extra["axis"] % nd
                pshape = draw(sb_shape(shape[a:])) if draw(st.booleans()) else shape[a:]
            else:
                pshape = (shape[extra["channel_axis"] % nd],)
            pdt = draw(st.sampled_from(["input", "float32"]))
            c["params"][name] = (pshape, pdt, draw(st.one_of(st.none(), layouts(len(pshape)))))
    c["epsilon"] = draw(st.sampled_from([1e-5, 1e-3, 0.5]))
    c["act"] = draw(activations())
    c["return_stats"] = draw(st.booleans())
    return shape, c


def _group_reference(x0, g, scale, bias, ca, eps):
    xs = np.moveaxis(f64(x0), ca, 1)
    n, ch = xs.shape[:2]
    vshape = (n, g, ch // g) + xs.shape[2:]
    pshape = (1, g, ch // g) + (1,) * (len(vshape) - 3)
    s = None if scale is None else f64(scale).reshape(pshape)
    b = None if bias is None else f64(bias).reshape(pshape)
    z, zs, mean, inv = mvn_terms(xs.reshape(vshape), tuple(range(2, len(vshape))), s, b, epsilon=eps)
    back = lambda a: np.moveaxis(a.reshape(xs.shape), 1, ca)
    return back(z), back(zs), mean.reshape(n, g), inv.reshape(n, g), xs.reshape(vshape)


@fuzz_settings(120)
@given(convenience_cases())
def test_fuzz_conveniences(case):
    shape, c = case
    nd = len(shape)
    which, extra = c["which"], c["extra"]
    run = Case(c, shape)
    for name, (pshape, pdt, lay) in c["params"].items():
        run.param(name, pshape, c["dtype"] if pdt == "input" else F32, lay, name)
    act, params, as_obj = c["act"]
    kw = dict(epsilon=c["epsilon"], activation=act_arg(act, params, as_object=as_obj), return_stats=c["return_stats"])
    fn = getattr(simdnorm, which)

    def call(x, p, out):
        if which == "group_norm":
            return fn(x, extra["num_groups"], p.get("scale"), p.get("bias"), channel_axis=extra["channel_axis"],
                      out=out, **kw)
        if which == "rms_norm":
            return fn(x, p.get("scale"), axis=extra["axis"], out=out, **kw)
        if which == "layer_norm":
            return fn(x, p.get("scale"), p.get("bias"), axis=extra["axis"], out=out, **kw)
        return fn(x, p.get("scale"), p.get("bias"), channel_axis=extra["channel_axis"], out=out, **kw)

    res, x0, p0, ctx = run.run(call, f"{which} {extra}")
    y, stats = (res[0], res[1:]) if c["return_stats"] else (res, None)
    if x0.size == 0:
        assert y.shape == shape
        return
    s, b = p0.get("scale"), p0.get("bias")
    if which == "group_norm":
        ca = extra["channel_axis"] % nd
        with quiet():
            z, zs, mean, inv, xg = _group_reference(x0, extra["num_groups"], s, b, ca, c["epsilon"])
            check_close(y, z, zs, act, params, dtype=c["dtype"], context=ctx)
        if stats is not None:  # (N, G): compare as the (N, G, 1, ...) statistics of the grouped view
            gm, gi = stats
            assert gm.shape == mean.shape and gi.shape == inv.shape, (gm.shape, gi.shape, ctx)
            ones = (1,) * (xg.ndim - 2)
            check_stats_nan_aware((gm.reshape(gm.shape + ones), gi.reshape(gi.shape + ones)), xg,
                                  tuple(range(2, xg.ndim)), mean.reshape(mean.shape + ones),
                                  inv.reshape(inv.shape + ones), ctx, dtype=c["dtype"])
        return
    if which == "instance_norm":
        ca = extra["channel_axis"] % nd
        axes = tuple(d for d in range(1, nd) if d != ca)
        chan = lambda a: None if a is None else f64(a).reshape([-1 if d == ca else 1 for d in range(nd)])
        s, b = chan(s), chan(b)
        nm = True
    else:
        axes = tuple(range(extra["axis"] % nd, nd))
        nm = which == "layer_norm"
    with quiet():
        check_mvn(y, x0, axes, s, b, normalize_mean=nm, epsilon=c["epsilon"], activation=act, act_params=params,
                  context=ctx)
        if stats is not None:
            _, _, mean, inv = mvn_terms(x0, axes, normalize_mean=nm, epsilon=c["epsilon"])
            check_stats_nan_aware(stats, x0, axes, mean, inv, ctx)


# ----------------------------------------------------------------------------------------------
# the harness catches what it should (so that a green run means something)
# ----------------------------------------------------------------------------------------------

def test_arena_detects_stray_writes_and_unwritten_elements():
    c = dict(dtype=F32, x_layout=None, x_readonly=False, data=(0.0, 1.0), out_kind="separate", out_layout=None,
             overlap_shift=0, threads=1, seed=1, gap=7, specials=0)
    shape = (3, 5)

    def sloppy(x, p, out):  # writes one float just past the end of out
        simdnorm.layer_norm(x, out=out)
        r = run.arena.regions["out"]
        run.arena.buf[r.offset + r.hi:r.offset + r.hi + 4] = 0
        return out

    run = Case(dict(c), shape)
    with pytest.raises(AssertionError, match=r"bytes outside out were written"):
        run.run(sloppy, "sloppy")

    def lazy(x, p, out):  # leaves the last element unwritten (poisoned)
        y = simdnorm.layer_norm(x)
        out[:, :-1] = y[:, :-1]
        return out

    run = Case(dict(c), shape)
    y, x0, _, ctx = run.run(lazy, "lazy")
    with pytest.raises(AssertionError, match="out of tolerance"):
        check_mvn(y, x0, (1,), context=ctx)

