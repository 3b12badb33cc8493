"""Case generators: random data in the four element types and in every memory layout SPEC §1 allows
(contiguous, channels-last, transposed, negative steps, zero strides, unaligned), poisoned outputs,
and parameters by both shape rules of SPEC §2.

Every generator returns arrays whose *logical* shape is the one asked for; only the memory
layout differs, so one reference serves all of them."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from reference import ACTIVATION_NAMES, BF16, DTYPES, F16, F32, F64, NONDEFAULT_PARAMS, dtype_id  # noqa: F401

try:
    from numpy.exceptions import AxisError  # noqa: F401  (re-exported for the tests)
except ImportError:  # pragma: no cover - numpy < 1.25
    from numpy import AxisError  # noqa: F401

# Under .ci/sanitize.sh (SIMDNORM_SANITIZED_RUN=1) the build instruments one kernel unit, the widest
# this CPU runs, and compiles the x86 fallback unit without the sanitizers: there the tests that run
# every unit run that one, and the plain suite runs them all.
SANITIZED_RUN = os.environ.get("SIMDNORM_SANITIZED_RUN") == "1"


def isas_under_test():
    """The ISA units a test runs its cases on: every one this machine has (widest first), or under
    the sanitizers the one their build instruments."""
    import simdnorm

    isas = list(simdnorm.available_isas())
    return isas[:1] if SANITIZED_RUN else isas


# a test parametrized over the four element types
DT = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)

# layouts of an input of logical shape `shape`
LAYOUTS = (
    "contiguous",     # C order
    "channels_last",  # NHWC memory (channel axis 1 stored innermost) viewed as NCHW via transpose
    "transposed",     # Fortran order (all axes reversed in memory)
    "permuted",       # a fixed non-trivial permutation of the axes in memory
    "negative",       # every axis sliced with a negative step (and the innermost step -2)
    "strided",        # every axis strided by 2 or 3 from a larger buffer
    "zero_stride",    # np.broadcast_to: one or more axes of stride 0
    "unaligned",      # C order at an odd byte offset in a uint8 buffer
    "unaligned_strided",  # odd byte offset, innermost step 3, outermost axis reversed
)
WRITABLE_LAYOUTS = tuple(lay for lay in LAYOUTS if lay != "zero_stride")


def rand_values(rng, shape, dtype, *, loc=0.0, scale=2.0, nonzero=True):
    """Random normal values rounded to dtype, never exactly zero (so an unwritten zero shows)."""
    v = rng.normal(loc, scale, size=shape)
    if nonzero:
        v = np.where(np.abs(v) < 1e-3, 1e-3 + np.abs(v), v)
    return v.astype(dtype)


def poison_value(dtype):
    return np.array(np.nan, dtype=dtype)


def _unaligned_buffer(nbytes, offset=1):
    buf = np.empty(nbytes + offset + 64, dtype=np.uint8)
    # start at a 64-byte boundary + offset so the misalignment is real and deterministic
    start = (-buf.ctypes.data) % 64 + offset
    return buf[start:start + nbytes]


def empty_past_line(shape, dtype, offset):
    """A writeable C-ordered array starting `offset` bytes past a 64-byte boundary."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(_unaligned_buffer(n * dtype.itemsize, offset), dtype=dtype, count=n).reshape(shape)


def empty_at_page_phase(shape, dtype, phase):
    """A writeable C-ordered array starting `phase` bytes past a 4096-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(nbytes + 2 * 4096, dtype=np.uint8)
    start = (phase - buf.ctypes.data) % 4096
    return np.frombuffer(buf[start:start + nbytes], dtype=dtype).reshape(shape)


def unaligned_empty(shape, dtype, offset=1):
    """A writeable C-ordered array at an odd byte offset (not aligned to its itemsize)."""
    a = empty_past_line(shape, dtype, offset)
    if a.itemsize > 1:
        assert not a.flags.aligned or a.size == 0
    return a


def layout_empty(shape, dtype, layout, rng=None):
    """An uninitialized writeable array of logical `shape` in `layout` (not zero_stride)."""
    shape = tuple(int(s) for s in shape)
    nd = len(shape)
    dtype = np.dtype(dtype)
    if layout == "contiguous":
        return np.empty(shape, dtype)
    if layout == "channels_last":
        if nd < 3:
            return np.empty(shape, dtype, order="F")
        perm = (0,) + tuple(range(2, nd)) + (1,)  # memory order N, spatial..., C
        base = np.empty(tuple(shape[p] for p in perm), dtype)
        inv = np.argsort(perm)
        return base.transpose(inv)
    if layout == "transposed":
        return np.empty(shape, dtype, order="F")
    if layout == "permuted":
        perm = _permutation(nd)
        base = np.empty(tuple(shape[p] for p in perm), dtype)
        return base.transpose(np.argsort(perm))
    if layout == "negative":
        big = tuple(s * (2 if d == nd - 1 else 1) for d, s in enumerate(shape))
        base = np.empty(big, dtype)
        sl = tuple(slice(None, None, -2) if d == nd - 1 else slice(None, None, -1) for d in range(nd))
        return base[sl]
    if layout == "strided":
        steps = [2 + (d % 2) for d in range(nd)]
        base = np.empty(tuple(max(1, s * st) for s, st in zip(shape, steps)), dtype)
        return base[tuple(slice(None, s * st if s else 0, st) for s, st in zip(shape, steps))]
    if layout == "unaligned":
        return unaligned_empty(shape, dtype, offset=1)
    if layout == "unaligned_strided":
        big = tuple(s * (3 if d == nd - 1 else 1) for d, s in enumerate(shape))
        base = unaligned_empty(big, dtype, offset=3)
        sl = tuple(slice(None, None, 3) if d == nd - 1 else slice(None) for d in range(nd))
        v = base[sl]
        if nd >= 2:
            v = v[::-1]
        return v
    raise ValueError(layout)


def _permutation(nd):
    if nd == 1:
        return (0,)
    # rotate by one and swap the last two: different from C, F and channels-last orders for nd >= 3
    p = list(range(1, nd)) + [0]
    p[-1], p[-2] = p[-2], p[-1]
    return tuple(p)


def make_input(rng, shape, dtype, layout="contiguous", *, loc=0.0, scale=2.0):
    """Random input of logical `shape` and `dtype` stored in `layout`."""
    shape = tuple(int(s) for s in shape)
    if layout == "zero_stride":
        # stride 0 on every other axis (starting at axis 0) that has size > 1, data random elsewhere
        small = tuple(1 if (d % 2 == 0) else s for d, s in enumerate(shape))
        if len(shape) == 1:
            small = (1,)
        src = rand_values(rng, small, dtype, loc=loc, scale=scale)
        a = np.broadcast_to(src, shape)
        return a
    a = layout_empty(shape, dtype, layout)
    a[...] = rand_values(rng, shape, dtype, loc=loc, scale=scale)
    return a


def offset_input(rng, shape, dtype, layout="contiguous"):
    """Random input with a non-zero mean (loc 1.5), so that mean subtraction matters."""
    return make_input(rng, shape, dtype, layout, loc=1.5, scale=2.0)


def scale_bias_values(rng, shape, dtype, kind="scale"):
    """Scale or bias of an MVN-family op: for "scale" a magnitude in [0.5, 2] of random sign,
    otherwise standard normal values."""
    if kind == "scale":
        v = rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    else:
        v = rng.normal(0.0, 1.0, size=shape)
    return np.asarray(v).astype(dtype)


def make_out(shape, dtype, layout="contiguous"):
    """A NaN-poisoned writeable output in `layout`."""
    o = layout_empty(shape, dtype, layout)
    o[...] = poison_value(dtype)
    return o


def channels_last_nhwc(rng, shape_nchw, dtype):
    """A genuinely NHWC array (C-contiguous, channels innermost) for channel_axis=-1, and its
    logical NCHW shape."""
    n, c, *sp = shape_nchw
    return rand_values(rng, (n, *sp, c), dtype)


# ----------------------------------------------------------------------------------------------
# batch-norm parameters
# ----------------------------------------------------------------------------------------------

PARAM_NAMES = ("mean", "variance", "scale", "bias")


def param_values(rng, name, shape, dtype):
    if name == "variance":
        v = rng.uniform(0.25, 4.0, size=shape)
    elif name == "scale":
        v = rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    elif name == "mean":
        v = rng.normal(0.0, 1.0, size=shape)
    else:  # bias
        v = rng.normal(0.0, 1.0, size=shape)
    v = np.where(np.abs(v) < 1e-3, 1e-3 + np.abs(v), v)
    return np.asarray(v).astype(dtype)


def bn_param_1d(rng, name, x_shape, channel_axis, dtype):
    c = x_shape[channel_axis % len(x_shape)]
    return param_values(rng, name, (c,), dtype)


def bn_param_same_rank(rng, name, x_shape, keep_mask, dtype):
    """Same-rank parameter: dim d is x_shape[d] where keep_mask[d] else 1."""
    shape = tuple(s if k else 1 for s, k in zip(x_shape, keep_mask))
    return param_values(rng, name, shape, dtype)


def broadcast_masks(nd, rng, channel_axis=1):
    """Four different same-rank broadcast masks for mean/variance/scale/bias: per channel, full
    size, all ones (scalar), and a random subset."""
    c = channel_axis % nd
    per_channel = tuple(d == c for d in range(nd))
    full = (True,) * nd
    ones = (False,) * nd
    rnd = tuple(bool(b) for b in rng.integers(0, 2, size=nd))
    masks = [per_channel, full, ones, rnd]
    order = rng.permutation(4)
    return [masks[i] for i in order]


def odd_sizes():
    """Innermost lengths around every SIMD head/tail: 1..67 (covers vector widths 4, 8, 16 and
    their multiples plus one either side)."""
    return range(1, 68)


# ----------------------------------------------------------------------------------------------
# calling the package
# ----------------------------------------------------------------------------------------------


def act_arg(name, params=None, *, as_object=None):
    """The activation= argument for (name, params): None, the bare name (default parameters), or
    simdnorm.Activation(name, **params)."""
    if name is None:
        return None
    if not params and not as_object:
        return name
    import simdnorm

    return simdnorm.Activation(name, **(params or {}))


def activation_draws(none_weight=1):
    """A hypothesis strategy of (activation name or None, its non-default parameters or None): None
    `none_weight` times as likely as each activation; the non-default parameters, where the
    activation has any, half of the time."""
    from hypothesis import strategies as st  # only the property and fuzz tests need hypothesis

    @st.composite
    def draws(draw):
        name = draw(st.sampled_from((None,) * none_weight + ACTIVATION_NAMES))
        params = NONDEFAULT_PARAMS.get(name) if name and draw(st.booleans()) else None
        return name, params

    return draws()


def run_in_threads(work, n):
    """Run work(0), ..., work(n - 1) in n threads at once; fail with what any of them raised."""
    errors = []

    def guarded(i):
        try:
            work(i)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def bits(a):
    """The raw bits of a float array (for bitwise comparisons that treat NaN like any value)."""
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
