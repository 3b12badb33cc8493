"""simdnorm.moments, Moments and merge_moments (SPEC section 11): the statistics of every dtype, layout
and ISA against an extended-precision reference; parts merged into the whole (Chan) in a fixed
order; count 0 as the identity; data far from zero; variance and inv_std; the kernels'
statistics-only entry; one thread per caller (the scoping simdnorm.dask runs its tasks in); errors."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

import simdnorm
from simdnorm import _core, _runtime
from cases import AxisError, bits, make_input
from reference import DTYPES, F32, F64, dtype_id, f64, normalize_axes

DT = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
AXES = [0, -1, (1, 2), (0, 2, 3), (0, 1, 2, 3)]


def reference(x, axes):
    """(count, mean, m2) in extended precision, the reduced dims kept."""
    xl = f64(x).astype(np.longdouble)
    ax = normalize_axes(axes, xl.ndim)
    mean = xl.mean(axis=ax, keepdims=True)
    m2 = ((xl - mean) ** 2).sum(axis=ax, keepdims=True)
    return int(np.prod([xl.shape[d] for d in ax])), mean.astype(np.float64), m2.astype(np.float64)


def check(m, x, axes, *, rtol=1e-12, context=""):
    count, mean, m2 = reference(x, axes)
    assert isinstance(m, simdnorm.Moments)
    for name, a in zip(("count", "mean", "m2"), m):
        assert a.dtype == F64 and a.shape == mean.shape, (name, a.dtype, a.shape, mean.shape, context)
    assert (m.count == count).all(), context
    std = np.sqrt(m2 / max(count, 1))
    assert (np.abs(m.mean - mean) <= rtol * (np.abs(mean) + std) + 1e-300).all(), (
        f"mean off by {np.max(np.abs(m.mean - mean) / (np.abs(mean) + std))} relative {context}")
    assert (np.abs(m.m2 - m2) <= rtol * m2 + 1e-300).all(), (
        f"m2 off by {np.max(np.abs(m.m2 - m2) / m2)} relative {context}")


@DT
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "negative", "zero_stride", "unaligned"])
def test_moments_match_the_reference(isa, rng, dtype, layout):
    x = make_input(rng, (3, 5, 6, 37), dtype, layout, loc=4.0, scale=3.0)
    for axes in AXES:
        check(simdnorm.moments(x, axes), x, axes, context=f"{isa} {dtype_id(dtype)} {layout} axes={axes}")


def test_moments_of_rows_and_columns_long_enough_to_split(rng):
    # groups past one block of sums (32768 elements), and columns whose lanes span several tasks
    x = make_input(rng, (3, 70000), F32, loc=-50.0, scale=0.5)
    check(simdnorm.moments(x, 1), x, 1)
    y = make_input(rng, (3000, 700), F32, loc=200.0, scale=0.1)
    check(simdnorm.moments(y, 0), y, 0)
    check(simdnorm.moments(y, (0, 1)), y, (0, 1))


def test_moments_take_lists_and_dlpack_tensors(rng):
    m = simdnorm.moments([[1.0, 2.0, 6.0]], 1)
    assert m.mean.tolist() == [[3.0]] and m.count.tolist() == [[3.0]]
    np.testing.assert_allclose(m.m2, [[14.0]], rtol=1e-15)
    torch = pytest.importorskip("torch", reason="PyTorch is optional")
    t = torch.randn(4, 9, dtype=torch.bfloat16) * 3 + 7
    x = t.float().numpy().astype(F32)  # bfloat16 values are exact in float32
    got = simdnorm.moments(t, (0, 1))
    assert isinstance(got.mean, np.ndarray)
    check(got, x, (0, 1))


def test_moments_are_read_by_the_statistics_only_entry(rng):
    # out=None: the kernels write float64 statistics and no normalized output
    x = make_input(rng, (40, 33), F32, loc=3.0)
    m, i, v = (np.full((40, 1), np.nan) for _ in range(3))
    args = (x, (1,), None, None, None, 0.0, True, True, False, (0, 0.0, 0.0), m, i, -1, False, v)
    assert _core.explain_mvn(*args).endswith("statistics-only")
    _core.mvn(*args)
    count, mean, m2 = reference(x, 1)
    np.testing.assert_allclose(m, mean, rtol=1e-13)
    np.testing.assert_allclose(v * count, m2, rtol=1e-12)
    with pytest.raises(TypeError, match="float64"):  # float32 statistics are the normalizing call's
        _core.mvn(x, (1,), None, None, None, 0.0, True, True, False, (0, 0.0, 0.0), m.astype(F32), None, -1, False)
    with pytest.raises(ValueError, match="statistics only"):
        _core.mvn(x, (1,), x[:1], None, None, 0.0, True, True, False, (0, 0.0, 0.0), m, None, -1, False)
    with pytest.raises(ValueError, match="statistics only"):
        _core.mvn(x, (1,), None, None, None, 0.0, True, True, False, (0, 0.0, 0.0), None, None, -1, False)


def _cuts(rng, n, parts):
    """Cut points splitting range(n) into `parts` pieces, some empty, some of one element."""
    inner = sorted(rng.integers(0, n + 1, size=parts - 1).tolist() + [1, n - 1][: max(0, min(2, parts - 1))])
    return [0] + inner[: parts - 1] + [n]


@pytest.mark.parametrize("axes", [0, (0, 2), (0, 1, 2)])
def test_parts_merge_into_the_whole(rng, axes):
    x = make_input(rng, (40, 6, 11), F32, loc=30.0, scale=0.3)
    ax = normalize_axes(axes, 3)
    cuts = _cuts(rng, 40, 7)  # along axis 0, which every case reduces
    parts = [x[a:b] for a, b in zip(cuts, cuts[1:])]
    assert any(p.shape[0] == 0 for p in parts) or any(p.shape[0] == 1 for p in parts)
    if 2 in ax:  # and along axis 2 of the first piece
        p0 = parts.pop(0)
        parts = [p0[:, :, :4], p0[:, :, 4:]] + parts
    merged = simdnorm.merge_moments(simdnorm.moments(p, axes) for p in parts)
    check(merged, x, axes)
    whole = simdnorm.moments(x, axes)
    np.testing.assert_allclose(merged.mean, whole.mean, rtol=1e-14)
    np.testing.assert_allclose(merged.m2, whole.m2, rtol=1e-11)


def test_merge_is_in_a_fixed_order(rng):
    ms = [simdnorm.moments(make_input(rng, (n, 3), F32, loc=5.0), 0) for n in (4, 1, 7, 2, 9)]
    a, b, c, d, e = ms
    want = a.merge(b).merge(c.merge(d)).merge(e)
    for _ in range(2):
        got = simdnorm.merge_moments(ms)
        for g, w in zip(got, want):
            assert (bits(g) == bits(w)).all()
    # merging never changes its operands
    again = simdnorm.merge_moments(ms)
    assert all((bits(g) == bits(w)).all() for g, w in zip(again, want))


def test_count_zero_is_the_identity(rng):
    x = make_input(rng, (9, 4), F32, loc=2.0)
    m = simdnorm.moments(x, 0)
    for empty in (simdnorm.Moments(0, np.nan, np.inf), simdnorm.moments(x[:0], 0)):
        for got in (m.merge(empty), empty.merge(m), simdnorm.merge_moments([empty, m, empty])):
            for g, w in zip(got, m):
                assert (bits(g) == bits(w)).all()
    nothing = simdnorm.moments(x[:0], 0)
    assert nothing.count.tolist() == [[0.0] * 4] and (nothing.mean == 0).all() and (nothing.m2 == 0).all()
    assert np.isnan(nothing.variance()).all() and np.isnan(nothing.inv_std()).all()
    both = nothing.merge(simdnorm.Moments(0, 0.0, 0.0))
    assert (both.count == 0).all() and np.isnan(both.variance()).all()


def test_large_mean_in_many_parts_keeps_its_variance(rng):
    # the data: (8192, 1024) float32 of mean 1000 and std 0.01, in 64 parts of 128 rows
    x = (1000.0 + 0.01 * rng.standard_normal((8192, 1024))).astype(F32)
    count, _, m2 = reference(x, (0, 1))
    truth = float(m2.ravel()[0]) / count
    merged = simdnorm.merge_moments(simdnorm.moments(x[i:i + 128], (0, 1)) for i in range(0, 8192, 128))
    err = abs(float(merged.variance().ravel()[0]) / truth - 1)
    assert err < 1e-10, err
    # what the test guards against: float32 sums of squares, E[x^2] - E[x]^2, are far off here
    naive = np.mean(x * x, dtype=F32) - np.mean(x, dtype=F32) ** 2
    assert abs(float(naive) / truth - 1) > 1e-2


def test_variance_and_inv_std(rng):
    x = make_input(rng, (7, 5), F64, loc=1.0)
    m = simdnorm.moments(x, 0)
    for ddof in (0, 1, 2.5):
        np.testing.assert_allclose(m.variance(ddof), np.var(x, axis=0, ddof=ddof, keepdims=True), rtol=1e-13)
    assert np.isnan(m.variance(7)).all() and np.isnan(m.variance(9)).all()
    var = np.var(x, axis=0, keepdims=True)
    np.testing.assert_allclose(m.inv_std(), 1 / np.sqrt(var + 1e-5), rtol=1e-13)
    np.testing.assert_allclose(m.inv_std(0.5, "outside"), 1 / (np.sqrt(var) + 0.5), rtol=1e-13)
    flat = simdnorm.moments(np.full((4, 2), 3.0, F32), 0)
    assert (flat.m2 == 0).all() and np.isinf(flat.inv_std(0.0)).all() and (flat.inv_std(0.0, "outside") > 0).all()


def test_nan_and_inf_stay_in_their_group(rng):
    x = make_input(rng, (6, 3), F32)
    x[2, 1] = np.nan
    x[4, 2] = np.inf
    m = simdnorm.moments(x, 0)
    assert np.isfinite(m.mean[0, 0]) and np.isfinite(m.m2[0, 0])
    assert np.isnan(m.mean[0, 1:]).all() and np.isnan(m.m2[0, 1:]).all()


def test_bitwise_the_same_on_any_number_of_threads(rng, threads):
    rows = make_input(rng, (64, 70000), F32, loc=9.0)
    cols = make_input(rng, (4000, 900), F32, loc=9.0)
    cases = [(rows, 1), (rows, (0, 1)), (cols, 0)]
    threads(1)
    one = [simdnorm.moments(x, a) for x, a in cases]
    threads(2)
    two = [simdnorm.moments(x, a) for x, a in cases]
    with _runtime.caller_threads(1):
        scoped = [simdnorm.moments(x, a) for x, a in cases]
    for a, b, c in zip(one, two, scoped):
        for u, v, w in zip(a, b, c):
            assert (bits(u) == bits(v)).all() and (bits(u) == bits(w)).all()


def test_caller_threads_scope_one_thread_only(threads):
    threads(2)
    seen = {}
    inside = threading.Event()
    release = threading.Event()

    def other():
        inside.wait(10)
        seen["other"] = _core.caller_threads()
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with _runtime.caller_threads(1):
        assert _core.caller_threads() == 1 and simdnorm.get_num_threads() == 2
        with _runtime.caller_threads(3):
            assert _core.caller_threads() == 3
        assert _core.caller_threads() == 1
        inside.set()
        release.wait(10)
    t.join()
    assert seen["other"] == 2  # another thread keeps the global count
    assert _core.caller_threads() == 2 and simdnorm.get_num_threads() == 2
    for bad, err in ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(err):
            with _runtime.caller_threads(bad):
                pass
    assert _core.caller_threads() == 2
    # a count above the pool's: the pool grows to it, and the result is the same bits
    x = make_input(np.random.default_rng(5), (8, 200000), F32, loc=1.0)
    want = simdnorm.moments(x, 1)
    with _runtime.caller_threads(4):
        got = simdnorm.moments(x, 1)
        y = simdnorm.layer_norm(x)
    assert all((bits(g) == bits(w)).all() for g, w in zip(got, want))
    assert (bits(y) == bits(simdnorm.layer_norm(x))).all()


def test_moments_pickle_and_unpack(rng):
    m = simdnorm.moments(make_input(rng, (5, 4), F32), 1)
    count, mean, m2 = m
    back = pickle.loads(pickle.dumps(m))
    assert all((bits(a) == bits(b)).all() for a, b in zip(back, m))
    assert back.shape == mean.shape == (5, 1) and "Moments(count=" in repr(m)
    own = simdnorm.Moments(count, mean, m2)
    own.mean[0, 0] += 1  # a Moments owns copies of what it is given
    assert own.mean[0, 0] != mean[0, 0]


def test_errors_name_the_argument_and_rule():
    x = np.ones((3, 4), F32)
    with pytest.raises(TypeError, match="int32"):
        simdnorm.moments(np.ones((3, 4), np.int32), 0)
    with pytest.raises(AxisError):
        simdnorm.moments(x, 2)
    with pytest.raises(ValueError, match="axes"):
        simdnorm.moments(x, (0, 0))
    with pytest.raises(TypeError, match="axes"):
        simdnorm.moments(x, 0.5)
    with pytest.raises(ValueError):
        simdnorm.moments(np.float32(1.0), 0)
    lazy = type("Array", (), {"__module__": "dask.array.core"})()
    with pytest.raises(TypeError, match="simdnorm.dask"):
        simdnorm.moments(lazy, 0)
    m = simdnorm.moments(x, 0)
    with pytest.raises(ValueError, match="broadcast"):
        simdnorm.Moments(np.ones(3), np.ones(4), np.ones(4))
    with pytest.raises(ValueError, match="count"):
        simdnorm.Moments(-1, 0.0, 0.0)
    with pytest.raises(TypeError, match="float64"):
        simdnorm.Moments("a", 0.0, 0.0)
    with pytest.raises(TypeError, match="Moments"):
        m.merge((1, 2, 3))
    with pytest.raises(ValueError, match="broadcast"):
        m.merge(simdnorm.moments(np.ones((3, 5), F32), 0))
    cube = np.ones((4, 6, 5), F32)  # (1, 6, 1) and (1, 1, 5): groups of other axes, whose shapes broadcast
    with pytest.raises(ValueError, match="different axes"):
        simdnorm.moments(cube, (0, 2)).merge(simdnorm.moments(cube, (0, 1)))
    with pytest.raises(ValueError, match="different axes"):
        simdnorm.merge_moments([simdnorm.moments(cube, (0, 1)), simdnorm.moments(cube, (0, 2))])
    with pytest.raises(ValueError, match="at least one"):
        simdnorm.merge_moments([])
    with pytest.raises(TypeError, match="item 1"):
        simdnorm.merge_moments([m, 3])
    with pytest.raises(ValueError, match="ddof"):
        m.variance(-1)
    with pytest.raises(TypeError, match="ddof"):
        m.variance("1")
    with pytest.raises(ValueError, match="epsilon"):
        m.inv_std(-1.0)
    with pytest.raises(ValueError, match="epsilon_mode"):
        m.inv_std(1e-5, "middle")


def test_float64_past_the_range_of_squares(rng):
    # documented: squared deviations past double's range give an infinite m2 (merging them warns of
    # nothing); the mean stays exact
    x = rng.standard_normal((8, 3)) * 1e200
    parts = [simdnorm.moments(x[:4], 0), simdnorm.moments(x[4:], 0)]
    merged = simdnorm.merge_moments(parts)
    assert np.isinf(merged.m2).all()
    np.testing.assert_allclose(merged.mean, x.mean(axis=0, keepdims=True), rtol=1e-14)
