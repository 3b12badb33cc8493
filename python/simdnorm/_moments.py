"""Mergeable statistics (SPEC section 11): ``moments`` of an array's parts, merged into those of the
whole by Chan et al.'s parallel formula, in float64 and in a fixed order.

The kernels take a part's mean and variance in one read (_core.mvn with no output: the statistics
only, in float64, summed about a pivot as every MVN is: docs/ARCHITECTURE.md). Merging partial
means and sums of squared deviations never forms E[x^2] - E[x]^2, so data far from zero keeps its
variance; the merge of two parts adds the spread of their means, delta^2 * na * nb / n.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Tuple

import numpy as np

from . import _core
from ._compile import as_input, plan_mvn
from ._descriptors import (
    DescriptorError,
    DescriptorTypeError,
    MeanVarianceNormalizationDesc,
    TensorDesc,
    check_epsilon,
    check_epsilon_mode,
    value_text,
)

__all__ = ["Moments", "moments", "merge_moments"]

_F64 = np.dtype(np.float64)
_IDENTITY = (0, 0.0, 0.0)

# A Moments as one numpy array (simdnorm.dask's intermediate results: a real dtype and shape,
# which dask can concatenate, store and send between processes).
RECORD = np.dtype([("count", _F64), ("mean", _F64), ("m2", _F64)])


class Moments:
    """Partial statistics of an array, to be merged: ``count`` elements of mean ``mean`` whose squared
    deviations from that mean sum to ``m2``, per group. Three float64 arrays of one shape (the
    input's with the reduced dims kept as 1, as :func:`moments` returns them); unpacks as
    ``count, mean, m2 = m``.

    A count-0 Moments (any mean and m2) is the identity of :meth:`merge`.

    Examples
    --------
    >>> import numpy as np, simdnorm
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 10.0, 20.0, 20.0]], np.float32)
    >>> left, right = simdnorm.moments(x[:, :1], axes=1), simdnorm.moments(x[:, 1:], axes=1)
    >>> whole = left.merge(right)
    >>> print(whole.count.ravel(), whole.mean.ravel(), whole.variance().ravel())
    [4. 4.] [ 2.5 15. ] [ 1.25 25.  ]
    >>> print(whole.inv_std(epsilon=0.0).ravel())
    [0.89442719 0.2       ]
    """

    __slots__ = ("count", "mean", "m2")

    def __init__(self, count: Any, mean: Any, m2: Any) -> None:
        arrays = []
        for name, v in (("count", count), ("mean", mean), ("m2", m2)):
            try:
                a = np.asarray(v, dtype=_F64)
            except (TypeError, ValueError) as e:
                raise DescriptorTypeError(f"Moments.{name}: cannot convert {type(v).__name__} to float64 ({e})") from None
            arrays.append(a)
        try:
            shape = np.broadcast_shapes(*(a.shape for a in arrays))
        except ValueError:
            raise DescriptorError(
                "Moments: count, mean and m2 have shapes " + ", ".join(str(a.shape) for a in arrays)
                + ", which do not broadcast to one shape") from None
        if np.any(arrays[0] < 0):
            raise DescriptorError("Moments.count: negative; a count of elements is >= 0")
        # (copies: a Moments owns its arrays, so merging never writes into a caller's)
        self.count, self.mean, self.m2 = (np.array(np.broadcast_to(a, shape)) for a in arrays)

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.mean.shape

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter((self.count, self.mean, self.m2))

    def __repr__(self) -> str:
        return f"Moments(count={self.count!r}, mean={self.mean!r}, m2={self.m2!r})"

    def merge(self, other: "Moments") -> "Moments":
        """The statistics of both parts together (Chan et al.), group by group; one part's shape
        broadcasts to the other's (a count-0 Moments of shape () merges with any)."""
        if not isinstance(other, Moments):
            raise DescriptorTypeError(f"Moments.merge: expected a Moments, got {type(other).__name__}")
        try:
            n, m, q = _chan(self.count, self.mean, self.m2, other.count, other.mean, other.m2)
        except ValueError:
            raise DescriptorError(f"Moments.merge: shapes {self.shape} and {other.shape} do not broadcast") from None
        if n.shape != self.shape and n.shape != other.shape:  # ((1, 6, 1) with (1, 1, 5): other groups)
            raise DescriptorError(f"Moments.merge: shapes {self.shape} and {other.shape}: neither broadcasts to the "
                                  "other (statistics over different axes are of different groups)")
        return _owned(n, m, q)

    def variance(self, ddof: Any = 0) -> np.ndarray:
        """``m2 / (count - ddof)``, float64; NaN where ``count - ddof <= 0`` (as for no elements)."""
        if isinstance(ddof, (bool, np.bool_)) or not isinstance(ddof, (int, float, np.integer, np.floating)):
            raise DescriptorTypeError(f"variance: ddof must be a number >= 0, got {type(ddof).__name__}")
        if not (math.isfinite(ddof) and ddof >= 0):
            raise DescriptorError(f"variance: ddof {value_text(ddof)}; it must be finite and >= 0")
        dof = self.count - float(ddof)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(dof > 0, self.m2 / np.where(dof > 0, dof, 1.0), np.nan)

    def inv_std(self, epsilon: float = 1e-5, epsilon_mode: str = "inside") -> np.ndarray:
        """``1 / sqrt(variance + epsilon)`` ("inside") or ``1 / (sqrt(variance) + epsilon)``
        ("outside"), of the population variance, float64."""
        outside = check_epsilon_mode(epsilon_mode)
        return inv_std_of(self.variance(), check_epsilon(epsilon), outside)


def inv_std_of(var: np.ndarray, epsilon: float, outside: bool) -> np.ndarray:
    """1/std of a float64 variance by the kernels' rule (an infinite result where the denominator is 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return 1.0 / (np.sqrt(var) + epsilon) if outside else 1.0 / np.sqrt(var + epsilon)


def _owned(n: np.ndarray, m: np.ndarray, q: np.ndarray) -> Moments:
    """A Moments of arrays just computed here (no validation or copy)."""
    r = Moments.__new__(Moments)
    r.count, r.mean, r.m2 = n, m, q
    return r


def _chan(na: np.ndarray, ma: np.ndarray, qa: np.ndarray, nb: np.ndarray, mb: np.ndarray,
          qb: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chan et al.'s merge of two parts, elementwise; a count-0 part leaves the other as it is."""
    n = na + nb
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # (m2 past double's range: inf)
        wb = nb / n  # the weight of b's mean: delta * nb / n moves a's mean to the whole's
        delta = mb - ma
        m = ma + delta * wb
        q = qa + qb + delta * delta * na * wb
    m = np.where(nb == 0, ma, np.where(na == 0, mb, m))
    q = np.where(nb == 0, qa, np.where(na == 0, qb, q))
    return n, m, q


def _tree(n: np.ndarray, m: np.ndarray, q: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge along the last axis, pairwise in a fixed order ((0 1) (2 3) ..., then their pairs), so
    the result depends on the parts only, never on the order they were computed in."""
    while n.shape[-1] > 1:
        k = n.shape[-1] // 2 * 2
        merged = _chan(n[..., 0:k:2], m[..., 0:k:2], q[..., 0:k:2], n[..., 1:k:2], m[..., 1:k:2], q[..., 1:k:2])
        if k < n.shape[-1]:  # an odd one out joins the next round, last
            merged = tuple(np.concatenate((a, b[..., k:]), axis=-1) for a, b in zip(merged, (n, m, q)))
        n, m, q = merged
    return n[..., 0], m[..., 0], q[..., 0]


def merge_moments(parts: Iterable[Moments]) -> Moments:
    """The merge of a non-empty sequence of Moments (of one shape, or shapes broadcasting to it),
    pairwise in a fixed order: ``merge_moments([a, b, c, d])`` is ``a.merge(b).merge(c.merge(d))``
    whatever the order in which the parts were computed."""
    items = list(parts)
    if not items:
        raise DescriptorError("merge_moments: no Moments to merge; give at least one")
    for i, p in enumerate(items):
        if not isinstance(p, Moments):
            raise DescriptorTypeError(f"merge_moments: item {i} is a {type(p).__name__}, not a Moments")
    while len(items) > 1:
        pairs = [items[i].merge(items[i + 1]) for i in range(0, len(items) - 1, 2)]
        items = pairs + items[len(items) // 2 * 2:]
    return items[0]


# ----------------------------------------------------------------------------------------------------
# moments of an array

_PLANS: dict = {}


def _plan(x: np.ndarray, axes: Any) -> tuple:
    """(reduced axes, statistics shape, count), by MVN's validator (the same messages)."""
    try:
        key: Any = (x.dtype, x.shape, axes if axes.__class__ is int else (tuple(axes), tuple(map(type, axes))))
        plan = _PLANS.get(key)
    except TypeError:  # not hashable, or not a sequence: the validator says what is wrong
        key, plan = None, None
    if plan is None:
        axes_t, stats_shape = plan_mvn(MeanVarianceNormalizationDesc(TensorDesc(x.dtype, x.shape), axes)._validated())[:2]
        plan = (axes_t, stats_shape, math.prod(x.shape[d] for d in axes_t))
        if key is not None:
            if len(_PLANS) >= 256:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def moments(x: Any, axes: Any) -> Moments:
    """Mergeable statistics of ``x`` over ``axes``: its count, mean and sum of squared deviations.

    Computed by the SIMD kernels in one read of the input, with nothing written but the statistics:
    float64 arrays of the input's shape with the reduced dims kept as 1. Merge the Moments of the
    parts of an array (:meth:`Moments.merge`, :func:`merge_moments`) to get those of the whole.

    Parameters
    ----------
    x : array_like
        1 to 8 dims of float32, float16, bfloat16 or float64, any strides; an ndarray or a CPU
        DLPack tensor (read in place), or a list. The result is numpy arrays whatever the input.
    axes : int or sequence of int
        The dims to reduce, as :func:`mean_variance_normalization` takes them.

    Returns
    -------
    Moments
        ``count`` (the number of elements per group, as float64), ``mean``, ``m2``. Groups of no
        elements (a reduced dim of size 0) have count 0 (mean and m2 0); an inf or NaN in a group
        makes its mean and m2 NaN; float64 data whose squared deviations pass double's range
        (magnitudes past ~1e154) has an infinite m2.

    Examples
    --------
    >>> import numpy as np, simdnorm
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 10.0, 20.0, 20.0]], np.float32)
    >>> m = simdnorm.moments(x, axes=1)
    >>> print(m.count.ravel(), m.mean.ravel(), m.m2.ravel())
    [4. 4.] [ 2.5 15. ] [  5. 100.]
    """
    if x.__class__ is not np.ndarray:
        x = as_input(x)
    axes_t, stats_shape, count = _plan(x, axes)
    mean = np.zeros(stats_shape, _F64)
    var = np.zeros(stats_shape, _F64)
    if count and x.size:
        inv_std = np.empty(stats_shape, _F64)  # (the kernel writes the variance beside inv_std)
        _core.mvn(x, axes_t, None, None, None, 0.0, True, True, False, _IDENTITY, mean, inv_std, -1, False, var)
    var *= count
    return _owned(np.full(stats_shape, float(count)), mean, var)


# ----------------------------------------------------------------------------------------------------
# records (simdnorm.dask)

def to_record(m: Moments) -> np.ndarray:
    rec = np.empty(m.shape, RECORD)
    rec["count"], rec["mean"], rec["m2"] = m.count, m.mean, m.m2
    return rec


def from_record(rec: np.ndarray) -> Moments:
    return _owned(rec["count"].copy(), rec["mean"].copy(), rec["m2"].copy())


def merge_record(rec: np.ndarray, axes: Tuple[int, ...]) -> np.ndarray:
    """A record array's Moments merged along ``axes`` (kept as 1), pairwise in their row-major order."""
    kept = [d for d in range(rec.ndim) if d not in axes]
    moved = np.transpose(rec, kept + sorted(axes))
    parts = math.prod(rec.shape[d] for d in axes)  # (not -1 below: a kept dim may be 0)
    flat = moved.reshape(moved.shape[:len(kept)] + (parts,))
    out_shape = tuple(1 if d in axes else rec.shape[d] for d in range(rec.ndim))
    out = np.zeros(out_shape, RECORD)  # no parts at all: the identity
    if flat.shape[-1]:
        n, m, q = _tree(flat["count"], flat["mean"], flat["m2"])
        out["count"], out["mean"], out["m2"] = (a.reshape(out_shape) for a in (n, m, q))
    return out
