"""simdnorm on Dask arrays (SPEC section 11): the ops of sections 2-4 and
``batch_normalization_training``, lazily, chunk by chunk, results chunked as the input.

Each function checks its arguments by their dtypes and shapes with the validator the in-memory
functions use (the same messages, raised at once, not at compute time), then builds a graph:

- the normalized axes each in one chunk: one task per chunk runs the in-memory op, statistics and
  normalization in one read of the chunk;
- else the statistics first, a ``dask.array.reduction`` of :func:`simdnorm.moments` merged in
  float64 by Chan's formula in a fixed order (the same result on any scheduler), then one
  ``batch_normalization`` task per chunk with them. The input is read twice: persist it first
  (``x = x.persist()``) unless it is cheap to produce, or it is computed twice.

Every task runs its kernel on one simdnorm thread (``num_threads=`` to change it), so Dask's
threads (or a distributed worker's) and simdnorm's do not compete for the cores.
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

try:
    import dask.array as da
    from dask.base import tokenize as _tokenize
except ImportError as _e:  # pragma: no cover - the test extra installs dask
    raise ImportError("simdnorm.dask needs Dask: pip install 'simdnorm[dask]' (or dask[array])") from _e

from . import _api, _training
from ._activation import ActivationLike
from ._compile import as_param, plan_bn, plan_mvn
from ._descriptors import (
    BatchNormalizationDesc,
    DescriptorError,
    MeanVarianceNormalizationDesc,
    TensorDesc,
    channel_axis_rule,
    is_int,
    per_channel_rule,
    spatial_axes_rule,
    stats_dtype,
    trailing_axes_rule,
    value_text,
)
from ._moments import RECORD, inv_std_of, merge_record, moments, to_record
from ._runtime import MAX_THREADS, caller_threads

__all__ = [
    "batch_normalization",
    "mean_variance_normalization",
    "layer_norm",
    "rms_norm",
    "instance_norm",
    "group_norm",
    "batch_normalization_training",
]

_F32_MIN = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------------------------------
# arguments

def _no_out(fn: str, out: Any) -> None:
    if out is not None:
        raise TypeError(f"simdnorm.dask.{fn}: out= does not apply: the result is a new lazy dask array (write it "
                        "where it belongs with dask.array.store, to_zarr, ...)")


def _threads(fn: str, num_threads: Any) -> int:
    if num_threads is None:
        return 1
    if not is_int(num_threads):
        raise TypeError(f"simdnorm.dask.{fn}: num_threads: expected an int >= 1, got {type(num_threads).__name__}")
    n = int(num_threads)
    if not 1 <= n <= MAX_THREADS:
        raise ValueError(f"simdnorm.dask.{fn}: num_threads: {value_text(n)}; it must be 1 to {MAX_THREADS}")
    return n


def _lazy_kind(obj: Any) -> str:
    return (type(obj).__module__ or "").split(".")[0]


def _numpy_chunks(fn: str, a: "da.Array", name: str) -> None:
    if not isinstance(a._meta, np.ndarray) or isinstance(a._meta, np.ma.MaskedArray):
        raise TypeError(f"simdnorm.dask.{fn}: {name}: chunks of type {type(a._meta).__name__}; simdnorm runs on "
                        "numpy chunks (on the CPU)")


def _known(fn: str, a: "da.Array", name: str) -> None:
    if any(math.isnan(s) for s in a.shape):
        raise ValueError(f"simdnorm.dask.{fn}: {name}: unknown chunk sizes {a.chunks}; call "
                         f"{name}.compute_chunk_sizes() first")
    _numpy_chunks(fn, a, name)


class _Sized:
    """The input's dtype and shape as the in-memory validators read them, a size dask does not
    know (NaN: chunks from a boolean index) given as 1. Only dims whose sizes the op does not need
    may be unknown (_known_along), so no check depends on that stand-in."""

    def __init__(self, x: "da.Array") -> None:
        self.dtype, self.ndim = x.dtype, x.ndim
        self.shape = tuple(1 if math.isnan(n) else int(n) for n in x.shape)


def _known_along(fn: str, x: "da.Array", dims: Any, why: str) -> None:
    for d in sorted(set(dims)):
        if math.isnan(x.shape[d]):
            raise ValueError(f"simdnorm.dask.{fn}: input: unknown chunk sizes along axis {d} {x.chunks[d]}, whose "
                             f"size {why}; call input.compute_chunk_sizes() first")


def _spanned(x: "da.Array", params: Any, ca: Optional[int] = None) -> List[int]:
    """The dims of x along which parameters have sizes other than 1: a 1-D one's channel axis ca
    (ca None: aligned to the right, as MVN's are), a same-rank one's own dims."""
    dims = []
    for p in params:
        if p is None:
            continue
        if p.ndim == 1 and ca is not None:
            dims.append(ca)
            continue
        off = x.ndim - p.ndim
        dims += [off + i for i, n in enumerate(p.shape) if n != 1 and off + i >= 0]
    return dims


def _unknown(x: "da.Array") -> bool:
    return any(math.isnan(n) for n in x.shape)


def _params_known_along(fn: str, x: "da.Array", params: Any, channel_axis: Any = None) -> None:
    """Where x has unknown sizes: the parameters span none of those dims (a 1-D one placed at the
    channel axis when channel_axis is given, else aligned to the right)."""
    if not _unknown(x):
        return
    ca = None
    if channel_axis is not None and any(p is not None and p.ndim == 1 for p in params):
        if x.ndim == 1:
            ca = 0  # (a 1-D input's parameters run along it, whatever channel_axis says)
        elif not is_int(channel_axis) or not -x.ndim <= int(channel_axis) < x.ndim:
            return  # (the op's validation refuses it)
        else:
            ca = int(channel_axis) % x.ndim
    _known_along(fn, x, _spanned(x, params, ca), "the parameters need")


def _input(fn: str, x: Any) -> "da.Array":
    if not isinstance(x, da.Array):
        if _lazy_kind(x) == "xarray":
            raise TypeError(f"simdnorm.dask.{fn}: input: an xarray {type(x).__name__}; pass its .data (a dask "
                            "array) and wrap the result, or call through xarray.apply_ufunc(..., dask='allowed')")
        raise TypeError(f"simdnorm.dask.{fn}: input: expected a dask.array.Array, got {type(x).__name__}; "
                        f"simdnorm.{fn} takes numpy arrays and CPU tensors")
    _numpy_chunks(fn, x, "input")
    TensorDesc(x.dtype, _Sized(x).shape)._check("input", "data")
    return x


def _param(fn: str, p: Any, name: str, x: "da.Array") -> Any:
    """None, a dask array, or (anything else, converted as the in-memory functions do) an ndarray."""
    if p is None or isinstance(p, da.Array):
        if p is not None:
            _known(fn, p, name)
        return p
    if _lazy_kind(p) == "xarray":
        raise TypeError(f"simdnorm.dask.{fn}: {name}: an xarray {type(p).__name__}; pass its .data")
    return as_param(p, name, x)


def _td(p: Any) -> Optional[TensorDesc]:
    return None if p is None else TensorDesc(p.dtype, p.shape)


def _aligned(p: Any, shape: Tuple[int, ...], x: "da.Array") -> Any:
    """p (an ndarray or a dask array) seen with ``shape`` (its elements, dims of 1 added), as a dask
    array chunked like x along the dims it spans (so each block of x meets its own part of p)."""
    if p is None:
        return None
    chunks = tuple(x.chunks[d] if shape[d] == x.shape[d] else (shape[d],) for d in range(x.ndim))
    if isinstance(p, da.Array):  # (in one chunk first: dask's reshape fails on empty chunks)
        return p.rechunk(-1).reshape(shape).rechunk(chunks)
    return da.from_array(p.reshape(shape), chunks=chunks)


def _right(p: Any, x: "da.Array") -> Any:
    """MVN's rule: p's dims aligned to the right of x's."""
    return None if p is None else _aligned(p, (1,) * (x.ndim - p.ndim) + tuple(p.shape), x)


def _at(p: Any, x: "da.Array", ca: int) -> Any:
    """A 1-D per-channel p placed at axis ca; a same-rank p as it is."""
    if p is None:
        return None
    if p.ndim == x.ndim:
        return _aligned(p, tuple(p.shape), x)
    return _aligned(p, tuple(p.shape[0] if d == ca else 1 for d in range(x.ndim)), x)


def _meta(ndim: int, dtype: Any) -> np.ndarray:
    return np.empty((0,) * ndim, dtype)


def _spans(x: "da.Array", axes: Tuple[int, ...]) -> bool:
    """Whether the statistics need a reduction across chunks."""
    return any(x.numblocks[d] > 1 for d in axes)


# ----------------------------------------------------------------------------------------------------
# tasks (module-level functions: a distributed worker unpickles them by name)

def _mvn_task(xb, sb, bb, *, axes, nm, nv, eps, mode, act, stats, threads):
    with caller_threads(threads):
        return _api.mean_variance_normalization(xb, axes, sb, bb, normalize_mean=nm, normalize_variance=nv,
                                                epsilon=eps, epsilon_mode=mode, activation=act, return_stats=stats)


def _group_task(xb, sb, bb, *, k, ca, eps, act, stats, threads):
    c = xb.shape[ca]
    with caller_threads(threads):
        return _api.group_norm(xb, c // k, None if sb is None else sb.reshape(c),
                               None if bb is None else bb.reshape(c), epsilon=eps, channel_axis=ca,
                               activation=act, return_stats=stats)


def _bn_training_task(xb, sb, bb, fab, *, per_channel, eps, ca, act, threads):
    if per_channel:  # (C,) parameters arrive placed at the channel axis; the op takes them as (C,)
        sb = None if sb is None else sb.reshape(-1)
        bb = None if bb is None else bb.reshape(-1)
    with caller_threads(threads):
        return _training.batch_normalization_training(xb, sb, bb, epsilon=eps, channel_axis=ca, fused_add=fab,
                                                      activation=act)


def _bn_task(xb, mb, vb, sb, bb, *, eps, act, threads):
    with caller_threads(threads):
        return _api.batch_normalization(xb, mb, vb, sb, bb, epsilon=eps, activation=act)


def _moments_chunk(xb, axis, keepdims, computing_meta=False, threads=1):
    if computing_meta:
        return _meta(xb.ndim, RECORD)
    with caller_threads(threads):
        return to_record(moments(xb, axis))


def _moments_merge(rec, axis, keepdims, computing_meta=False):
    if computing_meta:
        return rec
    return merge_record(rec, axis)


def _group_moments(rec, *, k, ca):
    """Per-channel moments -> each channel holding its group's (the k channels of a group merged in
    order), so that the normalize step takes them as per-channel statistics."""
    n = rec.shape[ca]
    shape = rec.shape[:ca] + (n // k, k) + rec.shape[ca + 1:]
    merged = merge_record(rec.reshape(shape), (ca + 1,))
    return np.repeat(merged.reshape(rec.shape[:ca] + (n // k,) + rec.shape[ca + 1:]), k, axis=ca)


def _variance(rec):
    n = rec["count"]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n > 0, rec["m2"] / np.where(n > 0, n, 1.0), np.nan)


def _second(rec, nm):
    """The second moment MVN divides by: about the mean, or (normalize_mean=False) about 0."""
    var = _variance(rec)
    return var if nm else var + rec["mean"] * rec["mean"]


def _quiet(fn):
    """fn under np.errstate(all="ignore"): the numpy arithmetic of a task (inf, NaN, a float32
    overflow) warns where the in-memory ops' kernels give the same values silently."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)
    return run


@_quiet
def _mean_stat(rec, *, sdt):
    return np.where(rec["count"] > 0, rec["mean"], np.nan).astype(sdt)  # (of no elements: NaN, as in memory)


@_quiet
def _inv_std_stat(rec, *, nm, eps, outside, sdt):
    return inv_std_of(_second(rec, nm), eps, outside).astype(sdt)


@_quiet
def _variance_stat(rec, *, sdt):
    return _variance(rec).astype(sdt)


@_quiet
def _normalize_task(xb, rec, sb, bb, fab, *, nm, nv, eps, outside, act, threads):
    """One chunk normalized with statistics merged from all chunks: batch norm's kernel with
    shift = mean and variance (and epsilon) chosen so that 1 / sqrt(variance + epsilon) is MVN's
    1 / std (float64 until rounded to the parameters' type)."""
    sdt = stats_dtype(xb.dtype)
    shift = rec["mean"] if nm else np.zeros(rec.shape)
    if not nv:
        var, e = np.ones(rec.shape), 0.0
    elif outside:
        var, e = (np.sqrt(_second(rec, nm)) + eps) ** 2, 0.0
    else:
        var, e = _second(rec, nm), eps
    finite = np.isfinite(var) & (var != 0)
    in_range = sdt != np.float32 or bool(np.all((np.abs(var[finite]) >= _F32_MIN) & (np.abs(var[finite]) <= _F32_MAX)))
    # (outside the root, (std + epsilon) ** 2 overflows double past epsilon ~1e154, where 1 / it is not 0)
    in_range = in_range and not (outside and np.isinf(var).any())
    with caller_threads(threads):
        if fab is None and in_range:
            return _api.batch_normalization(xb, shift.astype(sdt), var.astype(sdt), sb, bb, epsilon=e, activation=act)
        # A fused add, or a variance the statistics' type cannot hold (data spread below ~1e-19 in
        # float32): the same terms from 1 / std in float64, in the compute type, then the activation.
        inv = inv_std_of(_second(rec, nm), eps, True) if outside else inv_std_of(var, e, False)
        return _composed(xb, shift, inv, sb, bb, fab, act)


@_quiet
def _composed(xb, shift, inv, sb, bb, fab, act):
    """act(scale * (x - shift) * inv + bias + fused_add) in the compute type, rounded once at the end
    (the in-memory batch_normalization_training's way for a fused add)."""
    sdt = stats_dtype(xb.dtype)
    pre = np.subtract(xb, shift.astype(sdt), dtype=sdt)
    pre *= inv.astype(sdt)
    if sb is not None:
        np.multiply(pre, sb, out=pre, casting="unsafe")
    if bb is not None:
        np.add(pre, bb, out=pre, casting="unsafe")
    if fab is not None:
        np.add(pre, fab, out=pre, casting="unsafe")
    if act is not None:  # act(1 * (pre - 0) / sqrt(1 + 0) + 0) is act(pre), in place
        one = np.ones((1,) * pre.ndim, sdt)
        _api.batch_normalization(pre, one * 0, one, epsilon=0.0, activation=act, out=pre)
    return pre if pre.dtype == xb.dtype else pre.astype(xb.dtype)


# ----------------------------------------------------------------------------------------------------
# graphs

def _item(t, *, i, at=None, ndim=0):
    """Item i of a task's tuple; with ``at``, its dims placed at those axes of ndim (the others 1)."""
    a = t[i]
    if at is not None:
        shape = [1] * ndim
        for j, d in enumerate(at):
            shape[d] = a.shape[j]
        a = a.reshape(shape)
    return a


def _tuple_outputs(tmp: "da.Array", outputs: List[Optional[Dict[str, Any]]]) -> tuple:
    """The items of the tuples tmp's tasks return (an in-memory op's result and statistics), each
    a dask array with its own chunks (map_blocks arguments; None: that item is None). The chunks
    have tmp's dims: statistics of fewer dims come as placed by _item's ``at`` and are squeezed."""
    arrays = []
    for i, spec in enumerate(outputs):
        if spec is None:
            arrays.append(None)
            continue
        spec = dict(spec)
        squeeze = spec.pop("squeeze", None)
        a = tmp.map_blocks(_item, i=i, at=spec.pop("at", None), ndim=tmp.ndim, **spec)
        arrays.append(a if squeeze is None else a.squeeze(axis=squeeze))
    return tuple(arrays)


def _stats_spec(x: "da.Array", axes: Tuple[int, ...], sdt: Any) -> Dict[str, Any]:
    """map_blocks arguments of keepdims statistics from a per-chunk tuple (axes each in one chunk)."""
    return dict(chunks=tuple((1,) if d in axes else x.chunks[d] for d in range(x.ndim)), dtype=sdt,
                meta=_meta(x.ndim, sdt))


def _moments_of(x: "da.Array", axes: Tuple[int, ...], threads: int) -> "da.Array":
    """The merged Moments of x over axes, as a keepdims dask array of RECORD (count, mean, m2)."""
    return da.reduction(x, functools.partial(_moments_chunk, threads=threads), _moments_merge,
                        combine=_moments_merge, axis=axes, keepdims=True, dtype=RECORD, concatenate=True,
                        meta=_meta(x.ndim, RECORD), name="simdnorm-moments")


def _map_blocks(func: Any, *args: Any, prefix: str, **kw: Any) -> "da.Array":
    """da.map_blocks with its keys named prefix-<hash of the arguments>, as token=prefix names
    them: dask 2024.x deprecates token= (a FutureWarning a call), later versions take it again;
    name= means the whole name in all of them."""
    return da.map_blocks(func, *args, name=f"{prefix}-{_tokenize(func, *args, **kw)}", **kw)


def _normalized(x, rec, s, b, fa, *, nm, nv, eps, outside, act, threads, prefix):
    return _map_blocks(_normalize_task, x, rec, s, b, fa, nm=nm, nv=nv, eps=eps, outside=outside, act=act,
                       threads=threads, dtype=x.dtype, meta=x._meta, prefix=prefix)


def _mvn_graph(fn, x, axes, s, b, *, nm, nv, eps, mode, act, return_stats, threads):
    """MVN over axes with full-rank aligned scale and bias (dask arrays or None)."""
    sdt = stats_dtype(x.dtype)
    prefix = f"simdnorm-{fn}"
    if not (nm or nv) or not _spans(x, axes):
        kw = dict(axes=axes, nm=nm, nv=nv, eps=eps, mode=mode, act=act, threads=threads)
        if not return_stats:
            return _map_blocks(_mvn_task, x, s, b, stats=False, dtype=x.dtype, meta=x._meta, prefix=prefix, **kw)
        tmp = _map_blocks(_mvn_task, x, s, b, stats=True, dtype=x.dtype, meta=x._meta, prefix=prefix, **kw)
        spec = _stats_spec(x, axes, sdt)
        return tuple(_tuple_outputs(tmp, [dict(dtype=x.dtype, meta=x._meta), spec if nm else None,
                                             spec if nv else None]))
    outside = mode == "outside"
    rec = _moments_of(x, axes, threads)
    out = _normalized(x, rec, s, b, None, nm=nm, nv=nv, eps=eps, outside=outside, act=act, threads=threads,
                      prefix=prefix)
    if not return_stats:
        return out
    meta = _meta(x.ndim, sdt)
    mean = rec.map_blocks(_mean_stat, sdt=sdt, dtype=sdt, meta=meta) if nm else None
    inv = rec.map_blocks(_inv_std_stat, nm=nm, eps=eps, outside=outside, sdt=sdt, dtype=sdt, meta=meta) if nv else None
    return out, mean, inv


def _check_flag(fn: str, name: str, v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise TypeError(f"simdnorm.dask.{fn}: {name}: expected a bool, got {type(v).__name__} ({value_text(v)})")


def _mvn_plan(x, axes, s, b, nm, nv, epsilon, epsilon_mode, activation):
    """The in-memory op's validation, on dtypes and shapes: (axes, epsilon, epsilon_mode)."""
    info = MeanVarianceNormalizationDesc(TensorDesc(x.dtype, _Sized(x).shape), axes, _td(s), _td(b), normalize_mean=nm,
                                         normalize_variance=nv, epsilon=epsilon, epsilon_mode=epsilon_mode,
                                         activation=activation)._validated()
    plan = plan_mvn(info)
    return plan[0], plan[3], "outside" if plan[6] else "inside"


# ----------------------------------------------------------------------------------------------------
# the functions

_COMMON = """

    Takes and returns dask arrays (the result chunked as ``x``; scale and bias may be numpy or
    dask arrays); ``num_threads`` is the simdnorm threads each task uses (default 1: Dask runs
    the tasks in parallel). Statistics, when returned, are float32 (float64 for float64 data)
    dask arrays. ``out=`` does not apply (TypeError). Arguments are checked at once, by the rules
    and messages of the in-memory function."""


def _public(twin: str) -> Any:
    """A public function: its docstring after the in-memory twin's, and its errors on an input of
    unknown sizes naming that input's shape."""
    def wrap(fn: Any) -> Any:
        if fn.__doc__ is not None:  # (None under python -OO)
            fn.__doc__ = f"Lazy :func:`simdnorm.{twin}` of a dask array.\n" + fn.__doc__ + _COMMON

        @functools.wraps(fn)
        def call(x: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(x, *args, **kwargs)
            except DescriptorError as e:  # (the validators read unknown sizes as 1: _Sized)
                if isinstance(x, da.Array) and _unknown(x):
                    raise type(e)(f"{e} (the input's shape {x.shape}: its unknown sizes read as 1 here)") from None
                raise
        return call
    return wrap


@_public("batch_normalization")
def batch_normalization(x: Any, mean: Any, variance: Any, scale: Any = None, bias: Any = None, *,
                        epsilon: float = 1e-5, activation: ActivationLike = None, channel_axis: int = 1,
                        num_threads: Optional[int] = None, out: Any = None) -> Any:
    """
    One task per chunk, with the parameters' matching parts ((C,) parameters placed at
    ``channel_axis``)."""
    fn = "batch_normalization"
    _no_out(fn, out)
    threads = _threads(fn, num_threads)
    x = _input(fn, x)
    params = [_param(fn, p, n, x) for p, n in ((mean, "mean"), (variance, "variance"), (scale, "scale"),
                                               (bias, "bias"))]
    _params_known_along(fn, x, params, channel_axis)
    desc = BatchNormalizationDesc(TensorDesc(x.dtype, _Sized(x).shape), *map(_td, params), epsilon=epsilon,
                                  activation=activation, channel_axis=channel_axis)
    eps, _, ca = plan_bn(desc._validated())
    m, v, s, b = (_at(p, x, ca) for p in params)
    return _map_blocks(_bn_task, x, m, v, s, b, eps=eps, act=activation, threads=threads, dtype=x.dtype,
                       meta=x._meta, prefix="simdnorm-batch_normalization")


@_public("mean_variance_normalization")
def mean_variance_normalization(x: Any, axes: Any, scale: Any = None, bias: Any = None, *,
                                normalize_mean: bool = True, normalize_variance: bool = True,
                                epsilon: float = 1e-5, epsilon_mode: str = "inside",
                                activation: ActivationLike = None, return_stats: bool = False,
                                num_threads: Optional[int] = None, out: Any = None) -> Any:
    """
    Over ``axes`` each in one chunk: one task per chunk. Over axes split into several chunks: the
    statistics by a reduction of :func:`simdnorm.moments`, then a task per chunk; persist ``x``
    first unless it is cheap to compute twice."""
    fn = "mean_variance_normalization"
    _no_out(fn, out)
    threads = _threads(fn, num_threads)
    stats = _check_flag(fn, "return_stats", return_stats)
    x = _input(fn, x)
    s, b = _param(fn, scale, "scale", x), _param(fn, bias, "bias", x)
    _params_known_along(fn, x, (s, b))
    axes_t, eps, mode = _mvn_plan(x, axes, s, b, normalize_mean, normalize_variance, epsilon, epsilon_mode, activation)
    return _mvn_graph(fn, x, axes_t, _right(s, x), _right(b, x), nm=bool(normalize_mean), nv=bool(normalize_variance),
                      eps=eps, mode=mode, act=activation, return_stats=stats, threads=threads)


@_public("layer_norm")
def layer_norm(x: Any, scale: Any = None, bias: Any = None, *, axis: int = -1, epsilon: float = 1e-5,
               activation: ActivationLike = None, return_stats: bool = False, num_threads: Optional[int] = None,
               out: Any = None) -> Any:
    """
    Over the dims ``axis .. ndim-1``; statistics shaped like ``x`` with those dims kept as 1."""
    fn = "layer_norm"
    _no_out(fn, out)
    threads = _threads(fn, num_threads)
    stats = _check_flag(fn, "return_stats", return_stats)
    x = _input(fn, x)
    s, b = _param(fn, scale, "scale", x), _param(fn, bias, "bias", x)
    _params_known_along(fn, x, (s, b))
    axes_t, eps, _ = _mvn_plan(x, trailing_axes_rule(_Sized(x), axis), s, b, True, True, epsilon, "inside", activation)
    return _mvn_graph(fn, x, axes_t, _right(s, x), _right(b, x), nm=True, nv=True, eps=eps, mode="inside",
                      act=activation, return_stats=stats, threads=threads)


@_public("rms_norm")
def rms_norm(x: Any, scale: Any = None, *, axis: int = -1, epsilon: float = 1e-5, activation: ActivationLike = None,
             return_stats: bool = False, num_threads: Optional[int] = None, out: Any = None) -> Any:
    """
    ``x / sqrt(mean(x**2) + epsilon) * scale`` over the dims ``axis .. ndim-1``; with
    ``return_stats``, ``(out, None, inv_rms)``."""
    fn = "rms_norm"
    _no_out(fn, out)
    threads = _threads(fn, num_threads)
    stats = _check_flag(fn, "return_stats", return_stats)
    x = _input(fn, x)
    s = _param(fn, scale, "scale", x)
    _params_known_along(fn, x, (s,))
    axes_t, eps, _ = _mvn_plan(x, trailing_axes_rule(_Sized(x), axis), s, None, False, True, epsilon, "inside",
                               activation)
    return _mvn_graph(fn, x, axes_t, _right(s, x), None, nm=False, nv=True, eps=eps, mode="inside", act=activation,
                      return_stats=stats, threads=threads)


@_public("instance_norm")
def instance_norm(x: Any, scale: Any = None, bias: Any = None, *, epsilon: float = 1e-5, channel_axis: int = 1,
                  activation: ActivationLike = None, return_stats: bool = False, num_threads: Optional[int] = None,
                  out: Any = None) -> Any:
    """
    Each (n, c) over the spatial dims; scale and bias of shape (C,)."""
    fn = "instance_norm"
    _no_out(fn, out)
    threads = _threads(fn, num_threads)
    stats = _check_flag(fn, "return_stats", return_stats)
    x = _input(fn, x)
    s, b = _param(fn, scale, "scale", x), _param(fn, bias, "bias", x)
    ca = channel_axis_rule(_Sized(x), channel_axis, "instance_norm")
    axes = spatial_axes_rule(_Sized(x), ca)
    _params_known_along(fn, x, (s, b), ca)
    c = _Sized(x).shape[ca]
    per_channel_rule("scale", s, c, "instance_norm")
    per_channel_rule("bias", b, c, "instance_norm")
    s, b = _at(s, x, ca), _at(b, x, ca)
    axes_t, eps, _ = _mvn_plan(x, axes, s, b, True, True, epsilon, "inside", activation)
    return _mvn_graph(fn, x, axes_t, s, b, nm=True, nv=True, eps=eps, mode="inside", act=activation,
                      return_stats=stats, threads=threads)


def _group_chunks(chunks: Tuple[int, ...], k: int) -> Tuple[int, ...]:
    """Channel chunks with each boundary moved to the nearest group boundary (multiples of k)."""
    ends, edge = [], 0
    for c in chunks:
        edge += c
        end = int(round(edge / k)) * k
        if end > (ends[-1] if ends else 0):
            ends.append(end)
    ends[-1] = sum(chunks)
    return tuple(e - s for s, e in zip([0] + ends[:-1], ends))


def _nan_block(b: np.ndarray, *, g: int, sdt: Any) -> np.ndarray:
    return np.full((b.shape[0], g), np.nan, dtype=sdt)


def _nan_stats(x: "da.Array", g: int, sdt: Any) -> "da.Array":
    """(N, g) statistics of NaN, chunked as x along its first dim (whose sizes may be unknown)."""
    if not math.isnan(x.shape[0]):
        return da.full((x.shape[0], g), np.nan, dtype=sdt)
    rows = x.sum(axis=tuple(range(1, x.ndim)))  # (of no elements: a cheap (N,) with x's chunks)
    return rows.map_blocks(_nan_block, g=g, sdt=sdt, new_axis=1, chunks=(rows.chunks[0], (g,)), dtype=sdt,
                           meta=_meta(2, sdt))


@_public("group_norm")
def group_norm(x: Any, num_groups: int, scale: Any = None, bias: Any = None, *, epsilon: float = 1e-5,
               channel_axis: int = 1, activation: ActivationLike = None, return_stats: bool = False,
               num_threads: Optional[int] = None, out: Any = None) -> Any:
    """
    The channels are first rechunked to group boundaries (each chunk boundary moved to the nearest
    one; the result keeps those chunks). Statistics of shape (N, num_groups)."""
    fn = "group_norm"
    _no_out(fn, out)
    threads = _threads(fn, num_threads)
    stats = _check_flag(fn, "return_stats", return_stats)
    x = _input(fn, x)
    s, b = _param(fn, scale, "scale", x), _param(fn, bias, "bias", x)
    if _unknown(x):
        _known_along(fn, x, [channel_axis_rule(_Sized(x), channel_axis, fn)], "the groups need")
    ca, g, k, _, _, plan, _ = _api.group_plan(_Sized(x), num_groups, s, b, epsilon, channel_axis, activation)
    eps = plan[3]
    sdt = stats_dtype(x.dtype)
    if k == 0:  # no channels: an empty result, and groups of no elements (NaN statistics)
        res = x.map_blocks(np.copy, dtype=x.dtype, meta=x._meta)
        return (res, _nan_stats(x, g, sdt), _nan_stats(x, g, sdt)) if stats else res
    if k > 1:
        x = x.rechunk({ca: _group_chunks(x.chunks[ca], k)})
    s, b = _at(s, x, ca), _at(b, x, ca)
    spatial = tuple(d for d in range(1, x.ndim) if d != ca)
    prefix = "simdnorm-group_norm"
    if not _spans(x, spatial):
        kw = dict(k=k, ca=ca, eps=eps, act=activation, threads=threads)
        if not stats:
            return _map_blocks(_group_task, x, s, b, stats=False, dtype=x.dtype, meta=x._meta, prefix=prefix, **kw)
        tmp = _map_blocks(_group_task, x, s, b, stats=True, dtype=x.dtype, meta=x._meta, prefix=prefix, **kw)
        chunks = tuple(tuple(c // k for c in x.chunks[ca]) if d == ca else x.chunks[d] if d == 0 else (1,)
                       for d in range(x.ndim))
        spec = dict(at=(0, ca), squeeze=spatial, chunks=chunks, dtype=sdt, meta=_meta(x.ndim, sdt))
        return tuple(_tuple_outputs(tmp, [dict(dtype=x.dtype, meta=x._meta), spec, spec]))
    # Per-channel moments (instance norm's), merged k channels at a time into their group's.
    rec = _moments_of(x, spatial, threads).map_blocks(_group_moments, k=k, ca=ca, dtype=RECORD,
                                                       meta=_meta(x.ndim, RECORD))
    res = _normalized(x, rec, s, b, None, nm=True, nv=True, eps=eps, outside=False, act=activation,
                      threads=threads, prefix=prefix)
    if not stats:
        return res
    firsts = rec[tuple(slice(None, None, k) if d == ca else slice(None) for d in range(x.ndim))]
    firsts = firsts.squeeze(axis=spatial)
    meta = _meta(2, sdt)
    return (res, firsts.map_blocks(_mean_stat, sdt=sdt, dtype=sdt, meta=meta),
            firsts.map_blocks(_inv_std_stat, nm=True, eps=eps, outside=False, sdt=sdt, dtype=sdt, meta=meta))


@_public("batch_normalization_training")
def batch_normalization_training(x: Any, scale: Any = None, bias: Any = None, *, epsilon: float = 1e-5,
                                 channel_axis: int = 1, fused_add: Any = None, activation: ActivationLike = None,
                                 num_threads: Optional[int] = None, running_mean: Any = None, running_var: Any = None,
                                 out: Any = None) -> Tuple[Any, Any, Any]:
    """
    Returns ``(out, mean, variance)``, the batch's statistics (population variance) over every dim
    but ``channel_axis`` (or where same-rank parameters have size 1). Running statistics do not
    apply (TypeError): update them from the returned statistics."""
    fn = "batch_normalization_training"
    _no_out(fn, out)
    if running_mean is not None or running_var is not None:
        raise TypeError(f"simdnorm.dask.{fn}: running_mean, running_var do not apply: a lazy array cannot update "
                        "them in place; compute the returned mean and variance and update them from those")
    threads = _threads(fn, num_threads)
    x = _input(fn, x)
    s, b, fa = (_param(fn, p, n, x) for p, n in ((scale, "scale"), (bias, "bias"), (fused_add, "fused_add")))
    _params_known_along(fn, x, (s, b), channel_axis)
    _params_known_along(fn, x, (fa,))
    eps, _, axes, sshape, kca = _training._plan_bn_training(_Sized(x), s, b, fa, epsilon, activation, channel_axis)
    ca = kca if kca >= 0 else 0  # (same-rank parameters: no channel axis needed to place them)
    s, b = _at(s, x, ca), _at(b, x, ca)
    fa = _right(fa, x)
    sdt = stats_dtype(x.dtype)
    full = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
    if not _spans(x, axes):
        tmp = _map_blocks(_bn_training_task, x, s, b, fa, per_channel=kca >= 0, eps=eps, ca=channel_axis,
                          act=activation, threads=threads, dtype=x.dtype, meta=x._meta, prefix=f"simdnorm-{fn}")
        if len(sshape) == x.ndim:
            spec = _stats_spec(x, axes, sdt)
        else:
            spec = dict(at=(kca,), squeeze=axes, chunks=tuple(x.chunks[d] if d == kca else (1,) for d in range(x.ndim)),
                        dtype=sdt, meta=_meta(x.ndim, sdt))
        return _tuple_outputs(tmp, [dict(dtype=x.dtype, meta=x._meta), spec, spec])
    rec = _moments_of(x, axes, threads)
    res = _normalized(x, rec, s, b, fa, nm=True, nv=True, eps=eps, outside=False, act=activation, threads=threads,
                      prefix=f"simdnorm-{fn}")
    meta = _meta(x.ndim, sdt)
    mean = rec.map_blocks(_mean_stat, sdt=sdt, dtype=sdt, meta=meta)
    var = rec.map_blocks(_variance_stat, sdt=sdt, dtype=sdt, meta=meta)
    if tuple(sshape) != full:  # (C,): the reduced dims dropped (dask's reshape fails on empty chunks)
        mean, var = (da.squeeze(a, axis=axes) for a in (mean, var))
        if not _unknown(mean):  # (an unknown C: the squeeze's (C,) as it is)
            mean, var = mean.reshape(sshape), var.reshape(sshape)
    return res, mean, var
