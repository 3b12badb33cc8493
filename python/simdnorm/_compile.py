"""The planner (validated descriptor -> what a call needs) and ``simdnorm.compile``.

A plan is a plain tuple, so that a call unpacks it in one step:

* batch norm: ``(epsilon, activation, channel_axis)``; the kernel takes 1-D parameters as they
  are and places them at ``channel_axis`` itself (a numpy view per parameter would cost as much
  as the rest of a small call);
* MVN: ``(axes, stats_shape, stats_dtype, epsilon, normalize_mean, normalize_variance,
  epsilon_outside, activation)``; the kernel aligns lower-rank scale/bias to the right (numpy
  broadcasting), or a 1-D one at a channel axis when the caller gives one (instance norm).

Every call first asks the kernel to run with ``check_overlap``: the kernel declines (returns False,
having done nothing) when ``out`` may share memory with an operand other than being the input; the
exact decision (numpy) and the temporary are then ``run_overlapping``'s.

The functional API (``_api``) caches plans by (dtypes, shapes, attributes); a compiled operator
keeps its plan and only checks, per call, that the arrays match its descriptors.
"""
from __future__ import annotations

import builtins
import functools
import sys
from typing import Any, Callable, Optional, Tuple

import numpy as np

from . import _core
from ._runtime import share_torch_threads_once
from ._activation import core_tuple, value_text
from ._descriptors import (
    BatchNormalizationDesc,
    BNInfo,
    DescriptorError,
    MeanVarianceNormalizationDesc,
    MVNInfo,
    TensorDesc,
    ACCEPTED_DTYPES,
    is_bfloat16,
    DescriptorTypeError,
    dtype_name,
    stats_dtype,
)

__all__ = ["compile"]

_nd = np.ndarray
_empty_like = np.empty_like
_empty = np.empty
_may_share = np.may_share_memory
_TooHardError = getattr(getattr(np, "exceptions", np), "TooHardError", Exception)


# ----------------------------------------------------------------------------------------------------
# Arrays in

def reject_masked(a: np.ndarray, name: str) -> None:
    """The kernels read every element: a masked array's mask would be ignored, and statistics taken
    over its masked elements would be a silent wrong answer. One without masked elements is fine."""
    if isinstance(a, np.ma.MaskedArray) and np.ma.is_masked(a):
        raise TypeError(
            f"{name}: a masked array with masked elements; simdnorm reads every element and would ignore "
            "the mask: pass a.filled(value), or a.data to normalize the masked values too"
        )


def as_input(obj: Any, name: str = "input") -> np.ndarray:
    """An ndarray (subclasses too, but not a masked array that masks anything), a DLPack object
    (read in place: dlpack_array) or a list/array-like (np.asarray)."""
    if isinstance(obj, _nd):
        if obj.__class__ is not _nd:
            reject_masked(obj, name)
        return obj
    if hasattr(obj, "__dlpack__"):
        return dlpack_array(obj, name)
    reject_lazy(obj, name)
    try:
        return np.asarray(obj)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: cannot convert {type(obj).__name__} to a numpy array ({e})") from None


def reject_lazy(obj: Any, name: str) -> None:
    """A dask array or an xarray object would be computed whole (np.asarray) into one array: their
    place is simdnorm.dask, which runs the op per chunk."""
    module = type(obj).__module__ or ""
    if module.split(".")[0] in ("dask", "xarray"):
        raise TypeError(f"{name}: a {module.split('.')[0]} {type(obj).__name__}; the plain functions take numpy "
                        "arrays and CPU tensors: use simdnorm.dask, which normalizes it chunk by chunk")


def is_tensor(obj: Any) -> bool:
    """A torch.Tensor (or subclass), told without importing torch: until torch is imported, no
    object is one."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, getattr(torch, "Tensor", ()))


def dlpack_array(obj: Any, name: str, writeable: bool = False) -> np.ndarray:
    """obj's memory as a numpy array, no copy: _core.from_dlpack reads obj.__dlpack__()'s capsule
    itself (float16 and bfloat16 included, which numpy's from_dlpack lacks); the array owns it.
    writeable: for out= and the running statistics (a read-only export is a ValueError). A torch
    tensor that requires grad is read through its detached alias (the same memory) under
    torch.no_grad(); with grad mode on, simdnorm's plain functions would drop its autograd: a
    TypeError."""
    if is_tensor(obj):
        torch = sys.modules["torch"]
        if (torch._C._is_tracing() or _transforming(torch) and _transformed(torch, obj)
                or torch._C._len_torch_dispatch_stack() and _tracing_mode(torch)):
            raise _refuse_transformed(name)
        if obj.requires_grad:
            if torch.is_grad_enabled():  # (follow_input sends the forward ops' such calls to their torch op)
                raise TypeError(
                    f"{name}: a torch tensor that requires grad, with grad mode on; this function records no "
                    "autograd: call it under torch.no_grad() or on .detach()")
            obj = obj.detach()
        if obj.is_neg():
            obj = resolved_negative(obj, name, writeable)
        try:
            return _core.from_dlpack(obj, name, writeable)
        except TypeError:  # (a torch.compile or torch.export trace's fake tensor, asked only then)
            if torch.compiler.is_compiling():
                raise _refuse_transformed(name) from None
            raise
    return _core.from_dlpack(obj, name, writeable)


def resolved_negative(t: Any, name: str, writeable: bool) -> Any:
    """A torch tensor with the negative bit set (a lazily negated view, such as ``z.conj().imag``)
    holds the negatives of its values in memory, and torch exports that memory through DLPack
    unmarked: read, it is resolved (``resolve_neg()``, a copy: the one a correct read needs); as an
    output it is refused, since the values written would read back negated."""
    if writeable:
        raise ValueError(
            f"{name}: a torch tensor with the negative bit set (a lazily negated view, such as z.conj().imag): "
            "its memory holds the negatives of its values, so it cannot be written; pass a tensor without it")
    return t.resolve_neg()


def is_foreign_out(out: Any) -> bool:
    """out= that is not an ndarray but a DLPack tensor (a torch tensor): follow_input writes it."""
    return out.__class__ is not _nd and not isinstance(out, _nd) and hasattr(out, "__dlpack__")


def _to_torch(a: np.ndarray, torch: Any) -> Any:
    """A new result array as a torch tensor over the same memory (bfloat16 through an int16 view:
    torch.from_numpy does not know ml_dtypes' type)."""
    if is_bfloat16(a.dtype):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# The functions whose torch op autograd differentiates, and the arguments it differentiates: a call
# with one of them requiring grad (grad mode on) runs that op (SPEC section 10).
_DIFFERENTIABLE = {
    "batch_normalization": ("x", "mean", "variance", "scale", "bias"),
    "mean_variance_normalization": ("x", "scale", "bias"),
    "layer_norm": ("x", "scale", "bias"),
    "rms_norm": ("x", "scale"),
    "instance_norm": ("x", "scale", "bias"),
    "group_norm": ("x", "scale", "bias"),
    "batch_normalization_training": ("x", "scale", "bias", "fused_add"),
}


def _transforming(torch: Any) -> bool:
    """Whether a torch.func transform or a forward-mode AD level is active."""
    return torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0


def _transformed(torch: Any, t: Any) -> bool:
    """Whether tensor t (while _transforming) is a torch.func transform's wrapper or carries a
    forward-mode tangent: only the torch.ops.simdnorm ops (their autograd.Function) compute with those."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t) or torch.autograd.forward_ad.unpack_dual(t).tangent \
        is not None


def _transformed_tensors(torch: Any, kw: dict) -> bool:
    """Whether the call is traced (torch.jit.trace records the ops only) or an argument is a
    transform's (while _transforming: isinstance(None, torch.Tensor) costs 0.2 us an argument)."""
    return torch._C._is_tracing() or _transforming(torch) and any(
        isinstance(v, torch.Tensor) and _transformed(torch, v) for v in kw.values())


def _refuse_transformed(what: str) -> TypeError:
    return TypeError(f"{what}: a tensor under torch.jit.trace, torch.compile, torch.export, a dispatch mode, a "
                     "torch.func transform (vmap, grad, jvp, ...) or with a forward-mode tangent; this function reads tensors' memory, "
                     "which the trace or transform would not see: call it outside, or call the torch.ops.simdnorm op")


_TRACING_MODES = ("ProxyTorchDispatchMode", "FakeTensorMode")


def _tracing_mode(torch: Any) -> bool:
    """Whether a dispatch mode that traces (make_fx's proxy mode) or has no memory (fake tensors) is
    active: what reads a tensor's memory there would be missing from the trace."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(type(m).__name__ in _TRACING_MODES for m in _get_current_dispatch_mode_stack())


def sparse_error(name: str, layout: Any) -> TypeError:
    return TypeError(f"{name}: a torch tensor of layout {layout}; simdnorm reads dense (strided) tensors' memory: "
                     "pass t.to_dense()")


def _refuse_sparse(torch: Any, kw: dict) -> None:
    """A sparse tensor among the arguments (torch's numpy() and DLPack exports fail each their own
    way): a TypeError naming it. Asked only once a call has failed (it costs as much as a call)."""
    for k, v in kw.items():
        if isinstance(v, torch.Tensor) and v.layout is not torch.strided:
            raise sparse_error("input" if k == "x" else k, v.layout) from None


def _as_function_args(fn: Callable[..., Any], kw: dict) -> dict:
    """The arguments of the plain function named fn.__name__: kw itself, or for a compiled operator
    (which the op records in its stead) its arrays checked against its descriptors and the
    descriptor's attributes added (epsilon, axes, activation, ...)."""
    descs = getattr(fn, "arg_descs", None)
    if descs is None:
        return kw
    for arg, (name, d) in descs.items():
        a = kw.get(arg)
        if not is_tensor(a):
            kw[arg] = check_arg(name, a, d)
        elif d is None or (str(a.dtype).rpartition(".")[2], tuple(a.shape)) != (dtype_name(d.dtype), d.sizes) or (
                d.strides is not None and tuple(a.stride()) != d.strides):
            raise _tensor_mismatch(name, a, d)
    return {**kw, **fn.desc_args}


def _tensor_mismatch(name: str, t: Any, d: Optional[TensorDesc]) -> Exception:
    if d is None:
        return _mismatch(name, t, d)
    dt = str(t.dtype).rpartition(".")[2]
    if dt != dtype_name(d.dtype):
        return DescriptorTypeError(f"{name}: dtype {dt} does not match the compiled descriptor's {dtype_name(d.dtype)}")
    if tuple(t.shape) != d.sizes:
        return DescriptorError(f"{name}: shape {tuple(t.shape)} does not match the compiled descriptor's sizes "
                               f"{d.sizes}")
    return DescriptorError(f"{name}: strides {tuple(t.stride())} (elements) do not match the compiled descriptor's "
                           f"strides {d.strides}")


def follow_input(fn: Callable[..., Any], args: dict) -> Any:
    """Run the public function fn on numpy views of a torch input x and of a DLPack out=, and give
    the results the caller's type (SPEC section 10). args: fn's locals() at the call (fn's own
    parameters are picked from it by name). A torch input gets torch outputs: the output is
    torch.empty_like(input) (its memory format kept), written through a DLPack view; the other
    results (statistics, parameter gradients), new numpy arrays, become tensors over the same
    memory. out= (a torch tensor, whatever the input) is written through a writeable view and
    returned itself. numpy inputs never come here: their calls stay as they were."""
    code = fn.__code__
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    # (at a function's top its locals are its parameters: the dict is theirs to reuse)
    kw = args if len(args) == len(names) else {k: args[k] for k in names}
    x = kw["x"]
    torch = sys.modules.get("torch") if is_tensor(x) else None
    if torch is not None and (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()):
        # torch.compile's or torch.export's trace (its tensors have no memory to read), or a dispatch
        # mode (make_fx's tracer, FakeTensorMode, a counter), which sees ops only: the op records the call
        from .torch._ops import call_backward, call_differentiable

        if fn.__name__ in _DIFFERENTIABLE:
            return call_differentiable(fn.__name__, _as_function_args(fn, kw))
        if fn.__name__.endswith("_backward"):
            return call_backward(fn.__name__, _as_function_args(fn, kw))
        raise _refuse_transformed(fn.__name__)
    transformed = torch is not None and _transformed_tensors(torch, kw)
    if torch is not None and fn.__name__ in _DIFFERENTIABLE and (transformed or torch.is_grad_enabled() and any(
            getattr(kw.get(k), "requires_grad", False) for k in _DIFFERENTIABLE[fn.__name__])):
        from .torch._ops import call_differentiable  # (loads simdnorm.torch: torch is loaded already)

        return call_differentiable(fn.__name__, _as_function_args(fn, kw))
    if transformed:
        raise _refuse_transformed(fn.__name__)
    try:
        if torch is not None:
            share_torch_threads_once()
            from .torch._routes import plain_call  # (loads simdnorm.torch: torch is loaded already)

            r = plain_call(fn, kw)  # plain tensors, no activation or out=: straight to the kernels
            if r is not None:
                return r
            kw["x"] = dlpack_array(x, "input")
        out = result = kw.get("out")  # result: what the call returns for the array it writes
        if out is not None:
            if is_foreign_out(out):
                kw["out"] = dlpack_array(out, "out", writeable=True)
        elif torch is not None and kw.get("grad_input", True) is True:  # (a backward op may be asked for none)
            result = torch.empty_like(x, requires_grad=False)
            kw["out"] = dlpack_array(result, "out", writeable=True)
        target = kw.get("out")
        r = fn(**kw)
    except (TypeError, ValueError, RuntimeError):
        if torch is not None:
            _refuse_sparse(torch, kw)
        raise

    def back(v: Any) -> Any:
        if v is target and v is not None:
            return result
        if torch is not None and v.__class__ is _nd:
            return _to_torch(v, torch)
        return v

    return tuple(map(back, r)) if r.__class__ is tuple else back(r)


def as_param(obj: Any, name: str, x: np.ndarray) -> np.ndarray:
    """Like as_input; a list/tuple of numbers becomes an array of the compute type (float32, or
    float64 for a float64 input): a parameter may have the input's dtype or float32."""
    if obj is None:  # (the optional ones are None-checked before; np.asarray would make a 0-d NaN)
        raise DescriptorTypeError(f"{name}: expected an array, got None; {name} is required")
    if isinstance(obj, _nd) or hasattr(obj, "__dlpack__"):
        return as_input(obj, name)
    reject_lazy(obj, name)
    try:
        return np.asarray(obj, dtype=stats_dtype(x.dtype))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: cannot convert {type(obj).__name__} to a float array ({e})") from None


def check_return_stats(v: Any) -> bool:
    """The slow path of return_stats (callers test ``is False`` / ``is True`` first): numpy's bool is
    taken; anything else, 1 and "no" included, is a TypeError (a truthy non-bool gave a tuple)."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise TypeError(f"return_stats: expected a bool, got {type(v).__name__} ({value_text(v)})")


# ----------------------------------------------------------------------------------------------------
# out

def check_out(out: Any, x: np.ndarray) -> None:
    """out=: a writeable ndarray of the input's shape and dtype (any strides but a zero one, which
    makes several elements one location), not a masked array that masks an element."""
    if not isinstance(out, _nd):
        raise DescriptorTypeError(f"out: expected a numpy.ndarray, got {type(out).__name__}")
    if out.dtype != x.dtype:
        raise DescriptorTypeError(
            f"out: dtype {dtype_name(out.dtype)} differs from the input's {dtype_name(x.dtype)}; "
            "out must have the input's dtype and shape"
        )
    if out.shape != x.shape:
        raise ValueError(
            f"out: shape {out.shape} differs from the input's {x.shape}; out must have the input's shape and dtype"
        )
    if not out.flags.writeable:
        raise ValueError("out: the array is read-only; out must be writeable")
    for d, (n, st) in enumerate(zip(out.shape, out.strides)):
        if st == 0 and n > 1 and out.size:
            raise ValueError(f"out: strides[{d}] is 0 with size {n}: more than one element of it is one memory "
                             "location, so it cannot be written")
    if isinstance(out, np.ma.MaskedArray) and np.ma.is_masked(out):
        # numpy's ufuncs replace out's mask by the result's; a mask left in place would hide results
        # written under it, and clearing it unasked would lose the caller's mask.
        raise TypeError(
            "out: a masked array with masked elements; its mask would hide results written under it: "
            "pass out.data, or clear the mask first (out.mask = numpy.ma.nomask)"
        )


def _data_ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _overlaps(out: np.ndarray, a: np.ndarray) -> bool:
    if a is out:
        return True
    if not _may_share(out, a):
        return False
    try:
        return np.shares_memory(out, a, max_work=1 << 20)
    except _TooHardError:  # pragma: no cover - undecided: assume they overlap (a temporary is safe)
        return True


def needs_temporary(out: np.ndarray, x: np.ndarray, *params: Any) -> bool:
    """True when out overlaps the input (other than being it: same buffer, same strides) or a
    parameter: the call then computes into a temporary and copies (as numpy's ufuncs do)."""
    if x is not out and _may_share(out, x):
        if not (out.strides == x.strides and _data_ptr(out) == _data_ptr(x)) and _overlaps(out, x):
            return True
    return any(p is not None and _overlaps(out, p) for p in params)


def run_overlapping(run: Any, out: np.ndarray, x: np.ndarray, *params: Any) -> None:
    """The kernel declined ``run(out, check_overlap=True)``: out may share memory with an operand.
    Decide exactly; run into out, or into a temporary copied to out when they do overlap."""
    if not needs_temporary(out, x, *params):
        run(out, False)
        return
    res = _empty_like(x, subok=False)
    run(res, False)
    np.copyto(out, res)


# ----------------------------------------------------------------------------------------------------
# Planner

def channel_index(ca: int, ndim: int) -> Tuple[Any, ...]:
    """The index that views a 1-D array of C values with C at axis ca of ndim dims."""
    return (None,) * ca + (slice(None),) + (None,) * (ndim - 1 - ca)


def plan_bn(info: BNInfo) -> tuple:
    axes = [e[1] for e in info.params if e is not None and e[1] is not None]
    return (info.epsilon, core_tuple(info.activation), axes[0] if axes else 0)


def plan_mvn(info: MVNInfo) -> tuple:
    x = info.input
    axes = info.axes
    stats_shape = tuple(1 if d in axes else n for d, n in enumerate(x.sizes))
    return (axes, stats_shape, stats_dtype(x.dtype), info.epsilon, info.normalize_mean,
            info.normalize_variance, info.epsilon_outside, core_tuple(info.activation))


# ----------------------------------------------------------------------------------------------------
# Compiled operators
#
# compile() generates, per descriptor, one plain Python function with exactly the checks that
# descriptor needs (dtype and shape of each array, strides where the descriptor gives them), so a
# call is one Python frame and then C++. The fast path compares dtypes by identity (numpy's dtype
# instances are singletons); anything else (another equal dtype instance, a list, a DLPack object,
# a mismatch) takes the slow path, which converts or raises a message naming the argument.
# Each parameter gets the same inline check as the input, on every call, and nothing is remembered
# between calls. (A one-entry memo keyed by the argument's identity once skipped the check for the
# same array object; but numpy lets an array's shape, dtype and strides be reassigned in place
# (mean.shape = (3, 1)), and the memo then passed what a fresh check refuses: the parameter applied
# along another axis. The check costs ~45 ns per parameter more than the identity test did, mostly
# reading .shape, which builds a tuple.)


def _mismatch(name: str, a: Any, d: Optional[TensorDesc]) -> Exception:
    if d is None:
        return DescriptorError(f"{name}: the descriptor has no {name} tensor; pass None")
    if a is None:
        return DescriptorError(f"{name}: the descriptor has a {name} tensor of sizes {d.sizes}; pass an array")
    if not isinstance(a, _nd):
        return DescriptorTypeError(f"{name}: expected a numpy.ndarray, got {type(a).__name__}")
    if a.dtype != d.dtype:
        return DescriptorTypeError(
            f"{name}: dtype {dtype_name(a.dtype)} does not match the compiled descriptor's {dtype_name(d.dtype)}"
        )
    if a.shape != d.sizes:
        return DescriptorError(f"{name}: shape {a.shape} does not match the compiled descriptor's sizes {d.sizes}")
    return DescriptorError(
        f"{name}: strides {a.strides} (bytes) do not match the compiled descriptor's strides "
        f"{d.strides} (elements) = {d.byte_strides()} bytes"
    )


def expect(d: Optional[TensorDesc]) -> Optional[tuple]:
    """(dtype, shape, byte strides or None) that a call's array must match; None when absent."""
    if d is None:
        return None
    return (d.dtype, d.sizes, d.byte_strides())


def check_arg(name: str, a: Any, d: Optional[TensorDesc]) -> Any:
    """The slow path of a compiled operator's argument check: convert, then match or raise."""
    if d is None:
        if a is None:
            return None
        raise _mismatch(name, a, d)
    if a is None:
        raise _mismatch(name, a, d)
    dt, shape, st = expect(d)
    if isinstance(a, _nd):
        reject_masked(a, name)
    else:
        if name == "input" or hasattr(a, "__dlpack__"):
            a = as_input(a, name)
        else:  # a parameter as a list of numbers: the descriptor's dtype
            reject_lazy(a, name)
            try:
                a = np.asarray(a, dtype=dt)
            except (TypeError, ValueError) as e:
                raise DescriptorTypeError(f"{name}: cannot convert {type(a).__name__} to a {dt} array ({e})") from None
    if a.dtype != dt or a.shape != shape or (st is not None and a.strides != st):
        raise _mismatch(name, a, d)
    return a


def _check_out_compiled(out: Any, x: np.ndarray, od: TensorDesc) -> None:
    check_out(out, x)
    ost = od.byte_strides()
    if ost is not None and out.strides != ost:
        raise DescriptorError(
            f"out: strides {out.strides} (bytes) do not match the compiled output descriptor's "
            f"{od.strides} (elements) = {ost} bytes"
        )


def _gen_conditions(specs, ns) -> str:
    """The fast-path mismatch condition for [(argument, TensorDesc)]."""
    conds = []
    for arg, d in specs:
        dt, shape, st = expect(d)
        ns[f"{arg}_S"], ns[f"{arg}_D"] = shape, dt
        conds.append(f"{arg}.shape != {arg}_S or {arg}.dtype is not {arg}_D")
        if st is not None:
            ns[f"{arg}_T"] = st
            conds.append(f"{arg}.strides != {arg}_T")
    return "\n                or ".join(conds)


def _gen_params(params, ns) -> str:
    """Per parameter, the fast check (plain ndarray, the descriptor's shape, dtype and strides where
    it gives them) and, on a mismatch, the slow path that converts or raises. An absent parameter
    (descriptor None) must be None."""
    lines = []
    for arg, d in params:
        ns[f"{arg}_slow"] = functools.partial(check_arg, arg, d=d)
        if d is None:
            lines.append(f"    if {arg} is not None:\n        {arg}_slow({arg})")
            continue
        cond = _gen_conditions([(arg, d)], ns)
        lines.append(f"    if ({arg}.__class__ is not _nd or {cond}):\n        {arg} = {arg}_slow({arg})")
    return "\n".join(lines)


def _kernel_args(params) -> str:
    return ", ".join("None" if d is None else a for a, d in params)


def _allocator(desc: TensorDesc) -> Callable[[], np.ndarray]:
    """new(): an array of the output descriptor's dtype, sizes and strides (a new result takes the
    layout the descriptor gives, which out= is held to)."""
    dt, shape, st = expect(desc)
    packed, step = [], dt.itemsize
    for n in reversed(shape):  # (numpy's C-order strides: a dim's, the product of those after it)
        packed.insert(0, step)
        step *= max(n, 1)
    if st is None or 0 in shape or st == tuple(packed):
        return functools.partial(np.empty, shape, dt)
    low = sum(s * (n - 1) for s, n in zip(st, shape) if s < 0)
    span = sum(abs(s) * (n - 1) for s, n in zip(st, shape)) + dt.itemsize
    return lambda: np.ndarray(shape, dt, np.empty(span, np.uint8), -low, st)


def _gen_body(name: str, params, ns, kernel_call: str, out_desc: TensorDesc, ret: str) -> str:
    """The rest of a compiled operator after its argument checks: a new output, or out= with its fast
    checks (the slow path raises, or writes a torch out through follow_input) and the overlap rule
    (run_overlapping). kernel_call has the placeholders {target} and {check}."""
    ost = out_desc.byte_strides()
    st_cond = ""
    if ost is not None:
        ns["OUT_T"] = ost
        st_cond = " or out.strides != OUT_T"
    ns["_run_overlapping"] = run_overlapping
    plist = "".join(f", {a}" for a, d in params if d is not None)
    # (the locals the lambda reads, bound as defaults: a closure would make them cells, which
    # locals() hands torch.compile unbound where the call follows a tensor input before they are set)
    bound = "".join(f", {v}={v}" for v in ["x", *(a for a, d in params if d is not None), *(
        v for v in ("mo", "so") if v in kernel_call)])
    new_out = "_empty_like(x, subok=False)"
    if ost is not None:
        ns["_new_out"] = _allocator(out_desc)
        new_out = "_new_out()"
    return f"""    if out is None:
        out = {new_out}
        {kernel_call.format(target="out", check="False")}
        return {ret}
    if (out.__class__ is not _nd or out.shape != x_S or out.dtype is not x_D{st_cond}
            or not out.flags.writeable):
        if _is_foreign_out(out):
            return _follow({name}, locals())
        _check_out(out, x, OUT_DESC)
    if not {kernel_call.format(target="out", check="True")}:
        _run_overlapping(lambda o, check{bound}: {kernel_call.format(target="o", check="check")}, out, x{plist})
    return {ret}
"""


def _gen_operator(name: str, signature: str, info: Any, params, kernel_call: str, ns: dict,
                  before_call: str = "", ret: str = "out"):
    """Generate one compiled operator: the input's fast check, the parameters', the body."""
    ns["x_slow"] = lambda a: check_arg("input", a, info.input)
    ns["OUT_DESC"] = info.output
    # (A subclass takes the slow path: a masked array must be refused there.)
    cond = "x.__class__ is not _nd or " + _gen_conditions([("x", info.input)], ns)
    src = f"""def {name}({signature}):
    try:
        slow = ({cond})
    except AttributeError:
        slow = True
    if slow:
        if _is_tensor(x):
            return _follow({name}, locals())
        x = x_slow(x)
{_gen_params(params, ns)}
{before_call}{_gen_body(name, params, ns, kernel_call.replace("ARGS", _kernel_args(params)), info.output, ret)}"""
    return _compile_source(src, ns, name)


def _compile_source(src: str, ns: dict, name: str):
    ns.update(_nd=_nd, _empty_like=_empty_like, _empty=_empty, _check_out=_check_out_compiled, _core=_core,
              _is_tensor=is_tensor, _is_foreign_out=is_foreign_out, _follow=follow_input)
    code = builtins.compile(src, f"<simdnorm compiled {name}>", "exec")
    exec(code, ns)  # noqa: S102 - generated from the descriptor's own (validated) values only
    fn = ns[name]
    fn.__qualname__ = f"compiled.{name}"
    fn.__module__ = "simdnorm"
    fn.__source__ = src
    return fn


def _compile_bn(desc: BatchNormalizationDesc):
    info = desc._validated()
    eps, act, ca = plan_bn(info)
    params = list(zip(("mean", "variance", "scale", "bias"), [None if e is None else e[0] for e in info.params]))
    ns = {"EPS": eps, "ACT": act, "CA": ca}
    fn = _gen_operator("batch_normalization", "x, mean, variance, scale=None, bias=None, *, out=None", info,
                       params, "_core.batch_norm(x, ARGS, {target}, EPS, ACT, CA, {check})", ns)
    fn.desc = desc
    fn.arg_descs = {"x": ("input", info.input), **{a: (a, d) for a, d in params}}
    fn.desc_args = {"epsilon": desc.epsilon, "activation": desc.activation, "channel_axis": desc.channel_axis}
    fn.__doc__ = "op(x, mean, variance, scale=None, bias=None, *, out=None): a compiled batch normalization."
    return fn


def _compile_mvn(desc: MeanVarianceNormalizationDesc):
    info = desc._validated()
    axes, stats_shape, sdt, eps, nm, nv, eo, act = plan_mvn(info)
    ns = {"AXES": axes, "EPS": eps, "NM": nm, "NV": nv, "EO": eo, "ACT": act, "STATS_S": stats_shape, "STATS_D": sdt}
    ns["_check_return_stats"] = check_return_stats
    stats = f"""    if return_stats is False:
        mo = so = None
    elif return_stats is True or _check_return_stats(return_stats):
        mo = {"_empty(STATS_S, STATS_D)" if nm else "None"}
        so = {"_empty(STATS_S, STATS_D)" if nv else "None"}
    else:
        mo = so = None
"""
    fn = _gen_operator("mean_variance_normalization",
                       "x, scale=None, bias=None, *, out=None, return_stats=False", info,
                       [("scale", info.scale), ("bias", info.bias)],
                       "_core.mvn(x, AXES, ARGS, {target}, EPS, NM, NV, EO, ACT, mo, so, -1, {check})", ns,
                       before_call=stats, ret="(out, mo, so) if return_stats else out")
    fn.desc = desc
    fn.arg_descs = {"x": ("input", info.input), "scale": ("scale", info.scale), "bias": ("bias", info.bias)}
    fn.desc_args = {"axes": desc.axes, "normalize_mean": desc.normalize_mean, "normalize_variance":
                    desc.normalize_variance, "epsilon": desc.epsilon, "epsilon_mode": desc.epsilon_mode,
                    "activation": desc.activation}
    fn.__doc__ = ("op(x, scale=None, bias=None, *, out=None, return_stats=False): a compiled "
                  "mean-variance normalization.")
    return fn


def compile(desc: Any) -> Any:  # noqa: A001 - the public name is simdnorm.compile
    """Validate and plan ``desc`` once; return an operator that only checks its arrays match.

    ``BatchNormalizationDesc`` -> ``op(x, mean, variance, scale=None, bias=None, *, out=None)``;
    ``MeanVarianceNormalizationDesc`` -> ``op(x, scale=None, bias=None, *, out=None,
    return_stats=False)``; the training descriptors -> the operators their docstrings name. The operator is a plain function (one Python frame per call) with the
    descriptor as ``op.desc``. Arrays must match the descriptors' dtypes and sizes (and strides,
    where a descriptor gives them); the input and out may otherwise have any strides.
    Raises DescriptorError (a ValueError) for an invalid descriptor. The operator, a generated
    function, does not pickle; descriptors do: send ``op.desc`` to another process and compile it
    there.
    """
    if isinstance(desc, BatchNormalizationDesc):
        return _compile_bn(desc)
    if isinstance(desc, MeanVarianceNormalizationDesc):
        return _compile_mvn(desc)
    from . import _training  # (it imports this module)

    if isinstance(desc, _training.TRAINING_DESCRIPTORS):
        return _training.compile_training(desc)
    raise TypeError(
        "compile: expected a BatchNormalizationDesc, MeanVarianceNormalizationDesc, "
        "BatchNormalizationTrainingDesc, BatchNormalizationGradDesc or MeanVarianceNormalizationGradDesc, "
        f"got {type(desc).__name__}"
    )
