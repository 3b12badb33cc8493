"""The fuzzers' shared harness: the poisoned arena, the placement and filling of one call's arrays,
the calls of every op as data (so that a case can be run and printed as a repro from the same
description), and the checks against the float64 reference.

Two drivers use it: tests/test_fuzz.py (hypothesis, in process) and tests/fuzz_space.py (numpy
Generator from (seed, index), each case in a child process). A case is a shape and a dict `c` of
drawn choices; build_op(op, shape, c) turns it into an OpCase that runs and checks itself
(OpCase.execute) or prints itself as a self-contained Python snippet (OpCase.repro).

Every array of a call (input, parameters, out) is a strided view at some byte offset inside ONE
uint8 arena poisoned with an 8-byte pattern. After each call:

  * every byte of the arena outside out's elements is unchanged (padding, gaps inside strided
    views, the input and the parameters: no stray write, whatever the layout or the thread split);
  * out's elements hold the float64 reference (tests/reference.py) within its tolerance (an
    element left unwritten still holds the poison, which the reference rejects);
  * out=None gives np.empty_like's dtype, shape and order; out=... returns out; statistics match.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

import simdnorm
from cases import act_arg
from reference import (
    BF16,
    F32,
    F64,
    assert_like_empty_like,
    check_bn,
    check_close,
    check_mvn,
    compute_dtype,
    dtype_id,
    f64,
    mvn_terms,
)

PATTERN = np.array([0xA5, 0x5A, 0xC3, 0x3C, 0x96, 0x69, 0xF0, 0x0F], np.uint8)  # poison, 8-byte period
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# data kinds: (loc, scale) of the normal values of an input
DATA_KINDS = [(0.0, 1.0), (1.5, 2.0), (-20.0, 3.0), (300.0, 30.0), (0.0, 0.01)]

OUT_KINDS = ("new", "separate", "in_place", "overlap_input", "overlap_param")


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

    @property
    def total(self):
        return self.cursor + 64

    def build(self):
        total = self.total
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
# values (these two functions are also pasted, as they are, into every repro snippet)
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


def put_specials(rng, v, count, special_values):
    """Overwrite `count` random elements of v (in place) with values drawn from special_values."""
    if count and v.size:
        flat = v.reshape(-1)
        for i in rng.integers(0, flat.size, count):
            flat[i] = rng.choice(special_values)


def quiet():
    """The float64 references meet NaN and inf on purpose (specials): no numpy warnings for them."""
    return np.errstate(invalid="ignore", over="ignore", divide="ignore")


# ----------------------------------------------------------------------------------------------
# a call as data: run it, or print it
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arr:
    """An array of the arena, by region name, inside a Call's arguments."""
    name: str


@dataclass
class Call:
    """simdnorm.<func>(*args, **kwargs) with Arr placeholders; compiled: the op is built first with
    simdnorm.compile(<desc>(TensorDesc of each array argument (None stays None), desc_args...,
    **desc_kwargs)) and called with the arrays, out and return_stats."""
    func: str
    args: list
    kwargs: dict
    compiled: Optional[str] = None      # "BatchNormalizationDesc" / "MeanVarianceNormalizationDesc"
    desc_args: list = field(default_factory=list)    # after the input's TensorDesc (MVN: axes)
    desc_kwargs: dict = field(default_factory=dict)

    def invoke(self, views: dict):
        res = lambda a: views[a.name] if isinstance(a, Arr) else a
        args = [res(a) for a in self.args]
        kwargs = {k: res(v) for k, v in self.kwargs.items()}
        if self.compiled is None:
            return getattr(simdnorm, self.func)(*args, **kwargs)
        td = lambda a: None if a is None else simdnorm.TensorDesc(a.dtype, a.shape)
        x, params = args[0], args[1:]
        desc = getattr(simdnorm, self.compiled)(td(x), *self.desc_args, *map(td, params), **self.desc_kwargs)
        return simdnorm.compile(desc)(x, *params, **kwargs)

    def source(self) -> str:
        res = lambda a: a.name if isinstance(a, Arr) else literal(a)
        args = ", ".join([res(a) for a in self.args] + [f"{k}={res(v)}" for k, v in self.kwargs.items()])
        if self.compiled is None:
            return f"res = simdnorm.{self.func}({args})"
        td = lambda a: "None" if a is None else f"td({a.name})"
        dargs = ", ".join([td(a) for a in [self.args[0]]] + [literal(a) for a in self.desc_args]
                          + [td(a) for a in self.args[1:]]
                          + [f"{k}={literal(v)}" for k, v in self.desc_kwargs.items()])
        return (f"td = lambda a: simdnorm.TensorDesc(a.dtype, a.shape)\n"
                f"op = simdnorm.compile(simdnorm.{self.compiled}({dargs}))\n"
                f"res = op({args})")


def dtype_source(dt) -> str:
    dt = np.dtype(dt)
    return "ml_dtypes.bfloat16" if dt == BF16 else f"np.{dt.name}"


def literal(v) -> str:
    """Python source that evaluates to v (in a namespace with np, ml_dtypes and simdnorm)."""
    if isinstance(v, simdnorm.Activation):
        params = "".join(f", {k}={literal(float(p))}" for k, p in v.params.items())
        return f"simdnorm.Activation({v.name!r}{params})"
    if isinstance(v, np.ndarray):
        return f"np.array({v.tolist()!r}, np.{v.dtype.name})"
    if isinstance(v, np.generic):
        return f"np.{type(v).__name__}({v.item()!r})"
    if isinstance(v, (tuple, list)):
        items = ", ".join(literal(i) for i in v)
        if isinstance(v, tuple):
            return f"({items}{',' if len(v) == 1 else ''})"
        return f"[{items}]"
    if isinstance(v, float) and not np.isfinite(v):
        return f"float({str(v)!r})"
    return repr(v)


# ----------------------------------------------------------------------------------------------
# one case: placement, values, the call, the arena check
# ----------------------------------------------------------------------------------------------

class Case:
    """Lays out input, parameters and out in an arena, runs a call, checks the arena.

    c holds the drawn choices every op shares: dtype, x_layout, x_readonly, data, out_kind,
    out_layout, overlap_shift, threads, seed, gap, specials."""

    def __init__(self, c, shape, special_values=(np.nan,)):
        self.c = c
        self.special_values = special_values
        self.shape = tuple(shape)
        self.arena = Arena()
        self.params = {}  # name -> (shape, dtype, layout, kind)
        self.out_name = None
        self.placed = False
        self.returns_output = True  # the call returns an array like empty_like(x) or out (not moments)

    def param(self, name, shape, dtype, lay, kind):
        self.params[name] = (tuple(shape), np.dtype(dtype), lay, kind)

    def place(self):
        """Place the regions (deterministic: no memory is touched); resolve the out kind."""
        if self.placed:
            return
        c, a = self.c, self.arena
        x_lay = c["x_layout"]
        self.in_place = c["out_kind"] == "in_place" and (x_lay is None or not any(x_lay.zero))
        a.add("x", self.shape, c["dtype"], x_lay, c["gap"])
        for n, (shp, pdt, lay, _) in self.params.items():
            a.add(n, shp, pdt, lay, c["gap"])
        kind = c["out_kind"]
        if kind == "in_place" and not self.in_place:
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
            a.add("out", self.shape, c["dtype"], c["out_layout"], c["gap"], overlap=ov)
        self.out_kind = kind
        if self.in_place:
            self.out_name = "x"
        elif "out" in a.regions:
            self.out_name = "out"
        self.placed = True

    def _fill(self, views):
        """Values in the order the repro snippet writes them: input (and its specials), parameters."""
        rng = np.random.default_rng(self.c["seed"])
        xv = values(rng, self.shape, self.c["dtype"], self.c["data"])
        put_specials(rng, xv, self.c["specials"], self.special_values)
        fill(views["x"], xv)
        for n, (shp, pdt, _, pk) in self.params.items():
            fill(views[n], values(rng, shp, pdt, pk))

    def run(self, call: Call, ctx):
        self.place()
        c, a = self.c, self.arena
        views = a.build()
        self._fill(views)
        x = views["x"]
        out = views[self.out_name] if self.out_name else None
        # the overlapping placements wrote their values over each other: take what memory holds now
        x0 = np.array(x)
        p0 = {n: np.array(views[n]) for n in self.params}
        if c["x_readonly"] and not self.in_place:
            x.flags.writeable = False
        before = a.buf.copy()
        prev = simdnorm.set_num_threads(c["threads"])
        try:
            res = call.invoke(views)
        finally:
            simdnorm.set_num_threads(prev)
        full_ctx = (f"{ctx} {dtype_id(c['dtype'])} shape={self.shape} x.strides={x.strides} out={self.out_kind}"
                    f"{'' if out is None else ' out.strides=' + str(out.strides)} threads={c['threads']}")
        check_arena(a, before, self.out_name, full_ctx)
        if self.returns_output:
            y = res[0] if isinstance(res, tuple) else res
            if out is None:
                assert_like_empty_like(y, x0)
            else:
                assert y is out, "a call with out= must return out"
        return res, x0, p0, full_ctx

    def repro(self, call: Call) -> str:
        """A self-contained snippet: the arena with every array at its byte offset and strides, the
        same values, the call."""
        self.place()
        c, a = self.c, self.arena
        lines = ["import numpy as np, ml_dtypes, simdnorm", "",
                 inspect.getsource(values).rstrip(), "", inspect.getsource(put_specials).rstrip(), "",
                 f"rng = np.random.default_rng({c['seed']})",
                 f"raw = np.empty({a.total + 64}, np.uint8)",
                 f"buf = raw[(-raw.ctypes.data) % 64:][:{a.total}]  # 64-byte aligned arena",
                 f"buf[:] = np.resize(np.array({PATTERN.tolist()}, np.uint8), buf.size)  # poison"]
        for n, r in a.regions.items():
            lines.append(f"{n} = np.ndarray({r.shape}, {dtype_source(r.dtype)}, buffer=buf, offset={r.offset}, "
                         f"strides={r.strides})")
        lines.append(f"xv = values(rng, {self.shape}, {dtype_source(c['dtype'])}, {c['data']!r})")
        if c["specials"]:
            lines.append(f"put_specials(rng, xv, {c['specials']}, {literal(tuple(self.special_values))})")
        lines.append("if x.size: x[...] = xv")
        for n, (shp, pdt, _, pk) in self.params.items():
            lines.append(f"if {n}.size: {n}[...] = values(rng, {shp}, {dtype_source(pdt)}, {pk!r})")
        if c["x_readonly"] and not self.in_place:
            lines.append("x.flags.writeable = False")
        lines.append(f"simdnorm.set_num_threads({c['threads']})")
        lines.append(call.source())
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# statistics and the group-norm reference
# ----------------------------------------------------------------------------------------------

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


def group_reference(x0, g, scale, bias, ca, eps):
    """(z, zscale, mean, inv_std, grouped x) of group norm: x viewed as (N, G, C/G, spatial...)."""
    xs = np.moveaxis(f64(x0), ca, 1)
    n, ch = xs.shape[:2]
    vshape = (n, g, ch // g) + xs.shape[2:]
    pshape = (1, g, ch // g) + (1,) * (len(vshape) - 3)
    s = None if scale is None else f64(scale).reshape(pshape)
    b = None if bias is None else f64(bias).reshape(pshape)
    z, zs, mean, inv = mvn_terms(xs.reshape(vshape), tuple(range(2, len(vshape))), s, b, epsilon=eps)
    back = lambda a: np.moveaxis(a.reshape(xs.shape), 1, ca)
    return back(z), back(zs), mean.reshape(n, g), inv.reshape(n, g), xs.reshape(vshape)


# ----------------------------------------------------------------------------------------------
# the ops: (shape, c) -> OpCase
# ----------------------------------------------------------------------------------------------

@dataclass
class OpCase:
    case: Case
    call: Call
    ctx: str
    check: Callable[[Any, np.ndarray, dict, str], None]   # (result, x0, p0, ctx)

    def execute(self):
        res, x0, p0, ctx = self.case.run(self.call, self.ctx)
        self.check(res, x0, p0, ctx)

    def repro(self) -> str:
        return self.case.repro(self.call)


def build_bn(shape, c) -> OpCase:
    """c: + channel_axis, params {name: (rule "1d" / "same_rank" / "none", keep mask, "input" /
    "float32", layout)}, epsilon, act (name, params, as_object), compiled."""
    nd = len(shape)
    ca = c["channel_axis"]
    act, params, as_obj = c["act"]
    # +-inf inputs too, except where the float64 reference itself says NaN at infinity (inf/inf,
    # -inf * 0: softsign, and gelu/silu/hard_swish at -inf) while the limit is the right answer
    specials = (np.nan,) if act in ("softsign", "gelu", "silu", "hard_swish") else (np.nan, np.inf, -np.inf)
    case = Case(c, shape, special_values=specials)
    names = ("mean", "variance", "scale", "bias")
    for name in names:
        rule, keep, pdt, lay = c["params"][name]
        if rule == "none":
            continue
        pshape = (shape[ca % nd],) if rule == "1d" else tuple(s if k else 1 for s, k in zip(shape, keep))
        case.param(name, pshape, c["dtype"] if pdt == "input" else F32, lay, name)
    arg = lambda n: Arr(n) if n in case.params else None
    kw = dict(epsilon=c["epsilon"], activation=act_arg(act, params, as_object=as_obj), channel_axis=ca)
    case.place()
    out = Arr(case.out_name) if case.out_name else None
    if c["compiled"]:
        call = Call("compiled", [Arr("x")] + [arg(n) for n in names], dict(out=out),
                    compiled="BatchNormalizationDesc", desc_kwargs=kw)
    else:
        call = Call("batch_normalization", [Arr("x")] + [arg(n) for n in names], dict(kw, out=out))

    def check(y, x0, p0, ctx):
        with quiet():
            check_bn(y, x0, p0.get("mean"), p0.get("variance"), p0.get("scale"), p0.get("bias"),
                     epsilon=c["epsilon"], activation=act, act_params=params, channel_axis=ca, context=ctx)

    return OpCase(case, call, "batch_normalization" + (" compiled" if c["compiled"] else ""), check)


def build_mvn(shape, c) -> OpCase:
    """c: + axes (as spelled), norm_axes (sorted, non-negative), params {name: (shape, "input" /
    "float32", layout)}, normalize_mean, normalize_variance, epsilon, epsilon_mode, act,
    return_stats, compiled."""
    case = Case(c, shape)
    for name, (pshape, pdt, lay) in c["params"].items():
        case.param(name, pshape, c["dtype"] if pdt == "input" else F32, lay, name)
    act, params, as_obj = c["act"]
    kw = dict(normalize_mean=c["normalize_mean"], normalize_variance=c["normalize_variance"], epsilon=c["epsilon"],
              epsilon_mode=c["epsilon_mode"])
    activation = act_arg(act, params, as_object=as_obj)
    case.place()
    out = Arr(case.out_name) if case.out_name else None
    sb = [Arr(n) if n in case.params else None for n in ("scale", "bias")]
    if c["compiled"]:
        call = Call("compiled", [Arr("x")] + sb, dict(out=out, return_stats=c["return_stats"]),
                    compiled="MeanVarianceNormalizationDesc", desc_args=[c["axes"]],
                    desc_kwargs=dict(kw, activation=activation))
    else:
        call = Call("mean_variance_normalization", [Arr("x"), c["axes"]] + sb,
                    dict(kw, activation=activation, out=out, return_stats=c["return_stats"]))

    def check(res, x0, p0, ctx):
        y, stats = (res[0], res[1:]) if c["return_stats"] else (res, None)
        if x0.size == 0:
            assert y.shape == tuple(shape)
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

    return OpCase(case, call, f"mvn axes={c['axes']!r}" + (" compiled" if c["compiled"] else ""), check)


def build_moments(shape, c) -> OpCase:
    """c: + axes (as spelled), norm_axes (sorted, non-negative): simdnorm.moments, which writes
    nothing (the arena stays as it was) and returns count, mean and m2 in float64."""
    case = Case(c, shape)
    case.returns_output = False
    case.place()
    call = Call("moments", [Arr("x"), c["axes"]], {})
    axes = c["norm_axes"]
    kept = tuple(1 if d in axes else n for d, n in enumerate(shape))
    n = int(np.prod([shape[d] for d in axes]))

    def check(res, x0, p0, ctx):
        count, mean, m2 = res
        for name, a in (("count", count), ("mean", mean), ("m2", m2)):
            assert a.dtype == F64 and a.shape == kept, (name, a.dtype, a.shape, kept, ctx)
        assert (count == n).all(), f"count {count.ravel()[:4]} != {n} {ctx}"
        if x0.size == 0:
            return
        with quiet():
            xs = f64(x0)
            # The mean corrected once by the mean of the residuals: numpy's mean of 697 copies of 300.0
            # was 86 ulps off, and that error squared, times n, is an m2 past the bound below (a
            # constant group's m2 is 0; corrected, the reference's is too).
            want_mean = xs.mean(axis=axes, keepdims=True)
            want_mean = want_mean + (xs - want_mean).mean(axis=axes, keepdims=True)
            want_m2 = ((xs - want_mean) ** 2).sum(axis=axes, keepdims=True)
            # double sums of at most a few thousand terms: far inside these bounds. A constant group's
            # m2 is 0, where the reference's own rounding of the mean leaves n (ulp of the mean)^2.
            std = np.sqrt(want_m2 / n)
            scale = np.abs(want_mean) + std
            for name, got, want, tol in (("mean", mean, want_mean, 1e-10 * scale),
                                         ("m2", m2, want_m2, 1e-10 * want_m2 + n * (1e-14 * scale) ** 2 + 1e-300)):
                ok = (np.abs(got - want) <= tol) | (np.isnan(want) & np.isnan(got))
                assert ok.all(), (f"{name}: {np.sum(~ok)} of {ok.size} wrong; got {got[~ok][:4]} "
                                  f"want {want[~ok][:4]} {ctx}")

    return OpCase(case, call, f"moments axes={c['axes']!r}", check)


def build_convenience(shape, c) -> OpCase:
    """c: + which (layer_norm / rms_norm / instance_norm / group_norm), extra (axis; channel_axis;
    num_groups and channel_axis), params {name: (shape, "input" / "float32", layout)}, epsilon,
    act, return_stats."""
    nd = len(shape)
    which, extra = c["which"], c["extra"]
    case = Case(c, shape)
    for name, (pshape, pdt, lay) in c["params"].items():
        case.param(name, pshape, c["dtype"] if pdt == "input" else F32, lay, name)
    act, params, as_obj = c["act"]
    case.place()
    out = Arr(case.out_name) if case.out_name else None
    p = lambda n: Arr(n) if n in case.params else None
    kw = dict(epsilon=c["epsilon"], activation=act_arg(act, params, as_object=as_obj), out=out,
              return_stats=c["return_stats"])
    if which == "group_norm":
        call = Call(which, [Arr("x"), extra["num_groups"], p("scale"), p("bias")],
                    dict(channel_axis=extra["channel_axis"], **kw))
    elif which == "rms_norm":
        call = Call(which, [Arr("x"), p("scale")], dict(axis=extra["axis"], **kw))
    elif which == "layer_norm":
        call = Call(which, [Arr("x"), p("scale"), p("bias")], dict(axis=extra["axis"], **kw))
    else:
        call = Call(which, [Arr("x"), p("scale"), p("bias")], dict(channel_axis=extra["channel_axis"], **kw))

    def check(res, x0, p0, ctx):
        y, stats = (res[0], res[1:]) if c["return_stats"] else (res, None)
        if x0.size == 0:
            assert y.shape == tuple(shape)
            return
        s, b = p0.get("scale"), p0.get("bias")
        if which == "group_norm":
            ca = extra["channel_axis"] % nd
            with quiet():
                z, zs, mean, inv, xg = group_reference(x0, extra["num_groups"], s, b, ca, c["epsilon"])
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
            check_mvn(y, x0, axes, s, b, normalize_mean=nm, epsilon=c["epsilon"], activation=act,
                      act_params=params, context=ctx)
            if stats is not None:
                _, _, mean, inv = mvn_terms(x0, axes, normalize_mean=nm, epsilon=c["epsilon"])
                check_stats_nan_aware(stats, x0, axes, mean, inv, ctx)

    return OpCase(case, call, f"{which} {extra}", check)


def build_op(op, shape, c) -> OpCase:
    """op: "batch_normalization", "mean_variance_normalization", "moments" or one of the
    conveniences (which c["which"] names too)."""
    if op == "batch_normalization":
        return build_bn(shape, c)
    if op == "mean_variance_normalization":
        return build_mvn(shape, c)
    if op == "moments":
        return build_moments(shape, c)
    return build_convenience(shape, c)

