"""The forward ops written in torch's own ops, for exporters that have no translation of simdnorm's.

torch.onnx's exporter decomposes an op it cannot translate with the decompositions of
``torch._decomp``'s table; registered there, each ``torch.ops.simdnorm`` forward op becomes the
torch ops below (reductions, rsqrt, the activation's formula), which it translates into ONNX.
Neither eager calls nor ``torch.compile`` nor ``torch.export`` (whose default decompositions are
core ATen's own list) use them: they keep simdnorm's ops and kernels.

Each computes as the kernels do, in float32 (float64 for float64 data) with the parameters aligned
by simdnorm's rules, and returns what the op returns: the output in the input's dtype, the
statistics in the compute type with the op's shapes, an empty tensor for one not computed. The
arguments were validated when the op first ran on them (its fake kernel checks ranks; the exporter
traced the op on real shapes), so only the alignment is worked out here.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from .._activation import ACTIVATIONS
from . import _ops as _op_kernels  # (it imports this module halfway: its helpers are read at call time)

_ops = torch.ops.simdnorm


def _compute_dtype(x: Tensor) -> torch.dtype:
    return _op_kernels._stats_dtype(x)  # (the ops' statistics dtype is their compute type)


def _empty_stat(x: Tensor) -> Tensor:
    return _op_kernels._empty(x, _compute_dtype(x))


# ----------------------------------------------------------------------------------------------------
# activations: SPEC's formulas (DirectML's; clip, silu and hard_swish ONNX's), NaN kept NaN

def _elu_part(z: Tensor, alpha: float) -> Tensor:
    return alpha * torch.expm1(torch.clamp(z, max=0.0))


_FORMULAS: Dict[str, Callable[..., Tensor]] = {
    "identity": lambda z: z,
    "linear": lambda z, alpha, beta: alpha * z + beta,
    "relu": torch.relu,
    "leaky_relu": lambda z, alpha: torch.where(z >= 0, z, alpha * z),
    "thresholded_relu": lambda z, alpha: torch.where(z <= alpha, torch.zeros_like(z), z),
    "elu": lambda z, alpha: torch.where(z > 0, z, _elu_part(z, alpha)),
    "celu": lambda z, alpha: torch.clamp(z, min=0.0) + torch.clamp(
        alpha * torch.expm1(torch.clamp(z, max=0.0) / alpha), max=0.0),
    "scaled_elu": lambda z, alpha, gamma: gamma * torch.where(z > 0, z, _elu_part(z, alpha)),
    "sigmoid": torch.sigmoid,
    "hard_sigmoid": lambda z, alpha, beta: torch.clamp(alpha * z + beta, 0.0, 1.0),
    "tanh": torch.tanh,
    "scaled_tanh": lambda z, alpha, beta: alpha * torch.tanh(beta * z),
    "softplus": lambda z, steepness: torch.nn.functional.softplus(steepness * z) / steepness,
    "parametric_softplus": lambda z, alpha, beta: alpha * torch.nn.functional.softplus(beta * z),
    "softsign": lambda z: z / (1.0 + torch.abs(z)),
    "shrink": lambda z, bias, threshold: torch.where(
        torch.abs(z) <= threshold, torch.zeros_like(z), torch.where(z > 0, z - bias, z + bias)),
    "gelu": torch.nn.functional.gelu,
    "clip": lambda z, min, max: torch.clamp(z, min, max),
    "silu": torch.nn.functional.silu,
    "hard_swish": lambda z: z * torch.clamp(z / 6.0 + 0.5, 0.0, 1.0),
}
assert set(_FORMULAS) == set(ACTIVATIONS)


def _activate(z: Tensor, name: Optional[str], params: Optional[Sequence[float]]) -> Tensor:
    if name is None:
        return z
    names = tuple(ACTIVATIONS[name])
    values = dict(ACTIVATIONS[name])
    values.update(zip(names, params or ()))
    if z.dtype != torch.float64:  # (the kernels apply the parameters rounded to float32)
        values = {k: float(np.float32(v)) for k, v in values.items()}
    return _FORMULAS[name](z, *(values[n] for n in names))


# ----------------------------------------------------------------------------------------------------
# parameters aligned to the input (the rules the validator checked)

def _right_aligned(p: Optional[Tensor], x: Tensor) -> Optional[Tensor]:
    """MVN's rule: numpy broadcasting, aligned right, never enlarging x."""
    if p is None:
        return None
    return p.to(_compute_dtype(x)).reshape([1] * (x.dim() - p.dim()) + list(p.shape))


def _at_channel(p: Optional[Tensor], x: Tensor, ca: int) -> Optional[Tensor]:
    """Batch norm's rule (instance and group norm's (C,) too): a 1-D parameter along the channel
    axis of an input of 2 dims or more; else same rank."""
    if p is None:
        return None
    p = p.to(_compute_dtype(x))
    if p.dim() == 1 and x.dim() > 1:
        shape = [1] * x.dim()
        shape[ca % x.dim()] = p.shape[0]
        return p.reshape(shape)
    return p


def _affine(y: Tensor, scale: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y


def _inv_std(m2: Tensor, epsilon: float, epsilon_mode: str = "inside") -> Tensor:
    if epsilon_mode == "outside":
        return 1.0 / (torch.sqrt(m2) + epsilon)
    return torch.rsqrt(m2 + epsilon)


def _mvn(x: Tensor, axes: Sequence[int], scale: Optional[Tensor], bias: Optional[Tensor], normalize_mean: bool,
         normalize_variance: bool, epsilon: float, epsilon_mode: str, activation: Optional[str],
         params: Optional[Sequence[float]]) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """(output, mean, inv_std) with the reduced dims kept; scale and bias aligned already."""
    xc = x.to(_compute_dtype(x))
    dims = sorted({a % x.dim() for a in axes})
    mean = xc.mean(dim=dims, keepdim=True) if normalize_mean else None
    centered = xc - mean if mean is not None else xc
    inv = None
    if normalize_variance:
        inv = _inv_std((centered * centered).mean(dim=dims, keepdim=True), epsilon, epsilon_mode)
        centered = centered * inv
    y = _activate(_affine(centered, scale, bias), activation, params)
    return y.to(x.dtype), mean, inv


# ----------------------------------------------------------------------------------------------------
# the ops

def batch_normalization(input: Tensor, mean: Tensor, variance: Tensor, scale: Optional[Tensor] = None,
                        bias: Optional[Tensor] = None, *, epsilon: float = 1e-5, activation: Optional[str] = None,
                        activation_params: Optional[List[float]] = None, channel_axis: int = 1) -> Tensor:
    xc = input.to(_compute_dtype(input))
    m, v = _at_channel(mean, input, channel_axis), _at_channel(variance, input, channel_axis)
    y = (xc - m) / torch.sqrt(v + epsilon)  # (divided before scaled, as the kernels: no factor overflows)
    y = _affine(y, _at_channel(scale, input, channel_axis), _at_channel(bias, input, channel_axis))
    return _activate(y, activation, activation_params).to(input.dtype)


def mean_variance_normalization(input: Tensor, axes: List[int], scale: Optional[Tensor] = None,
                                bias: Optional[Tensor] = None, *, normalize_mean: bool = True,
                                normalize_variance: bool = True, epsilon: float = 1e-5, epsilon_mode: str = "inside",
                                activation: Optional[str] = None,
                                activation_params: Optional[List[float]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    y, mean, inv = _mvn(input, axes, _right_aligned(scale, input), _right_aligned(bias, input), normalize_mean,
                        normalize_variance, epsilon, epsilon_mode, activation, activation_params)
    return y, _empty_stat(input) if mean is None else mean, _empty_stat(input) if inv is None else inv


def layer_norm(input: Tensor, scale: Optional[Tensor] = None, bias: Optional[Tensor] = None, *, axis: int = -1,
               epsilon: float = 1e-5, activation: Optional[str] = None,
               activation_params: Optional[List[float]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    axes = list(range(axis % input.dim(), input.dim()))
    y, mean, inv = _mvn(input, axes, _right_aligned(scale, input), _right_aligned(bias, input), True, True, epsilon,
                        "inside", activation, activation_params)
    return y, mean, inv


def rms_norm(input: Tensor, scale: Optional[Tensor] = None, *, axis: int = -1, epsilon: float = 1e-5,
             activation: Optional[str] = None,
             activation_params: Optional[List[float]] = None) -> Tuple[Tensor, Tensor]:
    axes = list(range(axis % input.dim(), input.dim()))
    y, _, inv = _mvn(input, axes, _right_aligned(scale, input), None, False, True, epsilon, "inside", activation,
                     activation_params)
    return y, inv


def _instance_axes(nd: int, ca: int) -> List[int]:
    return [d for d in range(1, nd) if d != ca % nd]


def instance_norm(input: Tensor, scale: Optional[Tensor] = None, bias: Optional[Tensor] = None, *,
                  epsilon: float = 1e-5, channel_axis: int = 1, activation: Optional[str] = None,
                  activation_params: Optional[List[float]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    y, mean, inv = _mvn(input, _instance_axes(input.dim(), channel_axis), _at_channel(scale, input, channel_axis),
                        _at_channel(bias, input, channel_axis), True, True, epsilon, "inside", activation,
                        activation_params)
    return y, mean, inv


def group_norm(input: Tensor, num_groups: int, scale: Optional[Tensor] = None, bias: Optional[Tensor] = None, *,
               epsilon: float = 1e-5, channel_axis: int = 1, activation: Optional[str] = None,
               activation_params: Optional[List[float]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The channel axis split into (groups, channels a group); each sample's group normalized over
    the rest (the dims but the first and the groups'); the statistics (N, G)."""
    nd, ca = input.dim(), channel_axis % input.dim()
    c = input.shape[ca]
    view = input.reshape(list(input.shape[:ca]) + [num_groups, c // num_groups] + list(input.shape[ca + 1:]))
    pshape = [1] * ca + [num_groups, c // num_groups] + [1] * (nd - ca - 1)
    s = None if scale is None else scale.to(_compute_dtype(input)).reshape(pshape)
    b = None if bias is None else bias.to(_compute_dtype(input)).reshape(pshape)
    axes = [d for d in range(1, nd + 1) if d != ca]
    y, mean, inv = _mvn(view, axes, s, b, True, True, epsilon, "inside", activation, activation_params)
    stats = (input.shape[0], num_groups)
    return y.reshape(input.shape), mean.reshape(stats), inv.reshape(stats)


def batch_normalization_training(input: Tensor, scale: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                                 fused_add: Optional[Tensor] = None, *, epsilon: float = 1e-5, channel_axis: int = 1,
                                 activation: Optional[str] = None,
                                 activation_params: Optional[List[float]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Batch statistics: a statistics element per element of a same-rank parameter, else per channel;
    the population variance; fused_add added before the activation."""
    nd = input.dim()
    same_rank = next((p for p in (scale, bias) if p is not None and p.dim() == nd), None)
    if same_rank is not None:
        stats_shape = list(same_rank.shape)
        axes = [d for d in range(nd) if same_rank.shape[d] == 1]
    else:
        stats_shape = [input.shape[channel_axis % nd]]
        axes = [d for d in range(nd) if d != channel_axis % nd] if nd > 1 else []
    xc = input.to(_compute_dtype(input))
    mean = xc.mean(dim=axes, keepdim=True) if axes else xc
    var = ((xc - mean) ** 2).mean(dim=axes, keepdim=True) if axes else torch.zeros_like(xc)
    y = (xc - mean) / torch.sqrt(var + epsilon)
    y = _affine(y, _at_channel(scale, input, channel_axis), _at_channel(bias, input, channel_axis))
    if fused_add is not None:
        y = y + _right_aligned(fused_add, input)
    y = _activate(y, activation, activation_params).to(input.dtype)
    return y, mean.reshape(stats_shape), var.reshape(stats_shape)


FORWARD: Dict[str, Callable[..., Any]] = {
    "batch_normalization": batch_normalization,
    "mean_variance_normalization": mean_variance_normalization,
    "layer_norm": layer_norm,
    "rms_norm": rms_norm,
    "instance_norm": instance_norm,
    "group_norm": group_norm,
    "batch_normalization_training": batch_normalization_training,
}


def register() -> None:
    """Each forward op's decomposition into torch._decomp's table (torch.onnx's exporter reads it)."""
    from torch._decomp import register_decomposition

    for name, fn in FORWARD.items():
        op = getattr(_ops, name).default
        if op not in torch._decomp.decomposition_table:
            register_decomposition(op)(fn)
    declare_inductor_fallbacks()


_inductor_fallbacks_declared = False


def declare_inductor_fallbacks() -> None:
    """Each forward op's inductor fallback declared, once inductor's lowerings are loaded.

    Inductor runs an op it has no lowering for by an implicit fallback, which raises where the
    environment variable CI is set if the op has a decomposition in torch._decomp's table (it takes
    it for a decomposition inductor should have used). The fallback inductor would make is declared
    explicitly instead. Every forward op's fake kernel calls this: inductor lowers a graph traced
    after it was loaded (by AOTAutograd), and such a trace ran the fake kernel of each op in it.
    """
    global _inductor_fallbacks_declared
    lowering = sys.modules.get("torch._inductor.lowering")
    if _inductor_fallbacks_declared or lowering is None:
        return
    from torch._library.utils import get_layout_constraint_tag

    for name in FORWARD:
        op = getattr(_ops, name).default
        if op not in lowering.lowerings:  # (the layout constraint an implicit fallback takes)
            constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            lowering.make_fallback(op, layout_constraint=constraint, warn=False)
    _inductor_fallbacks_declared = True

