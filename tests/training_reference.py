"""float64 numpy references for SPEC §9 (training: batch statistics and gradients), and the
comparison helpers the training tests share.

Nothing here imports simdnorm: every function follows the SPEC §9 formulas directly. The
references compute in float64 from the exact values of their inputs (float16, bfloat16 and float32
convert to float64 exactly); the statistics handed to a backward reference are used as given (they
are what the forward returned, and the kernel uses them as given too).

  * batch statistics of batch_normalization_training and its output (bn_training_ref);
  * running statistics, PyTorch's momentum and cumulative conventions and ONNX's (running_update_ref);
  * the backward ops (bn_backward_ref, mvn_backward_ref, layer_norm_backward_ref, rms_norm_backward_ref,
    instance_norm_backward_ref, group_norm_backward_ref): gradients plus, per element, a bound on the
    error a float32 (float64 for float64 data) evaluation of the same formula makes, in units of the
    compute rtol (see _core below);
  * plain float64 forward functions (the loss of the finite-difference checks) for every op.

The activations of the backward ops: None, relu, leaky_relu, silu, gelu; relu'(0) = 0 and
leaky_relu'(0) = alpha (PyTorch's choice, SPEC §9).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Optional

import ml_dtypes
import numpy as np

from reference import (
    BF16,
    OUTPUT_RTOL,
    activation_params,
    apply_activation,
    compute_dtype,
    dtype_id,
    f64,
    normalize_axes,
)

_erfc = np.vectorize(math.erfc, otypes=[np.float64])

BACKWARD_ACTIVATIONS = (None, "relu", "leaky_relu", "silu", "gelu")

try:
    from numpy.exceptions import AxisError
except ImportError:  # pragma: no cover - numpy < 1.25
    from numpy import AxisError


@contextlib.contextmanager
def quiet():
    """No numpy warnings: the references meet empty reductions, NaN and inf on purpose."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


# --------------------------------------------------------------------------------------------
# activation derivatives
# --------------------------------------------------------------------------------------------


def _sigmoid(z):
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _with_limits(z, d):
    return np.where(z == np.inf, 1.0, np.where(z == -np.inf, 0.0, d))


def activation_grad(z, name: Optional[str] = None, params: Optional[dict] = None) -> np.ndarray:
    """d activation / dz at the float64 pre-activation values z. relu'(0) = 0, leaky_relu'(0) = alpha."""
    z = np.asarray(z, dtype=np.float64)
    if name is None:
        return np.ones(z.shape)
    p = activation_params(name, params)
    with quiet():
        if name == "relu":
            return np.where(z > 0, 1.0, 0.0)
        if name == "leaky_relu":
            return np.where(z > 0, 1.0, p["alpha"])
        # (silu' and gelu' at +-inf: their limits, 1 and 0, not the formulas' inf * 0)
        if name == "silu":
            s = _sigmoid(z)
            return _with_limits(z, s * (1.0 + z * (1.0 - s)))
        if name == "gelu":  # d/dz [z Phi(z)] = Phi(z) + z phi(z)
            return _with_limits(z, 0.5 * _erfc(-z / math.sqrt(2.0))
                                + z * np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi))
    raise ValueError(f"no backward for activation {name!r}")


def activation_grad_range(z, d, name, params):
    """(act'(z), max - min of act' over z-d, z, z+d): the derivative and how much it may move when
    the pre-activation value is off by d (a kink inside the interval counts in full)."""
    a = activation_grad(z, name, params)
    if name is None:
        return a, np.zeros(a.shape)
    lo = activation_grad(z - d, name, params)
    hi = activation_grad(z + d, name, params)
    with quiet():
        rng = np.maximum(np.maximum(a, lo), hi) - np.minimum(np.minimum(a, lo), hi)
    return a, np.where(np.isfinite(rng), rng, 0.0)


# --------------------------------------------------------------------------------------------
# shapes: parameters broadcast to the input, gradients summed back to a parameter's shape
# --------------------------------------------------------------------------------------------


def sum_to(a, shape):
    """Sum a (float64, of the input's shape) to `shape` by numpy's broadcasting rules in reverse:
    leading dims summed away, dims of size 1 summed with the dim kept."""
    a = np.asarray(a, np.float64)
    shape = tuple(shape)
    lead = a.ndim - len(shape)
    if lead:
        a = a.sum(axis=tuple(range(lead)))
    axes = tuple(d for d, s in enumerate(shape) if s == 1 and a.shape[d] != 1)
    if axes:
        a = a.sum(axis=axes, keepdims=True)
    return a.reshape(shape)


def broadcast_numpy(p, x_shape):
    """A parameter of numpy-broadcast shape (MVN, layer/rms norm) as a float64 view of x's shape."""
    if p is None:
        return None
    p = f64(p)
    if p.ndim > len(x_shape) or np.broadcast_shapes(p.shape, tuple(x_shape)) != tuple(x_shape):
        raise ValueError(f"parameter of shape {p.shape} does not broadcast to {tuple(x_shape)}")
    return np.broadcast_to(p, x_shape)


def is_same_rank(p_shape, x_shape):
    return len(p_shape) == len(x_shape) and all(s == d or s == 1 for s, d in zip(p_shape, x_shape))


def bn_frame_shape(p_shape, x_shape, channel_axis):
    """The same-rank shape of a batch-norm parameter (SPEC §2's two rules): same rank as is, or
    (C,) placed at channel_axis."""
    nd = len(x_shape)
    p_shape = tuple(p_shape)
    if is_same_rank(p_shape, x_shape):
        return p_shape
    if nd > 1 and len(p_shape) == 1 and p_shape[0] == x_shape[channel_axis % nd]:
        s = [1] * nd
        s[channel_axis % nd] = p_shape[0]
        return tuple(s)
    raise ValueError(f"parameter of shape {p_shape} does not fit input {tuple(x_shape)}")


def bn_broadcast(p, x_shape, channel_axis):
    if p is None:
        return None
    p = f64(p)
    return np.broadcast_to(p.reshape(bn_frame_shape(p.shape, x_shape, channel_axis)), x_shape)


def bn_stat_shape(x_shape, scale_shape=None, bias_shape=None, channel_axis=1):
    """SPEC §9: the statistics take the shape of a same-rank scale/bias, else (C,); a 1-D input
    needs a same-rank parameter (AxisError)."""
    nd = len(x_shape)
    for s in (scale_shape, bias_shape):
        if s is not None and is_same_rank(tuple(s), x_shape):
            return tuple(s)
    if nd == 1:
        raise AxisError("a 1-D input needs a same-rank scale or bias")
    return (x_shape[channel_axis % nd],)


def bn_reduced_axes(x_shape, stat_shape, channel_axis):
    frame = bn_frame_shape(stat_shape, x_shape, channel_axis)
    return tuple(d for d, s in enumerate(frame) if s == 1)


# --------------------------------------------------------------------------------------------
# forward references (float64): batch-norm training and the plain forward ops of the FD checks
# --------------------------------------------------------------------------------------------


@dataclass
class BNTraining:
    out: np.ndarray          # activation(pre), float64
    pre: np.ndarray          # the pre-activation value
    zscale: np.ndarray       # per element: the magnitude of the terms a float32 evaluation adds up
    mean: np.ndarray         # of stat_shape
    var: np.ndarray          # population variance, of stat_shape
    count: int               # elements per statistic
    stat_shape: tuple
    axes: tuple              # the reduced dims


def bn_training_ref(x, scale=None, bias=None, *, epsilon=1e-5, channel_axis=1, fused_add=None,
                    activation=None, act_params=None) -> BNTraining:
    """batch_normalization_training (SPEC §9): mean and population variance over every dim but
    channel_axis, or over the dims where a same-rank scale/bias has size 1."""
    xs = f64(x)
    shp = xs.shape
    stat_shape = bn_stat_shape(shp, None if scale is None else np.shape(scale),
                               None if bias is None else np.shape(bias), channel_axis)
    axes = bn_reduced_axes(shp, stat_shape, channel_axis)
    count = int(np.prod([shp[d] for d in axes], dtype=np.int64))
    frame = bn_frame_shape(stat_shape, shp, channel_axis)
    with quiet():
        xl = xs.astype(np.longdouble)
        mean_l = xl.mean(axis=axes, keepdims=True)
        var = ((xl - mean_l) ** 2).mean(axis=axes, keepdims=True).astype(np.float64)
        mean = mean_l.astype(np.float64)
        inv = 1.0 / np.sqrt(var + epsilon)
        s = np.ones(shp) if scale is None else bn_broadcast(scale, shp, channel_axis)
        b = np.zeros(shp) if bias is None else bn_broadcast(bias, shp, channel_axis)
        fa = np.zeros(shp) if fused_add is None else broadcast_numpy(fused_add, shp)
        pre = (xs - mean) * inv * s + b + fa
        zscale = (np.abs(xs) + np.abs(mean) + np.sqrt(var)) * inv * np.abs(s) + np.abs(b) + np.abs(fa)
        out = apply_activation(pre, activation, act_params)
    return BNTraining(out, pre, zscale, mean.reshape(stat_shape), var.reshape(stat_shape), count, stat_shape,
                      axes)


def running_update_ref(running_mean, running_var, batch_mean, batch_var, count, *, momentum=None,
                       momentum_convention="pytorch", num_batches_tracked=None):
    """New (running_mean, running_var), float64, SPEC §9:
    "pytorch": r = (1 - m) r + m batch, variance unbiased (n / (n - 1)), m = momentum (None: 0.1),
    or 1 / num_batches_tracked with momentum="cumulative";
    "onnx": r = m r + (1 - m) batch, population variance, m = momentum (None: 0.9)."""
    rm, rv = f64(running_mean), f64(running_var)
    bm, bv = f64(batch_mean), f64(batch_var)
    if momentum_convention == "pytorch":
        if isinstance(momentum, str) and momentum == "cumulative":
            m = 1.0 / num_batches_tracked
        else:
            m = 0.1 if momentum is None else float(momentum)
        unbiased = bv * (count / (count - 1))
        return (1.0 - m) * rm + m * bm, (1.0 - m) * rv + m * unbiased
    if momentum_convention == "onnx":
        m = 0.9 if momentum is None else float(momentum)
        return m * rm + (1.0 - m) * bm, m * rv + (1.0 - m) * bv
    raise ValueError(momentum_convention)


def bn_inference_forward(x, mean, variance, scale=None, bias=None, *, epsilon=1e-5, channel_axis=1,
                         fused_add=None, activation=None, act_params=None):
    """activation(scale (x - mean) / sqrt(variance + eps) + bias + fused_add) with fixed statistics
    (the function batch_normalization_backward(training=False) differentiates)."""
    xs = f64(x)
    shp = xs.shape
    m = bn_broadcast(mean, shp, channel_axis)
    v = bn_broadcast(variance, shp, channel_axis)
    s = np.ones(shp) if scale is None else bn_broadcast(scale, shp, channel_axis)
    b = np.zeros(shp) if bias is None else bn_broadcast(bias, shp, channel_axis)
    fa = 0.0 if fused_add is None else broadcast_numpy(fused_add, shp)
    return apply_activation((xs - m) / np.sqrt(v + epsilon) * s + b + fa, activation, act_params)


def mvn_stats_ref(x, axes, *, normalize_mean=True, normalize_variance=True, epsilon=1e-5,
                  epsilon_mode="inside"):
    """(mean, inv_std, variance) over axes, reduced dims kept (mean None without normalize_mean;
    inv_std and variance None without normalize_variance). The second moment is about the mean, or
    about 0 without normalize_mean."""
    xs = f64(x)
    axes = normalize_axes(axes, xs.ndim)
    xl = xs.astype(np.longdouble)
    with quiet():
        if normalize_mean:
            mean_l = xl.mean(axis=axes, keepdims=True)
            c = xl - mean_l
            mean = mean_l.astype(np.float64)
        else:
            c = xl
            mean = None
        if not normalize_variance:
            return mean, None, None
        var = (c * c).mean(axis=axes, keepdims=True).astype(np.float64)
        inv = 1.0 / (np.sqrt(var + epsilon) if epsilon_mode == "inside" else np.sqrt(var) + epsilon)
    return mean, inv, var


def mvn_forward(x, axes, scale=None, bias=None, *, normalize_mean=True, normalize_variance=True, epsilon=1e-5,
                epsilon_mode="inside", activation=None, act_params=None):
    xs = f64(x)
    mean, inv, _ = mvn_stats_ref(xs, axes, normalize_mean=normalize_mean, normalize_variance=normalize_variance,
                                 epsilon=epsilon, epsilon_mode=epsilon_mode)
    y = xs - (0.0 if mean is None else mean)
    if inv is not None:
        y = y * inv
    s = 1.0 if scale is None else broadcast_numpy(scale, xs.shape)
    b = 0.0 if bias is None else broadcast_numpy(bias, xs.shape)
    return apply_activation(y * s + b, activation, act_params)


def layer_norm_axes(ndim, axis=-1):
    return tuple(range(axis % ndim, ndim))


def instance_norm_axes(ndim, channel_axis=1):
    c = channel_axis % ndim
    return tuple(d for d in range(1, ndim) if d != c)


def channel_shape(ndim, channel_axis, c):
    s = [1] * ndim
    s[channel_axis % ndim] = c
    return tuple(s)


def channel_broadcast(p, x_shape, channel_axis):
    """A (C,) parameter of instance/group norm as a float64 view of x's shape."""
    if p is None:
        return None
    p = f64(p)
    return np.broadcast_to(p.reshape(channel_shape(len(x_shape), channel_axis, p.shape[0])), x_shape)


def _grouped(xs, num_groups, channel_axis):
    """x (float64) viewed as (N, G, C/G, rest...) with the channel axis moved to 1; and the way back."""
    ca = channel_axis % xs.ndim
    xm = np.moveaxis(xs, ca, 1)
    n, c = xm.shape[:2]
    vshape = (n, num_groups, c // num_groups) + xm.shape[2:]

    def back(a):
        return np.moveaxis(np.asarray(a).reshape(xm.shape), 1, ca)

    return xm.reshape(vshape), back


def group_norm_stats_ref(x, num_groups, *, epsilon=1e-5, channel_axis=1):
    """(mean, inv_std) of shape (N, num_groups)."""
    xg, _ = _grouped(f64(x), num_groups, channel_axis)
    mean, inv, _ = mvn_stats_ref(xg, tuple(range(2, xg.ndim)), epsilon=epsilon)
    n, g = xg.shape[:2]
    return mean.reshape(n, g), inv.reshape(n, g)


def group_norm_forward(x, num_groups, scale=None, bias=None, *, epsilon=1e-5, channel_axis=1, activation=None,
                       act_params=None):
    xs = f64(x)
    xg, back = _grouped(xs, num_groups, channel_axis)
    mean, inv, _ = mvn_stats_ref(xg, tuple(range(2, xg.ndim)), epsilon=epsilon)
    y = back((xg - mean) * inv)
    s = 1.0 if scale is None else channel_broadcast(scale, xs.shape, channel_axis)
    b = 0.0 if bias is None else channel_broadcast(bias, xs.shape, channel_axis)
    return apply_activation(y * s + b, activation, act_params)


# --------------------------------------------------------------------------------------------
# the backward ops
# --------------------------------------------------------------------------------------------


@dataclass
class Grads:
    """Reference gradients (float64) and, for each, a bound on the absolute error of a float32
    (float64 for float64 data) evaluation (before the final rounding to the output type). None
    where the gradient does not apply. grad_input / e_input have the input's shape; the others the
    shape of their parameter."""
    grad_input: Optional[np.ndarray] = None
    e_input: Optional[np.ndarray] = None
    grad_scale: Optional[np.ndarray] = None
    e_scale: Optional[np.ndarray] = None
    grad_bias: Optional[np.ndarray] = None
    e_bias: Optional[np.ndarray] = None
    grad_fused_add: Optional[np.ndarray] = None
    e_fused_add: Optional[np.ndarray] = None


@dataclass
class _Core:
    gi: np.ndarray
    e_gi: np.ndarray
    gs: np.ndarray      # per element: grad_output * act'(pre) * y (summed to scale's shape)
    e_gs: np.ndarray
    gb: np.ndarray      # per element: grad_output * act'(pre) (summed to bias's / fused_add's shape)
    e_gb: np.ndarray


def _core(dy, x, red, mean, inv, s, b, fa, *, nm, nv, training, epsilon, epsilon_mode, activation, act_params,
          rt, rt_fold=None, var_zero=None):
    """SPEC §9's formulas on float64 arrays of x's shape (mean, inv, s, b, fa broadcast; None: absent).

    pre = s * y + b + fa, y = (x - mean) * inv; g = dy * act'(pre) * s;
    grad_input = inv * (g - [nm] M(g) - [nv] k y M(g y)) (training), inv * g (training=False).

    The error bounds: every product, sum and mean adds a relative error rt of its magnitude
    (rt = TRAINING_RTOL of the compute dtype); y itself may be off by rt_fold (|x| + |mean|) inv (a
    kernel may fold (x - mean) * inv into x * inv - mean * inv); act' may move by its range over
    pre +- its own error (a kink inside counts in full).
    """
    rt_fold = rt if rt_fold is None else rt_fold
    with quiet():
        xs = x
        mu = 0.0 if mean is None else mean
        iv = np.ones(xs.shape) if inv is None else inv
        ones = np.ones(xs.shape)
        s = ones if s is None else s
        b = 0.0 if b is None else b
        fa = 0.0 if fa is None else fa
        y = (xs - mu) * iv
        e_y = rt_fold * (np.abs(xs) + np.abs(mu)) * np.abs(iv) + rt * np.abs(y)
        pre = s * y + b + fa
        e_pre = np.abs(s) * e_y + rt * (np.abs(s * y) + np.abs(b) + np.abs(fa))
        ad, ad_range = activation_grad_range(pre, e_pre, activation, act_params)
        gy = dy * ad
        # silu' and gelu' to rt of their magnitude, or absolutely where they are tiny (gelu's far
        # negative tail: Phi(z) + z phi(z) evaluated in float32 has an absolute error)
        e_ad = rt * (np.abs(ad) + (1.0 if activation in ("silu", "gelu") else 0.0))
        e_gy = np.abs(dy) * (ad_range + e_ad)
        g = gy * s
        e_g = np.abs(s) * e_gy + rt * np.abs(g)
        M = lambda a: np.mean(a, axis=red, keepdims=True) if red else a  # noqa: E731
        if training:
            Mg = M(g) if nm else 0.0
            e_Mg = (M(e_g) + rt * M(np.abs(g))) if nm else 0.0
            if nv:
                gyv = g * y
                Mgy = M(gyv)
                e_Mgy = M(e_g * np.abs(y) + np.abs(g) * e_y) + rt * M(np.abs(gyv))
                if epsilon_mode == "inside":
                    k = np.ones(xs.shape)
                    e_k = np.zeros(xs.shape)
                else:
                    k = 1.0 / (1.0 - epsilon * iv)
                    e_k = rt * np.abs(k) * (1.0 + epsilon * np.abs(iv) * np.abs(k))
                    if var_zero is not None:  # SPEC: the k-term is 0 where the variance is 0
                        k = np.where(var_zero, 0.0, k)
                        e_k = np.where(var_zero, 0.0, e_k)
                kyM = k * y * Mgy
                e_kyM = e_k * np.abs(y * Mgy) + np.abs(k) * (e_y * np.abs(Mgy) + np.abs(y) * e_Mgy)
                if var_zero is not None:
                    e_kyM = np.where(var_zero, 0.0, e_kyM)
            else:
                kyM = 0.0
                e_kyM = 0.0
            inner = g - Mg - kyM
            e_inner = e_g + e_Mg + e_kyM + rt * (np.abs(g) + np.abs(Mg) + np.abs(kyM))
            gi = iv * inner
            e_gi = np.abs(iv) * e_inner + rt * np.abs(gi)
        else:
            gi = iv * g
            e_gi = np.abs(iv) * e_g + rt * np.abs(gi)
        gs = gy * y
        e_gs = e_gy * np.abs(y) + np.abs(gy) * e_y + rt * np.abs(gs)
        e_gb = e_gy + rt * np.abs(gy)
    return _Core(gi, e_gi, gs, e_gs, gy, e_gb)


def _sum_grad(core_vals, core_err, shape, rt):
    """A parameter's gradient summed to its shape, and its error bound (the elements' errors plus rt
    of the sum of magnitudes for the reduction itself; inf - inf is NaN, quietly)."""
    with quiet():
        return sum_to(core_vals, shape), sum_to(core_err, shape) + rt * sum_to(np.abs(core_vals), shape)


# The relative error each step of a backward evaluation may add (the unit of the error bounds
# above), by compute dtype: about 67 float32 rounding units and 900 float64 ones. Tighter than the
# forward's COMPUTE_RTOL in reference.py (1e-5 / 1e-12): the measured errors of a correct kernel
# stay below 1/20 of it on every ISA, while a sum accumulated in a half type, or a value rounded
# to one on the way, exceeds it.
TRAINING_RTOL = {np.dtype(np.float32): 4e-6, np.dtype(np.float64): 1e-13}


def _rt(dtype, rt):
    return TRAINING_RTOL[compute_dtype(dtype)] if rt is None else rt


def bn_backward_ref(dy, x, mean, variance, scale=None, bias=None, *, epsilon=1e-5, channel_axis=1, training=True,
                    fused_add=None, activation=None, act_params=None, rt=None, rt_fold=None) -> Grads:
    """batch_normalization_backward: mean/variance as batch_normalization_training returned them
    (stat shape (C,) or same-rank); inv_std = 1 / sqrt(variance + epsilon); the normalized axes are
    the dims where the statistics have size 1 (same-rank) or every dim but channel_axis."""
    xs = f64(x)
    shp = xs.shape
    rt = _rt(np.asarray(x).dtype, rt)
    red = bn_reduced_axes(shp, np.shape(mean), channel_axis)
    with quiet():
        m = bn_broadcast(mean, shp, channel_axis)
        v = bn_broadcast(variance, shp, channel_axis)
        inv = 1.0 / np.sqrt(v + epsilon)
    s = bn_broadcast(scale, shp, channel_axis)
    b = bn_broadcast(bias, shp, channel_axis)
    fa = broadcast_numpy(fused_add, shp)
    c = _core(f64(dy), xs, red, m, inv, s, b, fa, nm=True, nv=True, training=training, epsilon=epsilon,
              epsilon_mode="inside", activation=activation, act_params=act_params, rt=rt, rt_fold=rt_fold)
    out = Grads(c.gi, c.e_gi)
    frame = lambda p: bn_frame_shape(np.shape(p), shp, channel_axis)  # noqa: E731
    if scale is not None:
        gs, es = _sum_grad(c.gs, c.e_gs, frame(scale), rt)
        out.grad_scale, out.e_scale = gs.reshape(np.shape(scale)), es.reshape(np.shape(scale))
    if bias is not None:
        gb, eb = _sum_grad(c.gb, c.e_gb, frame(bias), rt)
        out.grad_bias, out.e_bias = gb.reshape(np.shape(bias)), eb.reshape(np.shape(bias))
    if fused_add is not None:
        out.grad_fused_add, out.e_fused_add = _sum_grad(c.gb, c.e_gb, np.shape(fused_add), rt)
    return out


def mvn_backward_ref(dy, x, axes, mean, inv_std, scale=None, bias=None, *, normalize_mean=True,
                     normalize_variance=True, epsilon=1e-5, epsilon_mode="inside", activation=None, act_params=None,
                     rt=None, rt_fold=None) -> Grads:
    """mean_variance_normalization_backward; mean / inv_std shaped like x with the reduced dims
    kept (None without normalize_mean / normalize_variance)."""
    xs = f64(x)
    shp = xs.shape
    rt = _rt(np.asarray(x).dtype, rt)
    red = normalize_axes(axes, xs.ndim)
    m = None if not normalize_mean else np.broadcast_to(f64(mean), shp)
    inv = None if not normalize_variance else np.broadcast_to(f64(inv_std), shp)
    var_zero = None
    if normalize_variance and epsilon_mode == "outside":
        _, _, var = mvn_stats_ref(xs, red, normalize_mean=normalize_mean, epsilon=epsilon, epsilon_mode="outside")
        # A constant group's variance is 0 exactly, though its long-double mean may round off it.
        top = lambda a: np.max(a, axis=red, keepdims=True, initial=-np.inf)  # noqa: E731 (initial: empty groups)
        spread = top(xs) + top(-xs) if normalize_mean else top(np.abs(xs))
        var_zero = np.broadcast_to((var == 0) | (spread == 0), shp)
    s = broadcast_numpy(scale, shp)
    b = broadcast_numpy(bias, shp)
    c = _core(f64(dy), xs, red, m, inv, s, b, None, nm=normalize_mean, nv=normalize_variance, training=True,
              epsilon=epsilon, epsilon_mode=epsilon_mode, activation=activation, act_params=act_params, rt=rt,
              rt_fold=rt_fold, var_zero=var_zero)
    out = Grads(c.gi, c.e_gi)
    if scale is not None:
        out.grad_scale, out.e_scale = _sum_grad(c.gs, c.e_gs, np.shape(scale), rt)
    if bias is not None:
        out.grad_bias, out.e_bias = _sum_grad(c.gb, c.e_gb, np.shape(bias), rt)
    return out


def layer_norm_backward_ref(dy, x, mean, inv_std, scale=None, bias=None, *, axis=-1, epsilon=1e-5,
                            activation=None, act_params=None, rt=None, rt_fold=None) -> Grads:
    return mvn_backward_ref(dy, x, layer_norm_axes(np.ndim(x), axis), mean, inv_std, scale, bias, epsilon=epsilon,
                            activation=activation, act_params=act_params, rt=rt, rt_fold=rt_fold)


def rms_norm_backward_ref(dy, x, inv_rms, scale=None, *, axis=-1, epsilon=1e-5, activation=None, act_params=None,
                          rt=None, rt_fold=None) -> Grads:
    return mvn_backward_ref(dy, x, layer_norm_axes(np.ndim(x), axis), None, inv_rms, scale, None,
                            normalize_mean=False, epsilon=epsilon, activation=activation, act_params=act_params,
                            rt=rt, rt_fold=rt_fold)


def instance_norm_backward_ref(dy, x, mean, inv_std, scale=None, bias=None, *, channel_axis=1, epsilon=1e-5,
                               activation=None, act_params=None, rt=None, rt_fold=None) -> Grads:
    nd = np.ndim(x)
    cs = lambda p: None if p is None else f64(p).reshape(channel_shape(nd, channel_axis, np.shape(p)[0]))  # noqa
    g = mvn_backward_ref(dy, x, instance_norm_axes(nd, channel_axis), mean, inv_std, cs(scale), cs(bias),
                         epsilon=epsilon, activation=activation, act_params=act_params, rt=rt, rt_fold=rt_fold)
    for name in ("scale", "bias"):
        for pre in ("grad_", "e_"):
            v = getattr(g, pre + name)
            if v is not None:
                setattr(g, pre + name, v.reshape(-1))
    return g


def group_norm_backward_ref(dy, x, num_groups, mean, inv_std, scale=None, bias=None, *, channel_axis=1,
                            epsilon=1e-5, activation=None, act_params=None, rt=None, rt_fold=None) -> Grads:
    """mean / inv_std of shape (N, num_groups); scale / bias of shape (C,)."""
    xs = f64(x)
    rt = _rt(np.asarray(x).dtype, rt)
    xg, back = _grouped(xs, num_groups, channel_axis)
    dg, _ = _grouped(f64(dy), num_groups, channel_axis)
    n, G, K = xg.shape[:3]
    rest = (1,) * (xg.ndim - 3)
    stat = lambda a: np.broadcast_to(f64(a).reshape((n, G, 1) + rest), xg.shape)  # noqa: E731
    par = lambda p: None if p is None else np.broadcast_to(f64(p).reshape((1, G, K) + rest), xg.shape)  # noqa
    red = tuple(range(2, xg.ndim))
    c = _core(dg, xg, red, stat(mean), stat(inv_std), par(scale), par(bias), None, nm=True, nv=True, training=True,
              epsilon=epsilon, epsilon_mode="inside", activation=activation, act_params=act_params, rt=rt,
              rt_fold=rt_fold)
    out = Grads(back(c.gi), back(c.e_gi))
    psum = lambda a: sum_to(a, (1, G, K) + rest).reshape(-1)  # noqa: E731
    if scale is not None:
        out.grad_scale = psum(c.gs)
        out.e_scale = psum(c.e_gs) + rt * psum(np.abs(c.gs))
    if bias is not None:
        out.grad_bias = psum(c.gb)
        out.e_bias = psum(c.e_gb) + rt * psum(np.abs(c.gb))
    return out


# --------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------


def _tiny(dt):
    dt = np.dtype(dt)
    if dt == BF16:
        return 1e-38
    return float(np.finfo(dt).smallest_subnormal) * 2


def grad_tolerance(ref, err, dtype, *, extra_rtol=0.0):
    """Allowed |got - ref| for a gradient of dtype `dtype` (the output's dtype): the compute error
    bound, then one rounding to dtype (OUTPUT_RTOL of the value), and a subnormal floor."""
    dt = np.dtype(dtype)
    ort = OUTPUT_RTOL[dt] + extra_rtol
    return np.asarray(err) + ort * (np.abs(ref) + np.asarray(err)) + _tiny(dt)


def check_grad(got, ref, err, *, dtype=None, name="grad", shape=None, context="", extra_rtol=0.0):
    """Assert got (an array of dtype `dtype`, if given) is within grad_tolerance of ref."""
    assert got is not None, f"{name}: got None {context}"
    got = np.asarray(got)
    if dtype is not None:
        assert got.dtype == np.dtype(dtype), f"{name}: dtype {got.dtype}, want {np.dtype(dtype)} {context}"
    want_shape = np.shape(ref) if shape is None else tuple(shape)
    assert got.shape == want_shape, f"{name}: shape {got.shape}, want {want_shape} {context}"
    g = f64(got)
    ref = np.asarray(ref, np.float64)
    tol = grad_tolerance(ref, err, got.dtype, extra_rtol=extra_rtol)
    with quiet():
        diff = np.abs(g - ref)
        ok = diff <= tol
        # a value beyond the dtype's range rounds to inf (IEEE): where the allowed interval
        # reaches past the largest finite value, the infinity of that sign is a right answer
        big = float(ml_dtypes.finfo(got.dtype).max)
        ok |= (ref + tol > big) & (g == np.inf)
        ok |= (ref - tol < -big) & (g == -np.inf)
    ok |= np.isnan(ref) & np.isnan(g)
    if not ok.all():
        bad = np.argwhere(~ok)
        with quiet():
            ratio = np.where(ok, 0.0, np.where(np.isnan(diff), np.inf, diff / tol))
        worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.ndim else ()
        lines = []
        for idx in list(bad[:6]) + ([np.array(worst)] if len(bad) > 6 else []):
            t = tuple(int(i) for i in idx)
            lines.append(f"  at {t}: got {g[t]!r} ref {ref[t]!r} |diff| {diff[t]:.3g} tol {tol[t]:.3g}")
        raise AssertionError(f"{name}: {len(bad)} of {g.size} elements out of tolerance ({dtype_id(got.dtype)}), "
                             f"worst {np.max(ratio):.3g} x tolerance {context}\n" + "\n".join(lines))


def max_rel_error(got, ref, err=None):
    """max |got - ref| / (max|ref| + tiny): a summary number for reports."""
    g, r = f64(got), np.asarray(ref, np.float64)
    scale = float(np.max(np.abs(r), initial=0.0)) or 1.0
    with quiet():
        return float(np.nanmax(np.abs(g - r), initial=0.0) / scale)


def check_grads(res, ref: Grads, *, x, scale=None, bias=None, fused_add=None, want=("input", "scale", "bias"),
                context="", extra_rtol=0.0):
    """res: the tuple a backward op returned; want: which gradients were asked for (the others must
    be None). Checks arity, dtypes, shapes and values."""
    x = np.asarray(x)
    n = 4 if fused_add is not None else 3
    assert isinstance(res, tuple) and len(res) == n, f"expected a {n}-tuple, got {type(res).__name__} " \
        f"{len(res) if isinstance(res, tuple) else ''} {context}"
    gi, gs, gb = res[:3]
    if "input" in want:
        check_grad(gi, ref.grad_input, ref.e_input, dtype=x.dtype, name="grad_input", context=context,
                   extra_rtol=extra_rtol)
    else:
        assert gi is None, f"grad_input not asked for but returned {context}"
    for name, got, p, r, e in (("scale", gs, scale, ref.grad_scale, ref.e_scale),
                               ("bias", gb, bias, ref.grad_bias, ref.e_bias)):
        if name in want:
            p = np.asarray(p)
            check_grad(got, r, e, dtype=p.dtype, name="grad_" + name, shape=p.shape, context=context,
                       extra_rtol=extra_rtol)
        else:
            assert got is None, f"grad_{name} not asked for but returned {context}"
    if fused_add is not None:
        fa = np.asarray(fused_add)
        check_grad(res[3], ref.grad_fused_add, ref.e_fused_add, dtype=fa.dtype, name="grad_fused_add",
                   shape=fa.shape, context=context, extra_rtol=extra_rtol)



# --------------------------------------------------------------------------------------------
# one call of a backward op, as data: its inputs, its forward (the loss of the finite-difference
# checks), its statistics as the forward returns them, its reference gradients
# --------------------------------------------------------------------------------------------

# "batch_norm": training=True (statistics of the batch); "batch_norm_eval": training=False (given
# statistics, constants)
OPS = ("batch_norm", "batch_norm_eval", "mvn", "layer_norm", "rms_norm", "instance_norm", "group_norm")


@dataclass
class Problem:
    op: str
    x: np.ndarray
    scale: Optional[np.ndarray] = None
    bias: Optional[np.ndarray] = None
    fused_add: Optional[np.ndarray] = None      # batch norm only
    kw: dict = None                             # op attributes (see forward)
    activation: Optional[str] = None
    act_params: Optional[dict] = None
    eval_stats: Optional[tuple] = None          # batch_norm_eval: the given (mean, variance)

    def __post_init__(self):
        self.kw = dict(self.kw or {})

    @property
    def epsilon(self):
        return self.kw.get("epsilon", 1e-5)

    def norm_axes(self):
        """MVN-family ops: the normalized axes of x (group norm: of its grouped view)."""
        nd = self.x.ndim
        if self.op == "mvn":
            return normalize_axes(self.kw["axes"], nd)
        if self.op in ("layer_norm", "rms_norm"):
            return layer_norm_axes(nd, self.kw.get("axis", -1))
        if self.op == "instance_norm":
            return instance_norm_axes(nd, self.kw.get("channel_axis", 1))
        raise ValueError(self.op)

    def stats(self, x=None):
        """The statistics as the forward returns them, exact (float64): batch norm (mean, variance);
        batch_norm_eval the given ones; mvn (mean or None, inv_std or None); layer norm and instance
        norm (mean, inv_std), kept dims; rms norm (inv_rms,); group norm (mean, inv_std) (N, G)."""
        x = self.x if x is None else x
        k = self.kw
        if self.op == "batch_norm":
            r = bn_training_ref(x, self.scale, self.bias, epsilon=self.epsilon, channel_axis=k.get("channel_axis", 1))
            return r.mean, r.var
        if self.op == "batch_norm_eval":
            return tuple(f64(a) for a in self.eval_stats)
        if self.op == "group_norm":
            return group_norm_stats_ref(x, k["num_groups"], epsilon=self.epsilon, channel_axis=k.get("channel_axis", 1))
        nm = k.get("normalize_mean", True) and self.op != "rms_norm"
        nv = k.get("normalize_variance", True)
        mean, inv, _ = mvn_stats_ref(x, self.norm_axes(), normalize_mean=nm, normalize_variance=nv,
                                     epsilon=self.epsilon, epsilon_mode=k.get("epsilon_mode", "inside"))
        if self.op == "rms_norm":
            return (inv,)
        if self.op == "mvn":
            return mean, inv
        return mean, inv

    def forward(self, x=None, scale=None, bias=None, fused_add=None):
        """float64 forward output; None arguments take this problem's arrays."""
        x = self.x if x is None else x
        s = self.scale if scale is None else scale
        b = self.bias if bias is None else bias
        fa = self.fused_add if fused_add is None else fused_add
        k, act, ap = self.kw, self.activation, self.act_params
        if self.op == "batch_norm":
            return bn_training_ref(x, s, b, epsilon=self.epsilon, channel_axis=k.get("channel_axis", 1), fused_add=fa,
                                   activation=act, act_params=ap).out
        if self.op == "batch_norm_eval":
            return bn_inference_forward(x, *self.eval_stats, s, b, epsilon=self.epsilon,
                                        channel_axis=k.get("channel_axis", 1), fused_add=fa, activation=act,
                                        act_params=ap)
        if self.op == "group_norm":
            return group_norm_forward(x, k["num_groups"], s, b, epsilon=self.epsilon,
                                      channel_axis=k.get("channel_axis", 1), activation=act, act_params=ap)
        if self.op == "instance_norm":
            ca = k.get("channel_axis", 1)
            s = None if s is None else f64(s).reshape(channel_shape(x.ndim, ca, np.shape(s)[0]))
            b = None if b is None else f64(b).reshape(channel_shape(x.ndim, ca, np.shape(b)[0]))
        nm = k.get("normalize_mean", True) and self.op != "rms_norm"
        return mvn_forward(x, self.norm_axes(), s, b, normalize_mean=nm,
                           normalize_variance=k.get("normalize_variance", True), epsilon=self.epsilon,
                           epsilon_mode=k.get("epsilon_mode", "inside"), activation=act, act_params=ap)

    def backward(self, dy, stats=None, *, rt=None, rt_fold=None) -> Grads:
        """Reference gradients with the given statistics (default: the exact ones)."""
        stats = self.stats() if stats is None else stats
        k, act, ap = self.kw, self.activation, self.act_params
        common = dict(activation=act, act_params=ap, rt=rt, rt_fold=rt_fold)
        if self.op in ("batch_norm", "batch_norm_eval"):
            return bn_backward_ref(dy, self.x, stats[0], stats[1], self.scale, self.bias, epsilon=self.epsilon,
                                   channel_axis=k.get("channel_axis", 1), training=self.op == "batch_norm",
                                   fused_add=self.fused_add, **common)
        if self.op == "mvn":
            return mvn_backward_ref(dy, self.x, k["axes"], stats[0], stats[1], self.scale, self.bias,
                                    normalize_mean=k.get("normalize_mean", True),
                                    normalize_variance=k.get("normalize_variance", True), epsilon=self.epsilon,
                                    epsilon_mode=k.get("epsilon_mode", "inside"), **common)
        if self.op == "layer_norm":
            return layer_norm_backward_ref(dy, self.x, stats[0], stats[1], self.scale, self.bias,
                                           axis=k.get("axis", -1), epsilon=self.epsilon, **common)
        if self.op == "rms_norm":
            return rms_norm_backward_ref(dy, self.x, stats[0], self.scale, axis=k.get("axis", -1),
                                         epsilon=self.epsilon, **common)
        if self.op == "instance_norm":
            return instance_norm_backward_ref(dy, self.x, stats[0], stats[1], self.scale, self.bias,
                                              channel_axis=k.get("channel_axis", 1), epsilon=self.epsilon, **common)
        if self.op == "group_norm":
            return group_norm_backward_ref(dy, self.x, k["num_groups"], stats[0], stats[1], self.scale, self.bias,
                                           channel_axis=k.get("channel_axis", 1), epsilon=self.epsilon, **common)
        raise ValueError(self.op)

    def pre_activation(self):
        """The float64 pre-activation value (the kink checks of relu / leaky_relu)."""
        saved = self.activation
        self.activation = None
        try:
            return self.forward()
        finally:
            self.activation = saved


def finite_difference(loss, a, h=1e-5):
    """Central differences of the scalar loss() with respect to every element of the float64 array
    a (perturbed in place and restored)."""
    g = np.empty(a.shape)
    flat = a.reshape(-1)  # a view: a must be contiguous
    assert np.shares_memory(flat, a)
    gf = g.reshape(-1)
    for i in range(flat.size):
        v = flat[i]
        flat[i] = v + h
        lp = loss()
        flat[i] = v - h
        lm = loss()
        flat[i] = v
        gf[i] = (lp - lm) / (2 * h)
    return g


def fd_gradients(problem: Problem, w, forward=None, h=1e-5):
    """Finite-difference gradients of sum(w * forward()) with respect to x, scale, bias, fused_add
    (those given); forward() defaults to problem.forward (float64 reference) and reads the
    problem's arrays, which are perturbed in place. Returns a dict name -> gradient."""
    forward = problem.forward if forward is None else forward
    loss = lambda: float(np.sum(w * f64(forward())))  # noqa: E731
    out = {}
    for name in ("x", "scale", "bias", "fused_add"):
        a = getattr(problem, name)
        if a is None:
            continue
        assert a.dtype == np.float64 and a.flags.c_contiguous
        out[name] = finite_difference(loss, a, h)
    return out


def random_problem(rng, op, *, shape=None, activation=None, act_params=None, scale=True, bias=True,
                   fused_add=False, channel_axis=1, dtype=np.float64, loc=0.5, spread=1.5, **kw) -> Problem:
    """A problem with fresh random values (never zero): x ~ N(loc, spread), scale of magnitude
    [0.5, 2] and random sign, bias N(0, 1); parameters (True: drawn, None/False: absent, or an
    array) of the usual shapes for the op: (C,) for batch/instance/group norm, the normalized
    trailing shape for layer/rms norm, x's shape with the non-normalized dims 1 for MVN."""
    dtype = np.dtype(dtype)

    def vals(shp, kind):
        if kind == "scale":
            v = rng.uniform(0.5, 2.0, size=shp) * rng.choice([-1.0, 1.0], size=shp)
        elif kind == "x":
            v = rng.normal(loc, spread, size=shp)
        else:
            v = rng.normal(0.0, 1.0, size=shp)
        v = np.where(np.abs(v) < 1e-3, 1e-3 + np.abs(v), v)
        return np.ascontiguousarray(np.asarray(v).astype(dtype))

    if shape is None:
        shape = {"batch_norm": (3, 4, 5), "batch_norm_eval": (3, 4, 5), "mvn": (3, 4, 5), "layer_norm": (3, 2, 6),
                 "rms_norm": (3, 2, 6), "instance_norm": (2, 3, 5), "group_norm": (2, 6, 4)}[op]
    shape = tuple(shape)
    nd = len(shape)
    x = vals(shape, "x")
    ca = channel_axis % nd
    kw = dict(kw)
    if op in ("batch_norm", "batch_norm_eval", "instance_norm", "group_norm"):
        kw.setdefault("channel_axis", channel_axis)
        pshape = (shape[ca],)
    elif op == "mvn":
        kw.setdefault("axes", (1, 2) if nd >= 3 else (nd - 1,))
        red = normalize_axes(kw["axes"], nd)
        pshape = tuple(s if d in red else 1 for d, s in enumerate(shape))  # varies along the normalized dims
    else:
        a = kw.setdefault("axis", -1) % nd
        pshape = shape[a:]
    pick = lambda given, kind: (vals(pshape, kind) if given is True else  # noqa: E731
                                None if given is None or given is False else given)
    s = pick(scale, "scale")
    b = None if op == "rms_norm" else pick(bias, "bias")
    fa = None
    if fused_add is not False and fused_add is not None:
        fa = vals(shape, "bias") if fused_add is True else fused_add
    eval_stats = None
    if op == "batch_norm_eval":
        stat = (shape[ca],)
        eval_stats = (rng.normal(0.0, 1.0, size=stat).astype(np.float64),
                      rng.uniform(0.25, 4.0, size=stat).astype(np.float64))
    return Problem(op, x, s, b, fa, kw, activation, act_params, eval_stats)


def push_from_kinks(problem: Problem, margin: float, *, tries: int = 30) -> Problem:
    """Move the input elements whose pre-activation value lies within `margin` of 0 (relu's and
    leaky_relu's kink) to about 3 margin on their side, keeping x's dtype (for comparisons with an
    implementation whose own rounding of the pre-activation value is coarse: bfloat16 PyTorch)."""
    if problem.activation not in ("relu", "leaky_relu"):
        return problem
    x = problem.x
    for _ in range(tries):
        pre = problem.pre_activation()
        bad = np.abs(pre) < margin
        if not bad.any():
            return problem
        x0 = f64(x)
        h = 1e-3 * (np.abs(x0) + 1.0)
        xp = x0.copy()
        xp[bad] += h[bad]
        problem.x = xp
        d = (problem.pre_activation() - pre) / h
        problem.x = x
        with quiet():
            want = np.where(pre >= 0, 1.0, -1.0) * 3 * margin - pre
            step = np.where(bad & (np.abs(d) > 1e-12), want / d, 0.0)
        x[...] = (x0 + step).astype(x.dtype)
    raise AssertionError("could not move the data away from the kink")
