"""The per-call route of small calls: plain CPU tensors straight into the kernels.

A small call is mostly overhead: a numpy view per tensor and the plain function's checks cost more
than its kernel. Here each call looks its plan up by the tensors' shapes and dtypes and its
attributes (what the plain functions key theirs by), and hands the tensors themselves to
``_core``, which reads them through DLPack's C exchange API (no Python call, no numpy array).
A miss plans through the plain functions' own validator on numpy views, so that a call runs here
only where the plain function would run it, with the same plan, and raises that function's errors.

Three kinds of caller: the drop-in modules (``module`` given: a miss first checks torch.nn's rules,
and a call torch.nn would compute or refuse itself returns None for the module to pass on); the
``torch.ops.simdnorm`` CPU kernels (``module`` None: simdnorm's rules, and the statistics); and the
plain functions called with tensors (``plain_call``, from ``_compile.follow_input``).

A route also returns None where the caller must take its general path: a tensor off the CPU, or
one with the negative bit (its memory holds the values' negatives). The callers pass plain tensors
(not fake or other subclass tensors, which have no memory to read).
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from .. import _api, _core, _training
from .._api import bn_plan, group_plan, instance_plan, mvn_plan
from .._descriptors import trailing_axes_rule
from . import _ops

_PLANS: Dict[Any, Any] = {}
_PLANS_MAX = 512
_empty_like = torch.empty_like
_empty = torch.empty
_from_dlpack = torch.from_dlpack
_huge_block_capsule = _core.huge_block_capsule
_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}
_DLPACK_TYPES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16), torch.float64: (2, 64)}
_HUGE_ELEMENTS = _core.huge_block_min_elements  # (4 MB of float32)
_mvn = _core.mvn
_batch_norm = _core.batch_norm
_F64 = torch.float64
_STRIDED = torch.strided
_F32 = torch.float32
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_HALF = (torch.float16, torch.bfloat16)

Result = Union[Tensor, Tuple[Tensor, Tensor, Tensor]]


def _new_like(x: Tensor) -> Tensor:
    """torch.empty_like(x) for a route's output; a large one laid out densely (row-major or channels
    last) on a block of 2 MB pages that simdnorm keeps for the next output of its size once the
    tensor dies (cpp/runtime/huge_blocks.h): with torch's 4 KB pages the kernels' stores miss the
    TLB every 64 lines."""
    if x.numel() < _HUGE_ELEMENTS or x.dtype not in _DLPACK_TYPES:
        return _empty_like(x)
    cl = _CHANNELS_LAST.get(x.dim())
    if not (x.is_contiguous() or (cl is not None and x.is_contiguous(memory_format=cl))):
        return _empty_like(x)
    capsule = _huge_block_capsule(x.shape, x.stride(), *_DLPACK_TYPES[x.dtype])
    return _empty_like(x) if capsule is None else _from_dlpack(capsule)  # (None: no block mapped)


if _core.huge_cache_setting_ignored():
    warnings.warn(f"SIMDNORM_TORCH_CACHE_MB={os.environ.get('SIMDNORM_TORCH_CACHE_MB')!r} is not a whole number of "
                  f"megabytes (decimal digits); using the default bound, {_core.huge_cache_limit() >> 20} MB",
                  RuntimeWarning, stacklevel=2)


def empty_cache() -> int:
    """Unmap the blocks of 2 MB pages simdnorm keeps for its next large outputs (those of tensors
    that have died; the ones alive are untouched) and return their bytes."""
    return _core.release_huge_blocks()


def takes(x: Tensor, *params: Optional[Tensor]) -> bool:
    """Whether simdnorm computes a module's call as torch.nn would: a non-empty dense CPU tensor of 1
    to 8 dims in one of its dtypes, each parameter of the input's dtype or, for 16-bit data, float32
    (the mixed precision torch.nn takes too); not a nested tensor (whose rows torch.nn normalizes)."""
    if (x.is_nested or not x.is_cpu or x.layout is not _STRIDED or x.dtype not in _FLOATS or not 1 <= x.dim() <= 8
            or x.numel() == 0):
        return False
    xd = x.dtype
    for p in params:
        if p is not None and (not p.is_cpu or (p.dtype != xd and not (p.dtype == torch.float32 and xd in _HALF))):
            return False
    return True


def trailing(x: Tensor, normalized_shape: Any) -> bool:
    k = len(normalized_shape)
    return 0 < k <= x.dim() and tuple(x.shape[x.dim() - k:]) == tuple(normalized_shape)


_MISS = object()
_GENERAL = ()  # a plan the route does not take: the caller's general path


def _cached(key: Any) -> Any:
    """The plan stored under key, _MISS, or None for a key that cannot be one (an unhashable
    attribute: the general path validates it and names it)."""
    try:
        return _PLANS.get(key, _MISS)
    except TypeError:
        return None


def _store(key: Any, make: Callable[[], Any]) -> Any:
    plan = make()
    if len(_PLANS) >= _PLANS_MAX:
        # (the C++ kernels' plans were put on this cache's misses; theirs first: another thread's
        # miss between the two clears then keeps its plan in both, not in this cache alone)
        if _ops.CPP_KERNELS:
            _core.torch_plans_clear()
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def _share(name: str, tensors: tuple, ints: tuple, eps: Any, plan: tuple) -> None:
    """Hands an op call's plan to the op's C++ kernel (simdnorm/torch/_ops.py: the kernels compute
    the calls whose shapes, dtypes and attributes have a plan), keyed by the tensors' dtypes and
    shapes (None where absent), the int attributes and epsilon, as the kernel reads the call."""
    if _ops.CPP_KERNELS and eps.__class__ is float and all(i.__class__ is int for i in ints):
        _core.torch_plan_put(name, tensors, ints, eps, plan)


def _share_mvn(name: str, tensors: tuple, ints: tuple, eps: Any, route: tuple, ca: int = -1,
               groups: Optional[int] = None) -> None:
    (axes, _, _, e, nm, nv, eo, act), _, inv_like = route
    if act[0] == 0:  # (the identity: the kernels take no activation)
        _share(name, tensors, ints, eps, (tuple(axes), e, nm, nv, eo, ca, groups, tuple(inv_like.shape),
                                          str(inv_like.dtype)))


def _readable(x: Tensor, *params: Optional[Tensor]) -> bool:
    """The per-call conditions a plan does not hold: on the CPU, no negative bit."""
    if not x.is_cpu or x.is_neg():
        return False
    for p in params:
        if p is not None and p.is_neg():
            return False
    return True


def _mvn_route(x: Tensor, mvn: tuple, stats_shape: Any = None) -> tuple:
    """A route's cached plan: the MVN plan and two empty tensors whose ``empty_like`` makes the
    statistics (mean, inv_std) of the shape the op returns (by default the plan's), the cheapest
    allocation torch has; a statistic the plan does not take is an empty tensor."""
    sd = _F64 if x.dtype is _F64 else _F32
    shape = mvn[1] if stats_shape is None else stats_shape
    stats = _empty(shape, dtype=sd)
    return mvn, stats if mvn[4] else _empty((0,), dtype=sd), stats


def _mvn_into(x: Tensor, route: tuple, scale: Optional[Tensor], bias: Optional[Tensor], stats: bool, ca: int = -1,
              groups: Optional[int] = None) -> Result:
    """The MVN kernel into torch.empty_like(x); with stats also (out, mean, inv_std), new tensors
    shaped as the route's templates (the kernel takes them in any shape equal up to size-1 dims)."""
    (axes, _, _, eps, nm, nv, eo, act), mean_like, inv_like = route
    res = _new_like(x)
    if not stats:
        _mvn(x, axes, scale, bias, res, eps, nm, nv, eo, act, None, None, ca, False, None, groups)
        return res
    mo = _empty_like(mean_like)
    so = _empty_like(inv_like)
    _mvn(x, axes, scale, bias, res, eps, nm, nv, eo, act, mo if nm else None, so, ca, False, None, groups)
    return res, mo, so


def layer_norm(x: Tensor, w: Optional[Tensor], b: Optional[Tensor], axis: int, eps: float, rms: bool = False,
               stats: bool = False, module: Any = None) -> Optional[Result]:
    """Layer norm (RMS norm with rms, b None) over the dims from axis; module: the LayerNorm's or
    RMSNorm's normalized_shape."""
    key = ("rms" if rms else "layer", x.shape, x.dtype, None if w is None else (w.shape, w.dtype),
           None if b is None else (b.shape, b.dtype), axis, axis.__class__, eps, eps.__class__, module)
    plan = _cached(key)
    if plan is None:
        return None
    if plan is _MISS:
        if module is not None and (not trailing(x, module) or not takes(x, w, b)):
            return None
        xn = _ops._as_numpy(x)
        plan = _store(key, lambda: _mvn_route(x, mvn_plan(None, xn, trailing_axes_rule(xn, axis), _ops._opt(w),
                                                          _ops._opt(b), not rms, True, eps, "inside", None)))
        if module is None:
            _share_mvn("rms_norm" if rms else "layer_norm", (x, None, None, w, b), (axis, 0), eps, plan)
    if not _readable(x, w, b):
        return None
    return _mvn_into(x, plan, w, b, stats)


def instance_norm(x: Tensor, w: Optional[Tensor], b: Optional[Tensor], eps: float, ca: int = 1,
                  stats: bool = False, module: bool = False) -> Optional[Result]:
    """Instance norm with the input's statistics."""
    key = ("instance", x.shape, x.dtype, None if w is None else (w.shape, w.dtype),
           None if b is None else (b.shape, b.dtype), eps, eps.__class__, ca, ca.__class__, module)
    plan = _cached(key)
    if plan is None:
        return None
    if plan is _MISS:
        if module and (x.dim() < 3 or not takes(x, w, b)):
            return None
        plan = _store(key, lambda: _instance_route(x, instance_plan(_ops._as_numpy(x), _ops._opt(w), _ops._opt(b),
                                                                    eps, ca, None)))
        if not module:
            _share_mvn("instance_norm", (x, None, None, w, b), (ca, 0), eps, plan[1], plan[0])
    if not _readable(x, w, b):
        return None
    channel_axis, route = plan
    return _mvn_into(x, route, w, b, stats, channel_axis)


def _instance_route(x: Tensor, plan: tuple) -> tuple:
    channel_axis, mvn = plan
    return channel_axis, _mvn_route(x, mvn)


def _group_route(x: Tensor, plan: tuple) -> tuple:
    channel_axis, g, _, _, _, mvn, nshape = plan
    return channel_axis, g, _mvn_route(x, mvn, nshape)


def group_norm(x: Tensor, num_groups: int, w: Optional[Tensor], b: Optional[Tensor], eps: float, ca: int = 1,
               stats: bool = False, module: bool = False) -> Optional[Result]:
    """Group norm: the kernel splits the channel dim of x, of the result and of the (C,) parameters
    into (G, C/G) itself (a torch view costs more than the call). The statistics: (N, G), which
    the kernel takes as they are for the split view's (N, G, 1, ...)."""
    key = ("group", x.shape, x.dtype, None if w is None else (w.shape, w.dtype),
           None if b is None else (b.shape, b.dtype), num_groups, num_groups.__class__, eps, eps.__class__, ca,
           ca.__class__, module)
    plan = _cached(key)
    if plan is None:
        return None
    if plan is _MISS:
        # (torch.nn's own checks: C divisible by G, the parameters' length C)
        if module and (x.dim() < 2 or x.shape[1] % num_groups != 0 or not takes(x, w, b) or any(
                p is not None and tuple(p.shape) != (x.shape[1],) for p in (w, b))):
            return None
        plan = _store(key, lambda: _group_route(x, group_plan(_ops._as_numpy(x), num_groups, _ops._opt(w), _ops._opt(b),
                                                              eps, ca, None)))
        if not module:
            _share_mvn("group_norm", (x, None, None, w, b), (num_groups, ca), eps, plan[2], plan[0], plan[1])
    if not _readable(x, w, b):
        return None
    channel_axis, g, route = plan
    return _mvn_into(x, route, w, b, stats, channel_axis, g)


def batch_norm(x: Tensor, mean: Tensor, var: Tensor, w: Optional[Tensor], b: Optional[Tensor], eps: float,
               ca: int = 1, module: bool = False) -> Optional[Tensor]:
    """Batch norm with given statistics."""
    key = ("bn", x.shape, x.dtype, mean.shape, mean.dtype, var.shape, var.dtype,
           None if w is None else (w.shape, w.dtype), None if b is None else (b.shape, b.dtype), eps, eps.__class__,
           ca, ca.__class__, module)
    plan = _cached(key)
    if plan is None:
        return None
    if plan is _MISS:
        if module and not takes(x, w, b, mean, var):
            return None
        plan = _store(key, lambda: bn_plan(None, _ops._as_numpy(x), _ops._as_numpy(mean), _ops._as_numpy(var),
                                           _ops._opt(w), _ops._opt(b), eps, None, ca))
        if not module and plan[1][0] == 0:
            _share("batch_normalization", (x, mean, var, w, b), (ca, 0), eps, (plan[0], plan[2]))
    if not _readable(x, mean, var, w, b):
        return None
    e, act, channel_axis = plan
    res = _new_like(x)
    _batch_norm(x, mean, var, w, b, res, e, act, channel_axis, False)
    return res


def bn_training(x: Tensor, w: Optional[Tensor], b: Optional[Tensor], eps: float, ca: int,
                act: tuple) -> Optional[Result]:
    """Batch norm with the batch's statistics (the training op without fused_add or out=): (out,
    mean, variance), the statistics shaped as the op returns them."""
    key = ("bn_training", x.shape, x.dtype, _spec(w), _spec(b), eps, eps.__class__, ca, ca.__class__, act[0],
           None if act[1] is None else tuple(act[1]))
    plan = _cached(key)
    if plan is None:
        return None
    if plan is _MISS:
        o = _ops._opt
        e, a, axes, sshape, c = _training._bn_training_plan(_ops._as_numpy(x), o(w), o(b), None, eps,
                                                            _ops._activation(*act), ca)[:5]
        stats = _empty(sshape, dtype=_F64 if x.dtype is _F64 else _F32)  # (the template of each statistic)
        plan = _store(key, lambda: _GENERAL if x.numel() == 0 else (axes, e, a, c, stats))
    if plan is _GENERAL or not _readable(x, w, b):
        return None
    axes, e, a, c, stats = plan
    res, mean, inv_std, var = _new_like(x), _empty_like(stats), _empty_like(stats), _empty_like(stats)
    _mvn(x, axes, w, b, res, e, True, True, False, a, mean, inv_std, c, False, var)
    return res, mean, var


# ----------------------------------------------------------------------------------------------------
# the backward ops' CPU kernels (an autograd backward's call among them): a call without out= or
# fused_add, planned by the plain function's own planner on a miss, then straight into the kernel
# with new tensors for the gradients. Where the parameters' gradients need summing beyond the
# kernel's sums (a parameter broadcast along more dims), the general path.

_mvn_backward = _core.mvn_backward
_CONTIGUOUS = torch.contiguous_format


def _spec(t: Optional[Tensor]) -> Any:
    return None if t is None else (t.shape, t.dtype)


def _backward_route(x: Tensor, core: tuple, sums: Optional[tuple], groups: Optional[int] = None) -> tuple:
    """A backward call's cached plan: (the kernel's axes, nm, nv, eps, eo, act, terms, channel axis,
    variance given), grad_input wanted, (grad_scale wanted, grad_bias wanted), and group norm's
    groups (None for the others); _GENERAL where the route does not take it (sums is the plain
    function's _sums_plan: direct, each gradient written by the kernel in its parameter's shape)."""
    if x.numel() == 0 or (sums is not None and not sums[3]):
        return _GENERAL
    return core[:-1], core[-1], (sums is not None and sums[1] is not None, sums is not None and sums[2] is not None), \
        groups


def _backward_into(plan: tuple, dy: Tensor, x: Tensor, mean: Optional[Tensor], inv_std: Optional[Tensor],
                   w: Optional[Tensor], b: Optional[Tensor]) -> Optional[tuple]:
    """(grad_input, grad_scale, grad_bias) as the backward ops return them (one not asked for: an
    empty tensor); None: the general path."""
    if plan is _GENERAL or not _readable(x, dy, mean, inv_std, w, b):
        return None
    (axes, nm, nv, eps, eo, act, terms, ca, variance_given), want_input, grads, groups = plan
    gi = _new_like(x) if want_input else x.new_empty(0)
    # (each the parameter's shape, contiguous, as the kernel writes the sums)
    gs = _empty_like(w, memory_format=_CONTIGUOUS) if grads[0] else None
    gb = _empty_like(b, memory_format=_CONTIGUOUS) if grads[1] else None
    # (group norm: the kernel splits the channel dim into (G, C/G) itself, its statistics (N, G) as
    # they are; a torch view costs more than the call)
    _mvn_backward(x, dy, axes, mean if nm else None, inv_std if nv else None, w, b, None, gi if want_input else None,
                  gs, gb, eps, nm, nv, eo, act, terms, False, ca, False, variance_given, groups)
    return (gi, x.new_empty(0, dtype=x.dtype if w is None else w.dtype) if gs is None else gs,
            x.new_empty(0, dtype=x.dtype if b is None else b.dtype) if gb is None else gb)


def _backward_key(name: str, dy: Tensor, x: Tensor, mean: Optional[Tensor], inv_std: Optional[Tensor],
                  w: Optional[Tensor], b: Optional[Tensor], attrs: tuple, act: tuple, want: tuple) -> Any:
    params = act[1]
    return (name, dy.shape, dy.dtype, x.shape, x.dtype, _spec(mean), _spec(inv_std), _spec(w), _spec(b), attrs,
            tuple(map(type, attrs)), act[0], params if params is None else tuple(params), want)


def _backward(name: str, attrs: tuple, dy: Tensor, x: Tensor, mean: Optional[Tensor], inv_std: Optional[Tensor],
              w: Optional[Tensor], b: Optional[Tensor], act: tuple, want: tuple, make: Callable) -> Optional[tuple]:
    """A backward op's call by its cached plan; on a miss make(numpy view, optional view, activation)
    plans it (the plain function's planner, which raises what the call deserves) as _backward_route's
    (core, sums[, groups])."""
    key = _backward_key(name, dy, x, mean, inv_std, w, b, attrs, act, want)
    plan = _cached(key)
    if plan is None:
        return None
    if plan is _MISS:
        plan = _store(key, lambda: _backward_route(x, *make(_ops._as_numpy, _ops._opt, _ops._activation(*act))))
    return _backward_into(plan, dy, x, mean, inv_std, w, b)


def mvn_backward(dy: Tensor, x: Tensor, axes: Any, mean: Optional[Tensor], inv_std: Optional[Tensor],
                 w: Optional[Tensor], b: Optional[Tensor], nm: bool, nv: bool, eps: float, mode: str, act: tuple,
                 want: tuple, trailing_from: Optional[int] = None) -> Optional[tuple]:
    """MVN's backward over axes (layer and RMS norm's: the dims from trailing_from, axes None)."""
    def make(n, o, activation):
        xn = n(x)
        a = axes if trailing_from is None else trailing_axes_rule(xn, trailing_from)
        p = _training._mvn_backward_plan(xn, n(dy), a, o(mean), o(inv_std), o(w), o(b), nm, nv, eps, mode, activation,
                                         *want)
        return p[:6] + (True, -1, False, p[6]), p[7]

    if trailing_from is None:
        return _backward("mvn_bwd", (tuple(axes) if axes.__class__ is list else axes, nm, nv, eps, mode), dy, x, mean,
                         inv_std, w, b, act, want, make)
    return _backward("trailing_bwd", (trailing_from, nm, nv, eps, mode), dy, x, mean, inv_std, w, b, act, want, make)


def bn_backward(dy: Tensor, x: Tensor, mean: Tensor, var: Tensor, w: Optional[Tensor], b: Optional[Tensor],
                eps: float, ca: int, training: bool, act: tuple, want: tuple) -> Optional[tuple]:
    def make(n, o, activation):
        e, a, terms, axes, c, want_input, sums = _training._bn_backward_sums_plan(
            n(x), n(dy), n(mean), n(var), o(w), o(b), None, eps, ca, training, activation, *want)
        return (axes, True, True, e, False, a, terms, c, True, want_input), sums

    return _backward("bn_bwd", (eps, ca, training), dy, x, mean, var, w, b, act, want, make)


def instance_backward(dy: Tensor, x: Tensor, mean: Tensor, inv_std: Tensor, w: Optional[Tensor], b: Optional[Tensor],
                      eps: float, ca: int, act: tuple, want: tuple) -> Optional[tuple]:
    def make(n, o, activation):
        axes, c, e, a, want_input, sums = _training._instance_backward_sums_plan(
            n(x), n(dy), n(mean), n(inv_std), o(w), o(b), ca, eps, activation, *want)
        return (axes, True, True, e, False, a, True, c, False, want_input), sums

    return _backward("instance_bwd", (eps, ca), dy, x, mean, inv_std, w, b, act, want, make)


def group_backward(dy: Tensor, x: Tensor, num_groups: int, mean: Tensor, inv_std: Tensor, w: Optional[Tensor],
                   b: Optional[Tensor], eps: float, ca: int, act: tuple, want: tuple) -> Optional[tuple]:
    def make(n, o, activation):  # (c: the channel axis)
        c, _, g, _, _, _, axes, e, a, want_input, sums = _training._group_backward_sums_plan(
            n(x), n(dy), num_groups, n(mean), n(inv_std), o(w), o(b), ca, eps, activation, *want)
        return (axes, True, True, e, False, a, True, c, False, want_input), sums, g

    return _backward("group_bwd", (num_groups, eps, ca), dy, x, mean, inv_std, w, b, act, want, make)


# ----------------------------------------------------------------------------------------------------
# the plain functions' calls on torch tensors (_compile.follow_input): name -> the route's call, from
# the function's arguments by name; None where the route does not take the call

def _plain_layer(kw: Dict[str, Any]) -> Optional[Result]:
    return layer_norm(kw["x"], kw["scale"], kw["bias"], kw["axis"], kw["epsilon"], stats=kw["return_stats"])


def _plain_rms(kw: Dict[str, Any]) -> Any:
    r = layer_norm(kw["x"], kw["scale"], None, kw["axis"], kw["epsilon"], rms=True, stats=kw["return_stats"])
    return (r[0], None, r[2]) if kw["return_stats"] and r is not None else r


def _plain_instance(kw: Dict[str, Any]) -> Optional[Result]:
    return instance_norm(kw["x"], kw["scale"], kw["bias"], kw["epsilon"], kw["channel_axis"], stats=kw["return_stats"])


def _plain_group(kw: Dict[str, Any]) -> Optional[Result]:
    return group_norm(kw["x"], kw["num_groups"], kw["scale"], kw["bias"], kw["epsilon"], kw["channel_axis"],
                      stats=kw["return_stats"])


def _plain_bn(kw: Dict[str, Any]) -> Optional[Result]:
    return batch_norm(kw["x"], kw["mean"], kw["variance"], kw["scale"], kw["bias"], kw["epsilon"], kw["channel_axis"])


_PLAIN: Dict[Any, Tuple[Callable[[Dict[str, Any]], Any], Tuple[str, ...]]] = {  # (not compiled operators)
    _api.layer_norm: (_plain_layer, ("x", "scale", "bias")),
    _api.rms_norm: (_plain_rms, ("x", "scale")),
    _api.instance_norm: (_plain_instance, ("x", "scale", "bias")),
    _api.group_norm: (_plain_group, ("x", "scale", "bias")),
    _api.batch_normalization: (_plain_bn, ("x", "mean", "variance", "scale", "bias")),
}
_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def plain_call(fn: Any, kw: Dict[str, Any]) -> Any:
    """A plain function's call (its arguments by name) on plain CPU tensors without an activation
    or out=, through the route; None where it does not apply (the caller then takes its general
    path, which also raises whatever the call deserves)."""
    entry = _PLAIN.get(fn)
    if entry is None or kw.get("out") is not None or kw.get("activation") is not None:
        return None
    if kw.get("return_stats", False).__class__ is not bool:
        return None
    call, tensors = entry
    for t in tensors:  # (another dtype or device takes the general path, which names it as it does)
        v = kw[t]
        if v is not None and (v.__class__ not in _PLAIN_TENSORS or v.dtype not in _FLOATS or not v.is_cpu):
            return None
    return call(kw)
