"""Drop-in torch.nn normalization modules running on the ``torch.ops.simdnorm`` ops, and convert().

Each class subclasses its torch.nn class and overrides only how the output is computed, so that
constructor arguments, parameters, buffers, ``state_dict`` (old checkpoints too), ``isinstance``
and ``convert_sync_batchnorm`` are torch.nn's own. Running statistics follow torch.nn's rules
(momentum, the unbiased running variance, ``num_batches_tracked``, momentum=None's cumulative
average). Whatever simdnorm does not take (a tensor off the CPU, another dtype, an empty batch, a
shape torch.nn would refuse) goes to torch.nn's own forward, which computes it or raises its error.
Tools that read a model see torch.nn's modules: torch.onnx's exporters torch.nn's forward (ONNX has
no translation of simdnorm's ops), torch.fx a call_module node, torch.jit.script torch.nn's module
(``__prepare_scriptable__``); revert() swaps torch.nn's classes back for tools keyed on them.
"""
from __future__ import annotations

import copy
import math
import sys
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

import simdnorm as _sn
from . import _ops  # registers torch.ops.simdnorm; its CPU kernels, called directly when _direct()
from . import _routes

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "LayerNorm",
    "GroupNorm",
    "RMSNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "convert",
    "revert",
]

_ops_ns = torch.ops.simdnorm
_bn = _ops_ns.batch_normalization.default
_bn_training = _ops_ns.batch_normalization_training.default
_update = _ops_ns.update_running_stats_.default
_layer_norm = _ops_ns.layer_norm.default
_rms_norm = _ops_ns.rms_norm.default
_group_norm = _ops_ns.group_norm.default
_instance_norm = _ops_ns.instance_norm.default

def _state(m: nn.Module, *names: str) -> tuple:
    """m's parameters and buffers by name, read from its dicts (nn.Module's __getattr__ is the slow
    path of a small call) when m is exactly a drop-in; a subclass (a parametrization's, say) may
    compute them, so it goes through getattr."""
    if type(m) in _OWN:
        p, b = m._parameters, m._buffers
        # (neither: a plain attribute, as an old-style weight_norm's weight or a tensor set by hand)
        return tuple(p[n] if n in p else b[n] if n in b else getattr(m, n, None) for n in names)
    return tuple(getattr(m, n) for n in names)


def _direct(*tensors: Optional[Tensor]) -> bool:
    """Whether a call may run the op's CPU kernel itself, skipping the dispatcher (a few
    microseconds of a small call): eager (not under torch.compile), plain tensors (not fake,
    functional or another subclass, which tracing uses), none of them recording autograd, no
    torch.func transform or forward-mode AD level active (their tensors' tangents and wrappers only
    the op's autograd.Function sees), not under torch.jit.trace (which records the ops only)."""
    if _is_compiling() or _is_tracing() or _transformed():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and ((t.__class__ is not Tensor and t.__class__ is not _Parameter) or (grad and t.requires_grad)):
            return False
    return True


def _plain(fn: Any, input: Tensor, *args: Any, **kw: Any) -> Tensor:
    """The plain function fn on numpy views of the tensors (no statistics asked for), written into
    torch.empty_like(input): a module's direct call."""
    res = torch.empty_like(input)
    fn(_ops._as_numpy(input), *[_ops._as_numpy(a) if isinstance(a, Tensor) else a for a in args],
       out=_ops._as_out(res), **kw)
    return res


_is_compiling = torch.compiler.is_compiling
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_transformed = _ops._transformed
_given = _ops._given  # (keyword arguments past their defaults: the dispatcher parses each)
_is_tracing = torch._C._is_tracing
_Parameter = nn.Parameter
_Proxy = torch.fx.Proxy


_onnx_flags: Any = None  # torch.onnx's exporter flags module, once an export has imported it


def _onnx_exporting() -> bool:
    """Whether torch.onnx is exporting, by either exporter (torch.export's, which runs the model on
    fake tensors, or TorchScript's trace). Read without importing torch.onnx (tens of ms): an
    export has imported it. Under Dynamo (the exporter's strict attempt, after its non-strict one
    has run here) the flag is read as a constant of the module the non-strict attempt found."""
    global _onnx_flags
    if _is_dynamo_compiling():
        return _onnx_flags is not None and _onnx_flags._is_onnx_exporting
    if not (_is_compiling() or _is_tracing()):
        return False
    onnx = sys.modules.get("torch.onnx")
    if onnx is None:
        return False
    exporting = onnx.is_in_onnx_export()
    if _onnx_flags is None:
        _onnx_flags = sys.modules.get("torch.onnx._internal.exporter._flags")
    return exporting


def _attributes_taken(eps: Any, momentum: Any = None, positive: bool = False) -> bool:
    """Whether simdnorm takes a module's eps (finite and >= 0; > 0 where torch.nn's batch norm asks
    it, with batch statistics) and momentum (None or in [0, 1]); torch.nn's forward has any other
    value, and computes with it or raises its own error."""
    return (0.0 < eps < math.inf if positive else 0.0 <= eps < math.inf) and (
        momentum is None or 0.0 <= momentum <= 1.0)


def _fx_call(m: nn.Module, input: Any, nn_forward: Callable[[Any], Any]) -> Any:
    """A drop-in's forward on a torch.fx Proxy: a call_module node of m, as torch.fx's tracer makes
    for torch.nn's own modules (its rule knows them by their module path, torch.nn's), so that the
    traced GraphModule calls the drop-in; torch.nn's forward, traced, where m is the traced root
    or a tracer without module paths. (The forwards test isinstance: a tracer's own Proxy subclass
    comes here too.)"""
    tracer = input.tracer
    path = ""
    if hasattr(tracer, "path_of_module"):
        try:
            path = tracer.path_of_module(m)
        except NameError:  # (not a submodule of the traced root)
            path = ""
    if not path:
        return nn_forward(input)
    return tracer.create_proxy("call_module", path, (input,), {})


def _update_running(rm: Tensor, rv: Tensor, mean: Tensor, var: Tensor, nbt: Optional[Tensor], input: Tensor,
                    skip: Tuple[int, ...], momentum: Optional[float]) -> None:
    """The running statistics' update (update_running_stats_ with count = the product of input's
    sizes but the skip dims). Under torch.jit.trace in torch's own ops: the op's count is an int,
    which a trace records as the traced batch's constant, where the sizes read here are traced
    values (n / (n - 1) of each later batch). The same arithmetic: in double, rounded once."""
    if _is_compiling() or not _is_tracing():  # (dynamo cannot trace _is_tracing: asked outside it only)
        count = 1
        for d, size in enumerate(input.shape):
            count *= 1 if d in skip else size
        _update(rm, rv, mean, var, nbt, **_given({}, count=count, momentum=momentum))
        return
    if nbt is not None:
        nbt.add_(1)
    n = torch.ones((), dtype=torch.float64)
    for d in range(input.dim()):
        if d not in skip:
            n = n * input.size(d)
    f64 = torch.float64
    m = 1.0 / nbt.to(f64) if momentum is None else torch.tensor(float(momentum), dtype=f64)
    unbias = torch.where(n > 1, n / (n - 1), torch.ones((), dtype=f64))
    new_mean = (1.0 - m) * rm.to(f64) + m * mean.to(f64)
    new_var = (1.0 - m) * rv.to(f64) + (m * var.to(f64)) * unbias
    rm.copy_(torch.where(n > 0, new_mean, rm.to(f64)))  # (an empty batch moves nothing)
    rv.copy_(torch.where(n > 0, new_var, rv.to(f64)))


class _BatchNormForward(_BatchNorm):
    """forward of _BatchNorm (torch/nn/modules/batchnorm.py), step for step. (A subclass of it, so
    that it types; BatchNorm1d's MRO puts nn.BatchNorm1d after it: super() is torch.nn's.)"""

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, _Proxy):
            return _fx_call(self, input, super().forward)
        rm, rv, w, b = _state(self, "running_mean", "running_var", "weight", "bias")
        if (input.dim() < 2 or input.shape[1] != self.num_features
                or not _attributes_taken(self.eps, self.momentum, positive=self.training or rm is None)):
            return super().forward(input)  # (its dims' or channels' error, as torch.nn words it)
        direct = _direct(input, w, b)
        if not self.training and rm is not None and rv is not None and direct:
            self._check_input_dim(input)
            y = _routes.batch_norm(input, rm, rv, w, b, self.eps, module=True)
            if y is not None:
                return y
        if (rm is None) != (rv is None) or not _routes.takes(input, w, b, rm, rv) or _onnx_exporting():
            return super().forward(input)
        self._check_input_dim(input)
        if not self.training and rm is not None:
            if direct:
                return _plain(_sn.batch_normalization, input, rm, rv, w, b, epsilon=self.eps)
            return _bn(input, rm, rv, w, b, **_given({}, epsilon=self.eps))
        if self.training or rm is None:  # batch statistics, as torch.nn's bn_training
            F._verify_batch_size(input.size())  # type: ignore[attr-defined]
        (nbt,) = _state(self, "num_batches_tracked")
        if direct and self.training and self.track_running_stats and rm is not None and _direct(rm, rv, nbt):
            # the plain function updates the running statistics by the same rules, in one call
            if nbt is not None:
                nbt.add_(1)
            if self.momentum is not None:
                mom: Dict[str, Any] = {"momentum": float(self.momentum)}
            elif nbt is not None:
                mom = {"momentum": "cumulative", "num_batches_tracked": int(nbt)}
            else:
                mom = {"momentum": 0.0}
            return _plain(_sn.batch_normalization_training, input, w, b, epsilon=self.eps,
                          running_mean=_ops._as_out(rm, "running_mean"), running_var=_ops._as_out(rv, "running_var"),
                          **mom)
        train = _ops.batch_normalization_training if direct else _bn_training
        out, mean, var = train(input, w, b, **_given({}, epsilon=self.eps))
        if self.training and self.track_running_stats:
            if rm is not None:
                # momentum=None without a counter: torch.nn's factor is then 0 (nothing moves)
                momentum = 0.0 if self.momentum is None and nbt is None else self.momentum
                if direct and _direct(rm, rv, nbt):
                    _ops.update_running_stats_(rm, rv, mean, var, nbt, count=input.numel() // input.shape[1],
                                               momentum=momentum)
                else:
                    _update_running(rm, rv, mean, var, nbt, input, (1,), momentum)
            elif nbt is not None:
                nbt.add_(1)
        return out


class BatchNorm1d(_BatchNormForward, nn.BatchNorm1d):
    """:class:`torch.nn.BatchNorm1d` computed by simdnorm on the CPU."""


class BatchNorm2d(_BatchNormForward, nn.BatchNorm2d):
    """:class:`torch.nn.BatchNorm2d` computed by simdnorm on the CPU."""


class BatchNorm3d(_BatchNormForward, nn.BatchNorm3d):
    """:class:`torch.nn.BatchNorm3d` computed by simdnorm on the CPU."""


class _InstanceNormForward(_InstanceNorm):
    """_InstanceNorm's normalization (its forward's checks, warning and unbatched input stay
    torch.nn's: it calls this after them)."""

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, _Proxy):
            return _fx_call(self, input, super().forward)
        return super().forward(input)

    def _apply_instance_norm(self, input: Tensor) -> Tensor:
        rm, rv = self.running_mean, self.running_var
        if ((rm is None) != (rv is None) or not _routes.takes(input, self.weight, self.bias, rm, rv)
                or input.dim() < 3 or (rm is not None and rm.shape != (input.shape[1],))
                or not _attributes_taken(self.eps, self.momentum) or _onnx_exporting()):
            return super()._apply_instance_norm(input)
        if not self.training and self.track_running_stats and rm is not None:  # torch.nn's use_input_stats
            return _bn(input, rm, rv, self.weight, self.bias, **_given({}, epsilon=self.eps))
        F._verify_spatial_size(input.size())  # type: ignore[attr-defined]
        if rm is None:
            if _direct(input, self.weight, self.bias):
                y = _routes.instance_norm(input, self.weight, self.bias, self.eps, module=True)
                return _plain(_sn.instance_norm, input, self.weight, self.bias, epsilon=self.eps) if y is None else y
            return _instance_norm(input, self.weight, self.bias, **_given({}, epsilon=self.eps))[0]
        # Running statistics need the variance: batch norm with (N, C, 1, ...) parameters takes the
        # statistics of each (n, c), the (C,) weight and bias expanded to that shape (no copy).
        n, c = input.shape[0], input.shape[1]
        shape = [n, c] + [1] * (input.dim() - 2)
        w: Tensor = self.weight if self.weight is not None else input.new_ones((), dtype=torch.float32)
        w = w.reshape([1, -1] + [1] * (input.dim() - 2)).expand(shape)
        b = None if self.bias is None else self.bias.reshape([1, c] + [1] * (input.dim() - 2)).expand(shape)
        out, mean, var = _bn_training(input, w, b, epsilon=self.eps)
        # torch.nn averages each (n, c)'s update over n, and leaves num_batches_tracked alone
        _update_running(rm, rv, mean.reshape(n, c).mean(0), var.reshape(n, c).mean(0), None, input, (0, 1),
                        self.momentum if self.momentum is not None else 0.0)
        return out


class InstanceNorm1d(_InstanceNormForward, nn.InstanceNorm1d):
    """:class:`torch.nn.InstanceNorm1d` computed by simdnorm on the CPU."""


class InstanceNorm2d(_InstanceNormForward, nn.InstanceNorm2d):
    """:class:`torch.nn.InstanceNorm2d` computed by simdnorm on the CPU."""


class InstanceNorm3d(_InstanceNormForward, nn.InstanceNorm3d):
    """:class:`torch.nn.InstanceNorm3d` computed by simdnorm on the CPU."""


class LayerNorm(nn.LayerNorm):
    """:class:`torch.nn.LayerNorm` computed by simdnorm on the CPU."""

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, _Proxy):
            return _fx_call(self, input, super().forward)
        if input.is_nested or not _attributes_taken(self.eps):  # (a strided nested tensor has no shape)
            return super().forward(input)
        w, b = _state(self, "weight", "bias")
        direct = _direct(input, w, b)
        if direct:
            ns = self.normalized_shape
            y = _routes.layer_norm(input, w, b, -len(ns), self.eps, module=ns)
            if y is not None:
                return y
        if not _routes.trailing(input, self.normalized_shape) or not _routes.takes(input, w, b) or _onnx_exporting():
            return super().forward(input)
        if direct:
            return _plain(_sn.layer_norm, input, w, b, axis=-len(self.normalized_shape), epsilon=self.eps)
        return _layer_norm(input, w, b, **_given({}, axis=-len(self.normalized_shape), epsilon=self.eps))[0]


class RMSNorm(nn.RMSNorm):
    """:class:`torch.nn.RMSNorm` computed by simdnorm on the CPU. ``eps=None`` is the machine epsilon
    of the computation type, as torch.nn's: float32's for float32 and 16-bit data, float64's for
    float64."""

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(x, _Proxy):
            return _fx_call(self, x, super().forward)
        (w,) = _state(self, "weight")
        eps = self.eps
        if eps is None:
            eps = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
        elif not _attributes_taken(eps):
            return super().forward(x)
        direct = _direct(x, w)
        if direct:
            ns = self.normalized_shape
            y = _routes.layer_norm(x, w, None, -len(ns), eps, rms=True, module=ns)
            if y is not None:
                return y
        if not _routes.trailing(x, self.normalized_shape) or not _routes.takes(x, w) or _onnx_exporting():
            return super().forward(x)
        if direct:
            return _plain(_sn.rms_norm, x, w, axis=-len(self.normalized_shape), epsilon=eps)
        return _rms_norm(x, w, **_given({}, axis=-len(self.normalized_shape), epsilon=eps))[0]


class GroupNorm(nn.GroupNorm):
    """:class:`torch.nn.GroupNorm` computed by simdnorm on the CPU."""

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, _Proxy):
            return _fx_call(self, input, super().forward)
        w, b = _state(self, "weight", "bias")
        # (one sample of one-element groups: torch.nn's ValueError)
        if input.is_nested or input.numel() == self.num_groups or not _attributes_taken(self.eps):
            return super().forward(input)
        direct = _direct(input, w, b)
        if direct:
            y = _routes.group_norm(input, self.num_groups, w, b, self.eps, module=True)
            if y is not None:
                return y
        if (input.dim() < 2 or input.shape[1] % self.num_groups != 0
                or (self.affine and input.shape[1] != self.num_channels)
                or not _routes.takes(input, w, b) or _onnx_exporting()):
            return super().forward(input)
        if direct:
            return _plain(_sn.group_norm, input, self.num_groups, w, b, epsilon=self.eps)
        return _group_norm(input, self.num_groups, w, b, **_given({}, epsilon=self.eps))[0]


_DROP_INS = {
    nn.BatchNorm1d: BatchNorm1d,
    nn.BatchNorm2d: BatchNorm2d,
    nn.BatchNorm3d: BatchNorm3d,
    nn.LayerNorm: LayerNorm,
    nn.GroupNorm: GroupNorm,
    nn.RMSNorm: RMSNorm,
    nn.InstanceNorm1d: InstanceNorm1d,
    nn.InstanceNorm2d: InstanceNorm2d,
    nn.InstanceNorm3d: InstanceNorm3d,
}


_OWN = frozenset(_DROP_INS.values())
_TORCH_NN = {cls: nn_cls for nn_cls, cls in _DROP_INS.items()}


def _prepare_scriptable(self: nn.Module) -> nn.Module:
    """torch.jit.script's hook: TorchScript cannot compile a drop-in's Python forward, so it
    scripts torch.nn's module in its place, a copy of torch.nn's class sharing this module's
    parameters, buffers and hooks. torch also puts that copy in the drop-in's place among its
    parent's submodules, which the warning says. (A subclass of a drop-in is scripted as it is.)"""
    nn_cls = _TORCH_NN.get(type(self))
    if nn_cls is None:
        return self
    warnings.warn(f"torch.jit.script scripts torch.nn.{nn_cls.__name__} in place of simdnorm's drop-in "
                  "(TorchScript cannot compile its forward) and puts it in the drop-in's place in the model "
                  "as well; simdnorm.torch.convert(model) swaps simdnorm's back in", UserWarning, stacklevel=2)
    twin = copy.copy(self)  # (its __dict__ copied: the same parameter and buffer dicts)
    twin.__class__ = nn_cls
    return twin


for _cls in _OWN:
    setattr(_cls, "__prepare_scriptable__", _prepare_scriptable)  # (one hook for the nine classes)


def _swap_classes(model: nn.Module, classes: Dict[type, type]) -> nn.Module:
    """Every module of model whose class is exactly a key of classes takes that key's value."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    for m in model.modules():
        cls = classes.get(type(m))
        if cls is not None:
            m.__class__ = cls
    return model


def convert(model: nn.Module) -> nn.Module:
    """Swap, in place, every module of ``model`` (``model`` itself included) whose class is exactly
    one of torch.nn's BatchNorm1d/2d/3d, LayerNorm, GroupNorm, RMSNorm, InstanceNorm1d/2d/3d for
    simdnorm's drop-in, and return ``model``.

    The module objects stay where they are and only change class, so their Parameter and buffer
    objects, hooks and the optimizers that hold those parameters carry on unchanged. Subclasses
    of those classes (yours, SyncBatchNorm) are left alone.
    """
    return _swap_classes(model, _DROP_INS)


def revert(model: nn.Module) -> nn.Module:
    """Undo :func:`convert`: swap, in place, every drop-in of ``model`` (``model`` itself included)
    back to its torch.nn class, and return ``model``. The modules stay the same objects with the
    same parameters and buffers, as in convert. For tools that know torch.nn's classes by their
    exact type, such as ``torch.ao.quantization.fuse_modules``."""
    return _swap_classes(model, _TORCH_NN)
