"""DirectML-style descriptors and THE validator.

Every rule of DirectML's "Tensor constraints" and "Tensor support" tables for its two operators, as
simdnorm extends them (the user guide, docs/guide.rst, states them for users):

* every tensor has 1 to 8 dims, sizes >= 0, strides (in elements; 0 broadcasts, negative allowed)
  one per dim or None (packed);
* input and output: the same sizes and the same dtype, one of float32, float16, bfloat16, float64
  (DirectML: FLOAT32, FLOAT16; simdnorm adds bfloat16 and float64), native byte order;
* parameters: the input's dtype or float32 (DirectML requires the same DataType; simdnorm allows
  float32 parameters for mixed precision, as oneDNN's T2); batch-norm parameters have the input's
  DimensionCount with each dim the input's or 1 (DirectML feature level 4.0), or are 1-D of length
  C (oneDNN BatchNormInference); MVN scale and bias broadcast to the input by numpy's rules without
  enlarging it (DirectML's "any dim may be 1", plus fewer leading dims); scale and bias are optional
  independently (DirectML requires them together; simdnorm's rule is a superset);
* epsilon finite and >= 0; axes non-empty, in range, unique; epsilon_mode "inside" or "outside".

The functional API builds these descriptors from arrays (on a plan-cache miss) and goes through the
same ``_validated()`` methods, so there is one validator.
"""
from __future__ import annotations

import math
import numbers
import sys
from array import array as _PyArray
from collections.abc import Sequence as _Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from ._activation import Activation, ActivationLike, beyond_float64, resolve as _resolve_activation, value_text

try:  # numpy >= 1.25
    from numpy.exceptions import AxisError
except ImportError:  # pragma: no cover
    from numpy import AxisError  # type: ignore[attr-defined,no-redef]

__all__ = [
    "DescriptorError",
    "DescriptorTypeError",
    "DescriptorAxisError",
    "TensorDesc",
    "BatchNormalizationDesc",
    "MeanVarianceNormalizationDesc",
    "MAX_DIMS",
    "VIEW_MAX_DIMS",
]

MAX_DIMS = 8
# The kernels take views of one dim more than a user's tensor: group norm views the channel dim as
# (groups, channels per group).
VIEW_MAX_DIMS = MAX_DIMS + 1

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
F64 = np.dtype(np.float64)
NUMPY_DTYPES = (F32, F16, F64)  # the four but bfloat16


def is_bfloat16(dt: Any) -> bool:
    """Whether dtype dt is ml_dtypes' bfloat16. simdnorm does not import ml_dtypes (its import takes
    most of a second); until something has, no array holds its type."""
    ml = sys.modules.get("ml_dtypes")
    return ml is not None and dt == ml.bfloat16


def supported_dtype(dt: np.dtype) -> bool:
    """Whether the input and output may hold dtype dt (one of the four, native byte order)."""
    return dt in NUMPY_DTYPES or is_bfloat16(dt)

ACCEPTED_DTYPES = "float32, float16, bfloat16 (ml_dtypes.bfloat16), float64, in native byte order"


class DescriptorError(ValueError):
    """A descriptor (or the arrays of a call) breaks a rule; the message names the field and the rule."""


class DescriptorTypeError(DescriptorError, TypeError):
    """A dtype or type rule: both a DescriptorError (ValueError) and a TypeError."""


class DescriptorAxisError(DescriptorError, AxisError):
    """An axis out of range: both a DescriptorError and numpy's AxisError (ValueError, IndexError)."""

    def __init__(self, msg: str) -> None:
        AxisError.__init__(self, msg)


# Shown as simdnorm.DescriptorError and so on in tracebacks: the names a user imports.
for _cls in (DescriptorError, DescriptorTypeError, DescriptorAxisError):
    _cls.__module__ = "simdnorm"
del _cls


def dtype_name(dt: Any) -> str:
    if isinstance(dt, np.dtype):
        if not dt.isnative:
            return f"{dt.str} (non-native byte order)"
        return str(dt)
    return repr(dt)


def stats_dtype(dt: np.dtype) -> np.dtype:
    """The dtype of the statistics (and compute type): float64 for float64 data, else float32."""
    return F64 if dt == F64 else F32


def is_int(v: Any) -> bool:
    if v.__class__ is np.ndarray:  # a 0-d integer array, as numpy's axis= takes one
        return v.ndim == 0 and v.dtype.kind in "iu"
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_sequence(v: Any) -> bool:
    """A sequence (tuple, list, range, 1-D array, ...): ordered, so its items can be sizes, strides or
    axes. Not a set or a dict (a set's order is not the caller's, a dict's items are its keys), nor
    a generator or iterator (numpy's axis= refuses all of them too); nor a str or bytes."""
    cls = v.__class__
    if cls is tuple or cls is list or cls is np.ndarray:  # (the ABC's isinstance costs ~0.2-0.3 us)
        return True
    # (array.array: a Sequence from Python 3.10 on, registered; named for 3.9)
    return isinstance(v, (_Sequence, np.ndarray, _PyArray)) and not isinstance(v, (str, bytes))


def as_int_tuple(v: Any) -> Any:
    """Normalize a sequence of ints to a tuple of Python ints; leave anything else for validate()."""
    if v is None or not _is_sequence(v):
        return v
    if isinstance(v, np.ndarray):
        if v.ndim != 1:
            return v
        v = v.tolist()
    return tuple(int(i) if is_int(i) else i for i in v)


def _shape_str(sizes: Sequence[int]) -> str:
    """A shape for a message, as str(tuple) but any int past 20 digits by its size (value_text)."""
    items = [value_text(s) for s in sizes]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


# The kernels take sizes, element counts and byte strides as int64, and the byte extent with 8 bytes
# of room (cpp/bindings/module.cpp, check_extent); numpy refuses an array whose size * itemsize
# passes int64 (even a broadcast view).
_I64_MAX = (1 << 63) - 1
_I64_MIN = -(1 << 63)
_EXTENT_MAX = _I64_MAX - 8


def check_extent(name: str, a: np.ndarray) -> None:
    """An array numpy will read itself (not through a kernel, which checks the same): its byte
    extent must fit int64, or numpy's own loops wrap past the mapping."""
    if a.size and sum((n - 1) * abs(s) for n, s in zip(a.shape, a.strides)) > _EXTENT_MAX:
        raise DescriptorError(f"{name}: the byte extent of its sizes and strides overflows 64-bit arithmetic")


def _too_large_sizes(name: str, sizes: Tuple[int, ...], count: int, isz: int) -> None:
    """A size, or the element count in bytes, past int64: name the first size past it, else the count."""
    for i, s in enumerate(sizes):
        if s > _I64_MAX:
            raise DescriptorError(
                f"{name}.sizes[{i}]: {value_text(s)} does not fit in int64; a size must be at most 2**63 - 1"
            )
    raise DescriptorError(
        f"{name}: sizes {_shape_str(sizes)} hold {value_text(count)} elements of {isz} bytes = "
        f"{value_text(count * isz)} bytes, past int64 (2**63 - 1); numpy makes no array that large, and "
        "the kernels count elements and bytes in int64"
    )


def _check_real(name: str, v: Any) -> float:
    if not isinstance(v, (numbers.Real, np.floating, np.integer)) or isinstance(v, (bool, np.bool_)):
        raise DescriptorTypeError(f"{name}: expected a real number, got {type(v).__name__}")
    try:
        return float(v)
    except OverflowError:  # an int (or Fraction) past float64: a bad value, not a crash
        raise DescriptorError(
            f"{name}: {beyond_float64(v)} is not allowed; {name} must be finite and >= 0"
        ) from None


def check_epsilon(v: Any, dt: Optional[np.dtype] = None, outside: bool = False) -> float:
    """Finite and >= 0. For data computed in float32 (all but float64), at most 2**252 (2**126
    outside the root): the kernels add epsilon in double but multiply by 1 / std in float32, and
    past that bound epsilon alone takes 1 / std below float32's normal range, where it loses bits."""
    eps = _check_real("epsilon", v)
    if not (math.isfinite(eps) and eps >= 0.0):
        raise DescriptorError(f"epsilon: {value_text(v)} is not allowed; epsilon must be finite and >= 0")
    power = 126 if outside else 252
    if eps > 2.0 ** power and dt is not None and np.dtype(dt) != F64:
        root = "epsilon" if outside else "sqrt(epsilon)"
        raise DescriptorError(
            f"epsilon: {value_text(v)} is past 2**{power} ({2.0 ** power:.4g}), where 1 / {root} leaves float32's "
            f"normal range; float32 is the compute type of {dtype_name(dt)} data")
    return eps


@dataclass(frozen=True)
class TensorDesc:
    """A tensor's element type, sizes and strides (in elements; None = packed, 0 = broadcast).

    ``TensorDesc(np.float32, (2, 16, 8, 8))``. Construction only normalizes (sizes and strides to
    tuples of ints, dtype through ``np.dtype``); :meth:`validate` checks the rules.
    """

    dtype: Any
    sizes: Tuple[int, ...]
    strides: Optional[Tuple[int, ...]] = None

    def __post_init__(self) -> None:
        dt = self.dtype
        if dt is not None and not isinstance(dt, np.dtype):
            try:
                dt = np.dtype(dt)
            except (TypeError, ValueError):
                if isinstance(dt, str) and dt == "bfloat16":  # (numpy knows the name once ml_dtypes is loaded)
                    import ml_dtypes

                    dt = np.dtype(ml_dtypes.bfloat16)
                # anything else is reported by validate()
        object.__setattr__(self, "dtype", dt)
        object.__setattr__(self, "sizes", as_int_tuple(self.sizes))
        object.__setattr__(self, "strides", as_int_tuple(self.strides))

    @classmethod
    def from_array(cls, array: np.ndarray, *, strides: bool = False) -> "TensorDesc":
        """The descriptor of an array; with ``strides=True`` its strides too (in elements)."""
        a = np.asarray(array) if not isinstance(array, np.ndarray) else array
        st = None
        if strides:
            isz = a.dtype.itemsize
            if any(s % isz for s in a.strides):
                raise DescriptorError(
                    f"strides: {a.strides} bytes are not multiples of the item size {isz}; "
                    "a TensorDesc counts strides in elements"
                )
            st = tuple(s // isz for s in a.strides)
        return cls(a.dtype, a.shape, st)

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    def byte_strides(self) -> Optional[Tuple[int, ...]]:
        if self.strides is None:
            return None
        isz = self.dtype.itemsize
        return tuple(s * isz for s in self.strides)

    def validate(self, name: str = "tensor") -> None:
        """Check the rules every tensor follows (any dtype of the four); raise DescriptorError."""
        self._check(name, "data")

    def _check(self, name: str, role: str, max_dims: int = MAX_DIMS) -> None:
        """role: 'data' (input/output: one of the four dtypes) or 'param' (dtype checked by the op).
        max_dims: MAX_DIMS for a user's tensor; an op's internal view may have one more (VIEW_MAX_DIMS)."""
        dt = self.dtype
        if not isinstance(dt, np.dtype):
            raise DescriptorTypeError(
                f"{name}.dtype: {value_text(dt)} is not a numpy dtype; accepted: {ACCEPTED_DTYPES}"
            )
        if role == "data" and not supported_dtype(dt):
            raise DescriptorTypeError(f"{name}: dtype {dtype_name(dt)} is not supported; accepted: {ACCEPTED_DTYPES}")
        sizes = self.sizes
        if not isinstance(sizes, tuple):
            raise DescriptorTypeError(
                f"{name}.sizes: expected a sequence of ints, got {type(sizes).__name__}"
            )
        nd = len(sizes)
        if not 1 <= nd <= max_dims:
            raise DescriptorError(
                f"{name}: {nd} dimensions (shape {_shape_str(sizes)}); tensors must have 1 to {MAX_DIMS} dimensions"
            )
        count = 1
        for i, s in enumerate(sizes):
            if s.__class__ is not int and not is_int(s):  # (sizes are Python ints: __post_init__)
                raise DescriptorTypeError(f"{name}.sizes[{i}]: expected an int, got {type(s).__name__}")
            if s < 0:
                raise DescriptorError(f"{name}.sizes[{i}]: {value_text(s)} is negative; sizes must be >= 0")
            count *= s
        isz = dt.itemsize or 1  # (a parameter's dtype is checked by the op: S0 has none)
        if count * isz > _I64_MAX or (not count and max(sizes) > _I64_MAX):
            _too_large_sizes(name, sizes, count, isz)
        st = self.strides
        if st is None:
            return
        if not isinstance(st, tuple):
            raise DescriptorTypeError(
                f"{name}.strides: expected None (packed) or a sequence of ints, got {type(st).__name__}"
            )
        if len(st) != nd:
            raise DescriptorError(
                f"{name}.strides: {len(st)} strides for {nd} sizes; give one stride per dim, or None (packed)"
            )
        hi = _I64_MAX // isz  # a stride's bytes in int64: numpy's strides, the kernels' offsets
        lo = -(-_I64_MIN // isz)
        span = 0  # sum of (size - 1) * |stride|: the farthest element from the nearest, in elements
        for i, s in enumerate(st):
            if s.__class__ is not int and not is_int(s):
                raise DescriptorTypeError(f"{name}.strides[{i}]: expected an int, got {type(s).__name__}")
            if not lo <= s <= hi:
                raise DescriptorError(
                    f"{name}.strides[{i}]: {value_text(s)} elements of {isz} bytes do not fit in int64 "
                    f"({value_text(s * isz)} bytes); a stride in bytes must be within -2**63 to 2**63 - 1"
                )
            span += (sizes[i] - 1) * (s if s >= 0 else -s)
        if count and span * isz > _EXTENT_MAX:
            raise DescriptorError(
                f"{name}: the byte extent of sizes {_shape_str(sizes)} with strides {st} is "
                f"{value_text(span * isz + isz)} bytes ((size - 1) * |stride| summed over the dims, plus one "
                f"element, times {isz} bytes); the kernels address a tensor with int64 byte offsets, so it "
                f"must be at most 2**63 - 9 bytes (with 8 bytes of room for the last element)"
            )


def _require_desc(name: str, v: Any, optional: bool) -> None:
    if v is None and optional:
        return
    if not isinstance(v, TensorDesc):
        what = "None or a TensorDesc" if optional else "a TensorDesc"
        raise DescriptorTypeError(f"{name}: expected {what}, got {type(v).__name__}")


def _check_output(out: TensorDesc, x: TensorDesc, max_dims: int = MAX_DIMS) -> None:
    out._check("output", "data", max_dims)
    if out.dtype != x.dtype:
        raise DescriptorTypeError(
            f"output: dtype {dtype_name(out.dtype)} differs from the input's {dtype_name(x.dtype)}; "
            "the output must have the input's dtype"
        )
    if out.sizes != x.sizes:
        raise DescriptorError(
            f"output: sizes {_shape_str(out.sizes)} differ from the input's {_shape_str(x.sizes)}; "
            "the output must have the input's sizes"
        )
    if out.strides is not None:
        for i, (n, s) in enumerate(zip(out.sizes, out.strides)):
            if s == 0 and n > 1:
                raise DescriptorError(
                    f"output.strides[{i}]: 0 on a dim of size {n}; the output cannot broadcast "
                    "(its elements would overlap)"
                )
        _check_output_disjoint(out.sizes, out.strides)


# Above this many elements an output layout that fails the sufficient test is not decided exactly.
_OVERLAP_EXACT_MAX = 1 << 22


def _provably_disjoint(sizes: Tuple[int, ...], strides: Tuple[int, ...]) -> bool:
    """The sufficient test: with the dims of size > 1 sorted by |stride|, each |stride| reaches past
    the span of the dims before it (no zero stride, no two elements at one address)."""
    span = 1
    for s, n in sorted((abs(s), n) for n, s in zip(sizes, strides) if n > 1):
        if s < span:
            return False
        span += s * (n - 1)
    return True


def _default_output(x: Any) -> Any:
    """A descriptor's output when none is given: the input's, or packed (as np.empty_like lays out
    such an input's result) where the input's strides broadcast or overlap, as no output's may."""
    if not isinstance(x, TensorDesc) or x.strides is None:
        return x
    try:
        if _provably_disjoint(x.sizes, x.strides):
            return x
    except TypeError:  # (invalid sizes or strides: validate() names them, on the input)
        return x
    return TensorDesc(x.dtype, x.sizes)


def _check_output_disjoint(sizes: Tuple[int, ...], strides: Tuple[int, ...]) -> None:
    """The output's elements must not overlap (the kernels would write one element twice, from two
    results). Sufficient: _provably_disjoint. Otherwise the element offsets decide (up to
    _OVERLAP_EXACT_MAX elements; beyond, a layout that fails the sufficient test is refused as
    unproven)."""
    if 0 in sizes or _provably_disjoint(sizes, strides):
        return
    dims = sorted((abs(s), n) for n, s in zip(sizes, strides) if n > 1)
    count = math.prod(n for _, n in dims)
    if count > _OVERLAP_EXACT_MAX:
        raise DescriptorError(
            f"output.strides: {strides} on sizes {_shape_str(sizes)} could not be proven non-overlapping (the "
            f"sufficient test fails, and the exact one takes up to {_OVERLAP_EXACT_MAX} elements); the output's "
            "elements cannot overlap"
        )
    dt = np.int64 if sum(s * (n - 1) for s, n in dims) < 1 << 63 else object
    offsets = np.zeros(1, dt)
    for s, n in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=dt) * s).ravel()
    offsets.sort()  # neighbours compared: np.unique took 15x longer (numpy 2.4, 2**22 offsets)
    if (offsets[1:] == offsets[:-1]).any():
        raise DescriptorError(
            f"output.strides: {strides} on sizes {_shape_str(sizes)} give two elements the same address; the "
            "output's elements cannot overlap"
        )


def check_param_dtype(name: str, p: TensorDesc, x: TensorDesc) -> None:
    if p.dtype != x.dtype and p.dtype != F32:
        raise DescriptorTypeError(
            f"{name}: dtype {dtype_name(p.dtype)} is not accepted with a {dtype_name(x.dtype)} input; "
            f"a parameter's dtype must be the input's ({dtype_name(x.dtype)}) or float32"
        )


def normalize_axis(name: str, axis: Any, ndim: int) -> int:
    if not is_int(axis):
        raise DescriptorTypeError(f"{name}: expected an int, got {type(axis).__name__}")
    a = int(axis)
    if not -ndim <= a < ndim:
        raise DescriptorAxisError(
            f"{name}: axis {value_text(a)} is out of range for an input of {ndim} dims (valid: {-ndim} to {ndim - 1})"
        )
    return a + ndim if a < 0 else a


def normalize_axes(axes: Any, ndim: int) -> Tuple[int, ...]:
    """MVN's axes: an int or a non-empty sequence of ints; in range; unique. -> sorted tuple."""
    if is_int(axes):
        return (normalize_axis("axes", axes, ndim),)
    if not _is_sequence(axes):
        raise DescriptorTypeError(
            f"axes: expected an int or a sequence of ints, got {type(axes).__name__}"
            + ("" if isinstance(axes, (str, bytes)) or not hasattr(axes, "__iter__") else
               "; pass the axes as a tuple or a list")
        )
    if isinstance(axes, np.ndarray) and axes.ndim != 1:
        raise DescriptorTypeError(f"axes: expected an int or a 1-D sequence of ints, got a {axes.ndim}-D array")
    items = list(axes)
    if not items:
        raise DescriptorError("axes: empty; give at least one axis to normalize over")
    seen = {}
    for a in items:
        if not is_int(a):
            raise DescriptorTypeError(f"axes: expected ints, got {type(a).__name__} ({value_text(a)})")
        n = normalize_axis("axes", a, ndim)
        if n in seen:
            raise DescriptorError(
                f"axes: axis {n} appears twice (as {seen[n]} and {int(a)}); each axis may appear once"
            )
        seen[n] = int(a)
    return tuple(sorted(seen))


# ----------------------------------------------------------------------------------------------------
# The conveniences' own rules (layer, RMS, instance and group norm are routes onto MVN: these are
# what each adds before its MVN descriptor is validated). ``x`` is anything with a dtype and a shape.

def _check_input_array(x: Any) -> None:
    """The input's own rules (dtype, rank) with the input's name, before any shape rule uses it."""
    TensorDesc(x.dtype, x.shape)._check("input", "data")


def trailing_axes_rule(x: Any, axis: Any) -> Tuple[int, ...]:
    """layer_norm and rms_norm: the dims ``axis .. ndim-1``."""
    _check_input_array(x)
    a = normalize_axis("axis", axis, len(x.shape))
    return tuple(range(a, len(x.shape)))


def channel_axis_rule(x: Any, channel_axis: Any, what: str) -> int:
    """The channel axis of an (N, C, *S) or (N, *S, C) input: not the batch axis 0."""
    _check_input_array(x)
    if len(x.shape) < 2:
        raise DescriptorError(
            f"input: shape {x.shape}; {what} takes an input of shape (N, C, ...) or (N, ..., C) (2 or more dims)"
        )
    ca = normalize_axis("channel_axis", channel_axis, len(x.shape))
    if ca == 0:
        raise DescriptorError(
            f"channel_axis: {channel_axis} is the batch axis; {what} takes (N, C, ...) (channel_axis=1) or "
            "(N, ..., C) (channel_axis=-1)"
        )
    return ca


def spatial_axes_rule(x: Any, ca: int) -> Tuple[int, ...]:
    """instance_norm: the dims other than the batch and the channel axis ca, at least one."""
    axes = tuple(d for d in range(1, len(x.shape)) if d != ca)
    if not axes:
        raise DescriptorError(
            f"input: shape {x.shape} has no spatial dims; instance_norm normalizes each (n, c) over the "
            "spatial dims of an input of 3 or more dims"
        )
    return axes


def per_channel_rule(name: str, p: Any, c: int, what: str) -> None:
    """instance_norm and group_norm: scale and bias (None or anything with a shape) of shape (C,)."""
    if p is not None and p.shape != (c,):
        raise DescriptorError(f"{name}: shape {p.shape}; {what} takes a per-channel {name} of shape (C,) = ({c},)")


def num_groups_rule(num_groups: Any, c: int) -> int:
    """group_norm: an int >= 1 that divides the C channels."""
    if not is_int(num_groups):
        raise DescriptorTypeError(f"num_groups: expected an int, got {type(num_groups).__name__}")
    g = int(num_groups)
    if g < 1:
        raise DescriptorError(f"num_groups: {value_text(g)}; it must be >= 1 and divide the number of channels C = {c}")
    if c % g:
        raise DescriptorError(
            f"num_groups: {value_text(g)} does not divide the number of channels C = {c}; C % num_groups must be 0"
        )
    return g


# ----------------------------------------------------------------------------------------------------
# Validated representations (what the planner consumes)

class BNInfo(NamedTuple):
    input: TensorDesc
    output: TensorDesc
    # Per parameter (mean, variance, scale, bias): None (absent) or (desc, channel_axis or None):
    # channel_axis is set when the parameter is 1-D of length C and must be viewed with C at that axis.
    params: Tuple[Optional[Tuple[TensorDesc, Optional[int]]], ...]
    epsilon: float
    activation: Optional[Activation]


class MVNInfo(NamedTuple):
    input: TensorDesc
    output: TensorDesc
    axes: Tuple[int, ...]
    scale: Optional[TensorDesc]
    bias: Optional[TensorDesc]
    normalize_mean: bool
    normalize_variance: bool
    epsilon: float
    epsilon_outside: bool
    activation: Optional[Activation]


BN_PARAM_NAMES = ("mean", "variance", "scale", "bias")


def check_bool(name: str, v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)) or (isinstance(v, (int, np.integer)) and v in (0, 1)):
        return bool(v)
    raise DescriptorTypeError(f"{name}: expected a bool, got {type(v).__name__} ({value_text(v)})")


def check_activation(v: Any) -> Optional[Activation]:
    try:
        return _resolve_activation(v)
    except TypeError as e:
        raise DescriptorTypeError(str(e)) from None
    except ValueError as e:
        raise DescriptorError(str(e)) from None


def bn_param_rule(name: str, p: Tuple[int, ...], x: Tuple[int, ...], ca: Optional[int]) -> Optional[int]:
    """Batch norm's two shape rules. Returns None (same rank) or the channel axis (1-D of C)."""
    nd = len(x)
    if len(p) == nd and all(ps == xs or ps == 1 for ps, xs in zip(p, x)):
        return None
    if nd > 1 and ca is not None and len(p) == 1 and p[0] == x[ca]:
        return ca
    if nd == 1:
        raise DescriptorError(
            f"{name}: shape {_shape_str(p)} does not fit the input's shape {_shape_str(x)}: with a 1-D input "
            f"a parameter must be 1-D of length {x[0]} or 1"
        )
    raise DescriptorError(
        f"{name}: shape {_shape_str(p)} does not fit the input's shape {_shape_str(x)}: a parameter must either "
        f"have the input's {nd} dims, each equal to the input's or 1 (broadcast), or be 1-D of length "
        f"C = input.shape[channel_axis] = {x[ca]} (channel_axis={ca})"
    )


def mvn_param_rule(name: str, p: Tuple[int, ...], x: Tuple[int, ...]) -> None:
    nd = len(x)
    if len(p) <= nd and all(ps == xs or ps == 1 for ps, xs in zip(p, x[nd - len(p):])):
        return
    raise DescriptorError(
        f"{name}: shape {_shape_str(p)} does not broadcast to the input's shape {_shape_str(x)} without "
        f"enlarging it: it needs at most the input's {nd} dims, aligned to the right as in numpy "
        "broadcasting, each equal to the input's or 1"
    )


@dataclass(frozen=True)
class BatchNormalizationDesc:
    """DML_BATCH_NORMALIZATION_OPERATOR_DESC (+ oneDNN BatchNormInference's 1-D parameters).

    ``output`` defaults to the input's descriptor. ``spatial`` is accepted for compatibility and has
    no effect (deprecated in DirectML feature level 4.0).
    """

    input: TensorDesc
    mean: TensorDesc
    variance: TensorDesc
    scale: Optional[TensorDesc] = None
    bias: Optional[TensorDesc] = None
    output: Optional[TensorDesc] = None
    epsilon: float = 1e-5
    activation: ActivationLike = None
    channel_axis: int = 1
    spatial: bool = True

    def __init__(self, input: TensorDesc, mean: TensorDesc, variance: TensorDesc,
                 scale: Optional[TensorDesc] = None, bias: Optional[TensorDesc] = None,
                 output: Optional[TensorDesc] = None, *, epsilon: float = 1e-5,
                 activation: ActivationLike = None, channel_axis: int = 1, spatial: bool = True) -> None:
        s = object.__setattr__
        s(self, "input", input)
        s(self, "mean", mean)
        s(self, "variance", variance)
        s(self, "scale", scale)
        s(self, "bias", bias)
        s(self, "output", _default_output(input) if output is None else output)
        s(self, "epsilon", epsilon)
        s(self, "activation", activation)
        s(self, "channel_axis", channel_axis)
        s(self, "spatial", spatial)

    def validate(self) -> None:
        """Raise DescriptorError (naming the field and the rule) unless every rule holds."""
        self._validated()

    def _validated(self) -> BNInfo:
        info = self.__dict__.get("_info")
        if info is None:
            info = _validate_bn(self)
            object.__setattr__(self, "_info", info)
        return info


def _validate_bn(d: BatchNormalizationDesc) -> BNInfo:
    _require_desc("input", d.input, False)
    x = d.input
    x._check("input", "data")
    _require_desc("output", d.output, False)
    _check_output(d.output, x)
    nd = x.ndim
    ca = d.channel_axis
    if nd > 1:
        ca = normalize_axis("channel_axis", ca, nd)
    elif not is_int(ca):
        raise DescriptorTypeError(f"channel_axis: expected an int, got {type(ca).__name__}")
    else:
        ca = None
    params = []
    for name in BN_PARAM_NAMES:
        p = getattr(d, name)
        _require_desc(name, p, name in ("scale", "bias"))
        if p is None:
            params.append(None)
            continue
        p._check(name, "param")
        check_param_dtype(name, p, x)
        params.append((p, bn_param_rule(name, p.sizes, x.sizes, ca)))
    eps = check_epsilon(d.epsilon, x.dtype)
    act = check_activation(d.activation)
    check_bool("spatial", d.spatial)
    return BNInfo(x, d.output, tuple(params), eps, act)


@dataclass(frozen=True)
class MeanVarianceNormalizationDesc:
    """DML_MEAN_VARIANCE_NORMALIZATION1_OPERATOR_DESC + MVN2's ``normalize_mean`` + ONNX's epsilon mode.

    ``axes``: an int or a non-empty sequence of ints (negative allowed). ``output`` defaults to the
    input's descriptor. DirectML's older ``CrossChannel`` maps to axes (1, 2, 3) (TRUE) / (2, 3) (FALSE).
    """

    input: TensorDesc
    axes: Union[int, Tuple[int, ...]]
    scale: Optional[TensorDesc] = None
    bias: Optional[TensorDesc] = None
    output: Optional[TensorDesc] = None
    normalize_mean: bool = True
    normalize_variance: bool = True
    epsilon: float = 1e-5
    epsilon_mode: str = "inside"
    activation: ActivationLike = None

    def __init__(self, input: TensorDesc, axes: Union[int, Sequence[int]], scale: Optional[TensorDesc] = None,
                 bias: Optional[TensorDesc] = None, output: Optional[TensorDesc] = None, *,
                 normalize_mean: bool = True, normalize_variance: bool = True, epsilon: float = 1e-5,
                 epsilon_mode: str = "inside", activation: ActivationLike = None) -> None:
        s = object.__setattr__
        s(self, "input", input)
        s(self, "axes", axes if is_int(axes) else as_int_tuple(axes))
        s(self, "scale", scale)
        s(self, "bias", bias)
        s(self, "output", _default_output(input) if output is None else output)
        s(self, "normalize_mean", normalize_mean)
        s(self, "normalize_variance", normalize_variance)
        s(self, "epsilon", epsilon)
        s(self, "epsilon_mode", epsilon_mode)
        s(self, "activation", activation)

    def validate(self) -> None:
        """Raise DescriptorError (naming the field and the rule) unless every rule holds."""
        self._validated()

    def _validated(self, max_dims: int = MAX_DIMS) -> MVNInfo:
        """max_dims: VIEW_MAX_DIMS for an op's internal view (group norm's), never a user's tensor."""
        info = self.__dict__.get("_info")
        if info is None:
            info = _validate_mvn(self, max_dims)
            object.__setattr__(self, "_info", info)
        return info


def check_epsilon_mode(v: Any) -> bool:
    if isinstance(v, str) and v in ("inside", "outside"):
        return v == "outside"
    raise DescriptorError(
        f"epsilon_mode: {value_text(v)} is not valid; use 'inside' (sqrt(variance + epsilon)) or "
        "'outside' (sqrt(variance) + epsilon)"
    )


def _validate_mvn(d: MeanVarianceNormalizationDesc, max_dims: int = MAX_DIMS) -> MVNInfo:
    _require_desc("input", d.input, False)
    x = d.input
    x._check("input", "data", max_dims)
    _require_desc("output", d.output, False)
    _check_output(d.output, x, max_dims)
    axes = normalize_axes(d.axes, x.ndim)
    for name in ("scale", "bias"):
        p = getattr(d, name)
        _require_desc(name, p, True)
        if p is not None:
            p._check(name, "param", max_dims)
            check_param_dtype(name, p, x)
            mvn_param_rule(name, p.sizes, x.sizes)
    nm = check_bool("normalize_mean", d.normalize_mean)
    nv = check_bool("normalize_variance", d.normalize_variance)
    eo = check_epsilon_mode(d.epsilon_mode)
    eps = check_epsilon(d.epsilon, x.dtype, eo)
    act = check_activation(d.activation)
    return MVNInfo(x, d.output, axes, d.scale, d.bias, nm, nv, eps, eo, act)
