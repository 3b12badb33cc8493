"""Training: batch statistics with running statistics, and the backward of every op.

``batch_normalization_training`` is MVN over every dim but the channel's (its statistics, variance
included, from the same kernels), then the running statistics. Every backward op is one call of
``_core.mvn_backward`` (cpp/ops/backward.cpp): batch norm's over its reduced dims, the conveniences'
through the same views as their forward ops (group norm splits the channel dim). The parameters'
gradients come back as float64 sums over scale and bias's broadcast shape, reduced here to each
parameter's own shape and dtype.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Optional, Tuple

import numpy as np

from . import _core
from ._activation import ActivationLike, core_tuple
from ._api import documented, group_split, split_view
from ._compile import (as_input, as_param, check_arg, check_out, dlpack_array, expect,
                       follow_input, is_foreign_out, is_tensor, needs_temporary)
from ._descriptors import (
    MAX_DIMS,
    as_int_tuple,
    bn_param_rule,
    DescriptorAxisError,
    DescriptorError,
    DescriptorTypeError,
    TensorDesc,
    check_activation,
    check_bool,
    check_param_dtype,
    channel_axis_rule,
    check_epsilon,
    check_epsilon_mode,
    check_extent,
    dtype_name,
    is_int,
    mvn_param_rule,
    normalize_axes,
    normalize_axis,
    per_channel_rule,
    spatial_axes_rule,
    stats_dtype,
    trailing_axes_rule,
    value_text,
)

__all__ = [
    "batch_normalization_training",
    "batch_normalization_backward",
    "mean_variance_normalization_backward",
    "layer_norm_backward",
    "rms_norm_backward",
    "instance_norm_backward",
    "group_norm_backward",
    "BatchNormalizationTrainingDesc",
    "BatchNormalizationGradDesc",
    "MeanVarianceNormalizationGradDesc",
]

BACKWARD_ACTIVATIONS = ("relu", "leaky_relu", "silu", "gelu")
_IDENTITY = (0, 0.0, 0.0)
_nd = np.ndarray

# Plans (the validated attributes and shapes a call needs), keyed like the forward ops' by the
# dtypes and shapes of the arrays and by each attribute with its class: a call that hits skips the
# validation, which reads only dtypes, shapes and attributes.
_PLANS: dict = {}


def _k(a: Any) -> Any:
    return None if a is None else (a.dtype, a.shape)


def _a(v: Any) -> Any:
    return (v, v.__class__)


def _axes_key(axes: Any) -> Any:
    if axes.__class__ is int:
        return axes
    if axes.__class__ is tuple or axes.__class__ is list:
        return (tuple(axes), tuple(map(type, axes)))
    raise TypeError  # (uncached: validated every call)


def _planned(key: Any, make: Any, *args: Any) -> Any:
    """The plan cached under key, else make(*args) (validated, then cached). (A function and its
    arguments, not a closure: a closure would make the caller's locals cells, which locals() at the
    top of a plain function hands torch.compile unbound.)"""
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable attribute: validate without caching
        return make(*args)
    if plan is None:
        plan = make(*args)
        if len(_PLANS) >= 512:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _as_arrays(x: Any, dy: Any, *params: Tuple[str, Any]) -> tuple:
    """Conversions only (no rules): the input, grad_output and parameters as ndarrays."""
    if x.__class__ is not _nd:
        x = as_input(x)
    if dy is not None and dy.__class__ is not _nd:
        dy = as_input(dy, "grad_output")
    out = [x, dy]
    for name, p in params:
        out.append(p if p is None or p.__class__ is _nd else as_param(p, name, x))
    return tuple(out)


# ----------------------------------------------------------------------------------------------------
# argument rules

def _input(x: Any) -> Any:
    TensorDesc(x.dtype, x.shape)._check("input", "data")
    return x


def _grad_output(dy: Any, x: Any) -> Any:
    if dy.dtype != x.dtype:
        raise DescriptorTypeError(
            f"grad_output: dtype {dtype_name(dy.dtype)} differs from the input's {dtype_name(x.dtype)}; "
            "grad_output must have the input's dtype and shape")
    if dy.shape != x.shape:
        raise DescriptorError(f"grad_output: shape {dy.shape} differs from the input's {x.shape}")
    return dy


def _param(p: Any, name: str, x: Any) -> Any:
    if p is None:
        return None
    if not 1 <= len(p.shape) <= MAX_DIMS:  # (a 0-d one: refused as every op's parameters are)
        TensorDesc(p.dtype, p.shape)._check(name, "param")
    check_param_dtype(name, TensorDesc(p.dtype, p.shape), TensorDesc(x.dtype, x.shape))
    return p


def _backward_activation(activation: Any) -> Tuple[int, float, float]:
    act = check_activation(activation)
    if act is not None and act.name not in BACKWARD_ACTIVATIONS:
        raise DescriptorError(
            f"activation: {act.name!r} has no backward here; the backward ops take None, "
            + ", ".join(BACKWARD_ACTIVATIONS))
    return core_tuple(act)


def _wanted(flag: Any, name: str, present: bool) -> bool:
    """grad_scale / grad_bias: None means "when that parameter was given"."""
    if flag is None:
        return present
    want = check_bool(name, flag)
    if want and not present:
        raise DescriptorError(f"{name}=True but no {name[5:]} was given: there is no gradient to return")
    return want


def _gradients_wanted(grad_input: Any, grad_scale: Any, grad_bias: Any, scale: Any, bias: Any) -> tuple:
    """(grad_input, grad_scale, grad_bias): which gradients a backward call returns, its flags checked."""
    return (check_bool("grad_input", grad_input), _wanted(grad_scale, "grad_scale", scale is not None),
            _wanted(grad_bias, "grad_bias", bias is not None))


def _full_shape(shape: Tuple[int, ...], nd: int, ca: int) -> Tuple[int, ...]:
    """A parameter's shape at the input's rank, as the kernels place it: a 1-D one at ca (ca >= 0),
    otherwise aligned right."""
    if len(shape) == nd:
        return shape
    if ca >= 0 and len(shape) == 1:
        return (1,) * ca + shape + (1,) * (nd - ca - 1)
    return (1,) * (nd - len(shape)) + shape


def _sums_plan(x_shape: Tuple[int, ...], scale: Any, bias: Any, ca: int, want_scale: bool,
               want_bias: bool) -> Optional[tuple]:
    """How the parameters' gradients are summed (part of a call's cached plan): None when neither is
    asked for, else (the shape of the two float64 sums: 2 + scale and bias's broadcast shape at the
    input's rank; for grad_scale and grad_bias each, None or (the dims to add up, the parameter's
    shape); direct: nothing is left to add up, so the kernel writes the gradients themselves, each
    rounded once from its double sums)."""
    if not (want_scale or want_bias):
        return None
    nd = len(x_shape)
    full = [None if p is None else _full_shape(p.shape, nd, ca) for p in (scale, bias)]
    joint = np.broadcast_shapes(*[f for f in full if f is not None])

    def to(f: Tuple[int, ...], shape: Tuple[int, ...]) -> tuple:
        return tuple(d for d in range(nd) if f[d] == 1 and joint[d] != 1), shape

    to_scale = to(full[0], scale.shape) if want_scale else None
    to_bias = to(full[1], bias.shape) if want_bias else None
    direct = (to_scale is None or not to_scale[0]) and (to_bias is None or not to_bias[0])
    return (2,) + joint, to_scale, to_bias, direct


def _reduce_to(sums: np.ndarray, to: tuple, dtype: np.dtype) -> np.ndarray:
    """float64 sums over scale and bias's broadcast shape -> the parameter's shape (to: _sums_plan's)
    and dtype."""
    axes, shape = to
    if axes:
        sums = sums.sum(axis=axes, keepdims=True)
    return sums.reshape(shape).astype(dtype)


def _targets(out: Any, want_input: bool, x: np.ndarray, *others: Any) -> Tuple[Optional[np.ndarray], Any]:
    """(the array grad_input is written to or None, the user's out to copy it into or None)."""
    if not want_input:
        if out is not None:
            raise DescriptorError("out: given with grad_input=False; there is no grad_input to write")
        return None, None
    if out is None:
        return np.empty_like(x, subok=False), None
    if not (out.__class__ is _nd and out.flags.c_contiguous and out.flags.writeable and out.shape == x.shape
            and out.dtype == x.dtype):  # (numpy's own C-contiguous arrays pass both checks)
        check_out(out, x)
        check_extent("out", out)  # (the kernel's own check would name it grad_input)
    if not _core.may_overlap(out, x, *others):  # (byte ranges: a yes goes to numpy's exact tests)
        return out, None
    if np.may_share_memory(out, x) and np.shares_memory(out, x):
        if out.__array_interface__["data"][0] == x.__array_interface__["data"][0] and out.strides == x.strides:
            raise DescriptorError("out: is the input; the backward reads the input to the end, so out may not be "
                                  "the input (an out overlapping it otherwise is written through a temporary)")
        return np.empty_like(x, subok=False), out
    if needs_temporary(out, others[0], *others[1:]):
        return np.empty_like(x, subok=False), out
    return out, None


def _finish(result: tuple, copy_to: Any) -> tuple:
    if copy_to is None:
        return result
    np.copyto(copy_to, result[0])
    return (copy_to,) + result[1:]


# ----------------------------------------------------------------------------------------------------
# the one backward call

def _backward(dy: np.ndarray, x: np.ndarray, axes: Tuple[int, ...], mean: Optional[np.ndarray],
              inv_std: Optional[np.ndarray], scale: Optional[np.ndarray], bias: Optional[np.ndarray],
              fused_add: Optional[np.ndarray], target: Optional[np.ndarray], sums_plan: Optional[tuple],
              eps: float, nm: bool, nv: bool, eo: bool, act: Tuple[int, float, float], terms: bool,
              ca: int, variance_given: bool = False) -> tuple:
    """(grad_input written into target (or None), grad_scale, grad_bias[, grad_fused_add]); the
    parameters' gradients as sums_plan (_sums_plan's) says; with variance_given, inv_std is batch
    norm's variance (the kernel takes 1 / sqrt(variance + eps))."""
    nd = x.ndim
    sums: Any = (None, None)
    gs = gb = None
    direct = False
    if sums_plan is not None:
        shape, to_scale, to_bias, direct = sums_plan
        if direct:
            new = np.zeros if x.size == 0 else np.empty
            gs = None if to_scale is None else new(to_scale[1], scale.dtype)
            gb = None if to_bias is None else new(to_bias[1], bias.dtype)
            sums = (gs, gb)
        else:
            sums = np.zeros(shape, np.float64)
    # (before grad_input is written: out may be grad_output itself)
    gf = None if fused_add is None else _grad_fused_add(dy, x, axes, mean, inv_std, scale, bias, fused_add, eps, nm, nv,
                                                        eo, act, terms, ca, variance_given)
    if x.size == 0:
        pass  # nothing to write; the sums of nothing are 0
    elif target is not None or sums[0] is not None or sums[1] is not None:
        _core.mvn_backward(x, dy, axes, mean, inv_std, scale, bias, fused_add, target, sums[0], sums[1], eps, nm,
                           nv, eo, act, terms, False, ca, False, variance_given)
    if direct or sums_plan is None:
        return (target, gs, gb) if fused_add is None else (target, gs, gb, gf)
    with np.errstate(over="ignore", invalid="ignore"):  # a sum past the parameter's range is inf, as numpy's
        gs = None if to_scale is None else _reduce_to(sums[0], to_scale, scale.dtype)
        gb = None if to_bias is None else _reduce_to(sums[1], to_bias, bias.dtype)
    return (target, gs, gb) if fused_add is None else (target, gs, gb, gf)


def _grad_fused_add(dy: np.ndarray, x: np.ndarray, axes: Tuple[int, ...], mean: Optional[np.ndarray],
                    inv_std: Optional[np.ndarray], scale: Optional[np.ndarray], bias: Optional[np.ndarray],
                    fused_add: np.ndarray, eps: float, nm: bool, nv: bool, eo: bool, act: Tuple[int, float, float],
                    terms: bool, ca: int, variance_given: bool) -> np.ndarray:
    """grad_fused_add: dy * act'(pre) (in the compute type) summed to fused_add's shape, rounded once."""
    nd = x.ndim
    if act[0] == 0 or x.size == 0:
        check_extent("grad_output", dy)  # (numpy reads it here, before any kernel has checked it)
        ga = dy
    else:
        ga = np.empty(x.shape, stats_dtype(x.dtype))
        _core.mvn_backward(x, dy, axes, mean, inv_std, scale, bias, fused_add, ga, None, None, eps, nm, nv, eo,
                           act, terms, True, ca, False, variance_given)
    full = (1,) * (nd - fused_add.ndim) + fused_add.shape
    red = tuple(d for d in range(nd) if full[d] == 1 and x.shape[d] != 1)
    with np.errstate(over="ignore", invalid="ignore"):  # a sum past the parameter's range is inf, as numpy's
        gf = ga.astype(np.float64).sum(axis=red, keepdims=True) if red else ga
        return np.asarray(gf).reshape(fused_add.shape).astype(fused_add.dtype, copy=True)


def _fused_add(fused_add: Any, x: np.ndarray) -> Optional[np.ndarray]:
    if fused_add is None:
        return None
    _param(fused_add, "fused_add", x)
    mvn_param_rule("fused_add", fused_add.shape, x.shape)
    return fused_add


def _stats(p: Any, name: str, x: np.ndarray, axes: Tuple[int, ...]) -> np.ndarray:
    """MVN's statistics: x's shape with the normalized dims 1 (fewer leading dims allowed)."""
    if p is None:
        raise DescriptorTypeError(f"{name}: expected an array, got None; {name} is required")
    _param(p, name, x)
    mvn_param_rule(name, p.shape, x.shape)
    full = (1,) * (x.ndim - p.ndim) + p.shape
    bad = [d for d in axes if full[d] != 1]
    if bad:
        raise DescriptorError(f"{name}: shape {p.shape} has size {full[bad[0]]} along the normalized axis {bad[0]}; "
                              "the statistics have size 1 along every normalized axis")
    return p


# ----------------------------------------------------------------------------------------------------
# batch normalization

def _bn_layout(x: np.ndarray, channel_axis: Any, params: Tuple[Tuple[str, Optional[np.ndarray]], ...]
               ) -> Tuple[Tuple[int, ...], Tuple[int, ...], int]:
    """(reduced axes, statistics shape, ca for the kernels' 1-D parameters or -1) by batch norm's
    training rules: same-rank parameters (DirectML) give the statistics their shape, else (C,)."""
    nd = x.ndim
    ca = normalize_axis("channel_axis", channel_axis, nd) if nd > 1 else None
    if nd == 1 and not is_int(channel_axis):
        raise DescriptorTypeError(f"channel_axis: expected an int, got {type(channel_axis).__name__}")
    same = None
    for name, p in params:
        if p is None:
            continue
        if p.ndim == nd and all(ps in (xs, 1) for ps, xs in zip(p.shape, x.shape)):
            if same is not None and same[1] != p.shape:
                raise DescriptorError(f"{name}: shape {p.shape} differs from {same[0]}'s {same[1]}; same-rank "
                                      "parameters must have one shape (it is the statistics' shape)")
            same = (name, p.shape)
        elif ca is not None and p.shape == (x.shape[ca],):
            continue
        else:
            raise DescriptorError(
                f"{name}: shape {p.shape} does not fit the input's {x.shape}: it must be 1-D of length C = "
                f"input.shape[channel_axis] or have the input's {nd} dims, each the input's or 1")
    kinds = {(p.ndim == nd) for _, p in params if p is not None}
    if len(kinds) > 1 and nd > 1:
        raise DescriptorError("scale, bias: one is 1-D and the other same-rank; give both in one form")
    if same is not None:  # (no dim of size 1: statistics of one element each)
        return tuple(d for d in range(nd) if same[1][d] == 1), same[1], -1
    if ca is None:
        raise DescriptorAxisError("input: 1-D; batch norm of a 1-D input needs a same-rank (1-D) scale or bias "
                                  "to say which dim holds the channels")
    return tuple(d for d in range(nd) if d != ca), (x.shape[ca],), ca


def _momentum(momentum: Any, convention: Any, num_batches_tracked: Any) -> float:
    if convention not in ("pytorch", "onnx"):
        raise DescriptorError(f"momentum_convention: {value_text(convention)}; use 'pytorch' or 'onnx'")
    if momentum is None:
        return 0.1 if convention == "pytorch" else 0.9
    if isinstance(momentum, str):
        if momentum != "cumulative" or convention != "pytorch":
            raise DescriptorError(f"momentum: {momentum!r}; a float, None, or 'cumulative' (pytorch convention)")
        if num_batches_tracked is None:
            raise DescriptorError("num_batches_tracked: required with momentum='cumulative' (the count of batches "
                                  "including this one)")
        if not is_int(num_batches_tracked) or isinstance(num_batches_tracked, (bool, np.bool_)):
            raise DescriptorTypeError(f"num_batches_tracked: expected an int, got {type(num_batches_tracked).__name__}")
        if int(num_batches_tracked) < 1:
            raise DescriptorError(f"num_batches_tracked: {int(num_batches_tracked)}; it must be >= 1")
        return 1.0 / int(num_batches_tracked)
    if isinstance(momentum, (bool, np.bool_)) or not isinstance(momentum, (int, float, np.integer, np.floating)):
        raise DescriptorTypeError(f"momentum: expected a float, got {type(momentum).__name__}")
    m = float(momentum)
    if not (0.0 <= m <= 1.0):
        raise DescriptorError(f"momentum: {value_text(momentum)}; it must lie in [0, 1]")
    return m


_RUNNING_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _running(r: Any, name: str, shape: Tuple[int, ...], x: np.ndarray) -> np.ndarray:
    if not isinstance(r, np.ndarray) and hasattr(r, "__dlpack__"):  # a torch buffer: updated through a view
        r = dlpack_array(r, name, writeable=True)
    if not isinstance(r, np.ndarray):
        raise DescriptorTypeError(f"{name}: expected a numpy.ndarray (updated in place), got {type(r).__name__}")
    if r.shape != shape:
        raise DescriptorError(f"{name}: shape {r.shape}; the running statistics have the statistics' shape {shape}")
    if r.dtype not in _RUNNING_DTYPES and r.dtype != x.dtype:
        raise DescriptorTypeError(f"{name}: dtype {dtype_name(r.dtype)}; float32, float64 or the input's")
    if not r.flags.writeable:
        raise DescriptorError(f"{name}: read-only; the running statistics are updated in place")
    return r


# ----------------------------------------------------------------------------------------------------
# plans: the rules, on anything with a dtype and a shape (arrays, or the descriptors' stand-ins)

def _plan_bn_training(x: Any, scale: Any, bias: Any, fa: Any, epsilon: Any, activation: Any,
                      channel_axis: Any) -> tuple:
    _input(x)
    _param(scale, "scale", x)
    _param(bias, "bias", x)
    _fused_add(fa, x)
    return (check_epsilon(epsilon, x.dtype), core_tuple(check_activation(activation)))\
        + _bn_layout(x, channel_axis, (("scale", scale), ("bias", bias)))


def _training_mvn_into(x, axes, scale, bias, eps, act, mean, inv_std, ca, var, o, check):  # noqa: ANN001
    """batch_normalization_training's kernel call into o (the statistics into mean, inv_std, var)."""
    return _core.mvn(x, axes, scale, bias, o, eps, True, True, False, act, mean, inv_std, ca, check, var)


def _bn_training_plan(x: Any, scale: Any, bias: Any, fa: Any, epsilon: Any, activation: Any,
                      channel_axis: Any) -> tuple:
    """_plan_bn_training's plan, and what a call derives from the input's shape: the statistics'
    full-rank shape and dtype, and the elements a channel counts."""
    plan = _plan_bn_training(x, scale, bias, fa, epsilon, activation, channel_axis)
    axes = plan[2]
    full = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
    return plan + (full, math.prod(x.shape[d] for d in axes), stats_dtype(x.dtype))


def _plan_bn_backward(x: Any, dy: Any, mean: Any, variance: Any, scale: Any, bias: Any, fa: Any, epsilon: Any,
                      channel_axis: Any, training: Any, activation: Any, grad_input: Any, grad_scale: Any,
                      grad_bias: Any) -> tuple:
    _input(x)
    _grad_output(dy, x)
    for name, p in (("scale", scale), ("bias", bias), ("mean", mean), ("variance", variance)):
        if p is None and name in ("mean", "variance"):
            raise DescriptorTypeError(f"{name}: expected an array, got None; {name} is required")
        _param(p, name, x)
    _fused_add(fa, x)
    eps = check_epsilon(epsilon, x.dtype)
    act = _backward_activation(activation)
    terms = check_bool("training", training)
    layout: Tuple[Tuple[str, Optional[np.ndarray]], ...] = (("scale", scale), ("bias", bias))
    if x.ndim == 1 and scale is None and bias is None:  # (a 1-D input: its given statistics say where its
        try:                                              # channels are, as in the forward op)
            layout = (("mean", np.broadcast_to(mean, np.broadcast_shapes(mean.shape, variance.shape))),)
        except ValueError:
            layout = (("mean", mean),)  # (variance's shape is then refused below)
    try:
        axes, sshape, ca = _bn_layout(x, channel_axis, layout)
        for name, st in (("mean", mean), ("variance", variance)):
            if st.shape != sshape and not (st.shape == (1,) * len(sshape)):
                raise DescriptorError(f"{name}: shape {st.shape}; the statistics have shape {sshape}")
    except DescriptorError as e:
        if isinstance(e, (DescriptorAxisError, DescriptorTypeError)):
            raise
        axes, ca = _given_stats_layout(x, channel_axis, mean, variance, scale, bias, e)
    return (eps, act, terms, axes, ca) + _gradients_wanted(grad_input, grad_scale, grad_bias, scale, bias)


def _given_stats_layout(x: Any, channel_axis: Any, mean: Any, variance: Any, scale: Any, bias: Any,
                        error: DescriptorError) -> Tuple[Tuple[int, ...], int]:
    """Batch norm backward's layout read from the statistics, where the parameters' forms do not
    give theirs: each of the four by the forward op's rule (the input's rank, or 1-D of C at
    channel_axis), the statistics taken over the dims where both have size 1. (reduced axes, ca);
    the parameters' error when the statistics do not fit either."""
    nd = x.ndim
    ca = normalize_axis("channel_axis", channel_axis, nd) if nd > 1 else None
    try:
        forms = {name: bn_param_rule(name, p.shape, x.shape, ca)
                 for name, p in (("mean", mean), ("variance", variance), ("scale", scale), ("bias", bias))
                 if p is not None}
    except DescriptorError:
        raise error from None
    full = [p.shape if forms[name] is None else _full_shape(p.shape, nd, ca)
            for name, p in (("mean", mean), ("variance", variance))]
    stats = np.broadcast_shapes(*full)
    return tuple(d for d in range(nd) if stats[d] == 1), -1 if ca is None else ca


def _plan_mvn_backward(x: Any, dy: Any, axes: Any, mean: Any, inv_std: Any, scale: Any, bias: Any,
                       normalize_mean: Any, normalize_variance: Any, epsilon: Any, epsilon_mode: Any,
                       activation: Any, grad_input: Any, grad_scale: Any, grad_bias: Any) -> tuple:
    _input(x)
    _grad_output(dy, x)
    axes_t = normalize_axes(axes, x.ndim)
    for name, p in (("scale", scale), ("bias", bias)):
        if p is not None:
            _param(p, name, x)
            mvn_param_rule(name, p.shape, x.shape)
    nm = check_bool("normalize_mean", normalize_mean)
    nv = check_bool("normalize_variance", normalize_variance)
    if nm:
        _stats(mean, "mean", x, axes_t)
    if nv:
        _stats(inv_std, "inv_std", x, axes_t)
    outside = check_epsilon_mode(epsilon_mode)
    return (axes_t, nm, nv, check_epsilon(epsilon, x.dtype, outside), outside,
            _backward_activation(activation)) + _gradients_wanted(grad_input, grad_scale, grad_bias, scale, bias)



@documented
def batch_normalization_training(x: Any, scale: Any = None, bias: Any = None, *, epsilon: float = 1e-5,
                                 channel_axis: int = 1, fused_add: Any = None, activation: ActivationLike = None,
                                 running_mean: Optional[np.ndarray] = None, running_var: Optional[np.ndarray] = None,
                                 momentum: Any = None, momentum_convention: str = "pytorch",
                                 num_batches_tracked: Optional[int] = None,
                                 out: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch normalization with the batch's own statistics (training).

    The mean and population variance are taken over every dim but ``channel_axis`` (with scale or
    bias of the input's rank, over the dims where they have size 1), then ``out = activation(scale *
    (x - mean) / sqrt(variance + epsilon) + bias + fused_add)``. The running statistics, when given,
    are updated in place afterwards (and left untouched when the call raises).

    Parameters
    ----------
    {x}
    scale, bias : array_like, optional
        1-D of length C, or of the input's rank with each dim the input's or 1; both of one shape.
    fused_add : array_like, optional
        Added before the activation (DirectML's FusedAdd): the input's dtype or float32,
        broadcastable to the input.
    running_mean, running_var : ndarray, optional
        Given together: writeable, of the statistics' shape, float32, float64 or the input's dtype.
    momentum : float or "cumulative", optional
        "pytorch" convention: ``r = (1 - m) r + m batch`` with the unbiased variance, m = 0.1 by
        default; "cumulative" averages over ``num_batches_tracked`` batches (this one included).
        "onnx" convention: ``r = m r + (1 - m) batch`` with the population variance, m = 0.9.
    momentum_convention : {{"pytorch", "onnx"}}
    num_batches_tracked : int, optional
        With ``momentum="cumulative"``: the count of batches, this one included.
    {common}
    channel_axis : int, default 1

    Returns
    -------
    (ndarray, ndarray, ndarray)
        ``(out, mean, variance)``: the statistics are float32 (float64 for float64 data), of shape
        (C,) or of the same-rank parameters' shape.

    {raises}

    Examples
    --------
    >>> import numpy as np, simdnorm
    >>> x = np.array([[1.0, 10.0], [3.0, 30.0]], np.float32)  # (N, C) = (2, 2)
    >>> rm, rv = np.zeros(2, np.float32), np.ones(2, np.float32)
    >>> y, mean, var = simdnorm.batch_normalization_training(x, epsilon=0.0, running_mean=rm, running_var=rv)
    >>> print(y)
    [[-1. -1.]
     [ 1.  1.]]
    >>> print(mean, var, rm, rv)
    [ 2. 20.] [  1. 100.] [0.2 2. ] [ 1.1 20.9]
    """
    if (x.__class__ is not _nd and is_tensor(x)) or (out is not None and is_foreign_out(out)):
        return follow_input(batch_normalization_training, locals())  # torch in, torch out (SPEC section 10)
    x, _, scale, bias, fa = _as_arrays(x, None, ("scale", scale), ("bias", bias), ("fused_add", fused_add))
    try:
        key: Any = ("bn_training", _k(x), _k(scale), _k(bias), _k(fa), _a(epsilon), _a(activation), _a(channel_axis))
    except TypeError:
        key = []

    plan = _planned(key, _bn_training_plan, x, scale, bias, fa, epsilon, activation, channel_axis)
    return _bn_training_run(plan, x, scale, bias, fa, running_mean, running_var, momentum, momentum_convention,
                            num_batches_tracked, out)


def _bn_training_run(plan: tuple, x: np.ndarray, scale: Any, bias: Any, fa: Any, running_mean: Any, running_var: Any,
                     momentum: Any, momentum_convention: Any, num_batches_tracked: Any, out: Any) -> tuple:
    """batch_normalization_training with its plan (_bn_training_plan's), the arrays converted."""
    eps, act, axes, sshape, ca, full, count, sdt = plan
    if fa is not None:  # (then numpy reads fused_add, with 16-bit data scale and bias, and writes out itself)
        for name, a in (("scale", scale), ("bias", bias), ("fused_add", fa), ("out", out)):
            if a is not None:
                check_extent(name, a)
        if out is not None:
            check_out(out, x)
    if (running_mean is None) != (running_var is None):
        raise DescriptorError("running_mean, running_var: give both or neither")
    m = 0.0
    if running_mean is not None:
        running_mean = _running(running_mean, "running_mean", sshape, x)
        running_var = _running(running_var, "running_var", sshape, x)
        m = _momentum(momentum, momentum_convention, num_batches_tracked)
        if count == 1:
            raise DescriptorError("running_var: the statistics are over 1 element per channel, whose unbiased "
                                  "variance is undefined")
    target, copy_to = (np.empty_like(x, subok=False), None) if out is None else (out, None)
    if out is not None:
        if out.__class__ is not _nd or out.shape != x.shape or out.dtype != x.dtype or not out.flags.writeable:
            check_out(out, x)
        # fused_add is read after out is written: checked here; else the kernel checks the others
        if fa is not None and needs_temporary(out, x, scale, bias, fa):
            target, copy_to = np.empty_like(x, subok=False), out
    mean = np.empty(full, sdt)
    inv_std = np.empty(full, sdt)
    var = np.empty(full, sdt)
    if fa is None or x.dtype == sdt:
        run = partial(_training_mvn_into, x, axes, scale, bias, eps, _IDENTITY if fa is not None else act, mean,
                      inv_std, ca, var)  # (not a closure: see _planned)
        if target is not out or fa is not None:
            run(target, False)
        elif not run(out, True):  # out may overlap x, scale or bias: decided exactly
            if needs_temporary(out, x, scale, bias):
                target, copy_to = np.empty_like(x, subok=False), out
            run(target, False)
        pre = target
    else:  # 16-bit data: the sum taken in float32, rounded once at the end
        pre = np.empty(x.shape, sdt)
        # (the statistics only: the normalized values go to a scratch array, as out may be x)
        _core.mvn(x, axes, None, None, np.empty_like(x), eps, True, True, False, _IDENTITY, mean, inv_std, ca, False,
                  var)
        np.subtract(x, mean, out=pre, dtype=sdt)
        np.multiply(pre, inv_std, out=pre)
        if scale is not None:
            np.multiply(pre, scale.reshape(_full_shape(scale.shape, x.ndim, ca)), out=pre, casting="unsafe")
        if bias is not None:
            np.add(pre, bias.reshape(_full_shape(bias.shape, x.ndim, ca)), out=pre, casting="unsafe")
    if fa is not None:
        np.add(pre, fa, out=pre, casting="unsafe")
        if act != _IDENTITY:  # in place: act(fma(y - 0, 1 / sqrt(1 + 0), 0)) is act(y)
            zero, one = np.zeros(1, sdt), np.ones(1, sdt)
            _core.batch_norm(pre, zero, one, None, None, pre, 0.0, act, 0, False)
        if pre is not target:
            np.copyto(target, pre, casting="unsafe")
    if copy_to is not None:
        np.copyto(copy_to, target)
        target = copy_to
    mean = mean.reshape(sshape)
    var = var.reshape(sshape)
    if running_mean is not None and count > 0:
        update_running(running_mean, running_var, mean, var, count, m, momentum_convention)
    return target, mean, var


def update_running(running_mean: np.ndarray, running_var: np.ndarray, mean: np.ndarray, var: np.ndarray,
                   count: int, m: float, convention: str) -> None:
    """The running statistics' update in float64, each result rounded once into its buffer:
    PyTorch's convention (momentum m, the unbiased variance of count > 1 elements) or ONNX's."""
    # C-contiguous float32/float64 buffers: the same arithmetic in one call (numpy's takes a dozen)
    if _core.update_running(running_mean, running_var, mean, var, count, m, convention == "pytorch"):
        return
    bm, bv = mean.astype(np.float64), var.astype(np.float64)
    rm, rv = running_mean.astype(np.float64), running_var.astype(np.float64)
    if convention == "pytorch":
        rm = (1.0 - m) * rm + m * bm
        rv = (1.0 - m) * rv + m * bv * (count / (count - 1))
    else:
        rm = m * rm + (1.0 - m) * bm
        rv = m * rv + (1.0 - m) * bv
    running_mean[...] = rm
    running_var[...] = rv


_BACKWARD_DOC = """grad_output : array_like
        The gradient of the loss with respect to the forward's output: the input's shape and dtype.
    activation : str or Activation, optional
        The forward's fused activation: None, "relu", "leaky_relu", "silu" or "gelu"; its
        derivative is taken at the pre-activation value, recomputed from the input.
    grad_input : bool, default True
        Compute the input's gradient.
    grad_scale, grad_bias : bool, optional
        Compute the parameter's gradient; None means "when that parameter is given".
    out : ndarray, optional
        Receives grad_input: the input's shape and dtype, any strides; not the input itself
        (another overlap gives the result as if there were none)."""


def _documented_backward(fn: Any) -> Any:
    if fn.__doc__:
        fn.__doc__ = fn.__doc__.replace("{backward}", _BACKWARD_DOC)
    return documented(fn)


@_documented_backward
def batch_normalization_backward(grad_output: Any, x: Any, mean: Any, variance: Any, scale: Any = None,
                                 bias: Any = None, *, epsilon: float = 1e-5, channel_axis: int = 1,
                                 training: bool = True, fused_add: Any = None, activation: ActivationLike = None,
                                 grad_input: bool = True, grad_scale: Optional[bool] = None,
                                 grad_bias: Optional[bool] = None, out: Optional[np.ndarray] = None) -> tuple:
    """The gradients of batch normalization.

    With ``training=True`` the statistics are the batch's (:func:`batch_normalization_training`),
    and the input's gradient takes their dependence on it; with ``training=False`` they are
    constants (:func:`batch_normalization`): ``grad_input = grad_output * act'(pre) * scale /
    sqrt(variance + epsilon)``.

    Parameters
    ----------
    {backward}
    {x}
    mean, variance : array_like
        The statistics the forward used (its returned mean and variance when training).
    scale, bias, fused_add : array_like, optional
        As given to the forward.
    epsilon : float, default 1e-5
    channel_axis : int, default 1
    training : bool, default True

    Returns
    -------
    tuple
        ``(grad_input, grad_scale, grad_bias)``, each None when not asked for, and
        ``grad_fused_add`` last when fused_add is given.

    {raises}

    Examples
    --------
    >>> import numpy as np, simdnorm
    >>> x = np.array([[1.0], [3.0]], np.float32)
    >>> y, mean, var = simdnorm.batch_normalization_training(x, epsilon=0.0)
    >>> gi, gs, gb = simdnorm.batch_normalization_backward(np.array([[1.0], [0.0]], np.float32), x, mean, var,
    ...                                                     epsilon=0.0)
    >>> print(gi.ravel())
    [0. 0.]
    """
    if (x.__class__ is not _nd and is_tensor(x)) or (out is not None and is_foreign_out(out)):
        return follow_input(batch_normalization_backward, locals())
    x, dy, mean, variance, scale, bias, fa = _as_arrays(
        x, grad_output, ("mean", mean), ("variance", variance), ("scale", scale), ("bias", bias), ("fused_add", fused_add))
    try:
        key: Any = ("bn_backward", _k(x), _k(dy), _k(mean), _k(variance), _k(scale), _k(bias), _k(fa), _a(epsilon),
                    _a(channel_axis), _a(training), _a(activation), _a(grad_input), _a(grad_scale), _a(grad_bias))
    except TypeError:
        key = []

    plan = _planned(key, _bn_backward_sums_plan, x, dy, mean, variance, scale, bias, fa, epsilon, channel_axis,
                    training, activation, grad_input, grad_scale, grad_bias)
    return _bn_backward_run(plan, out, x, dy, mean, variance, scale, bias, fa)


def _bn_backward_run(plan: tuple, out: Any, x: np.ndarray, dy: np.ndarray, mean: Any, variance: Any, scale: Any,
                     bias: Any, fa: Any) -> tuple:
    eps, act, terms, axes, ca, want_input, sums = plan
    target, copy_to = _targets(out, want_input, x, dy, mean, variance, scale, bias, fa)
    return _finish(_backward(dy, x, axes, mean, variance, scale, bias, fa, target, sums, eps, True, True, False, act,
                             terms, ca, variance_given=True), copy_to)


@_documented_backward
def mean_variance_normalization_backward(grad_output: Any, x: Any, axes: Any, mean: Any, inv_std: Any,
                                         scale: Any = None, bias: Any = None, *, normalize_mean: bool = True,
                                         normalize_variance: bool = True, epsilon: float = 1e-5,
                                         epsilon_mode: str = "inside", activation: ActivationLike = None,
                                         grad_input: bool = True, grad_scale: Optional[bool] = None,
                                         grad_bias: Optional[bool] = None, out: Optional[np.ndarray] = None) -> tuple:
    """The gradients of :func:`mean_variance_normalization`.

    ``grad_input = inv_std * (g - mean(g) - k * y * mean(g * y))`` over ``axes``, with ``g =
    grad_output * act'(pre) * scale``, ``y`` the normalized input and ``k = 1`` (``k = 1 / (1 -
    epsilon * inv_std)`` with epsilon outside the root); ``grad_scale`` and ``grad_bias`` are the
    sums of ``grad_output * act'(pre) * y`` and ``grad_output * act'(pre)`` over the dims each
    parameter broadcasts along, in its shape and dtype.

    Parameters
    ----------
    {backward}
    {x}
    axes : int or sequence of int
        The forward's axes.
    mean, inv_std : array_like or None
        What the forward returned with ``return_stats=True`` (None where it returned None).
    scale, bias : array_like, optional
    normalize_mean, normalize_variance, epsilon, epsilon_mode
        As given to the forward.

    Returns
    -------
    tuple
        ``(grad_input, grad_scale, grad_bias)``, each None when not asked for.

    {raises}

    Examples
    --------
    >>> import numpy as np, simdnorm
    >>> x = np.array([[1.0, 2.0, 4.0]], np.float32)
    >>> y, mean, inv_std = simdnorm.mean_variance_normalization(x, 1, return_stats=True)
    >>> gi, _, _ = simdnorm.mean_variance_normalization_backward(np.ones_like(x), x, 1, mean, inv_std)
    >>> print(np.abs(gi).max() < 1e-6)  # a constant gradient moves no normalized value
    True
    """
    if (x.__class__ is not _nd and is_tensor(x)) or (out is not None and is_foreign_out(out)):
        return follow_input(mean_variance_normalization_backward, locals())
    x, dy, mean, inv_std, scale, bias = _as_arrays(
        x, grad_output, ("mean", mean), ("inv_std", inv_std), ("scale", scale), ("bias", bias))
    try:
        key: Any = ("mvn_backward", _k(x), _k(dy), _axes_key(axes), _k(mean), _k(inv_std), _k(scale), _k(bias),
                    _a(normalize_mean), _a(normalize_variance), _a(epsilon), _a(epsilon_mode), _a(activation),
                    _a(grad_input), _a(grad_scale), _a(grad_bias))
    except TypeError:
        key = []

    plan = _planned(key, _mvn_backward_plan, x, dy, axes, mean, inv_std, scale, bias, normalize_mean,
                    normalize_variance, epsilon, epsilon_mode, activation, grad_input, grad_scale, grad_bias)
    return _mvn_backward_run(plan, out, x, dy, mean, inv_std, scale, bias)


def _bn_backward_sums_plan(x: Any, dy: Any, mean: Any, variance: Any, scale: Any, bias: Any, fa: Any, epsilon: Any,
                           channel_axis: Any, training: Any, activation: Any, grad_input: Any, grad_scale: Any,
                           grad_bias: Any) -> tuple:
    """batch_normalization_backward's plan with its sums' plan."""
    eps, act, terms, axes, ca, want_input, ws, wb = _plan_bn_backward(
        x, dy, mean, variance, scale, bias, fa, epsilon, channel_axis, training, activation, grad_input, grad_scale,
        grad_bias)
    return eps, act, terms, axes, ca, want_input, _sums_plan(x.shape, scale, bias, ca, ws, wb)


def _trailing_backward_plan(x: Any, dy: Any, axis: Any, mean: Any, inv_std: Any, scale: Any, bias: Any,
                            normalize_mean: bool, epsilon: Any, activation: Any, grad_input: Any, grad_scale: Any,
                            grad_bias: Any) -> tuple:
    """layer_norm_backward's and rms_norm_backward's plan: MVN's over the dims from axis."""
    return _mvn_backward_plan(x, dy, trailing_axes_rule(x, axis), mean, inv_std, scale, bias, normalize_mean, True,
                              epsilon, "inside", activation, grad_input, grad_scale, grad_bias)


def _mvn_backward_plan(x: Any, dy: Any, axes: Any, mean: Any, inv_std: Any, scale: Any, bias: Any,
                       normalize_mean: Any, normalize_variance: Any, epsilon: Any, epsilon_mode: Any,
                       activation: Any, grad_input: Any, grad_scale: Any, grad_bias: Any) -> tuple:
    """The cached plan of MVN's backward and of layer and RMS norm's (which call it with their axes)."""
    axes_t, nm, nv, eps, eo, act, want_input, ws, wb = _plan_mvn_backward(
        x, dy, axes, mean, inv_std, scale, bias, normalize_mean, normalize_variance, epsilon, epsilon_mode, activation,
        grad_input, grad_scale, grad_bias)
    return axes_t, nm, nv, eps, eo, act, want_input, _sums_plan(x.shape, scale, bias, -1, ws, wb)


def _mvn_backward_run(plan: tuple, out: Any, x: np.ndarray, dy: np.ndarray, mean: Any, inv_std: Any, scale: Any,
                      bias: Any) -> tuple:
    axes_t, nm, nv, eps, eo, act, want_input, sums = plan
    mean = mean if nm else None
    inv_std = inv_std if nv else None
    target, copy_to = _targets(out, want_input, x, dy, mean, inv_std, scale, bias)
    return _finish(_backward(dy, x, axes_t, mean, inv_std, scale, bias, None, target, sums, eps, nm, nv, eo, act,
                             True, -1), copy_to)


@_documented_backward
def layer_norm_backward(grad_output: Any, x: Any, mean: Any, inv_std: Any, scale: Any = None, bias: Any = None, *,
                        axis: int = -1, epsilon: float = 1e-5, activation: ActivationLike = None,
                        grad_input: bool = True, grad_scale: Optional[bool] = None, grad_bias: Optional[bool] = None,
                        out: Optional[np.ndarray] = None) -> tuple:
    """The gradients of :func:`layer_norm` (over the dims ``axis .. ndim-1``).

    Parameters
    ----------
    {backward}
    {x}
    mean, inv_std : array_like
        What ``layer_norm(..., return_stats=True)`` returned.
    scale, bias : array_like, optional
    axis : int, default -1
    epsilon : float, default 1e-5

    Returns
    -------
    tuple
        ``(grad_input, grad_scale, grad_bias)``.

    {raises}

    Examples
    --------
    >>> import numpy as np, simdnorm
    >>> x, g = np.array([[1.0, 3.0]], np.float32), np.array([2.0, 2.0], np.float32)
    >>> y, mean, inv_std = simdnorm.layer_norm(x, g, epsilon=0.0, return_stats=True)
    >>> gi, gs, gb = simdnorm.layer_norm_backward(np.array([[1.0, 0.0]], np.float32), x, mean, inv_std, g,
    ...                                           epsilon=0.0)
    >>> print(gs, gb)
    [-1.  0.] None
    """
    if (x.__class__ is not _nd and is_tensor(x)) or (out is not None and is_foreign_out(out)):
        return follow_input(layer_norm_backward, locals())
    x, dy, mean, inv_std, scale, bias = _as_arrays(
        x, grad_output, ("mean", mean), ("inv_std", inv_std), ("scale", scale), ("bias", bias))
    key = ("layer_backward", _k(x), _k(dy), _k(mean), _k(inv_std), _k(scale), _k(bias), _a(axis), _a(epsilon),
           _a(activation), _a(grad_input), _a(grad_scale), _a(grad_bias))  # (unhashable: _planned validates)
    plan = _planned(key, _trailing_backward_plan, x, dy, axis, mean, inv_std, scale, bias, True, epsilon, activation,
                    grad_input, grad_scale, grad_bias)
    return _mvn_backward_run(plan, out, x, dy, mean, inv_std, scale, bias)


@_documented_backward
def rms_norm_backward(grad_output: Any, x: Any, inv_rms: Any, scale: Any = None, *, axis: int = -1,
                      epsilon: float = 1e-5, activation: ActivationLike = None, grad_input: bool = True,
                      grad_scale: Optional[bool] = None, grad_bias: Optional[bool] = None,
                      out: Optional[np.ndarray] = None) -> tuple:
    """The gradients of :func:`rms_norm`. ``grad_bias`` is always None (RMS norm has no bias).

    Parameters
    ----------
    {backward}
    {x}
    inv_rms : array_like
        What ``rms_norm(..., return_stats=True)`` returned last.
    scale : array_like, optional
    axis : int, default -1
    epsilon : float, default 1e-5

    Returns
    -------
    tuple
        ``(grad_input, grad_scale, None)``.

    {raises}

    Examples
    --------
    >>> import numpy as np, simdnorm
    >>> x = np.array([[3.0, 4.0]], np.float32)
    >>> y, _, inv_rms = simdnorm.rms_norm(x, epsilon=0.0, return_stats=True)
    >>> gi, _, _ = simdnorm.rms_norm_backward(y, x, inv_rms, epsilon=0.0)  # y is orthogonal to its own change
    >>> print(np.abs(gi).max() < 1e-6)
    True
    """
    if (x.__class__ is not _nd and is_tensor(x)) or (out is not None and is_foreign_out(out)):
        return follow_input(rms_norm_backward, locals())
    if grad_bias is not None and check_bool("grad_bias", grad_bias):
        raise DescriptorError("grad_bias=True: RMS norm has no bias")
    x, dy, inv_rms, scale = _as_arrays(x, grad_output, ("inv_rms", inv_rms), ("scale", scale))
    key = ("rms_backward", _k(x), _k(dy), _k(inv_rms), _k(scale), _a(axis), _a(epsilon), _a(activation),
           _a(grad_input), _a(grad_scale))
    plan = _planned(key, _trailing_backward_plan, x, dy, axis, None, inv_rms, scale, None, False, epsilon, activation,
                    grad_input, grad_scale, False)
    return _mvn_backward_run(plan, out, x, dy, None, inv_rms, scale, None)


def _plan_instance_backward(x: Any, dy: Any, mean: Any, inv_std: Any, scale: Any, bias: Any, channel_axis: Any,
                            epsilon: Any, activation: Any, grad_input: Any, grad_scale: Any, grad_bias: Any) -> tuple:
    """instance norm: statistics shaped like x with the spatial dims 1; scale and bias (C,) at ca."""
    ca = channel_axis_rule(x, channel_axis, "instance_norm")
    axes = spatial_axes_rule(x, ca)
    _grad_output(dy, x)
    _param(scale, "scale", x)
    _param(bias, "bias", x)
    c = x.shape[ca]
    per_channel_rule("scale", scale, c, "instance_norm")
    per_channel_rule("bias", bias, c, "instance_norm")
    _stats(mean, "mean", x, axes)
    _stats(inv_std, "inv_std", x, axes)
    return (axes, ca, check_epsilon(epsilon, x.dtype),
            _backward_activation(activation)) + _gradients_wanted(grad_input, grad_scale, grad_bias, scale, bias)


@_documented_backward
def instance_norm_backward(grad_output: Any, x: Any, mean: Any, inv_std: Any, scale: Any = None, bias: Any = None,
                           *, channel_axis: int = 1, epsilon: float = 1e-5, activation: ActivationLike = None,
                           grad_input: bool = True, grad_scale: Optional[bool] = None,
                           grad_bias: Optional[bool] = None, out: Optional[np.ndarray] = None) -> tuple:
    """The gradients of :func:`instance_norm`.

    Parameters
    ----------
    {backward}
    {x}
    mean, inv_std : array_like
        What ``instance_norm(..., return_stats=True)`` returned.
    scale, bias : array_like, optional
        Of shape (C,).
    channel_axis : int, default 1
    epsilon : float, default 1e-5

    Returns
    -------
    tuple
        ``(grad_input, grad_scale, grad_bias)``.

    {raises}
    """
    if (x.__class__ is not _nd and is_tensor(x)) or (out is not None and is_foreign_out(out)):
        return follow_input(instance_norm_backward, locals())
    x, dy, mean, inv_std, scale, bias = _as_arrays(
        x, grad_output, ("mean", mean), ("inv_std", inv_std), ("scale", scale), ("bias", bias))
    try:
        key: Any = ("instance_backward", _k(x), _k(dy), _k(mean), _k(inv_std), _k(scale), _k(bias), _a(channel_axis),
                    _a(epsilon), _a(activation), _a(grad_input), _a(grad_scale), _a(grad_bias))
    except TypeError:
        key = []
    axes, ca, eps, act, want_input, sums = _planned(
        key, _instance_backward_sums_plan, x, dy, mean, inv_std, scale, bias, channel_axis, epsilon, activation,
        grad_input, grad_scale, grad_bias)
    target, copy_to = _targets(out, want_input, x, dy, mean, inv_std, scale, bias)
    return _finish(_backward(dy, x, axes, mean, inv_std, scale, bias, None, target, sums, eps, True, True, False, act,
                             True, ca), copy_to)


def _instance_backward_sums_plan(x: Any, dy: Any, mean: Any, inv_std: Any, scale: Any, bias: Any, channel_axis: Any,
                                 epsilon: Any, activation: Any, grad_input: Any, grad_scale: Any,
                                 grad_bias: Any) -> tuple:
    """instance_norm_backward's plan with its sums' plan."""
    axes, ca, eps, act, want_input, ws, wb = _plan_instance_backward(
        x, dy, mean, inv_std, scale, bias, channel_axis, epsilon, activation, grad_input, grad_scale, grad_bias)
    return axes, ca, eps, act, want_input, _sums_plan(x.shape, scale, bias, ca, ws, wb)


def _group_backward_sums_plan(x: Any, dy: Any, num_groups: Any, mean: Any, inv_std: Any, scale: Any, bias: Any,
                              channel_axis: Any, epsilon: Any, activation: Any, grad_input: Any, grad_scale: Any,
                              grad_bias: Any) -> tuple:
    """group_norm_backward's plan with its sums' plan, summed over the split views (the parameters
    at (G, C/G), no channel axis)."""
    ca, c, g, k, sshape, pshape, axes, eps, act, want_input, ws, wb = _plan_group_backward(
        x, dy, num_groups, mean, inv_std, scale, bias, channel_axis, epsilon, activation, grad_input, grad_scale,
        grad_bias)
    split = x.shape[:ca] + (g, k) + x.shape[ca + 1:]
    params = [None if p is None else np.broadcast_to(np.zeros((), p.dtype), pshape) for p in (scale, bias)]
    return ca, c, g, k, sshape, pshape, axes, eps, act, want_input, _sums_plan(split, *params, -1, ws, wb)


def _plan_group_backward(x: Any, dy: Any, num_groups: Any, mean: Any, inv_std: Any, scale: Any, bias: Any,
                         channel_axis: Any, epsilon: Any, activation: Any, grad_input: Any, grad_scale: Any,
                         grad_bias: Any) -> tuple:
    """group norm through (..., G, C/G, ...) views: statistics (N, G) viewed at the split rank."""
    ca, c, g, k, pshape, axes = group_split(x, num_groups, channel_axis)
    _grad_output(dy, x)
    _param(scale, "scale", x)
    _param(bias, "bias", x)
    per_channel_rule("scale", scale, c, "group_norm")
    per_channel_rule("bias", bias, c, "group_norm")
    n = x.shape[0]
    vnd = x.ndim + 1
    if vnd > MAX_DIMS + 1:  # pragma: no cover - the input's own rule caps it first
        raise DescriptorError("input: too many dims")
    sshape = (n,) + (1,) * (ca - 1) + (g,) + (1,) * (vnd - ca - 1)
    for name, st in (("mean", mean), ("inv_std", inv_std)):
        if st is None:
            raise DescriptorTypeError(f"{name}: expected an array, got None; {name} is required")
        _param(st, name, x)
        if st.shape != (n, g):
            raise DescriptorError(f"{name}: shape {st.shape}; group_norm's statistics have shape (N, num_groups) = "
                                  f"({n}, {g})")
    return (ca, c, g, k, sshape, pshape, axes, check_epsilon(epsilon, x.dtype),
            _backward_activation(activation)) + _gradients_wanted(grad_input, grad_scale, grad_bias, scale, bias)


@_documented_backward
def group_norm_backward(grad_output: Any, x: Any, num_groups: int, mean: Any, inv_std: Any, scale: Any = None,
                        bias: Any = None, *, channel_axis: int = 1, epsilon: float = 1e-5,
                        activation: ActivationLike = None, grad_input: bool = True, grad_scale: Optional[bool] = None,
                        grad_bias: Optional[bool] = None, out: Optional[np.ndarray] = None) -> tuple:
    """The gradients of :func:`group_norm`, through the same (..., G, C/G, ...) views, never copies.

    Parameters
    ----------
    {backward}
    {x}
    num_groups : int
    mean, inv_std : array_like
        What ``group_norm(..., return_stats=True)`` returned: shape (N, num_groups).
    scale, bias : array_like, optional
        Of shape (C,).
    channel_axis : int, default 1
    epsilon : float, default 1e-5

    Returns
    -------
    tuple
        ``(grad_input, grad_scale, grad_bias)``.

    {raises}
    """
    if (x.__class__ is not _nd and is_tensor(x)) or (out is not None and is_foreign_out(out)):
        return follow_input(group_norm_backward, locals())
    x, dy, mean, inv_std, scale, bias = _as_arrays(
        x, grad_output, ("mean", mean), ("inv_std", inv_std), ("scale", scale), ("bias", bias))
    try:
        key: Any = ("group_backward", _k(x), _k(dy), _a(num_groups), _k(mean), _k(inv_std), _k(scale), _k(bias),
                    _a(channel_axis), _a(epsilon), _a(activation), _a(grad_input), _a(grad_scale), _a(grad_bias))
    except TypeError:
        key = []
    ca, c, g, k, sshape, pshape, axes, eps, act, want_input, sums = _planned(
        key, _group_backward_sums_plan, x, dy, num_groups, mean, inv_std, scale, bias, channel_axis, epsilon,
        activation, grad_input, grad_scale, grad_bias)
    stats = [mean.reshape(sshape), inv_std.reshape(sshape)]
    xv = split_view(x, ca, g, k)
    dv = split_view(dy, ca, g, k)
    target, copy_to = _targets(out, want_input, x, dy, scale, bias, *stats)
    sv = None if scale is None else scale.reshape(pshape)
    bv = None if bias is None else bias.reshape(pshape)
    tv = None if target is None else split_view(target, ca, g, k)
    _, gs, gb = _backward(dv, xv, axes, stats[0], stats[1], sv, bv, None, tv, sums, eps, True, True, False, act,
                          True, -1)
    gi = _finish((target,), copy_to)[0]
    return (gi, None if gs is None else gs.reshape(c), None if gb is None else gb.reshape(c))


# ----------------------------------------------------------------------------------------------------
# descriptors and compiled operators

def _stand_in(d: Any, name: str, role: str = "param") -> Any:
    """An array of the descriptor's dtype and sizes that takes no memory: the rules read only those."""
    if d is None:
        return None
    if not isinstance(d, TensorDesc):
        raise DescriptorTypeError(f"{name}: expected a TensorDesc or None, got {type(d).__name__}")
    d._check(name, role)
    return np.broadcast_to(np.zeros((), d.dtype), d.sizes)


class _TrainingDesc:
    """What the three descriptors share: validate() and the plan it caches."""

    _fields: Tuple[str, ...] = ()

    def __init__(self, **values: Any) -> None:
        for k, v in values.items():
            object.__setattr__(self, k, v)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self._fields) + ")"

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and all(getattr(self, k) == getattr(other, k) for k in self._fields)

    def __hash__(self) -> int:
        return hash(tuple(repr(getattr(self, k)) for k in self._fields))

    def __reduce__(self) -> Any:
        return (_rebuild_desc, (type(self), {k: getattr(self, k) for k in self._fields}))

    def validate(self) -> None:
        """Raise DescriptorError (naming the field and the rule) unless every rule holds."""
        self._validated()

    def _validated(self) -> Any:
        plan = self.__dict__.get("_plan")
        if plan is None:
            plan = self._plan()
            object.__setattr__(self, "_plan", plan)
        return plan

    def _plan(self) -> Any:  # pragma: no cover - each descriptor has its own
        raise NotImplementedError


def _rebuild_desc(cls: Any, values: dict) -> Any:
    obj = cls.__new__(cls)
    _TrainingDesc.__init__(obj, **values)
    return obj


class BatchNormalizationTrainingDesc(_TrainingDesc):
    """Batch normalization with batch statistics (DirectML BATCH_NORMALIZATION_TRAINING): compile it
    into ``op(x, scale=None, bias=None, fused_add=None, *, running_mean=None, running_var=None,
    momentum=None, momentum_convention="pytorch", num_batches_tracked=None, out=None)``."""

    _fields = ("input", "scale", "bias", "fused_add", "epsilon", "activation", "channel_axis")

    def __init__(self, input: TensorDesc, scale: Optional[TensorDesc] = None, bias: Optional[TensorDesc] = None,
                 fused_add: Optional[TensorDesc] = None, *, epsilon: float = 1e-5, activation: ActivationLike = None,
                 channel_axis: int = 1) -> None:
        super().__init__(input=input, scale=scale, bias=bias, fused_add=fused_add, epsilon=epsilon,
                         activation=activation, channel_axis=channel_axis)

    def _plan(self) -> Any:
        x = _stand_in(self.input, "input", "data")
        return _plan_bn_training(x, _stand_in(self.scale, "scale"), _stand_in(self.bias, "bias"),
                                 _stand_in(self.fused_add, "fused_add"), self.epsilon, self.activation,
                                 self.channel_axis)


class BatchNormalizationGradDesc(_TrainingDesc):
    """The gradients of batch normalization (DirectML BATCH_NORMALIZATION_GRAD with
    ``training=False``, _TRAINING_GRAD with ``training=True``): compile it into ``op(grad_output, x,
    mean, variance, scale=None, bias=None, fused_add=None, *, out=None)``."""

    _fields = ("input", "mean", "variance", "scale", "bias", "fused_add", "epsilon", "channel_axis", "training",
               "activation", "grad_input", "grad_scale", "grad_bias")

    def __init__(self, input: TensorDesc, mean: TensorDesc, variance: TensorDesc, scale: Optional[TensorDesc] = None,
                 bias: Optional[TensorDesc] = None, fused_add: Optional[TensorDesc] = None, *,
                 epsilon: float = 1e-5, channel_axis: int = 1, training: bool = True,
                 activation: ActivationLike = None, grad_input: bool = True, grad_scale: Optional[bool] = None,
                 grad_bias: Optional[bool] = None) -> None:
        super().__init__(input=input, mean=mean, variance=variance, scale=scale, bias=bias, fused_add=fused_add,
                         epsilon=epsilon, channel_axis=channel_axis, training=training, activation=activation,
                         grad_input=grad_input, grad_scale=grad_scale, grad_bias=grad_bias)

    def _plan(self) -> Any:
        x = _stand_in(self.input, "input", "data")
        return _plan_bn_backward(x, x, _stand_in(self.mean, "mean"), _stand_in(self.variance, "variance"),
                                 _stand_in(self.scale, "scale"), _stand_in(self.bias, "bias"),
                                 _stand_in(self.fused_add, "fused_add"), self.epsilon, self.channel_axis,
                                 self.training, self.activation, self.grad_input, self.grad_scale, self.grad_bias)


class MeanVarianceNormalizationGradDesc(_TrainingDesc):
    """The gradients of mean-variance normalization: compile it into ``op(grad_output, x, mean,
    inv_std, scale=None, bias=None, *, out=None)``."""

    _fields = ("input", "axes", "mean", "inv_std", "scale", "bias", "normalize_mean", "normalize_variance",
               "epsilon", "epsilon_mode", "activation", "grad_input", "grad_scale", "grad_bias")

    def __init__(self, input: TensorDesc, axes: Any, mean: Optional[TensorDesc], inv_std: Optional[TensorDesc],
                 scale: Optional[TensorDesc] = None, bias: Optional[TensorDesc] = None, *,
                 normalize_mean: bool = True, normalize_variance: bool = True, epsilon: float = 1e-5,
                 epsilon_mode: str = "inside", activation: ActivationLike = None, grad_input: bool = True,
                 grad_scale: Optional[bool] = None, grad_bias: Optional[bool] = None) -> None:
        super().__init__(input=input, axes=axes if is_int(axes) else as_int_tuple(axes), mean=mean, inv_std=inv_std,
                         scale=scale, bias=bias, normalize_mean=normalize_mean,
                         normalize_variance=normalize_variance, epsilon=epsilon, epsilon_mode=epsilon_mode,
                         activation=activation, grad_input=grad_input, grad_scale=grad_scale, grad_bias=grad_bias)

    def _plan(self) -> Any:
        x = _stand_in(self.input, "input", "data")
        return _plan_mvn_backward(x, x, self.axes, _stand_in(self.mean, "mean"), _stand_in(self.inv_std, "inv_std"),
                                  _stand_in(self.scale, "scale"), _stand_in(self.bias, "bias"), self.normalize_mean,
                                  self.normalize_variance, self.epsilon, self.epsilon_mode, self.activation,
                                  self.grad_input, self.grad_scale, self.grad_bias)


def _arg_check(name: str, d: Optional[TensorDesc]) -> Any:
    """A compiled operator's check of one argument against its descriptor: a plain ndarray of the
    descriptor's dtype, shape (and strides, where it gives them) passes as it is; anything else goes
    to check_arg, which converts it or raises."""
    slow = partial(check_arg, name, d=d)
    if d is None:
        return lambda a: a if a is None else slow(a)
    dt, shape, st = expect(d)
    if st is None:
        return lambda a: a if a.__class__ is _nd and a.shape == shape and a.dtype is dt else slow(a)
    return lambda a: a if a.__class__ is _nd and a.shape == shape and a.dtype is dt and a.strides == st else slow(a)


def compile_training(desc: Any) -> Any:
    """compile() for the training descriptors: an operator that checks its arrays against the
    descriptors and runs the functional op's plan, made on its first call (the descriptors fix every
    dtype, shape and attribute the plan depends on; the functional op looks it up on each call). It
    carries its function's name, its arrays' descriptors and the descriptor's attributes: a torch
    call that autograd or a trace must record goes through the function's op with them
    (_compile.follow_input)."""
    desc._validated()
    d = desc
    plan: list = []  # (made on the first call, from its arrays: the functional op's own rules)
    descs = {"x": ("input", d.input), "scale": ("scale", d.scale), "bias": ("bias", d.bias)}
    if isinstance(d, BatchNormalizationTrainingDesc):
        name = "batch_normalization_training"
        descs["fused_add"] = ("fused_add", d.fused_add)
        attrs = {"epsilon": d.epsilon, "channel_axis": d.channel_axis, "activation": d.activation}

        def op(x: Any, scale: Any = None, bias: Any = None, fused_add: Any = None, *, running_mean: Any = None,
               running_var: Any = None, momentum: Any = None, momentum_convention: str = "pytorch",
               num_batches_tracked: Any = None, out: Any = None) -> Any:
            if (x.__class__ is not _nd and is_tensor(x)) or (out is not None and is_foreign_out(out)):
                return follow_input(op, locals())  # torch in, torch out
            x, scale, bias, fused_add = chk["x"](x), chk["scale"](scale), chk["bias"](bias), chk["fused_add"](fused_add)
            if not plan:
                plan.append(_bn_training_plan(x, scale, bias, fused_add, d.epsilon, d.activation, d.channel_axis))
            return _bn_training_run(plan[0], x, scale, bias, fused_add, running_mean, running_var, momentum,
                                    momentum_convention, num_batches_tracked, out)
    else:
        # grad_output: the input's dtype and shape, any strides (SPEC section 9)
        descs["grad_output"] = ("grad_output", TensorDesc(d.input.dtype, d.input.sizes))
        attrs = {"epsilon": d.epsilon, "activation": d.activation, "grad_input": d.grad_input,
                 "grad_scale": d.grad_scale, "grad_bias": d.grad_bias}
        if isinstance(d, BatchNormalizationGradDesc):
            name = "batch_normalization_backward"
            descs.update(mean=("mean", d.mean), variance=("variance", d.variance), fused_add=("fused_add", d.fused_add))
            attrs.update(channel_axis=d.channel_axis, training=d.training)

            def op(grad_output: Any, x: Any, mean: Any, variance: Any, scale: Any = None, bias: Any = None,
                   fused_add: Any = None, *, out: Any = None) -> Any:  # type: ignore[misc]
                if (x.__class__ is not _nd and is_tensor(x)) or (out is not None and is_foreign_out(out)):
                    return follow_input(op, locals())
                dy, x, mean, variance = chk["grad_output"](grad_output), chk["x"](x), chk["mean"](mean), \
                    chk["variance"](variance)
                scale, bias, fused_add = chk["scale"](scale), chk["bias"](bias), chk["fused_add"](fused_add)
                if not plan:
                    plan.append(_bn_backward_sums_plan(x, dy, mean, variance, scale, bias, fused_add, d.epsilon,
                                                       d.channel_axis, d.training, d.activation, d.grad_input,
                                                       d.grad_scale, d.grad_bias))
                return _bn_backward_run(plan[0], out, x, dy, mean, variance, scale, bias, fused_add)
        else:
            name = "mean_variance_normalization_backward"
            descs.update(mean=("mean", d.mean), inv_std=("inv_std", d.inv_std))
            attrs.update(axes=d.axes, normalize_mean=d.normalize_mean, normalize_variance=d.normalize_variance,
                         epsilon_mode=d.epsilon_mode)

            def op(grad_output: Any, x: Any, mean: Any, inv_std: Any, scale: Any = None, bias: Any = None, *,
                   out: Any = None) -> Any:  # type: ignore[misc]
                if (x.__class__ is not _nd and is_tensor(x)) or (out is not None and is_foreign_out(out)):
                    return follow_input(op, locals())
                dy, x, mean, inv_std = chk["grad_output"](grad_output), chk["x"](x), chk["mean"](mean), \
                    chk["inv_std"](inv_std)
                scale, bias = chk["scale"](scale), chk["bias"](bias)
                if not plan:
                    plan.append(_mvn_backward_plan(x, dy, d.axes, mean, inv_std, scale, bias, d.normalize_mean,
                                                   d.normalize_variance, d.epsilon, d.epsilon_mode, d.activation,
                                                   d.grad_input, d.grad_scale, d.grad_bias))
                return _mvn_backward_run(plan[0], out, x, dy, mean, inv_std, scale, bias)
    chk = {k: _arg_check(n, t) for k, (n, t) in descs.items()}
    op.__name__, op.__qualname__ = name, f"compiled.{name}"
    op.arg_descs, op.desc_args, op.desc = descs, attrs, d  # type: ignore[attr-defined]
    return op


TRAINING_DESCRIPTORS = (BatchNormalizationTrainingDesc, BatchNormalizationGradDesc, MeanVarianceNormalizationGradDesc)
