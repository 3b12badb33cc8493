"""The ``torch.ops.simdnorm`` operators: every op of SPEC §2-§4 and §9 for CPU tensors.

Each op is defined with ``torch.library.Library`` (a schema string), not ``custom_op``: the latter's
Python wrappers cost as much as a whole small normalization. Per op:

* a CPU kernel: zero-copy numpy views of the tensors (``_as_numpy``), the simdnorm function, its
  output written straight into a ``torch.empty_like`` tensor through ``out=``;
* a ``.out`` overload taking the main output as ``out`` and returning the other outputs (a custom
  op may not return an alias of an argument: functionalization refuses it);
* a fake kernel (shapes and dtypes only) for torch.compile and torch.export;
* an Autograd kernel: with nothing to differentiate, on plain CPU tensors, it runs the CPU kernel
  itself (the path every inference call takes: a redispatch would cost another Python call), on
  any other tensors (fake, functional, subclasses) it redispatches; with something to
  differentiate, an ``autograd.Function`` whose backward calls the simdnorm ``*_backward`` op, so
  a compiled backward graph holds simdnorm ops too. The backward ops and the ``.out`` overloads
  have no derivative: differentiating them raises.

A small call's time is mostly the dispatcher, the Python Autograd kernel and one numpy view per
tensor; the drop-in modules skip the first two where nothing is differentiated (_modules._direct).

``update_running_stats_`` updates running statistics in place, separately, so the training op
itself stays functional.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .._compile import _transformed as _tensor_transformed, _transforming, resolved_negative, sparse_error
from .._descriptors import is_bfloat16
from .._training import update_running
from .. import _core
from .. import (
    ACTIVATIONS,
    Activation,
    batch_normalization as _sn_batch_normalization,
    batch_normalization_backward as _sn_batch_normalization_backward,
    batch_normalization_training as _sn_batch_normalization_training,
    group_norm as _sn_group_norm,
    group_norm_backward as _sn_group_norm_backward,
    instance_norm as _sn_instance_norm,
    instance_norm_backward as _sn_instance_norm_backward,
    layer_norm as _sn_layer_norm,
    layer_norm_backward as _sn_layer_norm_backward,
    mean_variance_normalization as _sn_mean_variance_normalization,
    mean_variance_normalization_backward as _sn_mean_variance_normalization_backward,
    rms_norm as _sn_rms_norm,
    rms_norm_backward as _sn_rms_norm_backward,
)

__all__ = ["SCHEMAS", "BACKWARD_ACTIVATIONS"]

_LIB = torch.library.Library("simdnorm", "DEF")

# ----------------------------------------------------------------------------------------------------
# tensors <-> numpy: every conversion is here, so that the binding's own DLPack path can replace it

_BF16 = torch.bfloat16
_ACCEPTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_from_numpy = torch.from_numpy


@functools.lru_cache(maxsize=None)
def _np_bf16() -> np.dtype:
    """numpy's bfloat16 (ml_dtypes'), imported at the first bfloat16 tensor: its import takes most
    of a second."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)



def _as_numpy(t: torch.Tensor, writeable: bool = False, name: str = "input") -> np.ndarray:
    """A zero-copy numpy view of a CPU tensor (any strides). numpy has no bfloat16: its bits are
    viewed as int16, then as ``ml_dtypes.bfloat16`` (asked first: a failing numpy() builds an error).
    A dtype outside simdnorm's four goes through when numpy holds it (simdnorm's TypeError then
    names it), else is refused here. A tensor with the negative bit set is resolved (read) or
    refused (writeable) as the plain functions do. (The conversion is tried before any other test:
    a test would cost every call.)"""
    try:
        return t.view(torch.int16).numpy().view(_np_bf16()) if t.dtype is _BF16 else t.numpy()
    except (TypeError, RuntimeError) as e:
        # (its type and text only: the exception itself would hold this frame in a reference
        # cycle, and with it every tensor of the caller's frames until the next garbage collection)
        numpy_refused_dtype, error = isinstance(e, TypeError), str(e)
    if t.layout is not torch.strided:  # (sparse: no memory of its shape to read)
        raise sparse_error(name, t.layout)
    if t.is_neg():
        return _as_numpy(resolved_negative(t, name, writeable), writeable, name)
    if numpy_refused_dtype:
        raise TypeError(f"dtype {t.dtype} is not accepted: simdnorm takes "
                        f"{', '.join(map(str, _ACCEPTED))}") from None
    # RuntimeError: requires grad (a caller outside the Autograd kernel), or no memory to read (a
    # torch.func transform's wrapper)
    if t.requires_grad:
        return _as_numpy(t.detach(), writeable, name)
    raise TypeError(f"{name}: simdnorm reads a tensor's memory, and this one has none to read ({error}); "
                    "under torch.func transforms call the torch.ops.simdnorm ops") from None


def _as_out(t: torch.Tensor, name: str = "out") -> np.ndarray:
    return _as_numpy(t, True, name)


def _opt(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    return None if t is None else _as_numpy(t)


def _opt_out(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    return None if t is None else _as_out(t)


def _as_tensor(a: Optional[np.ndarray], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A result array as a tensor (no copy); None, a result not asked for, as an empty tensor."""
    if a is None:
        return like.new_empty((0,), dtype=dtype)
    if is_bfloat16(a.dtype):
        return _from_numpy(a.view(np.int16)).view(_BF16)
    return _from_numpy(a)


def _stats_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype is torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------------
# activation: a name (str?) and its parameters in ACTIVATIONS' order (float[]?)

BACKWARD_ACTIVATIONS = (None, "relu", "leaky_relu", "silu", "gelu")
_ACTS: Dict[Any, Activation] = {}


def _activation(name: Optional[str], params: Optional[Sequence[float]]) -> Optional[Activation]:
    if name is None:
        if params:
            raise ValueError(f"activation_params: {list(params)} given without an activation")
        return None
    key = (name, None if params is None else tuple(params))
    act = _ACTS.get(key)
    if act is None:
        names = tuple(ACTIVATIONS[name]) if name in ACTIVATIONS else ()
        if params is not None and len(params) > len(names) and name in ACTIVATIONS:
            raise ValueError(f"activation_params: {len(params)} values for {name!r}, which takes "
                             f"{len(names)} ({', '.join(names) or 'none'}, in that order)")
        act = Activation(name, **dict(zip(names, params or ())))  # (an unknown name: its ValueError)
        if len(_ACTS) >= 256:
            _ACTS.clear()
        _ACTS[key] = act
    return act


# ----------------------------------------------------------------------------------------------------
# CPU kernels: the functional op and its .out overload in one function (out=None: a new tensor; the
# forward ops without an activation first try the per-call route, _routes)

from . import _routes  # noqa: E402 - (it reads this module's numpy views: after them)
from . import _batching  # noqa: E402
from . import _decompositions  # noqa: E402

def batch_normalization(input, mean, variance, scale=None, bias=None, *, epsilon=1e-05, activation=None,
                        activation_params=None, channel_axis=1, out=None):
    if out is None and activation is None and activation_params is None:
        y = _routes.batch_norm(input, mean, variance, scale, bias, epsilon, channel_axis)
        if y is not None:
            return y
    res = torch.empty_like(input) if out is None else out
    act = _activation(activation, activation_params)
    _sn_batch_normalization(_as_numpy(input), _as_numpy(mean), _as_numpy(variance), _opt(scale), _opt(bias),
                            epsilon=epsilon, activation=act, channel_axis=channel_axis, out=_as_out(res))
    return res


def _with_stats(res: torch.Tensor, input: torch.Tensor, r: tuple) -> tuple:
    sd = _stats_dtype(input)
    return (res,) + tuple(_as_tensor(a, input, sd) for a in r[1:])


def mean_variance_normalization(input, axes, scale=None, bias=None, *, normalize_mean=True,
                                normalize_variance=True, epsilon=1e-05, epsilon_mode="inside", activation=None,
                                activation_params=None, out=None):
    res = torch.empty_like(input) if out is None else out
    r = _sn_mean_variance_normalization(
        _as_numpy(input), axes, _opt(scale), _opt(bias), normalize_mean=normalize_mean,
        normalize_variance=normalize_variance, epsilon=epsilon, epsilon_mode=epsilon_mode,
        activation=_activation(activation, activation_params), out=_as_out(res), return_stats=True)
    return _with_stats(res, input, r)


def layer_norm(input, scale=None, bias=None, *, axis=-1, epsilon=1e-05, activation=None, activation_params=None,
               out=None):
    if out is None and activation is None and activation_params is None:
        r = _routes.layer_norm(input, scale, bias, axis, epsilon, stats=True)
        if r is not None:
            return r
    res = torch.empty_like(input) if out is None else out
    act = _activation(activation, activation_params)
    _, m, s = _sn_layer_norm(_as_numpy(input), _opt(scale), _opt(bias), axis=axis, epsilon=epsilon, activation=act,
                             out=_as_out(res), return_stats=True)
    return res, _from_numpy(m), _from_numpy(s)


def rms_norm(input, scale=None, *, axis=-1, epsilon=1e-05, activation=None, activation_params=None, out=None):
    if out is None and activation is None and activation_params is None:
        r = _routes.layer_norm(input, scale, None, axis, epsilon, rms=True, stats=True)
        if r is not None:
            return r[0], r[2]
    res = torch.empty_like(input) if out is None else out
    act = _activation(activation, activation_params)
    _, _, s = _sn_rms_norm(_as_numpy(input), _opt(scale), axis=axis, epsilon=epsilon, activation=act,
                           out=_as_out(res), return_stats=True)
    return res, _from_numpy(s)


def instance_norm(input, scale=None, bias=None, *, epsilon=1e-05, channel_axis=1, activation=None,
                  activation_params=None, out=None):
    if out is None and activation is None and activation_params is None:
        r = _routes.instance_norm(input, scale, bias, epsilon, channel_axis, stats=True)
        if r is not None:
            return r
    res = torch.empty_like(input) if out is None else out
    act = _activation(activation, activation_params)
    _, m, s = _sn_instance_norm(_as_numpy(input), _opt(scale), _opt(bias), epsilon=epsilon,
                                channel_axis=channel_axis, activation=act, out=_as_out(res), return_stats=True)
    return res, _from_numpy(m), _from_numpy(s)


def group_norm(input, num_groups, scale=None, bias=None, *, epsilon=1e-05, channel_axis=1, activation=None,
               activation_params=None, out=None):
    if out is None and activation is None and activation_params is None:
        r = _routes.group_norm(input, num_groups, scale, bias, epsilon, channel_axis, stats=True)
        if r is not None:
            return r
    res = torch.empty_like(input) if out is None else out
    act = _activation(activation, activation_params)
    _, m, s = _sn_group_norm(_as_numpy(input), num_groups, _opt(scale), _opt(bias), epsilon=epsilon,
                             channel_axis=channel_axis, activation=act, out=_as_out(res), return_stats=True)
    return res, _from_numpy(m), _from_numpy(s)


def batch_normalization_training(input, scale=None, bias=None, fused_add=None, *, epsilon=1e-05, channel_axis=1,
                                 activation=None, activation_params=None, out=None):
    if out is None and fused_add is None:
        r = _routes.bn_training(input, scale, bias, epsilon, channel_axis, (activation, activation_params))
        if r is not None:
            return r
    res = torch.empty_like(input) if out is None else out
    _, m, v = _sn_batch_normalization_training(
        _as_numpy(input), _opt(scale), _opt(bias), epsilon=epsilon, channel_axis=channel_axis,
        fused_add=_opt(fused_add), activation=_activation(activation, activation_params), out=_as_out(res))
    return res, _from_numpy(m), _from_numpy(v)


def _grads(input: torch.Tensor, gi: Optional[torch.Tensor], r: tuple,
           params: Sequence[Optional[torch.Tensor]]) -> tuple:
    """(grad_input, the parameters' gradients...): None (not asked for) as an empty tensor."""
    if gi is None:
        gi = input.new_empty((0,))
    return (gi,) + tuple(_as_tensor(a, input, input.dtype if p is None else p.dtype) for a, p in zip(r[1:], params))


def _grad_target(input: torch.Tensor, grad_input: bool, out: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if out is not None or not grad_input:
        return out  # (grad_input=False with out given: simdnorm's ValueError)
    return torch.empty_like(input)


def batch_normalization_backward(grad_output, input, mean, variance, scale=None, bias=None, fused_add=None, *,
                                 epsilon=1e-05, channel_axis=1, training=True, activation=None,
                                 activation_params=None, grad_input=True, grad_scale=None, grad_bias=None, out=None):
    if out is None and fused_add is None:
        r = _routes.bn_backward(grad_output, input, mean, variance, scale, bias, epsilon, channel_axis, training,
                                (activation, activation_params), (grad_input, grad_scale, grad_bias))
        if r is not None:
            return r + (input.new_empty((0,)),)
    gi = _grad_target(input, grad_input, out)
    r = _sn_batch_normalization_backward(
        _as_numpy(grad_output), _as_numpy(input), _as_numpy(mean), _as_numpy(variance), _opt(scale), _opt(bias),
        epsilon=epsilon, channel_axis=channel_axis, training=training, fused_add=_opt(fused_add),
        activation=_activation(activation, activation_params), grad_input=grad_input, grad_scale=grad_scale,
        grad_bias=grad_bias, out=_opt_out(gi))
    if fused_add is None:
        r = r + (None,)
    return _grads(input, gi, r, (scale, bias, fused_add))


def mean_variance_normalization_backward(grad_output, input, axes, mean, inv_std, scale=None, bias=None, *,
                                         normalize_mean=True, normalize_variance=True, epsilon=1e-05,
                                         epsilon_mode="inside", activation=None, activation_params=None,
                                         grad_input=True, grad_scale=None, grad_bias=None, out=None):
    if out is None:
        r = _routes.mvn_backward(grad_output, input, axes, mean, inv_std, scale, bias, normalize_mean,
                                 normalize_variance, epsilon, epsilon_mode, (activation, activation_params),
                                 (grad_input, grad_scale, grad_bias))
        if r is not None:
            return r
    gi = _grad_target(input, grad_input, out)
    r = _sn_mean_variance_normalization_backward(
        _as_numpy(grad_output), _as_numpy(input), axes, _opt(mean), _opt(inv_std), _opt(scale), _opt(bias),
        normalize_mean=normalize_mean, normalize_variance=normalize_variance, epsilon=epsilon,
        epsilon_mode=epsilon_mode, activation=_activation(activation, activation_params), grad_input=grad_input,
        grad_scale=grad_scale, grad_bias=grad_bias, out=_opt_out(gi))
    return _grads(input, gi, r, (scale, bias))


def layer_norm_backward(grad_output, input, mean, inv_std, scale=None, bias=None, *, axis=-1, epsilon=1e-05,
                        activation=None, activation_params=None, grad_input=True, grad_scale=None, grad_bias=None,
                        out=None):
    if out is None:
        r = _routes.mvn_backward(grad_output, input, None, mean, inv_std, scale, bias, True, True, epsilon, "inside",
                                 (activation, activation_params), (grad_input, grad_scale, grad_bias), axis)
        if r is not None:
            return r
    gi = _grad_target(input, grad_input, out)
    r = _sn_layer_norm_backward(
        _as_numpy(grad_output), _as_numpy(input), _as_numpy(mean), _as_numpy(inv_std), _opt(scale), _opt(bias),
        axis=axis, epsilon=epsilon, activation=_activation(activation, activation_params), grad_input=grad_input,
        grad_scale=grad_scale, grad_bias=grad_bias, out=_opt_out(gi))
    return _grads(input, gi, r, (scale, bias))


def rms_norm_backward(grad_output, input, inv_rms, scale=None, *, axis=-1, epsilon=1e-05, activation=None,
                      activation_params=None, grad_input=True, grad_scale=None, out=None):
    if out is None:
        r = _routes.mvn_backward(grad_output, input, None, None, inv_rms, scale, None, False, True, epsilon, "inside",
                                 (activation, activation_params), (grad_input, grad_scale, False), axis)
        if r is not None:
            return r[:2]
    gi = _grad_target(input, grad_input, out)
    r = _sn_rms_norm_backward(
        _as_numpy(grad_output), _as_numpy(input), _as_numpy(inv_rms), _opt(scale), axis=axis, epsilon=epsilon,
        activation=_activation(activation, activation_params), grad_input=grad_input, grad_scale=grad_scale,
        out=_opt_out(gi))
    return _grads(input, gi, r[:2], (scale,))


def instance_norm_backward(grad_output, input, mean, inv_std, scale=None, bias=None, *, channel_axis=1,
                           epsilon=1e-05, activation=None, activation_params=None, grad_input=True, grad_scale=None,
                           grad_bias=None, out=None):
    if out is None:
        r = _routes.instance_backward(grad_output, input, mean, inv_std, scale, bias, epsilon, channel_axis,
                                      (activation, activation_params), (grad_input, grad_scale, grad_bias))
        if r is not None:
            return r
    gi = _grad_target(input, grad_input, out)
    r = _sn_instance_norm_backward(
        _as_numpy(grad_output), _as_numpy(input), _as_numpy(mean), _as_numpy(inv_std), _opt(scale), _opt(bias),
        channel_axis=channel_axis, epsilon=epsilon, activation=_activation(activation, activation_params),
        grad_input=grad_input, grad_scale=grad_scale, grad_bias=grad_bias, out=_opt_out(gi))
    return _grads(input, gi, r, (scale, bias))


def group_norm_backward(grad_output, input, num_groups, mean, inv_std, scale=None, bias=None, *, channel_axis=1,
                        epsilon=1e-05, activation=None, activation_params=None, grad_input=True, grad_scale=None,
                        grad_bias=None, out=None):
    if out is None:
        r = _routes.group_backward(grad_output, input, num_groups, mean, inv_std, scale, bias, epsilon, channel_axis,
                                   (activation, activation_params), (grad_input, grad_scale, grad_bias))
        if r is not None:
            return r
    gi = _grad_target(input, grad_input, out)
    r = _sn_group_norm_backward(
        _as_numpy(grad_output), _as_numpy(input), num_groups, _as_numpy(mean), _as_numpy(inv_std), _opt(scale),
        _opt(bias), channel_axis=channel_axis, epsilon=epsilon, activation=_activation(activation, activation_params),
        grad_input=grad_input, grad_scale=grad_scale, grad_bias=grad_bias, out=_opt_out(gi))
    return _grads(input, gi, r, (scale, bias))


def update_running_stats_(running_mean, running_var, mean, variance, num_batches_tracked=None, *, count,
                          momentum=0.1, momentum_convention="pytorch"):
    """SPEC §9's running-statistics rules, in float64, each result rounded once into its buffer."""
    for name, r, b in (("running_mean", running_mean, mean), ("running_var", running_var, variance)):
        if r.shape != b.shape:
            raise ValueError(f"{name}: shape {tuple(r.shape)} differs from the batch statistic's {tuple(b.shape)}")
        for n, t in ((name, r), ("mean" if b is mean else "variance", b)):  # (before anything is written)
            if t.dtype not in _ACCEPTED:
                raise TypeError(f"{n}: unsupported dtype {str(t.dtype).replace('torch.', '')} (accepted: float32, "
                                "float16, bfloat16, float64)")
    nbt = num_batches_tracked
    if nbt is not None and (nbt.dim() != 0 or nbt.dtype.is_floating_point or nbt.dtype == torch.bool):
        raise TypeError(f"num_batches_tracked: a 0-d integer tensor (torch.nn's buffer), got a {nbt.dim()}-d "
                        f"{nbt.dtype} tensor")
    if momentum_convention not in ("pytorch", "onnx"):
        raise ValueError(f"momentum_convention: {momentum_convention!r}; use 'pytorch' or 'onnx'")
    if momentum is None:
        if momentum_convention != "pytorch" or num_batches_tracked is None:
            raise ValueError("momentum=None (the cumulative average) needs the pytorch convention and "
                             "num_batches_tracked")
    elif not 0.0 <= momentum <= 1.0:
        raise ValueError(f"momentum: {momentum}; it must lie in [0, 1]")
    if count == 1:
        raise ValueError("count: 1 element per channel, whose unbiased variance is undefined")
    if count < 0:
        raise ValueError(f"count: {count}; the number of elements each statistic was taken over, >= 0")
    # None with the negative bit: the tensors straight to the kernel (which takes C-contiguous float32
    # and float64 ones); else numpy views, made before the counter moves (they may refuse the buffers)
    direct = not (running_mean.is_neg() or running_var.is_neg() or mean.is_neg() or variance.is_neg())
    views = None if direct else (_as_out(running_mean, "running_mean"), _as_out(running_var, "running_var"))
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)  # as torch.nn counts batches: before the update, which may use it
    if count == 0:
        return  # (an empty batch: NaN statistics, running statistics untouched)
    m = 1.0 / float(num_batches_tracked) if momentum is None else float(momentum)
    if direct and _core.update_running(running_mean, running_var, mean, variance, count, m,
                                       momentum_convention == "pytorch"):
        return
    rm, rv = views or (_as_out(running_mean, "running_mean"), _as_out(running_var, "running_var"))
    update_running(rm, rv, _as_numpy(mean), _as_numpy(variance), count, m, momentum_convention)


# ----------------------------------------------------------------------------------------------------
# fake kernels: the outputs' shapes, dtypes and strides, exactly as the CPU kernels make them

def _empty(like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return like.new_empty((0,), dtype=like.dtype if dtype is None else dtype)


def _rank(input: torch.Tensor) -> int:
    """The input's dims, by simdnorm's rule (which the CPU kernel applies too)."""
    nd = input.dim()
    if not 1 <= nd <= 8:
        raise ValueError(f"input: {nd} dims; simdnorm takes 1 to 8")
    return nd


def _kept(input: torch.Tensor, axes: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    nd = _rank(input)
    red = {a % nd for a in axes}
    return input.new_empty([1 if d in red else n for d, n in enumerate(input.shape)], dtype=dtype)


def _checked(name: str, input: torch.Tensor, **attrs: Any) -> None:
    """The plain function's rules on the call's attributes where the shapes are concrete
    (_check_as_plain): a trace or an export refuses what the op would, not a program that fails
    when run."""
    _check_as_plain(name, {"x": input, **attrs}, {})


def _fake_batch_normalization(input, mean, variance, scale=None, bias=None, **kw):
    _checked("batch_normalization", input, **kw)
    return torch.empty_like(input)


def _fake_mean_variance_normalization(input, axes, scale=None, bias=None, *, normalize_mean=True,
                                      normalize_variance=True, **kw):
    _checked("mean_variance_normalization", input, axes=axes, **kw)
    sd = _stats_dtype(input)
    return (torch.empty_like(input), _kept(input, axes, sd) if normalize_mean else _empty(input, sd),
            _kept(input, axes, sd) if normalize_variance else _empty(input, sd))


def _fake_layer_norm(input, scale=None, bias=None, *, axis=-1, **kw):
    _checked("layer_norm", input, axis=axis, **kw)
    nd = _rank(input)
    s = _kept(input, range(axis % nd, nd), _stats_dtype(input))
    return torch.empty_like(input), s, torch.empty_like(s)


def _fake_rms_norm(input, scale=None, *, axis=-1, **kw):
    _checked("rms_norm", input, axis=axis, **kw)
    nd = _rank(input)
    return torch.empty_like(input), _kept(input, range(axis % nd, nd), _stats_dtype(input))


def _fake_instance_norm(input, scale=None, bias=None, *, channel_axis=1, **kw):
    _checked("instance_norm", input, channel_axis=channel_axis, **kw)
    nd = _rank(input)
    s = _kept(input, [d for d in range(1, nd) if d != channel_axis % nd], _stats_dtype(input))
    return torch.empty_like(input), s, torch.empty_like(s)


def _fake_group_norm(input, num_groups, scale=None, bias=None, **kw):
    _checked("group_norm", input, num_groups=num_groups, **kw)
    s = input.new_empty((input.shape[0], num_groups), dtype=_stats_dtype(input))
    return torch.empty_like(input), s, torch.empty_like(s)


def _bn_stats_shape(input: torch.Tensor, scale: Any, bias: Any, channel_axis: int) -> List[Any]:
    """batch norm training's statistics: a same-rank parameter's shape, else (C,)."""
    for p in (scale, bias):
        if p is not None and p.dim() == input.dim():
            return list(p.shape)
    return [input.shape[channel_axis]]


def _fake_batch_normalization_training(input, scale=None, bias=None, fused_add=None, *, channel_axis=1, **kw):
    _checked("batch_normalization_training", input, channel_axis=channel_axis, **kw)
    s = input.new_empty(_bn_stats_shape(input, scale, bias, channel_axis), dtype=_stats_dtype(input))
    return torch.empty_like(input), s, torch.empty_like(s)


def _fake_grads(input: torch.Tensor, grad_input: bool, wanted: Sequence[Tuple[Any, Optional[bool]]]) -> tuple:
    """grad_input like the input, then per (parameter, flag) its gradient (None: when given)."""
    res = [torch.empty_like(input) if grad_input else _empty(input)]
    for p, flag in wanted:
        want = p is not None if flag is None else flag
        res.append(input.new_empty(p.shape, dtype=p.dtype) if want and p is not None
                   else _empty(input, None if p is None else p.dtype))
    return tuple(res)


def _fake_batch_normalization_backward(grad_output, input, mean, variance, scale=None, bias=None, fused_add=None, *,
                                       grad_input=True, grad_scale=None, grad_bias=None, **kw):
    return _fake_grads(input, grad_input, ((scale, grad_scale), (bias, grad_bias), (fused_add, None)))


def _fake_mean_variance_normalization_backward(grad_output, input, axes, mean, inv_std, scale=None, bias=None, *,
                                               grad_input=True, grad_scale=None, grad_bias=None, **kw):
    return _fake_grads(input, grad_input, ((scale, grad_scale), (bias, grad_bias)))


def _fake_layer_norm_backward(grad_output, input, mean, inv_std, scale=None, bias=None, *, grad_input=True,
                              grad_scale=None, grad_bias=None, **kw):
    return _fake_grads(input, grad_input, ((scale, grad_scale), (bias, grad_bias)))


_fake_instance_norm_backward = _fake_layer_norm_backward


def _fake_rms_norm_backward(grad_output, input, inv_rms, scale=None, *, grad_input=True, grad_scale=None, **kw):
    return _fake_grads(input, grad_input, ((scale, grad_scale),))


def _fake_group_norm_backward(grad_output, input, num_groups, mean, inv_std, scale=None, bias=None, *,
                              grad_input=True, grad_scale=None, grad_bias=None, **kw):
    return _fake_grads(input, grad_input, ((scale, grad_scale), (bias, grad_bias)))


def _fake_update_running_stats_(*args, **kw):
    return None


# ----------------------------------------------------------------------------------------------------
# derivatives: setup (what the forward saves) and backward (the simdnorm backward op), per op.
# `a` is the op's positional arguments with their defaults filled in, `kw` its keyword-only ones;
# `need` says which positional arguments want a gradient.

_ops = torch.ops.simdnorm


def _check_differentiable(kw: dict, name: str) -> None:
    if kw["activation"] not in BACKWARD_ACTIVATIONS:
        raise ValueError(
            f"simdnorm::{name}: activation {kw['activation']!r} has no backward op (they take None, relu, "
            "leaky_relu, silu and gelu); run it without gradients (torch.no_grad()) or apply the activation "
            "after the op")


# The ops' keyword arguments' defaults by name (each name's default is the same in every schema),
# read from the schemas once they are registered (_register).
_KW_DEFAULTS: Dict[str, Any] = {}


def _given(kw: dict, *names: str, **more: Any) -> dict:
    """An op call's keyword arguments, the attributes `names` from kw (a forward call's) and `more`,
    without those equal to their default: the dispatcher parses each one given (about 1.5 us
    apiece, where small tensors spend a training step mostly in overhead)."""
    d = _KW_DEFAULTS
    given = {n: kw[n] for n in names if kw[n] != d[n]}
    given.update((k, v) for k, v in more.items() if k not in d or v != d[k])
    return given


def _placed(p: torch.Tensor, nd: int, ca: int) -> torch.Tensor:
    """A (C,) parameter viewed at the channel axis of an nd-dim input; a same-rank one as it is."""
    if p.dim() == nd:
        return p
    shape = [1] * nd
    shape[ca % nd] = p.shape[0]
    return p.reshape(shape)


def _sum_to(t: torch.Tensor, p: torch.Tensor, placed: torch.Tensor) -> torch.Tensor:
    dims = [d for d in range(t.dim()) if placed.shape[d] == 1 and t.shape[d] != 1]
    return (t.sum(dims, keepdim=True) if dims else t).reshape(p.shape).to(p.dtype)


def _laid_out_as(go: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad_output in x's layout where x has one (dense: contiguous, channels last, a permutation):
    the backward kernels walk x and dy along one order of dims, and a dy laid out otherwise (the
    contiguous or expanded gradient of a channels-last or transposed input) is read element by
    element, which costs several times this copy (torch.nn's backward copies it too)."""
    if _functorch_active() or all(a == b for a, b, n in zip(go.stride(), x.stride(), x.shape) if n > 1):
        return go
    like = torch.empty_like(x)
    return like.copy_(go) if like.stride() == x.stride() else go


def _setup_batch_normalization(ctx, a, kw, result):
    _check_differentiable(kw, "batch_normalization")
    _save(ctx, *a[:5])
    ctx.kw = kw


def _backward_batch_normalization(ctx, need, go):
    x, mean, var, scale, bias = ctx.saved_tensors
    go = _laid_out_as(go, x)
    kw = ctx.kw
    nd, ca = x.dim(), kw["channel_axis"]
    m, v, s, b = mean, var, scale, bias
    if nd > 1 and any(p is not None and p.dim() == nd for p in (mean, var, scale, bias)):
        # The forward takes each parameter 1-D or same-rank on its own, the backward one shape for
        # all: each expanded (a view) to their joint broadcast shape, scale 1 standing in if absent.
        joint = torch.broadcast_shapes(*[_placed(p, nd, ca).shape for p in (mean, var, scale, bias) if p is not None])
        m, v = _placed(mean, nd, ca).expand(joint), _placed(var, nd, ca).expand(joint)
        s = (mean.new_ones(()) if scale is None else _placed(scale, nd, ca)).expand(joint)
        b = None if bias is None else _placed(bias, nd, ca).expand(joint)
    want_stats = need[1] or need[2]
    gi, gs, gb, _ = _ops.batch_normalization_backward(
        go, x, m, v, s, b, **_given(kw, "epsilon", "channel_axis", "activation", "activation_params", training=False,
                                    grad_input=need[0] or want_stats, grad_scale=None if need[3] else False,
                                    grad_bias=None if need[4] else False))
    gs = _sum_to(gs, scale, _placed(scale, nd, ca)) if need[3] and gs.shape != scale.shape else gs
    gb = _sum_to(gb, bias, _placed(bias, nd, ca)) if need[4] and gb.shape != bias.shape else gb
    gm = gv = None
    if want_stats:  # the statistics as inputs (not torch.nn's use): out = f((x - mean) / sqrt(var + eps))
        cd = _stats_dtype(x)
        g = gi.to(cd)
        pm = _placed(mean, nd, ca)
        if need[1]:
            gm = _sum_to(-g, mean, pm)
        if need[2]:
            pv = _placed(var, nd, ca)
            gv = _sum_to(g * (x.to(cd) - pm.to(cd)) * (-0.5 / (pv.to(cd) + kw["epsilon"])), var, pv)
    return (gi if need[0] else None, gm, gv, gs if need[3] else None, gb if need[4] else None)


def _setup_batch_normalization_training(ctx, a, kw, result):
    _check_differentiable(kw, "batch_normalization_training")
    _save(ctx, *a[:4], result[1], result[2])
    ctx.kw = kw


def _backward_batch_normalization_training(ctx, need, go, _gm, _gv):
    x, scale, bias, fa, mean, var = ctx.saved_tensors
    go = _laid_out_as(go, x)
    kw = ctx.kw
    gi, gs, gb, gf = _ops.batch_normalization_backward(
        go, x, mean, var, scale, bias, fa, **_given(kw, "epsilon", "channel_axis", "activation", "activation_params",
                                                    **_flags(need, 0, 1, 2)))
    return (gi if need[0] else None, gs if need[1] else None, gb if need[2] else None, gf if need[3] else None)


def _save_stats(ctx, a, kw, result, name, n_tensors):
    _check_differentiable(kw, name)
    _save(ctx, *[t for t in a[:n_tensors] if not isinstance(t, (int, list))], *result[1:])
    ctx.a = [t for t in a if isinstance(t, (int, list))]  # (axes, num_groups)
    ctx.kw = kw


def _flags(need: Sequence[bool], gi: int, gs: int, gb: Optional[int] = None) -> dict:
    """grad_input, grad_scale, grad_bias by `need` (the positions of input, scale and bias): a
    parameter's gradient wanted as None, "when given" (one that wants a gradient was given)."""
    f = {"grad_input": need[gi], "grad_scale": None if need[gs] else False}
    if gb is not None:
        f["grad_bias"] = None if need[gb] else False
    return f


def _keep(need: Sequence[bool], grads: Sequence[Any], where: Sequence[Optional[int]]) -> tuple:
    """The gradient of each positional argument: grads[where[i]] when it is wanted, else None."""
    return tuple(None if w is None or not need[i] else grads[w] for i, w in enumerate(where))


def _setup_mean_variance_normalization(ctx, a, kw, result):
    _save_stats(ctx, a, kw, result, "mean_variance_normalization", 4)


def _backward_mean_variance_normalization(ctx, need, go, _gm, _gs):
    x, scale, bias, mean, inv_std = ctx.saved_tensors
    go = _laid_out_as(go, x)
    kw = ctx.kw
    grads = _ops.mean_variance_normalization_backward(
        go, x, ctx.a[0], mean if kw["normalize_mean"] else None, inv_std if kw["normalize_variance"] else None,
        scale, bias, **_given(kw, "normalize_mean", "normalize_variance", "epsilon", "epsilon_mode", "activation",
                              "activation_params", **_flags(need, 0, 2, 3)))
    return _keep(need, grads, (0, None, 1, 2))


def _setup_layer_norm(ctx, a, kw, result):
    _save_stats(ctx, a, kw, result, "layer_norm", 3)


def _backward_layer_norm(ctx, need, go, _gm, _gs):
    x, scale, bias, mean, inv_std = ctx.saved_tensors
    go = _laid_out_as(go, x)
    kw = ctx.kw
    grads = _ops.layer_norm_backward(go, x, mean, inv_std, scale, bias, **_given(
        kw, "axis", "epsilon", "activation", "activation_params", **_flags(need, 0, 1, 2)))
    return _keep(need, grads, (0, 1, 2))


def _setup_rms_norm(ctx, a, kw, result):
    _save_stats(ctx, a, kw, result, "rms_norm", 2)


def _backward_rms_norm(ctx, need, go, _gs):
    x, scale, inv_rms = ctx.saved_tensors
    go = _laid_out_as(go, x)
    kw = ctx.kw
    grads = _ops.rms_norm_backward(go, x, inv_rms, scale, **_given(kw, "axis", "epsilon", "activation",
                                                                   "activation_params", **_flags(need, 0, 1)))
    return _keep(need, grads, (0, 1))


def _setup_instance_norm(ctx, a, kw, result):
    _save_stats(ctx, a, kw, result, "instance_norm", 3)


def _backward_instance_norm(ctx, need, go, _gm, _gs):
    x, scale, bias, mean, inv_std = ctx.saved_tensors
    go = _laid_out_as(go, x)
    kw = ctx.kw
    grads = _ops.instance_norm_backward(go, x, mean, inv_std, scale, bias, **_given(
        kw, "channel_axis", "epsilon", "activation", "activation_params", **_flags(need, 0, 1, 2)))
    return _keep(need, grads, (0, 1, 2))


def _setup_group_norm(ctx, a, kw, result):
    _save_stats(ctx, a, kw, result, "group_norm", 4)


def _backward_group_norm(ctx, need, go, _gm, _gs):
    x, scale, bias, mean, inv_std = ctx.saved_tensors
    go = _laid_out_as(go, x)
    kw = ctx.kw
    grads = _ops.group_norm_backward(go, x, ctx.a[0], mean, inv_std, scale, bias, **_given(
        kw, "channel_axis", "epsilon", "activation", "activation_params", **_flags(need, 0, 2, 3)))
    return _keep(need, grads, (0, None, 1, 2))


# ----------------------------------------------------------------------------------------------------
# forward-mode derivatives (jvp): the output's tangent from the inputs' tangents, per op. Each op's
# normalization Jacobian is symmetric (u (I - 1 1^T / n - y y^T / n) and its variants), so its
# product with x's tangent is the backward op's grad_input for that tangent as grad_output, without
# scale or activation; the parameters' part is the forward op itself with their tangents as scale
# and bias; then the activation's derivative at the pre-activation value. `t` holds the positional
# arguments' tangents (None: none). The statistics outputs have none (they are non-differentiable).

def _act_tangent(kw: dict, pre: Optional[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """act'(pre) t, relu'(0) = 0 and leaky_relu'(0) = alpha as in the backward ops."""
    name = kw["activation"]
    if name is None:
        return t
    pre = pre.to(t.dtype)
    if name == "relu":
        return torch.where(pre > 0, t, torch.zeros_like(t))
    if name == "leaky_relu":
        return torch.where(pre > 0, t, t * _activation(name, kw["activation_params"]).params["alpha"])
    if name == "silu":
        s = torch.sigmoid(pre)
        d = s * (1 + pre * (1 - s))
    else:  # gelu, erf form: Phi(z) + z phi(z)
        d = 0.5 * (1 + torch.erf(pre * 0.7071067811865476)) + pre * torch.exp(-0.5 * pre * pre) * 0.3989422804014327
    return t * torch.where(pre.isinf(), (pre > 0).to(t.dtype), d)  # (the limits at +-inf, not inf * 0)


def _normalized_tangent(x: torch.Tensor, kw: dict, t: Sequence[Optional[torch.Tensor]], scale: Optional[torch.Tensor],
                        placed: Callable[[torch.Tensor], torch.Tensor], n_x: Callable[[torch.Tensor], torch.Tensor],
                        affine: Callable[..., torch.Tensor], extra: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The output's tangent of a normalization: scale (N t_x) + t_scale y + t_bias (+ extra), then
    the activation's derivative, laid out as the output. t: the tangents of input, scale and bias,
    then scale and bias themselves; n_x(g): N g; affine(scale, bias): the op's output without its
    activation, scale and bias as given (None: 1 and 0); placed(p): a parameter as it broadcasts."""
    cd = _stats_dtype(x)
    tx, ts, tb = t[:3]
    parts = [] if extra is None else [extra.to(cd)]
    if tx is not None:
        g = n_x(tx).to(cd)
        parts.append(g if scale is None else g * placed(scale).to(cd))
    if ts is not None:
        parts.append(affine(ts, tb).to(cd))
    elif tb is not None:
        parts.append(placed(tb).to(cd))
    if not parts:
        return None
    out = functools.reduce(torch.add, parts)
    if kw["activation"] is not None:
        out = _act_tangent(kw, affine(*t[3:5]), out)
    return out.expand(x.shape).to(x.dtype)  # (out of place: under vmap a tangent may be batched, x not)


def _tangents(t: Sequence[Any], n: int) -> List[Optional[torch.Tensor]]:
    return list(t) + [None] * (n - len(t))


def _same(p: torch.Tensor) -> torch.Tensor:
    return p


def _jvp_mean_variance_normalization(ctx, t):
    x, scale, bias, mean, inv_std = ctx.saved_tensors
    kw, axes = ctx.kw, ctx.a[0]
    tx, _, ts, tb = _tangents(t, 4)
    flags = {k: kw[k] for k in ("normalize_mean", "normalize_variance", "epsilon", "epsilon_mode")}
    nm, nv = kw["normalize_mean"], kw["normalize_variance"]
    return (_normalized_tangent(
        x, kw, (tx, ts, tb, scale, bias), scale, _same,
        lambda g: _ops.mean_variance_normalization_backward(g, x, axes, mean if nm else None, inv_std if nv else None,
                                                            grad_scale=False, grad_bias=False, **flags)[0],
        lambda s, b: _ops.mean_variance_normalization(x, axes, s, b, **flags)[0]), None, None)


def _jvp_layer_norm(ctx, t):
    x, scale, bias, mean, inv_std = ctx.saved_tensors
    kw = ctx.kw
    tx, ts, tb = _tangents(t, 3)
    at = {"axis": kw["axis"], "epsilon": kw["epsilon"]}
    return (_normalized_tangent(
        x, kw, (tx, ts, tb, scale, bias), scale, _same,
        lambda g: _ops.layer_norm_backward(g, x, mean, inv_std, grad_scale=False, grad_bias=False, **at)[0],
        lambda s, b: _ops.layer_norm(x, s, b, **at)[0]), None, None)


def _jvp_rms_norm(ctx, t):
    x, scale, inv_rms = ctx.saved_tensors
    kw = ctx.kw
    tx, ts = _tangents(t, 2)
    at = {"axis": kw["axis"], "epsilon": kw["epsilon"]}
    return (_normalized_tangent(
        x, kw, (tx, ts, None, scale, None), scale, _same,
        lambda g: _ops.rms_norm_backward(g, x, inv_rms, grad_scale=False, **at)[0],
        lambda s, b: _ops.rms_norm(x, s, **at)[0]), None)


def _jvp_instance_norm(ctx, t):
    x, scale, bias, mean, inv_std = ctx.saved_tensors
    kw = ctx.kw
    tx, ts, tb = _tangents(t, 3)
    at = {"channel_axis": kw["channel_axis"], "epsilon": kw["epsilon"]}
    return (_normalized_tangent(
        x, kw, (tx, ts, tb, scale, bias), scale, lambda p: _placed(p, x.dim(), kw["channel_axis"]),
        lambda g: _ops.instance_norm_backward(g, x, mean, inv_std, grad_scale=False, grad_bias=False, **at)[0],
        lambda s, b: _ops.instance_norm(x, s, b, **at)[0]), None, None)


def _jvp_group_norm(ctx, t):
    x, scale, bias, mean, inv_std = ctx.saved_tensors
    kw, groups = ctx.kw, ctx.a[0]
    tx, _, ts, tb = _tangents(t, 4)
    at = {"channel_axis": kw["channel_axis"], "epsilon": kw["epsilon"]}
    return (_normalized_tangent(
        x, kw, (tx, ts, tb, scale, bias), scale, lambda p: _placed(p, x.dim(), kw["channel_axis"]),
        lambda g: _ops.group_norm_backward(g, x, groups, mean, inv_std, grad_scale=False, grad_bias=False, **at)[0],
        lambda s, b: _ops.group_norm(x, groups, s, b, **at)[0]), None, None)


def _jvp_batch_normalization_training(ctx, t):
    x, scale, bias, fa, mean, var = ctx.saved_tensors
    kw = ctx.kw
    tx, ts, tb, tf = _tangents(t, 4)
    at = {"channel_axis": kw["channel_axis"], "epsilon": kw["epsilon"]}

    def affine(s, b):  # (the batch's statistics given: the same y; the pre-activation adds fused_add)
        y = _ops.batch_normalization(x, mean, var, s, b, **at)
        return y if fa is None or s is not scale else y + fa
    shaped = scale if scale is not None else bias  # (a same-rank parameter shapes the statistics: ones of it)
    ones = None if shaped is None else torch.ones_like(shaped)
    return (_normalized_tangent(
        x, kw, (tx, ts, tb, scale, bias), scale, lambda p: _placed(p, x.dim(), kw["channel_axis"]),
        lambda g: _ops.batch_normalization_backward(g, x, mean, var, ones, training=True, grad_scale=False,
                                                    grad_bias=False, **at)[0],
        affine, tf), None, None)


def _jvp_batch_normalization(ctx, t):
    x, mean, var, scale, bias = ctx.saved_tensors
    kw = ctx.kw
    tx, tm, tv, ts, tb = _tangents(t, 5)
    nd, ca, cd = x.dim(), kw["channel_axis"], _stats_dtype(x)
    at = {"channel_axis": ca, "epsilon": kw["epsilon"]}
    u = (_placed(var, nd, ca).to(cd) + kw["epsilon"]).rsqrt()
    stats = None
    if tm is not None or tv is not None:  # (the statistics as inputs: -u t_mean - y u^2 t_var / 2)
        stats = torch.zeros((), dtype=cd) if tm is None else -u * _placed(tm, nd, ca).to(cd)
        if tv is not None:
            y = _ops.batch_normalization(x, mean, var, **at).to(cd)
            stats = stats - 0.5 * y * u * u * _placed(tv, nd, ca).to(cd)
        if scale is not None:
            stats = stats * _placed(scale, nd, ca).to(cd)
        stats = stats.expand(x.shape)
    return _normalized_tangent(
        x, kw, (tx, ts, tb, scale, bias), scale, lambda p: _placed(p, nd, ca),
        lambda g: g.to(cd) * u, lambda s, b: _ops.batch_normalization(x, mean, var, s, b, **at), stats)


# ----------------------------------------------------------------------------------------------------
# the table: name, arguments, returns (the first is what .out receives); the kernels by name

_ACT = "str? activation=None, float[]? activation_params=None"
_GRADS = "bool grad_input=True, bool? grad_scale=None, bool? grad_bias=None"
_T2, _T3, _T4 = "(Tensor, Tensor)", "(Tensor, Tensor, Tensor)", "(Tensor, Tensor, Tensor, Tensor)"

_TABLE: Tuple[Tuple[str, str, str], ...] = (
    ("batch_normalization",
     "Tensor input, Tensor mean, Tensor variance, Tensor? scale=None, Tensor? bias=None, *, float epsilon=1e-05, "
     f"{_ACT}, int channel_axis=1", "Tensor"),
    ("mean_variance_normalization",
     "Tensor input, int[] axes, Tensor? scale=None, Tensor? bias=None, *, bool normalize_mean=True, "
     f"bool normalize_variance=True, float epsilon=1e-05, str epsilon_mode=\"inside\", {_ACT}", _T3),
    ("layer_norm", f"Tensor input, Tensor? scale=None, Tensor? bias=None, *, int axis=-1, float epsilon=1e-05, {_ACT}",
     _T3),
    ("rms_norm", f"Tensor input, Tensor? scale=None, *, int axis=-1, float epsilon=1e-05, {_ACT}", _T2),
    ("instance_norm",
     f"Tensor input, Tensor? scale=None, Tensor? bias=None, *, float epsilon=1e-05, int channel_axis=1, {_ACT}", _T3),
    ("group_norm",
     "Tensor input, int num_groups, Tensor? scale=None, Tensor? bias=None, *, float epsilon=1e-05, "
     f"int channel_axis=1, {_ACT}", _T3),
    ("batch_normalization_training",
     "Tensor input, Tensor? scale=None, Tensor? bias=None, Tensor? fused_add=None, *, float epsilon=1e-05, "
     f"int channel_axis=1, {_ACT}", _T3),
    ("batch_normalization_backward",
     "Tensor grad_output, Tensor input, Tensor mean, Tensor variance, Tensor? scale=None, Tensor? bias=None, "
     f"Tensor? fused_add=None, *, float epsilon=1e-05, int channel_axis=1, bool training=True, {_ACT}, {_GRADS}", _T4),
    ("mean_variance_normalization_backward",
     "Tensor grad_output, Tensor input, int[] axes, Tensor? mean, Tensor? inv_std, Tensor? scale=None, "
     "Tensor? bias=None, *, bool normalize_mean=True, bool normalize_variance=True, float epsilon=1e-05, "
     f"str epsilon_mode=\"inside\", {_ACT}, {_GRADS}", _T3),
    ("layer_norm_backward",
     "Tensor grad_output, Tensor input, Tensor mean, Tensor inv_std, Tensor? scale=None, Tensor? bias=None, *, "
     f"int axis=-1, float epsilon=1e-05, {_ACT}, {_GRADS}", _T3),
    ("rms_norm_backward",
     "Tensor grad_output, Tensor input, Tensor inv_rms, Tensor? scale=None, *, int axis=-1, float epsilon=1e-05, "
     f"{_ACT}, bool grad_input=True, bool? grad_scale=None", _T2),
    ("instance_norm_backward",
     "Tensor grad_output, Tensor input, Tensor mean, Tensor inv_std, Tensor? scale=None, Tensor? bias=None, *, "
     f"int channel_axis=1, float epsilon=1e-05, {_ACT}, {_GRADS}", _T3),
    ("group_norm_backward",
     "Tensor grad_output, Tensor input, int num_groups, Tensor mean, Tensor inv_std, Tensor? scale=None, "
     f"Tensor? bias=None, *, int channel_axis=1, float epsilon=1e-05, {_ACT}, {_GRADS}", _T3),
)

_MUTATING = (
    ("update_running_stats_",
     "Tensor(a!) running_mean, Tensor(b!) running_var, Tensor mean, Tensor variance, "
     "Tensor(c!)? num_batches_tracked=None, *, SymInt count, float? momentum=0.1, "
     "str momentum_convention=\"pytorch\"", "()"),
)


def _rest(returns: str) -> str:
    """What a .out overload returns: the outputs after the first (the one out receives)."""
    n = returns.count("Tensor")
    return "()" if n == 1 else "Tensor" if n == 2 else "(" + ", ".join(["Tensor"] * (n - 1)) + ")"


def _out_schema(args: str) -> str:
    return args + (", " if "*" in args else ", *, ") + "Tensor(a!) out"


#: Every op's schema (without the namespace), as defined: the docs list these.
SCHEMAS: Dict[str, str] = {}
for _name, _args, _returns in _TABLE:
    SCHEMAS[_name] = f"{_name}({_args}) -> {_returns}"
    SCHEMAS[_name + ".out"] = f"{_name}.out({_out_schema(_args)}) -> {_rest(_returns)}"
for _name, _args, _returns in _MUTATING:
    SCHEMAS[_name] = f"{_name}({_args}) -> {_returns}"


# ----------------------------------------------------------------------------------------------------
# registration

_grad_enabled = torch.is_grad_enabled
_functorch_active = torch._C._are_functorch_transforms_active
_forward_ad = torch.autograd.forward_ad
_below_autograd = torch._C._AutoDispatchBelowAutograd
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_AFTER_INPLACE = torch._C._after_ADInplaceOrView_keyset
_any_requires_grad: Callable[..., bool] = getattr(
    torch._C, "_any_requires_grad", lambda *a, **k: any(isinstance(t, torch.Tensor) and t.requires_grad
                                                       for t in (*a, *k.values())))


_interpreters = torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters
_DIFFERENTIATING = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)


def _refuse_nested_derivative(qualname: str) -> None:
    """Raise where torch.func transforms differentiate a derivative (jvp of grad, jacfwd of jacfwd,
    grad of jvp): an op's derivative is computed by a single-level autograd.Function, invisible to
    the outer transform, which would take it as constant (a Hessian of zeros). Called while a
    transform is active; vmap levels are no derivative."""
    if sum(i.key() in _DIFFERENTIATING for i in _interpreters()) > 1:
        raise RuntimeError(f"Trying to differentiate the derivative of {qualname} under nested torch.func transforms "
                           "(jvp of grad, jacfwd of jacfwd or of jacrev, grad of jvp), but no autograd formula was "
                           "registered for it: simdnorm's ops have first derivatives only")


def _defaults(op: Any) -> Tuple[List[Any], Dict[str, Any]]:
    """The schema's defaults: the dispatcher drops arguments equal to them before a Python kernel."""
    pos, kw = [], {}
    for arg in op._schema.arguments:
        d = arg.default_value if arg.has_default_value() else None
        if arg.kwarg_only:
            kw[arg.name] = d
        else:
            pos.append(d)
    return pos, kw


# The keyset an Autograd kernel receives for plain CPU tensors: nothing between it and the CPU
# kernel (no fake, functional or subclass tensor, no mode), so it may run the CPU kernel itself,
# saving the redispatch. Any other keyset redispatches.
_PLAIN_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutogradCPU)


def _runner(op: Any, cpu: Callable) -> Callable:
    """run(keyset, args, kwargs): the op below autograd."""
    redispatch = op._handle.redispatch_boxed  # (OpOverload.redispatch adds a Python frame a call)

    def run(keyset, args, kwargs):
        if keyset == _PLAIN_CPU:
            return cpu(*args, **kwargs)
        with _below_autograd():
            return redispatch(keyset & _AFTER_AUTOGRAD, *args, **kwargs)

    return run


def _transformed() -> bool:
    """Whether a torch.func transform or a forward-mode AD level is active: tensors may then carry
    what only an autograd.Function sees (a tangent, a transform's wrapper)."""
    return _transforming(torch)


def _save(ctx, *tensors: Optional[torch.Tensor]) -> None:
    """What the backward and, where forward-mode AD may ask, the jvp read. An inference tensor (made
    under torch.inference_mode) cannot be saved, yet a parameter's gradient needs it: its copy is
    saved instead, as torch.nn.RMSNorm's composite saves intermediates of its own."""
    for t in tensors:
        if t is not None and t.is_inference():
            tensors = tuple(t.clone() if t is not None and t.is_inference() else t for t in tensors)
            break
    ctx.save_for_backward(*tensors)
    if _transformed():
        ctx.save_for_forward(*tensors)


# The ops' autograd.Functions take torch's C++ apply (_SingleLevelFunction's), not Function.apply's
# Python one: they are applied inside the dispatcher's Autograd kernel, where a torch.func transform
# has already lifted the tensors to its level (as for torch's own ops' autograd kernels), and
# Function.apply would hand them to functorch's front end a second time.
_SingleLevel = torch.autograd.function._SingleLevelFunction
_single_level_allowed = torch._C._functorch.get_single_level_autograd_function_allowed
_allow_single_level = torch._C._functorch.set_single_level_autograd_function_allowed


def _function(name: str, run: Callable, methods: Dict[str, Callable]) -> Callable:
    """The apply of an op's autograd.Function: forward(keyset, kwargs, *args) runs the op below autograd."""

    def forward(keyset, kwargs, *args):
        return run(keyset, args, kwargs)

    body = {"forward": staticmethod(forward), **{k: staticmethod(f) for k, f in methods.items()}}
    apply = type(f"simdnorm_{name}", (_SingleLevel,), body).apply

    def apply_(keyset, kwargs, *args):
        if not _functorch_active():
            return apply(keyset, kwargs, *args)
        allowed = _single_level_allowed()  # (functorch's guard against a Function applied unlifted)
        _allow_single_level(True)
        try:
            return apply(keyset, kwargs, *args)
        finally:
            _allow_single_level(allowed)

    return apply_


def _differentiable(name: str, cpu: Callable, setup: Callable, backward: Callable, jvp: Callable) -> Callable:
    """The Autograd kernel of a forward op."""
    op = getattr(_ops, name).default
    run = _runner(op, cpu)
    pos_defaults, kw_defaults = _defaults(op)

    def setup_context(ctx, inputs, result):
        _, kwargs, *args = inputs
        setup(ctx, list(args) + pos_defaults[len(args):], {**kw_defaults, **kwargs}, result)
        if isinstance(result, tuple):
            ctx.mark_non_differentiable(*result[1:])  # the statistics, as native_layer_norm's
        ctx.set_materialize_grads(False)  # (the statistics' gradients, zeros, would be ignored)
        ctx.n_args = len(args)

    def backward_(ctx, *grads):
        if grads[0] is None:  # (no gradient reached the output)
            return (None,) * (2 + ctx.n_args)
        need = ctx.needs_input_grad[2:] + (False,) * (len(pos_defaults) - ctx.n_args)
        return (None, None) + tuple(backward(ctx, need, *grads))[:ctx.n_args]

    def jvp_(ctx, _keyset, _kwargs, *tangents):
        return jvp(ctx, tangents)

    apply = _function(name, run, {"setup_context": setup_context, "backward": backward_, "jvp": jvp_})

    qualname = f"simdnorm::{name}"

    def kernel(keyset, *args, **kwargs):
        # (a tangent, or a transform's wrapper, is not requires_grad)
        if _functorch_active():
            _refuse_nested_derivative(qualname)
            return apply(keyset, kwargs, *args)
        if (_grad_enabled() and _any_requires_grad(*args)) or _forward_ad._current_level >= 0:
            return apply(keyset, kwargs, *args)
        if keyset == _PLAIN_CPU:
            return cpu(*args, **kwargs)
        return run(keyset, args, kwargs)

    return kernel


def _not_differentiable(qualname: str, op: Any, cpu: Callable) -> Callable:
    """The Autograd kernel of a backward op: its result may be differentiated no further, in either
    mode (a transform's tangent through it would otherwise be dropped silently)."""
    run = _runner(op, cpu)

    def refuse(ctx, *grads):
        raise RuntimeError(f"Trying to backward through {qualname} but no autograd formula was registered: "
                           "simdnorm's backward ops have no derivative (no double backward, no forward-mode "
                           "derivative of a gradient)")

    def setup_context(ctx, inputs, result):
        pass

    apply = _function(op._opname, run, {"setup_context": setup_context, "backward": refuse, "jvp": refuse})

    def kernel(keyset, *args, **kwargs):
        if _functorch_active():
            _refuse_nested_derivative(qualname)
            return apply(keyset, kwargs, *args)
        if (_grad_enabled() and _any_requires_grad(*args)) or _forward_ad._current_level >= 0:
            return apply(keyset, kwargs, *args)
        return run(keyset, args, kwargs)

    return kernel


_PLAIN_CPU_MUTATING = _PLAIN_CPU | torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)


def _written(op: Any) -> Callable:
    """written(args, kwargs): a mutating op's written arguments, as (name, tensor) pairs."""
    pos = [(i, a.name) for i, a in enumerate(op._schema.arguments) if a.is_write and not a.kwarg_only]
    kws = [a.name for a in op._schema.arguments if a.is_write and a.kwarg_only]

    def written(args, kwargs):
        return [(n, args[i]) for i, n in pos if i < len(args)] + [(k, kwargs.get(k)) for k in kws]

    return written


def _mutated(op: Any) -> Callable:
    """bump(args, kwargs): autograd must see a mutating op's arguments change (their version)."""
    written = _written(op)
    increment = torch.autograd.graph.increment_version

    def bump(args, kwargs):
        for _, t in written(args, kwargs):
            if t is not None:
                increment(t)

    return bump


def _carries_tangent(args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
    """Whether a tensor argument has a forward-mode tangent or is a torch.func transform's (grad,
    jvp) wrapper: what an out= function would drop (the plain functions' test of each tensor)."""
    return any(isinstance(t, torch.Tensor) and _tensor_transformed(torch, t) for t in (*args, *kwargs.values()))


def _no_autograd(qualname: str, op: Any, cpu: Callable, out: bool = True) -> Callable:
    """The Autograd kernel of a mutating op (.out, running statistics): none, as torch's out= ops,
    which refuse forward-mode tangents too (the running statistics take the values: torch.nn's
    carry no tangent either). On plain CPU tensors it runs the CPU kernel and the ADInplaceOrView
    kernel's work itself."""
    redispatch = op._handle.redispatch_boxed
    bump = _mutated(op)
    written = _written(op)

    def kernel(keyset, *args, **kwargs):
        if _grad_enabled() and _any_requires_grad(*args, **kwargs):
            raise RuntimeError(f"{qualname}(): functions with out=... arguments don't support automatic "
                               "differentiation, but one of the arguments requires grad")
        if out and (_functorch_active() or _forward_ad._current_level >= 0) and _carries_tangent(args, kwargs):
            raise RuntimeError(f"Trying to use forward AD with {qualname} that does not support it because it is "
                               "an out= function (or a torch.func transform's tensor reached it)")
        if keyset == _PLAIN_CPU_MUTATING:
            result = cpu(*args, **kwargs)
            bump(args, kwargs)
            return result
        for name, t in written(args, kwargs):  # (torch's negative-bit fallback would write a copy)
            if isinstance(t, torch.Tensor) and t.is_neg():
                resolved_negative(t, name, writeable=True)
        with _below_autograd():
            return redispatch(keyset & _AFTER_AUTOGRAD, *args, **kwargs)

    return kernel


def _bump_versions(op: Any) -> Callable:
    """The ADInplaceOrView kernel of a mutating op (reached when the Autograd kernel redispatches)."""
    redispatch = op._handle.redispatch_boxed
    bump = _mutated(op)

    def kernel(keyset, *args, **kwargs):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            result = redispatch(keyset & _AFTER_INPLACE, *args, **kwargs)
        bump(args, kwargs)
        return result

    return kernel


def _out_kernel(kernel: Callable, returns: str) -> Callable:
    n = returns.count("Tensor")

    def out_kernel(*args, out, **kwargs):
        r = kernel(*args, out=out, **kwargs)
        return None if n == 1 else r[1] if n == 2 else r[1:]

    return out_kernel


def _on_one_device(fake: Callable) -> Callable:
    """A fake kernel is also the op's Meta kernel, which the dispatcher picks when any argument is
    a meta tensor: a CPU call with one meta parameter would return uninitialized CPU tensors. Such a
    call gets torch's own error for tensors on two devices."""
    @functools.wraps(fake)
    def checked(*args, **kwargs):
        device = None
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor):
                if device is None:
                    device = t.device
                elif t.device != device:
                    raise RuntimeError("Expected all tensors to be on the same device, but found at least two "
                                       f"devices, {device} and {t.device}!")
        return fake(*args, **kwargs)

    return checked


def _declaring_inductor_fallbacks(fake: Callable) -> Callable:
    @functools.wraps(fake)
    def declaring(*args, **kwargs):
        _decompositions.declare_inductor_fallbacks()
        return fake(*args, **kwargs)

    return declaring


def _register() -> None:
    g = globals()
    for name, args, returns in _TABLE:
        _LIB.define(SCHEMAS[name])
        _LIB.define(SCHEMAS[name + ".out"])
        kernel, fake = g[name], _on_one_device(g["_fake_" + name])
        _LIB.impl(name, kernel, "CPU")
        out_kernel = _out_kernel(kernel, returns)
        _LIB.impl(name + ".out", out_kernel, "CPU")
        if name in _decompositions.FORWARD:
            fake = _declaring_inductor_fallbacks(fake)
        torch.library.register_fake(f"simdnorm::{name}", fake, lib=_LIB)
        torch.library.register_fake(f"simdnorm::{name}.out", _out_kernel(fake, returns), lib=_LIB)
        packet = getattr(_ops, name)
        if name.endswith("_backward"):
            _LIB.impl(name, _not_differentiable(f"simdnorm::{name}", packet.default, kernel), "Autograd",
                      with_keyset=True)
        else:
            _LIB.impl(name, _differentiable(name, kernel, g["_setup_" + name], g["_backward_" + name],
                                            g["_jvp_" + name]), "Autograd", with_keyset=True)
        _LIB.impl(name + ".out", _no_autograd(f"simdnorm::{name}.out", packet.out, out_kernel), "Autograd",
                  with_keyset=True)
        _LIB.impl(name + ".out", _bump_versions(packet.out), "ADInplaceOrView", with_keyset=True)
    for name, args, returns in _MUTATING:
        _LIB.define(SCHEMAS[name])
        _LIB.impl(name, g[name], "CPU")
        torch.library.register_fake(f"simdnorm::{name}", _on_one_device(g["_fake_" + name]), lib=_LIB)
        op = getattr(_ops, name).default
        _LIB.impl(name, _no_autograd(f"simdnorm::{name}", op, g[name], out=False), "Autograd", with_keyset=True)
        _LIB.impl(name, _bump_versions(op), "ADInplaceOrView", with_keyset=True)
    _batching.register(_LIB)
    _decompositions.register()


_register()
for _name, _, _ in _TABLE + _MUTATING:
    _KW_DEFAULTS.update(_defaults(getattr(_ops, _name).default)[1])


# The forward ops whose plain calls a C++ kernel computes (cpp/bindings/torch_kernels.cpp): it is
# their AutogradCPU kernel, computing a call without a Python frame where nothing but the result is
# asked for (no autograd, transform, mode or activation; the call's shapes planned before, by the
# CPU kernel's route), and handing any other call to the op's twin `_<op>_general`, whose Autograd
# kernel is the Python one above (it redispatches the op itself below autograd, so that traces and
# graphs hold the op, never the twin). SIMDNORM_TORCH_CPP_KERNELS=0 leaves them out.
_CPP_OPS = ("batch_normalization", "layer_norm", "rms_norm", "instance_norm", "group_norm")
CPP_KERNELS = False


def _stashing(kernel: Callable) -> Callable:
    """The twin's kernel: an exception leaving it is handed to the C++ kernel that called it, which
    raises it as itself (torch's C ABI would carry only its message)."""
    stash = _core.torch_stash_error

    def twin_kernel(keyset, *args, **kwargs):
        try:
            return kernel(keyset, *args, **kwargs)
        except BaseException as e:
            stash(e)
            raise

    return twin_kernel


def _register_cpp_kernels() -> bool:
    import os

    if os.environ.get("SIMDNORM_TORCH_CPP_KERNELS", "1") == "0":
        return False
    libtorch_cpu = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not os.path.exists(libtorch_cpu) or _core.torch_attach(libtorch_cpu) != "":
        return False
    g = globals()
    for name, args, returns in _TABLE:
        if name not in _CPP_OPS:
            continue
        twin = f"_{name}_general"
        _LIB.define(f"{twin}({args}) -> {returns}")
        _LIB.impl(twin, _stashing(_differentiable(name, g[name], g["_setup_" + name], g["_backward_" + name],
                                                  g["_jvp_" + name])), "Autograd", with_keyset=True)
        _core.torch_register(name, twin)
    return True


CPP_KERNELS = _register_cpp_kernels()


# ----------------------------------------------------------------------------------------------------
# the plain functions' differentiable route (SPEC §10): simdnorm.layer_norm(x, ...) on a tensor that
# requires grad, with grad mode on, runs its torch.ops.simdnorm op, which autograd records

_RUNNING = ("running_mean", "running_var", "momentum", "momentum_convention", "num_batches_tracked")


def _tensor_arg(v: Any, like: torch.Tensor) -> Any:
    """A plain function's array argument as the op takes it: tensors as they are, numbers and lists
    of them as a tensor of the input's dtype (torch's own conversion, which torch.compile traces),
    anything else array-like as a zero-copy tensor where it can be."""
    if v is None or isinstance(v, torch.Tensor):
        return v
    if isinstance(v, (list, tuple, float, int)):
        return torch.as_tensor(v, dtype=like.dtype)
    if torch.compiler.is_compiling():  # (Dynamo converts a numpy array itself)
        return torch.as_tensor(v)
    return _as_tensor(np.asarray(v), like, like.dtype)


# each op and its arguments (name, a tensor, keyword-only), read from its schema once: in a
# torch.compile trace of a plain function the schema's objects are opaque
_ARGUMENTS = {name: (getattr(_ops, name).default, tuple(
    (a.name, str(a.type) in ("Tensor", "Optional[Tensor]"), a.kwarg_only)
    for a in getattr(_ops, name).default._schema.arguments))
    for name, _, _ in _TABLE}


def _call_op(name: str, kw: Dict[str, Any]) -> Any:
    """The op `name` on a plain function's arguments by name (x a torch tensor; the activation and
    axes in the plain functions' forms): what the op returns."""
    from .._descriptors import check_activation  # (the plain functions' own rules)

    act = check_activation(kw.pop("activation", None))
    if act is not None:
        kw["activation"], kw["activation_params"] = act.name, list(act.params.values())
    if isinstance(kw.get("axes"), int):
        kw["axes"] = [kw["axes"]]
    x = kw["x"]
    op, layout = _ARGUMENTS[name]
    args: List[Any] = []
    kwargs: Dict[str, Any] = {}
    for arg, is_tensor, kwarg_only in layout:
        if arg == "input":
            args.append(x)
        elif arg in kw:
            v = kw[arg]
            if is_tensor:
                v = _tensor_arg(v, x)
            if kwarg_only:
                kwargs[arg] = v
            else:
                args.append(v)
    return op(*args, **kwargs)


class _Shape:
    """An input's numpy dtype and shape: what the plain functions' shape rules read."""

    __slots__ = ("dtype", "shape", "ndim")

    def __init__(self, x: torch.Tensor) -> None:
        self.dtype = _np_bf16() if x.dtype is _BF16 else np.dtype(str(x.dtype)[6:])
        self.shape = tuple(x.shape)
        self.ndim = len(self.shape)


def _check_as_plain(name: str, kw: Dict[str, Any], running: Dict[str, Any]) -> None:
    """The plain function's own rules on the call's scalars and shapes, before the op: the same
    errors as on arrays (the op's schema parsing words a wrong type its own way, and under vmap a
    sample's shape meets the op's batched one), and the running statistics untouched by a call
    that raises."""
    from .. import _descriptors as d, _training as t
    from .._api import group_split

    x = kw["x"]
    if x.dtype not in _ACCEPTED or not all(type(n) is int for n in x.shape):
        return  # (the op refuses such a dtype by name; symbolic sizes are checked when the op runs)
    s = _Shape(x)
    d.check_epsilon(kw.get("epsilon", 1e-5), s.dtype, kw.get("epsilon_mode") == "outside")
    ca = kw.get("channel_axis", 1)
    if name in ("layer_norm", "rms_norm"):
        d.trailing_axes_rule(s, kw.get("axis", -1))
    elif name == "mean_variance_normalization":
        d.normalize_axes(kw.get("axes"), s.ndim)
    elif name == "instance_norm":
        d.spatial_axes_rule(s, d.channel_axis_rule(s, ca, "instance_norm"))
    elif name == "group_norm":
        group_split(s, kw.get("num_groups"), ca)
    elif s.ndim > 1:
        ca = d.normalize_axis("channel_axis", ca, s.ndim)
    rm, rv = running.get("running_mean"), running.get("running_var")
    if rm is None and rv is None:
        return
    if (rm is None) != (rv is None):
        raise d.DescriptorError("running_mean, running_var: give both or neither")
    t._momentum(running.get("momentum"), running.get("momentum_convention", "pytorch"),
                running.get("num_batches_tracked"))
    same = [tuple(np.shape(p)) for p in (kw.get("scale"), kw.get("bias")) if p is not None and np.ndim(p) == s.ndim]
    if same or s.ndim > 1:
        stats = same[0] if same else (s.shape[ca],)
        for n, r in (("running_mean", rm), ("running_var", rv)):
            t._running(r, n, stats, s)


def call_differentiable(name: str, kw: Dict[str, Any]) -> Any:
    """The plain function `name` called with `kw` (its arguments by name, x a torch tensor), through
    the op of the same name; the results as the plain function returns them."""
    kw = dict(kw)
    if kw.pop("out", None) is not None:
        raise TypeError(f"{name}: out= with a tensor that autograd follows (one that requires grad with grad "
                        "mode on, or under a torch.func transform or forward-mode AD); autograd records no writes "
                        "into out=: leave out= out, or call under torch.no_grad()")
    return_stats = kw.pop("return_stats", False)
    running = {k: kw.pop(k) for k in _RUNNING if k in kw}
    if not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()):
        _check_as_plain(name, kw, running)  # (a trace's or a mode's tensors: the op's fake kernel checks)
    res = _call_op(name, kw)
    if name == "batch_normalization":
        return res
    if name == "batch_normalization_training":
        if running.get("running_mean") is not None or running.get("running_var") is not None:
            _update_running(kw["x"], res[1], res[2], running)
        return res
    if not return_stats:
        return res[0]
    if name == "rms_norm":
        return res[0], None, res[1]
    if name == "mean_variance_normalization":
        return (res[0], res[1] if kw.get("normalize_mean", True) else None,
                res[2] if kw.get("normalize_variance", True) else None)
    return res


def call_backward(name: str, kw: Dict[str, Any]) -> tuple:
    """A plain *_backward function called with tensors under torch.compile or torch.export (fake
    tensors, no memory to read): its op, which the graph records; the results as the plain function
    returns them, None for a gradient not asked for (the op's empty tensor)."""
    from .._descriptors import DescriptorError

    kw = dict(kw)
    if kw.pop("out", None) is not None:
        raise TypeError(f"{name}: out= under torch.compile or torch.export, whose graphs record no writes into it: "
                        "leave out= out")
    rms = name == "rms_norm_backward"
    if rms and kw.pop("grad_bias", None):
        raise DescriptorError("grad_bias=True: RMS norm has no bias")
    res = _call_op(name, kw)

    def wanted(flag: str, param: str) -> bool:
        f = kw.get(flag)
        return kw.get(param) is not None if f is None else bool(f)

    flags = [bool(kw.get("grad_input", True)), wanted("grad_scale", "scale")]
    if not rms:
        flags.append(wanted("grad_bias", "bias"))
    grads = tuple(g if w else None for g, w in zip(res, flags))
    if rms:
        return grads + (None,)
    if name == "batch_normalization_backward" and kw.get("fused_add") is not None:
        return grads + (res[3],)
    return grads


def _update_running(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, running: Dict[str, Any]) -> None:
    """batch_normalization_training's running statistics, by its rules (momentum None: the
    convention's default; "cumulative": 1 / num_batches_tracked, the count with this batch)."""
    rm, rv = running.get("running_mean"), running.get("running_var")
    if (rm is None) != (rv is None):
        raise ValueError("running_mean, running_var: give both or neither")
    momentum, convention = running.get("momentum"), running.get("momentum_convention", "pytorch")
    nbt = None
    if momentum is None:
        momentum = 0.1 if convention == "pytorch" else 0.9
    elif momentum == "cumulative":
        count = running.get("num_batches_tracked")
        if count is None or isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise ValueError("num_batches_tracked: an int >= 1 (the count of batches including this one) is "
                             "required with momentum='cumulative'")
        momentum, nbt = None, torch.tensor(int(count) - 1, dtype=torch.int64)  # (the op counts this batch)
    rm_t = rm if isinstance(rm, torch.Tensor) else torch.from_numpy(rm)
    rv_t = rv if isinstance(rv, torch.Tensor) else torch.from_numpy(rv)
    with torch.no_grad():
        _ops.update_running_stats_(rm_t, rv_t, mean.detach(), var.detach(), nbt, count=x.numel() // max(1, mean.numel()),
                                   momentum=momentum, momentum_convention=convention)
