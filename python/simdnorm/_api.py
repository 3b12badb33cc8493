"""The functional API (the user guide, docs/guide.rst, describes each function).

Each call looks its plan up in a small dict keyed by the dtypes and shapes of its arrays and its
attributes (strides are not part of a plan: any strides are valid). The numeric attributes
(epsilon, axes, channel_axis, num_groups) and MVN's flags (normalize_mean, normalize_variance) are
keyed with their class too: a value the validator refuses that equals an accepted one (True == 1,
1+0j == 1.0 == True) must not hit that one's plan. On a miss the call builds the descriptors of its
arrays, validates them with the one validator (``_descriptors``), plans them with the one planner
(``_compile``) and stores the plan. The conveniences are thin routes onto MVN through views of
their arrays (group norm splits the channel dim), never copies.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Optional, Tuple

import numpy as np

from . import _core
from ._activation import ActivationLike
from ._compile import (
    as_input,
    as_param,
    channel_index,
    check_out,
    check_return_stats,
    follow_input,
    is_foreign_out,
    is_tensor,
    plan_bn,
    plan_mvn,
    run_overlapping,
)
from ._descriptors import (
    BatchNormalizationDesc,
    VIEW_MAX_DIMS,
    MeanVarianceNormalizationDesc,
    TensorDesc,
    as_int_tuple,
    channel_axis_rule,
    num_groups_rule,
    per_channel_rule,
    spatial_axes_rule,
    trailing_axes_rule,
)

__all__ = [
    "batch_normalization",
    "mean_variance_normalization",
    "layer_norm",
    "rms_norm",
    "instance_norm",
    "group_norm",
]

_nd = np.ndarray
_empty_like = np.empty_like
_empty = np.empty
_copyto = np.copyto
_int = int
_tuple = tuple
_list = list
_range = range
_CACHE_MAX = 512

# The sections every function's docstring shares, written once: each public function's docstring
# names them as {x}, {common} and {raises} (documented fills them in at import).
_DOC_SECTIONS = {
    "x": """x : array_like
        The input, 1 to 8 dims: float32, float16, bfloat16 (``ml_dtypes.bfloat16``) or float64,
        any strides (views, negative or zero strides, unaligned). An ndarray or a CPU DLPack
        tensor (a torch tensor, float16 and bfloat16 included) is read where it lies, never
        copied; a list is converted. A torch tensor gives torch tensors back (the result as
        ``torch.empty_like(x)``, memory format kept, and the statistics); any other input gives
        numpy arrays.""",
    "common": """epsilon : float, default 1e-5
        Added to the variance, finite and >= 0.
    activation : str or Activation, optional
        A fused activation applied before the single rounding to the output type ("relu",
        ``Activation("leaky_relu", alpha=0.1)``, ...; see :data:`ACTIVATIONS`).
    out : ndarray or torch.Tensor, optional
        A writeable array (or CPU DLPack tensor) of the input's shape and dtype, any strides, that
        receives the result (and is returned). It may be the input itself; any other overlap with
        an argument gives the result as if there were none.""",
    "raises": """Raises
    ------
    DescriptorError
        A ValueError naming the argument and the rule it breaks (a shape, an axis, epsilon);
        :class:`DescriptorTypeError` (also a TypeError) for a dtype or type;
        :class:`DescriptorAxisError` (also numpy's AxisError) for an axis out of range.""",
}


def documented(fn: Any) -> Any:
    if fn.__doc__:  # (None under python -OO)
        fn.__doc__ = fn.__doc__.format(**_DOC_SECTIONS)
    return fn


_BN_CACHE: dict = {}
_MVN_CACHE: dict = {}
_CONV_CACHE: dict = {}  # the conveniences: key starts with the convenience's name


def _store(cache: dict, key: Any, plan: Any) -> Any:
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    cache[key] = plan
    return plan


def clear_plan_caches() -> None:
    """Forget every cached plan (tests; the caches are bounded anyway)."""
    _BN_CACHE.clear()
    _MVN_CACHE.clear()
    _CONV_CACHE.clear()


def _td(a: Optional[np.ndarray]) -> Optional[TensorDesc]:
    return None if a is None else TensorDesc(a.dtype, a.shape)


# ----------------------------------------------------------------------------------------------------
# batch normalization

def bn_plan(key: Any, x, mean, variance, scale, bias, epsilon, activation, channel_axis) -> tuple:
    desc = BatchNormalizationDesc(_td(x), _td(mean), _td(variance), _td(scale), _td(bias),
                                  epsilon=epsilon, activation=activation, channel_axis=channel_axis)
    plan = plan_bn(desc._validated())
    if key is not None:
        _store(_BN_CACHE, key, plan)
    return plan


@documented
def batch_normalization(x: Any, mean: Any, variance: Any, scale: Any = None, bias: Any = None, *,
                        epsilon: float = 1e-5, activation: ActivationLike = None, channel_axis: int = 1,
                        out: Optional[np.ndarray] = None) -> np.ndarray:
    """Batch normalization with given statistics (inference).

    ``out = activation(scale * (x - mean) / sqrt(variance + epsilon) + bias)``, as DirectML's
    BATCH_NORMALIZATION and oneDNN's BatchNormInference compute it.

    Parameters
    ----------
    {x}
    mean, variance : array_like
        The statistics. Each parameter, independently, either has the input's number of dims with
        each dim the input's or 1 (broadcast), or is 1-D of length ``x.shape[channel_axis]``; its
        dtype is the input's or float32 (float64 data: float64 or float32). Where ``variance +
        epsilon`` is negative the output is NaN, where it is zero inf or NaN.
    scale, bias : array_like, optional
        As ``mean``; ``None`` means 1 and 0.
    {common}
    channel_axis : int, default 1
        The axis 1-D parameters lie along: 1 for (N, C, ...), -1 for channels last. A 1-D input
        has no channel axis (its parameters are of its own rank), so there it is not used.

    Returns
    -------
    ndarray
        A new array like ``np.empty_like(x)`` (same dtype, shape and memory order), or ``out``.

    {raises}

    Examples
    --------
    >>> import numpy as np, simdnorm
    >>> x = np.array([[[0.0, 2.0], [1.0, 3.0]]], np.float32)  # (N, C, W) = (1, 2, 2)
    >>> y = simdnorm.batch_normalization(x, mean=[1.0, 2.0], variance=[1.0, 1.0], epsilon=0.0)
    >>> print(y)
    [[[-1.  1.]
      [-1.  1.]]]
    >>> print(simdnorm.batch_normalization(x, [1.0, 2.0], [1.0, 1.0], epsilon=0.0, activation="relu"))
    [[[0. 1.]
      [0. 1.]]]
    """
    if type(x) is not _nd:
        if is_tensor(x):  # torch in, torch out (SPEC section 10)
            return follow_input(batch_normalization, locals())
        x = as_input(x)
    if type(mean) is not _nd:
        mean = as_param(mean, "mean", x)
    if type(variance) is not _nd:
        variance = as_param(variance, "variance", x)
    if scale is None:
        sdt = sshape = None
    else:
        if type(scale) is not _nd:
            scale = as_param(scale, "scale", x)
        sdt = scale.dtype
        sshape = scale.shape
    if bias is None:
        bdt = bshape = None
    else:
        if type(bias) is not _nd:
            bias = as_param(bias, "bias", x)
        bdt = bias.dtype
        bshape = bias.shape
    xd = x.dtype
    xs = x.shape
    key = (xd, xs, mean.dtype, mean.shape, variance.dtype, variance.shape, sdt, sshape, bdt, bshape, epsilon,
           epsilon.__class__, activation, channel_axis, channel_axis.__class__)
    # A miss is planned after the try statement, so that an invalid call's error does not show the
    # KeyError as its context.
    try:
        plan = _BN_CACHE[key]
    except KeyError:
        plan = None
    except TypeError:  # an unhashable attribute: validate without caching (raises or plans)
        plan = key = None
    if plan is None:
        plan = bn_plan(key, x, mean, variance, scale, bias, epsilon, activation, channel_axis)
    eps, act, ca = plan
    if out is None:
        res = _empty_like(x, subok=False)
        _core.batch_norm(x, mean, variance, scale, bias, res, eps, act, ca, False)
        return res
    if out.__class__ is not _nd or out.shape != xs or out.dtype is not xd or not out.flags.writeable:
        if is_foreign_out(out):
            return follow_input(batch_normalization, locals())
        check_out(out, x)
    if not _core.batch_norm(x, mean, variance, scale, bias, out, eps, act, ca, True):
        run_overlapping(partial(_bn_into, x, mean, variance, scale, bias, eps, act, ca), out, x, mean, variance, scale,
                        bias)
    return out


def _bn_into(x, mean, variance, scale, bias, eps, act, ca, o, check):  # noqa: ANN001 - the kernel's arguments
    """run_overlapping's run for batch_normalization. (A partial, not a lambda: a closure would make
    batch_normalization's locals cells, which locals() at its top hands torch.compile unbound.)"""
    return _core.batch_norm(x, mean, variance, scale, bias, o, eps, act, ca, check)


# ----------------------------------------------------------------------------------------------------
# mean-variance normalization

def mvn_plan(key: Any, x, axes, scale, bias, nm, nv, epsilon, epsilon_mode, activation) -> tuple:
    desc = MeanVarianceNormalizationDesc(_td(x), axes, _td(scale), _td(bias), normalize_mean=nm,
                                         normalize_variance=nv, epsilon=epsilon, epsilon_mode=epsilon_mode,
                                         activation=activation)
    plan = plan_mvn(desc._validated())
    if key is not None:
        _store(_MVN_CACHE, key, plan)
    return plan


def _run_mvn(x, scale, bias, out, return_stats, plan, channel_axis=-1):
    """Run a planned MVN; ``out`` was checked by the caller (None: a new array). scale/bias of lower
    rank align right, or (1-D) at channel_axis when one is given."""
    axes, stats_shape, sdt, eps, nm, nv, eo, act = plan
    if return_stats is False:
        mo = so = None
    elif return_stats is True or check_return_stats(return_stats):
        mo = _empty(stats_shape, sdt) if nm else None
        so = _empty(stats_shape, sdt) if nv else None
    else:
        mo = so = None
    if out is None:
        out = _empty_like(x, subok=False)
        _core.mvn(x, axes, scale, bias, out, eps, nm, nv, eo, act, mo, so, channel_axis, False)
    elif not _core.mvn(x, axes, scale, bias, out, eps, nm, nv, eo, act, mo, so, channel_axis, True):
        run_overlapping(lambda o, check: _core.mvn(x, axes, scale, bias, o, eps, nm, nv, eo, act, mo, so,
                                                   channel_axis, check), out, x, scale, bias)
    return (out, mo, so) if return_stats else out


def _other_axes(axes: Any) -> Tuple[Any, Any]:
    """(axes, cache key) for axes that are neither an int nor a tuple or list: a numpy integer becomes
    an int, a range, a 1-D integer array or another sequence of ints a tuple of ints, keyed as that
    tuple is (they validate alike: the validator takes numpy integers as ints). Anything else (a bad
    value, a float or bool array, a set) stays as given, uncached: the validator raises its message."""
    cls = axes.__class__
    if cls is _range:  # (its items are ints)
        t = _tuple(axes)
        return t, (t, (_int,) * len(t))
    if cls is _nd and axes.ndim == 1 and axes.dtype.kind in "iu":
        t = _tuple(axes.tolist())
        return t, (t, (_int,) * len(t))
    if isinstance(axes, np.integer) and not isinstance(axes, np.bool_):
        axes = _int(axes)
        return axes, axes
    t = as_int_tuple(axes)
    if t.__class__ is _tuple:
        types = _tuple(map(type, t))
        if all(c is _int for c in types):
            return t, (t, types)
    return axes, None


@documented
def mean_variance_normalization(x: Any, axes: Any, scale: Any = None, bias: Any = None, *,
                                normalize_mean: bool = True, normalize_variance: bool = True,
                                epsilon: float = 1e-5, epsilon_mode: str = "inside",
                                activation: ActivationLike = None, out: Optional[np.ndarray] = None,
                                return_stats: bool = False) -> Any:
    """Mean-variance normalization over any axes (DirectML MEAN_VARIANCE_NORMALIZATION1).

    The mean and the population variance (divided by the count) are taken over ``axes``, then
    ``out = activation(scale * (x - mean) / sqrt(variance + epsilon) + bias)``. Statistics are summed
    in float64 whatever the dtype, so data far from zero loses nothing to the subtraction.

    Parameters
    ----------
    {x}
    axes : int or sequence of int
        The dims to normalize over: any non-empty subset, negative allowed, no repeats.
    scale, bias : array_like, optional
        Broadcastable to ``x.shape`` without enlarging it (numpy's rules: fewer leading dims, dims of
        1); the input's dtype or float32. ``None`` means 1 and 0.
    normalize_mean : bool, default True
        False: the mean is not subtracted and the second moment is ``mean(x**2)`` (RMS norm).
    normalize_variance : bool, default True
        False: ``out = activation(scale * (x - mean) + bias)``.
    {common}
    epsilon_mode : {{"inside", "outside"}}, default "inside"
        "outside" divides by ``sqrt(variance) + epsilon`` (ONNX MeanVarianceNormalization).
    return_stats : bool, default False
        Also return the statistics: ``(out, mean, inv_std)``. Both are float32 (float64 for
        float64 data), shaped like
        ``x`` with the reduced dims kept as 1; ``mean`` is None when ``normalize_mean=False``,
        ``inv_std`` when ``normalize_variance=False``.

    Returns
    -------
    ndarray, or (ndarray, ndarray or None, ndarray or None)
        The result (a new array like ``np.empty_like(x)``, or ``out``), with the statistics when
        ``return_stats=True``.

    {raises}

    Examples
    --------
    >>> import numpy as np, simdnorm
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 10.0, 20.0, 20.0]], np.float32)
    >>> y, mean, inv_std = simdnorm.mean_variance_normalization(x, axes=1, epsilon=0.0, return_stats=True)
    >>> print(np.round(y, 4))
    [[-1.3416 -0.4472  0.4472  1.3416]
     [-1.     -1.      1.      1.    ]]
    >>> print(mean.ravel(), inv_std.ravel())
    [ 2.5 15. ] [0.8944272 0.2      ]
    """
    if type(x) is not _nd:
        if is_tensor(x):  # torch in, torch out (SPEC section 10)
            return follow_input(mean_variance_normalization, locals())
        x = as_input(x)
    if scale is None:
        sdt = sshape = None
    else:
        if type(scale) is not _nd:
            scale = as_param(scale, "scale", x)
        sdt = scale.dtype
        sshape = scale.shape
    if bias is None:
        bdt = bshape = None
    else:
        if type(bias) is not _nd:
            bias = as_param(bias, "bias", x)
        bdt = bias.dtype
        bshape = bias.shape
    cls = axes.__class__
    if cls is _int:
        akey = axes
    elif cls is _tuple or cls is _list:
        akey = (_tuple(axes), _tuple(map(type, axes)))  # (1.0,) and (True,) must not hit (1,)'s plan
    else:
        axes, akey = _other_axes(axes)
    if akey is None:
        plan = mvn_plan(None, x, axes, scale, bias, normalize_mean, normalize_variance, epsilon, epsilon_mode,
                         activation)
    else:
        key = (x.dtype, x.shape, akey, sdt, sshape, bdt, bshape, normalize_mean, normalize_mean.__class__,
               normalize_variance, normalize_variance.__class__, epsilon, epsilon.__class__, epsilon_mode, activation)
        try:
            plan = _MVN_CACHE[key]
        except KeyError:
            plan = None
        except TypeError:
            plan = key = None
        if plan is None:
            plan = mvn_plan(key, x, axes, scale, bias, normalize_mean, normalize_variance, epsilon,
                             epsilon_mode, activation)
    if out is not None and (out.__class__ is not _nd or out.shape != x.shape or out.dtype is not x.dtype
                            or not out.flags.writeable):
        if is_foreign_out(out):
            return follow_input(mean_variance_normalization, locals())
        check_out(out, x)
    return _run_mvn(x, scale, bias, out, return_stats, plan)


# ----------------------------------------------------------------------------------------------------
# conveniences

@documented
def layer_norm(x: Any, scale: Any = None, bias: Any = None, *, axis: int = -1, epsilon: float = 1e-5,
               activation: ActivationLike = None, out: Optional[np.ndarray] = None,
               return_stats: bool = False) -> Any:
    """Layer normalization (ONNX LayerNormalization-17): over the dims ``axis .. ndim-1``.

    Parameters
    ----------
    {x}
    scale, bias : array_like, optional
        Broadcastable to ``x`` (typically of shape ``x.shape[axis:]``); ``None`` means 1 and 0.
    axis : int, default -1
        The first normalized dim.
    {common}
    return_stats : bool, default False
        Also return the statistics: ``(out, mean, inv_std)``, shaped like ``x`` with the
        normalized dims kept as 1.

    Returns
    -------
    ndarray, or (ndarray, ndarray, ndarray)

    {raises}

    Examples
    --------
    >>> import numpy as np, simdnorm
    >>> x = np.array([[1.0, 3.0], [2.0, 6.0]], np.float32)
    >>> print(simdnorm.layer_norm(x, epsilon=0.0))
    [[-1.  1.]
     [-1.  1.]]
    >>> y, mean, inv_std = simdnorm.layer_norm(x, epsilon=0.0, return_stats=True)
    >>> print(mean.shape, mean.ravel(), inv_std.ravel())
    (2, 1) [2. 4.] [1.  0.5]
    """
    if type(x) is not _nd:
        if is_tensor(x):
            return follow_input(layer_norm, locals())
        x = as_input(x, "input")
    if scale is None:
        sk = None
    else:
        if type(scale) is not _nd:
            scale = as_param(scale, "scale", x)
        sk = (scale.dtype, scale.shape)
    if bias is None:
        bk = None
    else:
        if type(bias) is not _nd:
            bias = as_param(bias, "bias", x)
        bk = (bias.dtype, bias.shape)
    key = ("layer", x.dtype, x.shape, axis, axis.__class__, sk, bk, epsilon, epsilon.__class__, activation)
    try:
        plan = _CONV_CACHE[key]
    except (KeyError, TypeError):
        plan = None
    if plan is None:
        plan = mvn_plan(None, x, trailing_axes_rule(x, axis), scale, bias, True, True, epsilon, "inside",
                         activation)
        _store_hashable(key, plan)
    if out is not None and (out.__class__ is not _nd or out.shape != x.shape or out.dtype is not x.dtype
                            or not out.flags.writeable):
        if is_foreign_out(out):
            return follow_input(layer_norm, locals())
        check_out(out, x)
    return _run_mvn(x, scale, bias, out, return_stats, plan)


@documented
def rms_norm(x: Any, scale: Any = None, *, axis: int = -1, epsilon: float = 1e-5,
             activation: ActivationLike = None, out: Optional[np.ndarray] = None, return_stats: bool = False) -> Any:
    """RMS normalization (ONNX RMSNormalization-23): ``x / sqrt(mean(x**2) + epsilon) * scale`` over
    the dims ``axis .. ndim-1``.

    Parameters
    ----------
    {x}
    scale : array_like, optional
        Broadcastable to ``x``; ``None`` means 1.
    axis : int, default -1
        The first normalized dim.
    {common}
    return_stats : bool, default False
        Also return ``(out, None, inv_rms)``, ``inv_rms`` shaped like ``x`` with the normalized dims
        kept as 1.

    Returns
    -------
    ndarray, or (ndarray, None, ndarray)

    {raises}

    Examples
    --------
    >>> import numpy as np, simdnorm
    >>> x = np.array([[3.0, 4.0, 0.0, 0.0]], np.float32)  # mean of squares 6.25
    >>> print(simdnorm.rms_norm(x, epsilon=0.0))
    [[1.2 1.6 0.  0. ]]
    """
    if type(x) is not _nd:
        if is_tensor(x):
            return follow_input(rms_norm, locals())
        x = as_input(x, "input")
    if scale is None:
        sk = None
    else:
        if type(scale) is not _nd:
            scale = as_param(scale, "scale", x)
        sk = (scale.dtype, scale.shape)
    key = ("rms", x.dtype, x.shape, axis, axis.__class__, sk, epsilon, epsilon.__class__, activation)
    try:
        plan = _CONV_CACHE[key]
    except (KeyError, TypeError):
        plan = None
    if plan is None:
        plan = mvn_plan(None, x, trailing_axes_rule(x, axis), scale, None, False, True, epsilon, "inside",
                         activation)
        _store_hashable(key, plan)
    if out is not None and (out.__class__ is not _nd or out.shape != x.shape or out.dtype is not x.dtype
                            or not out.flags.writeable):
        if is_foreign_out(out):
            return follow_input(rms_norm, locals())
        check_out(out, x)
    return _run_mvn(x, scale, None, out, return_stats, plan)


def _store_hashable(key: Any, plan: Any) -> None:
    try:
        _store(_CONV_CACHE, key, plan)
    except TypeError:
        pass


def instance_plan(x, scale, bias, epsilon, channel_axis, activation) -> tuple:
    ca = channel_axis_rule(x, channel_axis, "instance_norm")
    axes = spatial_axes_rule(x, ca)
    nd = x.ndim
    c = x.shape[ca]
    per_channel_rule("scale", scale, c, "instance_norm")
    per_channel_rule("bias", bias, c, "instance_norm")
    idx = channel_index(ca, nd)
    s = None if scale is None else scale[idx]
    b = None if bias is None else bias[idx]
    # Validated on views with C at the channel axis; a call passes the (C,) arrays and ca instead.
    return (ca, mvn_plan(None, x, axes, s, b, True, True, epsilon, "inside", activation))


@documented
def instance_norm(x: Any, scale: Any = None, bias: Any = None, *, epsilon: float = 1e-5, channel_axis: int = 1,
                  activation: ActivationLike = None, out: Optional[np.ndarray] = None,
                  return_stats: bool = False) -> Any:
    """Instance normalization: each (n, c) over the spatial dims.

    Parameters
    ----------
    {x}
        At least 3 dims: (N, C, ...) or, with ``channel_axis=-1``, (N, ..., C).
    scale, bias : array_like, optional
        Of shape (C,); ``None`` means 1 and 0.
    {common}
    channel_axis : int, default 1
        1 for channels first, -1 (or the last axis) for channels last; not the batch axis 0.
    return_stats : bool, default False
        Also return the statistics: ``(out, mean, inv_std)``, shaped like ``x`` with the spatial
        dims kept as 1.

    Returns
    -------
    ndarray, or (ndarray, ndarray, ndarray)

    {raises}

    Examples
    --------
    >>> import numpy as np, simdnorm
    >>> x = np.array([[[1.0, 3.0], [5.0, 5.0]]], np.float32)  # (N, C, W) = (1, 2, 2)
    >>> print(simdnorm.instance_norm(x, epsilon=0.0))
    [[[-1.  1.]
      [nan nan]]]
    >>> print(simdnorm.instance_norm(x, epsilon=1.0))
    [[[-0.70710677  0.70710677]
      [ 0.          0.        ]]]
    """
    if type(x) is not _nd:
        if is_tensor(x):
            return follow_input(instance_norm, locals())
        x = as_input(x, "input")
    if scale is None:
        sk = None
    else:
        if type(scale) is not _nd:
            scale = as_param(scale, "scale", x)
        sk = (scale.dtype, scale.shape)
    if bias is None:
        bk = None
    else:
        if type(bias) is not _nd:
            bias = as_param(bias, "bias", x)
        bk = (bias.dtype, bias.shape)
    key = ("instance", x.dtype, x.shape, channel_axis, channel_axis.__class__, sk, bk, epsilon, epsilon.__class__,
           activation)
    try:
        ip = _CONV_CACHE[key]
    except (KeyError, TypeError):
        ip = None
    if ip is None:
        ip = instance_plan(x, scale, bias, epsilon, channel_axis, activation)
        _store_hashable(key, ip)
    ca, plan = ip
    if out is not None and (out.__class__ is not _nd or out.shape != x.shape or out.dtype is not x.dtype
                            or not out.flags.writeable):
        if is_foreign_out(out):
            return follow_input(instance_norm, locals())
        check_out(out, x)
    return _run_mvn(x, scale, bias, out, return_stats, plan, ca)


# group norm ------------------------------------------------------------------------------------------

_as_strided = np.lib.stride_tricks.as_strided


def split_view(a: np.ndarray, ca: int, g: int, k: int) -> np.ndarray:
    """A view of ``a`` with dim ca split into (g, k): always possible without a copy, any strides.
    (numpy's reshape never copies to split one dim; the check makes that certain.)"""
    shape = a.shape[:ca] + (g, k) + a.shape[ca + 1:]
    v = a.reshape(shape)
    if v.base is None and a.size:  # pragma: no cover - a copy: use explicit strides instead
        st = a.strides
        v = _as_strided(a, shape, st[:ca] + (st[ca] * k, st[ca]) + st[ca + 1:], subok=False,
                        writeable=a.flags.writeable)
    return v


def group_split(x: Any, num_groups: Any, channel_axis: Any) -> tuple:
    """Group norm's (..., G, C/G, ...) view of x, its rules checked: (the channel axis, C, G, C/G,
    scale and bias's shape in the view, the view's reduced dims). Forward and backward share it."""
    ca = channel_axis_rule(x, channel_axis, "group_norm")
    c = x.shape[ca]
    g = num_groups_rule(num_groups, c)
    k = c // g
    vnd = x.ndim + 1
    return ca, c, g, k, (1,) * ca + (g, k) + (1,) * (vnd - ca - 2), tuple(d for d in range(1, vnd) if d != ca)


def group_plan(x, num_groups, scale, bias, epsilon, channel_axis, activation) -> tuple:
    ca, c, g, k, pshape, reduced = group_split(x, num_groups, channel_axis)
    per_channel_rule("scale", scale, c, "group_norm")
    per_channel_rule("bias", bias, c, "group_norm")
    vshape = x.shape[:ca] + (g, k) + x.shape[ca + 1:]
    desc = MeanVarianceNormalizationDesc(TensorDesc(x.dtype, vshape), reduced,
                                         None if scale is None else TensorDesc(scale.dtype, pshape),
                                         None if bias is None else TensorDesc(bias.dtype, pshape),
                                         epsilon=epsilon, activation=activation)
    return (ca, g, k, vshape, pshape, plan_mvn(desc._validated(VIEW_MAX_DIMS)), (x.shape[0], g))


@documented
def group_norm(x: Any, num_groups: int, scale: Any = None, bias: Any = None, *, epsilon: float = 1e-5,
               channel_axis: int = 1, activation: ActivationLike = None, out: Optional[np.ndarray] = None,
               return_stats: bool = False) -> Any:
    """Group normalization (ONNX GroupNormalization-21).

    The C channels are split into ``num_groups`` groups of consecutive channels; each (n, group) is
    normalized over its channels and the spatial dims, then each channel takes its own scale and
    bias. Channels first or last, any strides: ``x`` and ``out`` are viewed as (..., G, C/G, ...),
    never copied.

    Parameters
    ----------
    {x}
        At least 2 dims: (N, C, ...) or, with ``channel_axis=-1``, (N, ..., C).
    num_groups : int
        Divides C.
    scale, bias : array_like, optional
        Of shape (C,); ``None`` means 1 and 0.
    {common}
    channel_axis : int, default 1
        1 for channels first, -1 for channels last; not the batch axis 0.
    return_stats : bool, default False
        Also return the statistics: ``(out, mean, inv_std)``, of shape (N, num_groups).

    Returns
    -------
    ndarray, or (ndarray, ndarray, ndarray)

    {raises}

    Examples
    --------
    >>> import numpy as np, simdnorm
    >>> x = np.array([[[0.0], [2.0], [10.0], [30.0]]], np.float32)  # (N, C, W) = (1, 4, 1)
    >>> y, mean, inv_std = simdnorm.group_norm(x, 2, epsilon=0.0, return_stats=True)
    >>> print(y.ravel())
    [-1.  1. -1.  1.]
    >>> print(mean, inv_std)
    [[ 1. 20.]] [[1.  0.1]]
    """
    if type(x) is not _nd:
        if is_tensor(x):
            return follow_input(group_norm, locals())
        x = as_input(x, "input")
    if scale is None:
        sk = None
    else:
        if type(scale) is not _nd:
            scale = as_param(scale, "scale", x)
        sk = (scale.dtype, scale.shape)
    if bias is None:
        bk = None
    else:
        if type(bias) is not _nd:
            bias = as_param(bias, "bias", x)
        bk = (bias.dtype, bias.shape)
    xs = x.shape
    key = ("group", x.dtype, xs, num_groups, num_groups.__class__, channel_axis, channel_axis.__class__, sk, bk,
           epsilon, epsilon.__class__, activation)
    try:
        gp = _CONV_CACHE[key]
    except (KeyError, TypeError):
        gp = None
    if gp is None:
        gp = group_plan(x, num_groups, scale, bias, epsilon, channel_axis, activation)
        _store_hashable(key, gp)
    ca, g, k, vshape, pshape, plan, nshape = gp
    if out is None:
        res = _empty_like(x, subok=False)
    else:
        if out.__class__ is not _nd or out.shape != xs or out.dtype is not x.dtype or not out.flags.writeable:
            if is_foreign_out(out):
                return follow_input(group_norm, locals())
            check_out(out, x)
        res = out
    # views, never copies: x and res split at the channel dim; scale/bias (C,) -> (G, C/G) there
    xv = x.reshape(vshape)
    rv = res.reshape(vshape)
    if xv.base is None or rv.base is None:  # pragma: no cover - numpy copied: explicit strides
        xv = split_view(x, ca, g, k)
        rv = split_view(res, ca, g, k)
    r = _run_mvn(xv, None if scale is None else scale.reshape(pshape), None if bias is None else bias.reshape(pshape),
                 rv, return_stats, plan)
    if not return_stats:
        return res
    _, mo, so = r
    return (res, None if mo is None else mo.reshape(nshape), None if so is None else so.reshape(nshape))
