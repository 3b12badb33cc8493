"""Arrays for a case, the float64 reference of its op, and the tolerance a result must meet.

Every implementation of a case gets the same input array (same values, dtype and memory layout)
and the same parameter values; parameters are float32 arrays whose values are exactly representable
in float16, bfloat16 and float64, so a peer that wants its parameters in the input's dtype
(``CaseData.params_as``; ``user_params`` gives what a user of that dtype passes) computes the very
same op. A float64 input holds float64 values (not float32 ones widened), so that an
implementation which reads it in float32 is off by ~1e-8 and fails the float64 tolerance even
before its arithmetic does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .shapes import Case

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
    return CaseData(case, x, params)


def reference(data: CaseData) -> np.ndarray:
    """The case's op in float64 numpy, on the case's arrays (logical shape)."""
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


def check(case: Case, out, ref: np.ndarray) -> tuple[bool, float]:
    """(within tolerance, max abs error). `out` must have the case's logical shape and dtype."""
    out = np.asarray(out)
    if out.shape != tuple(case.shape):
        return False, float("inf")
    if out.dtype != np_dtype(case.dtype):
        return False, float("inf")
    o = out.astype(np.float64)
    if not np.all(np.isfinite(o)):
        return False, float("nan")
    atol, rtol = TOLERANCE[case.dtype]
    err = np.abs(o - ref)
    ok = bool(np.all(err <= atol + rtol * np.abs(ref)))
    return ok, float(err.max()) if err.size else 0.0
