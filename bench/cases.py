"""Arrays for a case, the float64 reference of its op, and the tolerance a result must meet.

Every implementation of a case gets the same input array (same values, dtype and memory layout)
and the same parameter values; parameters are float32 arrays whose values are exactly representable
in float16, bfloat16 and float64, so a peer that wants its parameters in the input's dtype
(``CaseData.params_as``; ``user_params`` gives what a user of that dtype passes) computes the very
same op. A float64 input holds float64 values (not float32 ones widened), so that an
implementation which reads it in float32 is off by ~1e-8 and fails the float64 tolerance even
before its arithmetic does.

A training case (:attr:`Case.is_training`) has several outputs: its reference is an :class:`Expected`
(float64 arrays by output name), and an implementation's ``run_once`` returns a dict of the outputs it
computes, by the same names (the first one, "out" or "grad_input", required); each is checked. A
backward case also has ``grad_output`` (``CaseData.dy``): same shape, dtype and layout as the input.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from .shapes import MOMENTUM, RUNNING_MEAN_INIT, RUNNING_VAR_INIT, Case, forward_op

try:  # bfloat16 as a numpy dtype
    import ml_dtypes as _ml_dtypes
except Exception:  # pragma: no cover - depends on the environment
    _ml_dtypes = None


class NotAvailable(Exception):
    """An implementation cannot run a case; the message is the reason shown as n/a."""


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        if _ml_dtypes is None:
            raise NotAvailable("bfloat16 needs ml_dtypes (pip install ml_dtypes)")
        return np.dtype(_ml_dtypes.bfloat16)
    return np.dtype(name)


def _bf16_exact(a: np.ndarray) -> np.ndarray:
    """Round float32 values toward zero to 8 significant bits: exact in bfloat16 and float16."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def empty_like_layout(case: Case, shape=None, dtype=None) -> np.ndarray:
    """An uninitialized array of the case's logical shape in the case's memory layout."""
    shape = tuple(case.shape if shape is None else shape)
    dt = np_dtype(case.dtype) if dtype is None else np.dtype(dtype)
    if case.layout == "nhwc":
        n, c, h, w = shape
        return np.empty((n, h, w, c), dtype=dt).transpose(0, 3, 1, 2)
    return np.empty(shape, dtype=dt)


@dataclass
class CaseData:
    case: Case
    x: np.ndarray  # logical shape, case dtype, case layout
    params: dict[str, np.ndarray] = field(default_factory=dict)  # 1-D float32 (values exact in every dtype)
    dy: Optional[np.ndarray] = None  # grad_output of a backward case: like x (shape, dtype, layout)

    def new_output(self) -> np.ndarray:
        """A fresh output array like the input (same layout), filled with NaN."""
        out = np.empty_like(self.x)
        out[...] = np.nan
        return out

    def params_as(self, dtype) -> dict[str, np.ndarray]:
        dt = np.dtype(dtype)
        return {k: v.astype(dt) for k, v in self.params.items()}

    @property
    def param_dtype(self) -> np.dtype:
        """What a user passes the parameters as: float64 with float64 data, float32 otherwise
        (float32 parameters with float16/bfloat16 data: the mixed-precision norm)."""
        return np.dtype(np.float64 if self.case.dtype == "float64" else np.float32)

    def user_params(self) -> dict[str, np.ndarray]:
        """The parameters as :attr:`param_dtype` arrays (the float32 ones themselves for float32)."""
        if self.param_dtype == np.float32:
            return self.params
        return self.params_as(self.param_dtype)

    @property
    def base(self) -> np.ndarray:
        """The input's memory as a C-contiguous array (NHWC array for the channels-last layout)."""
        if self.case.layout == "nhwc":
            b = self.x.transpose(0, 2, 3, 1)
            assert b.flags.c_contiguous
            return b
        assert self.x.flags.c_contiguous
        return self.x


def make_data(case: Case, seed: int = 0) -> CaseData:
    rng = np.random.default_rng(seed)
    x = empty_like_layout(case)
    # standard normal plus a per-case offset so that the mean matters (float64 values for a
    # float64 input, float32 ones rounded to the input's type otherwise)
    gen = np.float64 if x.dtype == np.float64 else np.float32
    vals = rng.standard_normal(case.numel, dtype=gen).reshape(case.shape) + gen(0.25)
    x[...] = vals.astype(x.dtype)
    n = case.param_len
    params: dict[str, np.ndarray] = {}
    for name in case.params:
        if name == "mean":
            v = rng.uniform(-0.5, 0.5, n)
        elif name == "var":
            v = rng.uniform(0.5, 2.0, n)
        elif name == "scale":
            v = rng.uniform(0.5, 1.5, n)
        else:  # bias
            v = rng.uniform(-0.5, 0.5, n)
        params[name] = _bf16_exact(v.astype(np.float32))
    dy = None
    if case.is_backward:  # standard normal, in the input's dtype and layout
        dy = empty_like_layout(case)
        dy[...] = rng.standard_normal(case.numel, dtype=gen).reshape(case.shape).astype(dy.dtype)
    return CaseData(case, x, params, dy)


@dataclass
class Expected:
    """The float64 reference outputs of a training case, by name; `primary` ("out" or "grad_input")
    has the case's shape (and must have its dtype); the others are statistics or parameter-shaped.
    `sum_norms[k]` for an output that is a long sum (grad_scale, grad_bias): the L2 norm of the terms
    summed into each element, the scale its rounding error is relative to (a sum of random terms is
    often near zero, where a relative tolerance alone asks for more than any float32 sum gives)."""

    values: dict[str, np.ndarray]
    primary: str
    sum_norms: dict[str, np.ndarray] = field(default_factory=dict)


def _grouped(case: Case, a: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """(view of `a` in which the normalized groups are the reduced axes, those axes)."""
    op = forward_op(case.op)
    if op == "group_norm":
        n, c = a.shape[:2]
        g = case.groups
        v = a.reshape((n, g, c // g) + a.shape[2:])
        return v, tuple(range(2, v.ndim))
    return a, tuple(case.axes)


def _param_axes(case: Case, nd: int) -> tuple[int, ...]:
    """The dims a (C,) or (D,) parameter broadcasts along (its gradient is summed over them)."""
    if forward_op(case.op) in ("layer_norm", "rms_norm"):
        return tuple(range(nd - 1))
    return (0,) + tuple(range(2, nd))


def _training_reference(data: CaseData) -> Expected:
    case = data.case
    x = data.x.astype(np.float64)
    p = {k: v.astype(np.float64) for k, v in data.params.items()}
    eps = case.epsilon
    nd = x.ndim
    pshape = (-1,) if forward_op(case.op) in ("layer_norm", "rms_norm") else (1, -1) + (1,) * (nd - 2)
    xv, axes = _grouped(case, x)
    center = forward_op(case.op) != "rms_norm"
    given = case.op == "batch_norm_eval_backward"  # the statistics are the given ones, constants
    if given:
        m, var = p["mean"].reshape(pshape), p["var"].reshape(pshape)
    else:
        m = xv.mean(axis=axes, keepdims=True) if center else 0.0
        var = ((xv - m) ** 2).mean(axis=axes, keepdims=True)  # the mean square for RMS norm
    inv = 1.0 / np.sqrt(var + eps)
    y = ((xv - m) * inv).reshape(x.shape)  # the normalized value
    scale = p["scale"].reshape(pshape) if "scale" in p else 1.0
    if case.op == "batch_norm_training":
        count = x.size // x.shape[1]
        mean, v = m.reshape(-1), var.reshape(-1)
        keep = 1.0 - MOMENTUM
        return Expected({
            "out": y * scale + p["bias"].reshape(pshape),
            "mean": mean,
            "variance": v,
            # PyTorch: r = (1 - m) r + m batch, the variance unbiased
            "running_mean": keep * RUNNING_MEAN_INIT + MOMENTUM * mean,
            "running_var": keep * RUNNING_VAR_INIT + MOMENTUM * v * count / (count - 1),
            # ONNX BatchNormalization-15 (momentum 1 - m): the population variance
            "running_var_onnx": keep * RUNNING_VAR_INIT + MOMENTUM * v,
        }, "out")
    # backward: grad_input = inv_std * (g - M(g) - y * M(g * y)), g = ga * scale, ga = grad_output *
    # act'(y * scale + bias) (SPEC §9); with given statistics (training=False) grad_input = g * inv_std
    dy = data.dy.astype(np.float64)
    if case.activation:
        dy = dy * ACTIVATION_DERIVATIVES[case.activation](y * scale + p["bias"].reshape(pshape))
    g = dy * scale
    if given:
        gi = g * inv
    else:
        gv, yv = _grouped(case, g)[0], _grouped(case, y)[0]
        gi = gv - (gv.mean(axis=axes, keepdims=True) if center else 0.0)
        gi = (gi - yv * (gv * yv).mean(axis=axes, keepdims=True)) * inv
    values = {"grad_input": gi.reshape(x.shape)}
    norms = {}
    paxes = _param_axes(case, nd)
    for name, param, terms in (("grad_scale", "scale", dy * y), ("grad_bias", "bias", dy)):
        if param in p:
            values[name] = terms.sum(axis=paxes)
            norms[name] = np.sqrt((terms * terms).sum(axis=paxes))
    return Expected(values, "grad_input", norms)


# The fused activations (shapes.ACTIVATION_DESCRIPTIONS) in float64, applied to the op's output, and
# their derivatives (relu's 0 at 0, as PyTorch's).
ACTIVATIONS = {
    "relu": lambda y: np.maximum(y, 0.0),
    "silu": lambda y: y / (1.0 + np.exp(-y)),
}
ACTIVATION_DERIVATIVES = {
    "relu": lambda y: (y > 0.0).astype(np.float64),
    "silu": lambda y: (1.0 / (1.0 + np.exp(-y))) * (1.0 + y * (1.0 - 1.0 / (1.0 + np.exp(-y)))),
}


def reference(data: CaseData) -> Union[np.ndarray, Expected]:
    """The case's op in float64 numpy, on the case's arrays (logical shape), then its activation if
    it names one; an :class:`Expected` for a training case."""
    case = data.case
    if case.is_training:
        return _training_reference(data)
    y = _forward_reference(data)
    return ACTIVATIONS[case.activation](y) if case.activation else y


def _forward_reference(data: CaseData) -> np.ndarray:
    """The forward op alone, in float64."""
    case = data.case
    x = data.x.astype(np.float64)
    p = {k: v.astype(np.float64) for k, v in data.params.items()}
    eps = case.epsilon
    nd = x.ndim
    if case.op == "batch_norm":
        bshape = (1, -1) + (1,) * (nd - 2)
        a = p["scale"] / np.sqrt(p["var"] + eps)
        return (x - p["mean"].reshape(bshape)) * a.reshape(bshape) + p["bias"].reshape(bshape)
    if case.op in ("instance_norm", "mvn"):
        axes = tuple(case.axes)
        m = x.mean(axis=axes, keepdims=True)
        v = ((x - m) ** 2).mean(axis=axes, keepdims=True)
        y = (x - m) / np.sqrt(v + eps)
        if "scale" in p:
            bshape = (1, -1) + (1,) * (nd - 2)
            y = y * p["scale"].reshape(bshape) + p["bias"].reshape(bshape)
        return y
    if case.op == "group_norm":
        n, c = x.shape[:2]
        g = case.groups
        xg = x.reshape((n, g, c // g) + x.shape[2:])
        axes = tuple(range(2, xg.ndim))
        m = xg.mean(axis=axes, keepdims=True)
        v = ((xg - m) ** 2).mean(axis=axes, keepdims=True)
        y = ((xg - m) / np.sqrt(v + eps)).reshape(x.shape)
        bshape = (1, -1) + (1,) * (nd - 2)
        return y * p["scale"].reshape(bshape) + p["bias"].reshape(bshape)
    if case.op == "layer_norm":
        m = x.mean(axis=-1, keepdims=True)
        v = ((x - m) ** 2).mean(axis=-1, keepdims=True)
        return (x - m) / np.sqrt(v + eps) * p["scale"] + p["bias"]
    if case.op == "rms_norm":
        ms = (x * x).mean(axis=-1, keepdims=True)
        return x / np.sqrt(ms + eps) * p["scale"]
    raise ValueError(f"unknown op {case.op!r}")


# |y - ref| <= ATOL + RTOL * |ref|: float32 work rounded once to the output type, with room for a
# peer's different (but sound) summation order and for double rounding in float16/bfloat16.
TOLERANCE = {
    "float32": (1e-4, 1e-4),
    "float16": (4e-3, 4e-3),
    "bfloat16": (3e-2, 3e-2),
    "float64": (1e-10, 1e-10),
}


def _close(case: Case, got: np.ndarray, ref: np.ndarray, norm=None) -> tuple[bool, float]:
    o = got.astype(np.float64)
    if not np.all(np.isfinite(o)):
        return False, float("nan")
    atol, rtol = TOLERANCE[case.dtype]
    err = np.abs(o - ref)
    bound = np.abs(ref) if norm is None else np.abs(ref) + norm
    ok = bool(np.all(err <= atol + rtol * bound))
    return ok, float(err.max()) if err.size else 0.0


def check_each(case: Case, out, ref: Expected) -> dict[str, tuple[bool, float]]:
    """A training case's outputs one by one: {name: (within tolerance, max abs error)}. `out` is the
    primary output alone or a dict of outputs by name, which must hold the primary one and no name
    the reference does not know (a missing or unknown one fails). The others need the reference's
    number of elements (any shape, any float dtype: statistics shaped (C,) or with the reduced dims
    kept, gradients in the parameters' dtype); a long sum is within tolerance relative to |ref| + the
    L2 norm of its terms."""
    outs = out if isinstance(out, dict) else {ref.primary: out}
    res: dict[str, tuple[bool, float]] = {}
    if ref.primary not in outs:
        res[ref.primary] = (False, float("inf"))
    for name, got in outs.items():
        want = ref.values.get(name)
        if want is None:
            res[name] = (False, float("inf"))
        elif name == ref.primary:
            res[name] = check(case, got, want)
        else:
            got = np.asarray(got)
            if got.size != want.size or (got.dtype.kind != "f" and got.dtype.name != "bfloat16"):
                res[name] = (False, float("inf"))
            else:
                res[name] = _close(case, got.reshape(want.shape), want, ref.sum_norms.get(name))
    return res


def check(case: Case, out, ref) -> tuple[bool, float]:
    """(within tolerance, max abs error). `out` must have the case's logical shape and dtype.
    Training cases: `ref` is an :class:`Expected`, `out` one output or several (see check_each)."""
    if isinstance(ref, Expected):
        res = check_each(case, out, ref)
        bad = [e for ok, e in res.values() if not ok]
        if bad:
            return False, bad[0]
        return True, max(e for _, e in res.values())
    out = np.asarray(out)
    if out.shape != tuple(case.shape):
        return False, float("inf")
    if out.dtype != np_dtype(case.dtype):
        return False, float("inf")
    return _close(case, out, ref)
