"""Accuracy of the statistics (SPEC §3, DESIGN "Mean-variance normalization"): data with a large mean
(|mean|/std from 1e2 to 1e4), constant groups, float32 values near 1e30 and near the largest float,
data whose squares underflow (float32 near 2^-90, float64 near 2^-560) or whose variance leaves
double's range (float64 near 2^900) with epsilon 0, reductions of 10^6 elements, and 1 vs 2 threads
bitwise equal for every MVN strategy (rows, columns, large groups); batch norm's folded
coefficients: exact bias at x == mean, and parameters too far apart to fold."""

from __future__ import annotations

import numpy as np
import pytest

import simdnorm
from cases import bits, channels_last_nhwc
from reference import BF16, F16, F32, F64, check_bn, check_mvn, check_stats, dtype_id, f64, group_norm_ref, mvn_terms

mvn = simdnorm.mean_variance_normalization
EPS32 = float(np.finfo(np.float32).eps)


def assert_abs_close(got, ref, tol, context=""):
    g = np.asarray(got).astype(np.float64)
    err = np.abs(g - ref)
    bad = ~(err <= tol)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(np.isnan(err), np.inf, err)), err.shape)
        raise AssertionError(f"{int(bad.sum())} of {g.size} off; worst at {i}: got {g[i]!r} ref {ref[i]!r} "
                             f"(tolerance {tol:.3g}) {context}")


# ----------------------------------------------------------------------------------------------
# large mean: E[x^2] - E[x]^2 in float32 would be off by ~1e3 at mean 1e4, std 1
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [1e2, 1e3, 1e4])
@pytest.mark.parametrize("strategy", ["rows", "columns", "all"])
def test_large_mean_float32(rng, threads, ratio, strategy):
    sign = -1.0 if ratio == 1e3 else 1.0
    if strategy == "rows":
        shape, axes = (16, 3000), (1,)
    elif strategy == "columns":
        shape, axes = (3000, 16), (0,)
    else:
        shape, axes = (4, 5, 700), (0, 1, 2)
    x = (sign * ratio + rng.normal(0.0, 1.0, size=shape)).astype(np.float32)
    ref_z, _, ref_mean, ref_inv = mvn_terms(x, axes)
    for n in (1, 2):
        threads(n)
        y, m, inv = mvn(x, axes, return_stats=True)
        # the normalized values: float32 x minus a mean accurate to an ulp or so of |mean|
        assert_abs_close(y, ref_z, 1e-5 + 4e-7 * ratio, context=f"{strategy} ratio={ratio} threads={n}")
        check_stats((m, inv), x, axes, ref_mean, ref_inv, inv_rtol=1e-5 + 4e-7 * ratio,
                    context=f"{strategy} ratio={ratio}")
        # the mean itself to a few ulp of |mean| (plus a little of the standard deviation)
        assert_abs_close(m, ref_mean, 4 * EPS32 * ratio + 1e-5, context="mean")


@pytest.mark.parametrize("ratio", [1e2, 1e4, 1e8])
def test_large_mean_float64(rng, ratio):
    x = ratio + rng.normal(0.0, 1.0, size=(8, 5000))
    ref_z, _, ref_mean, ref_inv = mvn_terms(x, 1)
    y, m, inv = mvn(x, 1, return_stats=True)
    assert_abs_close(y, ref_z, 1e-11 + 1e-15 * ratio, context=f"ratio={ratio}")
    np.testing.assert_allclose(inv, ref_inv, rtol=1e-10 + 1e-15 * ratio)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
def test_large_mean_half_inputs(rng, dtype):
    # float16/bfloat16 data with mean 100, std 1 (as represented): statistics in float32
    x = (100.0 + rng.normal(0.0, 1.0, size=(8, 4000))).astype(dtype)
    y, m, inv = mvn(x, 1, return_stats=True)
    check_mvn(y, x, 1, stats=(m, inv), stat_rtol=1e-4)


@pytest.mark.parametrize("ratio", [1e1, 1e2, 1e3])
@pytest.mark.parametrize("n", [200, 768, 1024])
def test_float16_rows_shift_folded(rng, threads, ratio, n):
    # float16 rows of up to 1024 elements are normalized from their float32 copy as
    # fma(fma(x, inv_std, -(mean * inv_std)), scale, bias) (kernels/fused_rows.h): -(mean * inv_std)
    # is rounded once more than (x - mean) * inv_std would be, by at most 2^-24 |mean| inv_std.
    x = (ratio + rng.normal(0.0, 1.0, size=(9, n))).astype(F16)
    x[4] = x[4, 0]  # a constant row: bias, up to that rounding amplified by 1/sqrt(epsilon)
    scale = rng.uniform(0.5, 2.0, n).astype(F16)
    bias = rng.normal(0.0, 1.0, n).astype(F16)
    from simdnorm import _core
    plan = _core.explain_mvn(x, (1,), scale, bias, np.empty_like(x), 1e-5, True, True, False, (0, 0.0, 0.0), None,
                             None, -1, False)
    assert plan.startswith(f"rows groups=9 lanes=1 group_size={n} fused pipeline "), plan
    z, _, mean, inv = mvn_terms(x, 1, scale, bias)
    for t in (1, 2):
        threads(t)
        out = np.full_like(x, np.nan)
        y, m, i = simdnorm.layer_norm(x, scale, bias, out=out, return_stats=True)
        assert y is out
        check_mvn(y, x, 1, scale, bias, stats=(m, i), stat_rtol=1e-4)
        # tighter than check_mvn's model: the output's rounding (half an ulp of float16, with room
        # for float16's subnormal spacing), plus a few float32 roundings of |mean| inv_std |scale|
        err = np.abs(y.astype(np.float64) - z)
        tol = (2.0**-11 * np.abs(z) + 2.0**-25 + 6 * 2.0**-24 * (np.abs(mean) + 1.0) * inv * np.abs(f64(scale))
               + 2.0**-24 * np.abs(f64(bias)))
        bad = ~(err <= tol)
        assert not bad.any(), f"{int(bad.sum())} off; worst {float(np.max(err - tol))} (ratio {ratio}, n {n})"


@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("n", [768, 1024])
def test_16bit_row_stream_pivots(rng, threads, dtype, n):
    # The 16-bit row stream sums a row around 0 when its first vector spreads as far from its
    # first element as that is from 0, and around the first element otherwise (kernels/fused_rows.h,
    # pivot_of). A row whose mean turns out to be more than 8 standard deviations from 0 is summed
    # again: rows 2, 3 and 7 pick 0 (first element 0 or 400 with the rest near 1000, or -3000 with
    # a 0 among the first 16: mean/std 27-53). With that second pass disabled (a throwaway build),
    # inv_std came out off by up to 1.4e-4 (n = 768) and 1.9e-4 (n = 1024).
    x = rng.normal(0.3, 1.0, size=(12, n))
    x[1] += 5.0
    x[1, 1] = -20.0  # pivot 0, the mean within 5 standard deviations of it: settled by the first pass
    x[2] = 1000.0 + rng.normal(0.0, 1.0, n)
    x[2, 0] = 0.0
    x[3] = 1000.0 + rng.normal(0.0, 1.0, n)
    x[3, 0] = 400.0
    x[4] = 1000.0 + rng.normal(0.0, 1.0, n)  # pivot at the first element
    x[5] = 0.0
    x[6] = 2.5
    x[7] = -3000.0 + rng.normal(0.0, 1.0, n)
    x[7, 5] = 0.0
    x = x.astype(dtype)
    scale = rng.uniform(0.5, 2.0, n).astype(np.float32)
    bias = rng.normal(0.0, 1.0, n).astype(np.float32)
    z, _, mean, inv = mvn_terms(x, 1, scale, bias)
    for t in (1, 2):
        threads(t)
        out = np.full_like(x, np.nan)
        y, m, i = simdnorm.layer_norm(x, scale, bias, out=out, return_stats=True)
        check_mvn(y, x, 1, scale, bias)
        check_stats((m, i), x, 1, mean, inv, stat_rtol=1e-6, inv_rtol=1e-5, context=f"threads={t}")


# ----------------------------------------------------------------------------------------------
# constant groups: variance 0, finite output equal to bias (with epsilon > 0)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.1, 3.7, -1234.5, 1e4])
@pytest.mark.parametrize("n", [1, 7, 1000, 100003])
def test_constant_rows(value, n):
    x = np.full((3, n), value, dtype=np.float32)
    scale = np.float32(1.5)
    bias = np.array([[0.25], [-2.0], [7.0]], np.float32)
    eps = 1e-5
    y, m, inv = mvn(x, 1, np.full((1,), scale, np.float32), bias, epsilon=eps, return_stats=True)
    assert np.isfinite(y).all()
    # allowed: the mean off by at most 2 ulp of the value, amplified by scale / sqrt(eps)
    tol = 2 * float(np.spacing(np.float32(abs(value)))) * float(scale) / np.sqrt(eps)
    assert_abs_close(y, np.broadcast_to(bias.astype(np.float64), y.shape), tol, context=f"value={value} n={n}")
    assert_abs_close(m, np.full((3, 1), float(np.float32(value))), 2 * float(np.spacing(np.float32(abs(value)))))
    np.testing.assert_allclose(inv, 1.0 / np.sqrt(eps), rtol=1e-3)


def test_constant_columns_and_outside_mode():
    x = np.full((5000, 8), -3.3, np.float32)
    y = mvn(x, 0, bias=np.arange(8, dtype=np.float32), epsilon=1e-3, epsilon_mode="outside")
    assert np.isfinite(y).all()
    assert_abs_close(y, np.broadcast_to(np.arange(8.0), y.shape), 2 * float(np.spacing(np.float32(3.3))) / 1e-3)


# ----------------------------------------------------------------------------------------------
# float32 values near 1e30: squares overflow float32
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["offset", "centered"])
@pytest.mark.parametrize("axes", [(1,), (0,)], ids=str)
def test_float32_near_1e30(rng, kind, axes):
    if kind == "offset":
        x = (1e30 * (1.0 + 0.1 * rng.normal(size=(40, 1000)))).astype(np.float32)
    else:
        x = (1e30 * rng.normal(size=(40, 1000))).astype(np.float32)
    if axes == (0,):
        x = np.ascontiguousarray(x.T)
    ref_z, _, ref_mean, ref_inv = mvn_terms(x, axes)
    y, m, inv = mvn(x, axes, return_stats=True)
    assert np.isfinite(y).all() and np.isfinite(m).all() and (inv > 0).all()
    assert_abs_close(y, ref_z, 1e-4, context=kind)
    check_stats((m, inv), x, axes, ref_mean, ref_inv, stat_rtol=1e-5)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
@pytest.mark.parametrize("layout", ["rows", "strided_rows", "columns"])
def test_values_near_the_largest_float(isa, rng, dtype, layout):
    """Each group's first element (its pivot) ~2.7e38 and its second ~-2.7e38: their difference
    overflows float32 (and bfloat16), not only the squares. The statistics and the output stay
    finite and right (float64 reference). (The means stay near 0, so that x - mean does not
    overflow: the normalization takes x - mean in float32, as numpy's float32 arithmetic would.)"""
    big = float(np.finfo(np.float32).max) / 1.25
    x = big * np.clip(rng.normal(size=(40, 1000)), -1.0, 1.0)
    x[:, 0], x[:, 1] = big, -big
    x = x.astype(dtype)
    axes = (1,)
    if layout == "strided_rows":
        x = np.repeat(x, 2, axis=1)[:, ::2]
    elif layout == "columns":
        x, axes = np.ascontiguousarray(x.T), (0,)
    y, m, inv = mvn(x, axes, return_stats=True)
    assert np.isfinite(y.astype(np.float64)).all() and np.isfinite(m).all() and (inv > 0).all()
    check_mvn(y, x, axes, stats=(m, inv), context=f"{dtype_id(dtype)} {layout}")


# Data far from 1 with epsilon 0, where the variance is all there is: float32 and bfloat16 near
# 2^-90 (their squares underflow a float: the variance came out 0 or far too small), float64 near
# 2^-560 (squares underflow a double) and near 2^900 (squares overflow it, and so does the variance
# itself: 1 / std came out 0 and the output all zero, or NaN). With epsilon 0 the output does not
# change with the data's scale, so the reference is the float64 one of the data scaled back (a power
# of two: exact), and the statistics are its own scaled.
_FAR_FROM_ONE = {"f32-tiny": (F32, 2.0**-90), "bf16-tiny": (BF16, 2.0**-90), "f64-tiny": (F64, 2.0**-560),
                 "f64-huge": (F64, 2.0**900)}


@pytest.mark.parametrize("case", list(_FAR_FROM_ONE))
@pytest.mark.parametrize("layout", ["rows", "strided_rows", "columns"])
@pytest.mark.parametrize("mode", ["inside", "outside", "rms"])
def test_statistics_of_data_far_from_one(isa, rng, case, layout, mode):
    dtype, factor = _FAR_FROM_ONE[case]
    base = (3.0 + rng.normal(size=(40, 1000))).astype(dtype)
    x = (f64(base) * factor).astype(dtype)
    axes = (1,)
    if layout == "strided_rows":
        x, base = np.repeat(x, 2, axis=1)[:, ::2], np.repeat(base, 2, axis=1)[:, ::2]
    elif layout == "columns":
        x, base, axes = np.ascontiguousarray(x.T), np.ascontiguousarray(base.T), (0,)
    kw = dict(epsilon=0.0, epsilon_mode="outside" if mode == "outside" else "inside",
              normalize_mean=mode != "rms")
    y, m, inv = mvn(x, axes, return_stats=True, **kw)
    ct = F64 if dtype == F64 else F32
    stats = (None if m is None else (f64(m) / factor).astype(ct), (f64(inv) * factor).astype(ct))
    check_mvn(y, base, axes, stats=stats, context=f"{case} {layout} {mode}", **kw)


@pytest.mark.parametrize("case", list(_FAR_FROM_ONE))
def test_group_norm_channels_last_far_from_one(isa, rng, case):
    """The columns path with lanes combined into groups (channels-last group norm), the lanes' own
    variances past double's range for float64."""
    dtype, factor = _FAR_FROM_ONE[case]
    base = channels_last_nhwc(rng, (2, 32, 9, 9), dtype)
    x = (f64(base) * factor).astype(dtype)
    y, m, inv = simdnorm.group_norm(x, 4, epsilon=0.0, channel_axis=-1, return_stats=True)
    ref, ref_mean, ref_inv = group_norm_ref(base, 4, epsilon=0.0, channel_axis=-1)
    assert_abs_close(y, ref, 1e-10 if dtype == F64 else 2e-2 if dtype == BF16 else 1e-4, context=case)
    np.testing.assert_allclose(f64(m) / factor, ref_mean, rtol=1e-5, atol=1e-5 * np.abs(ref_mean).max())
    np.testing.assert_allclose(f64(inv) * factor, ref_inv, rtol=2e-5)


def test_group_norm_channels_last_means_far_apart():
    """float64 lanes each near constant, +-2^700 apart within a group: each lane's variance is in
    range, the spread of their means is not (it overflowed to inf: 1 / std 0, the output all 0)."""
    rng = np.random.default_rng(11)
    base = rng.normal(size=(2, 5, 5, 8)) * 1e-3 + np.where(np.arange(8) % 2, 1.0, -1.0)
    x = base * 2.0**700
    y, m, inv = simdnorm.group_norm(x, 2, epsilon=0.0, channel_axis=-1, return_stats=True)
    ref, ref_mean, ref_inv = group_norm_ref(base, 2, epsilon=0.0, channel_axis=-1)
    assert_abs_close(y, ref, 1e-10)
    np.testing.assert_allclose(inv * 2.0**700, ref_inv, rtol=1e-10)


# ----------------------------------------------------------------------------------------------
# the columns path finishes a task's lanes together (a kernel over all of them), and sums again
# only the lanes whose first pass does not settle them: those must not disturb their neighbours
# ----------------------------------------------------------------------------------------------


def _mixed_lanes(rng, dtype, rows, lanes):
    x = (3.0 + rng.normal(size=(rows, lanes))).astype(dtype)
    x[0, 3] = 5000.0            # lane 3: its pivot (first element) far from its mean: summed again
    x[:, 5] = 7.25              # lane 5: constant
    x[:, 8] = rng.normal(size=rows) * 100 + (2e4 if dtype == F16 else 1e6)  # lane 8: large mean
    x[2, 11] = np.inf           # lane 11: statistics NaN
    if dtype != F16:
        x[:, 13] = (1e30 * (1.0 + 0.1 * rng.normal(size=rows))).astype(dtype)  # lane 13: squares overflow
        x[0, 14] = -1e30        # lane 14: overflows and is far from its pivot
    return x


@pytest.mark.parametrize("dtype", [F32, F16, F64], ids=dtype_id)
@pytest.mark.parametrize("variant", ["default", "outside", "no_mean", "no_variance"])
def test_columns_lanes_settled_apart(isa, rng, threads, dtype, variant):
    rows, lanes = 37, 1000  # one task of 1000 lanes (group size 37)
    x = _mixed_lanes(rng, dtype, rows, lanes)
    kw = dict(epsilon=1e-3)
    if variant == "outside":
        kw["epsilon_mode"] = "outside"
    elif variant == "no_mean":
        kw["normalize_mean"] = False
    elif variant == "no_variance":
        kw["normalize_variance"] = False
    from simdnorm import _core
    plan = _core.explain_mvn(x, (0,), None, None, np.empty_like(x), kw["epsilon"], variant != "no_mean",
                             variant != "no_variance", variant == "outside", (0, 0.0, 0.0), None, None, -1, False)
    assert plan.startswith(f"columns groups=1 lanes={lanes} group_size={rows} lanes_per_task={lanes} "), plan
    results = []
    for n in (1, 2):
        threads(n)
        out = np.full_like(x, np.nan)
        results.append(mvn(x, 0, out=out, return_stats=True, **kw))
    _assert_bitwise(results[0], results[1], f"{dtype_id(dtype)} {variant}")
    y, m, inv = results[1]
    bad = np.zeros(lanes, bool)
    bad[11] = True  # the inf lane: NaN statistics; everything else as if it were alone
    if variant in ("default", "outside"):
        assert np.isnan(y[:, 11]).all() and np.isnan(m[0, 11]) and np.isnan(inv[0, 11])
    ok = ~bad
    check_mvn(y[:, ok], x[:, ok], 0, stats=(None if m is None else m[:, ok], None if inv is None else inv[:, ok]),
              normalize_mean=variant != "no_mean", normalize_variance=variant != "no_variance",
              epsilon=1e-3, epsilon_mode="outside" if variant == "outside" else "inside", context=variant)


# A few rows (batch norm training of (N, C) data) are finished and normalized by one kernel, chunk
# by chunk; from a lane it cannot settle on, the task's lanes take the passes above. Each lane's
# results are its own: a lane beside one that the kernel leaves has the bits it has when the
# kernel takes the whole task, and an output the kernel does not take (lanes reversed) gets the
# same bits.
@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("variant", ["default", "outside", "no_mean", "no_variance"])
def test_columns_few_rows_fused_and_left(isa, rng, threads, dtype, variant):
    from simdnorm import _core
    rows, lanes = 12, 5000  # three tasks of lanes (2048, 2048 and 904)
    kw = dict(epsilon=1e-3, normalize_mean=variant != "no_mean", normalize_variance=variant != "no_variance",
              epsilon_mode="outside" if variant == "outside" else "inside")
    clean = (3.0 + rng.normal(size=(rows, lanes))).astype(dtype)
    clean[:, 700] = 7.25  # a constant lane
    mixed = clean.copy()
    left = [11, 2100]  # lanes the kernel leaves (each task's rest taken by the passes)
    mixed[2, 11] = np.inf
    mixed[5, 2100] = np.nan
    if dtype == F64:  # squares overflow: summed again scaled down
        mixed[:, 300] = 1e200 * (1.0 + 0.1 * rng.normal(size=rows))
        left.append(300)
    plan = _core.explain_mvn(mixed, (0,), None, None, np.empty_like(mixed), 1e-3, kw["normalize_mean"],
                             kw["normalize_variance"], variant == "outside", (0, 0.0, 0.0), None, None, -1, False)
    assert plan.startswith(f"columns groups=1 lanes={lanes} group_size={rows} fused_columns lanes_per_task=2048 "), plan
    results = []
    for n in (1, 2):
        threads(n)
        results.append(mvn(mixed, 0, out=np.full_like(mixed, np.nan), return_stats=True, **kw))
    _assert_bitwise(results[0], results[1], f"{dtype_id(dtype)} {variant}")
    reversed_out = np.full_like(mixed, np.nan)[:, ::-1]
    plan = _core.explain_mvn(mixed, (0,), None, None, reversed_out, 1e-3, kw["normalize_mean"],
                             kw["normalize_variance"], variant == "outside", (0, 0.0, 0.0), None, None, -1, False)
    assert "fused_columns" not in plan, plan
    _assert_bitwise(results[1], mvn(mixed, 0, out=reversed_out, return_stats=True, **kw), "reversed output")
    whole = mvn(clean, 0, out=np.full_like(clean, np.nan), return_stats=True, **kw)
    ok = np.ones(lanes, bool)
    ok[left] = False
    for got, want in zip(results[1], whole):
        if got is not None:
            np.testing.assert_array_equal(bits(got[..., ok]), bits(want[..., ok]), err_msg=variant)
    y, m, inv = results[1]
    if variant in ("default", "outside"):
        assert np.isnan(y[:, [11, 2100]]).all() and np.isnan(m[0, [11, 2100]]).all()
    check_mvn(y[:, ok], clean[:, ok], 0, stats=(None if m is None else m[:, ok], None if inv is None else inv[:, ok]),
              context=variant, **kw)
    if dtype == F64 and variant != "no_variance":  # (the reference's squares overflow: scaled, epsilon 0)
        check_mvn(y[:, [300]], mixed[:, [300]] / 1e200, 0, normalize_mean=variant != "no_mean", epsilon=0.0,
                  epsilon_mode=kw["epsilon_mode"], context=variant)


# Float32 1 / std and scale / std are the float32 rounding of the double arithmetic,
# fl32(s * fl(1 / fl(sqrt(v + eps)))), bit for bit, in every path (batch norm's compact float32 fold,
# the fused columns kernel, the passes). The hardest lanes are ties, whose float64 quotient is
# exactly halfway between two float32s: any shortcut a double's last bit off (an estimate refined
# by Newton's steps, say) rounds them the other way. These were found by a search over every
# float32 in [1, 2) (or [1, 4)) beside a few hundred drawn variances or epsilons; each test checks
# that they are ties.
_TIES_SCALED = [(2.3613369464874268, 1.9707270860671997), (2.9261462688446045, 1.0079200267791748),
                (2.6529319286346436, 1.638656735420227), (1.2229810953140259, 1.4138774871826172),
                (2.2079296112060547, 1.8167874813079834), (2.9103803634643555, 1.7794923782348633),
                (3.301997184753418, 1.239004135131836)]  # (variance, scale), epsilon 1e-5
_TIES_UNSCALED = [(1.50210702419281, 0.00438304478302598), (2.2522900104522705, 0.00438304478302598),
                  (1.5896726846694946, 0.007958178408443928), (1.5931094884872437, 0.004521374590694904),
                  (2.871015787124634, 0.0029638514388352633), (1.0129542350769043, 0.009077716618776321)]
# (d, epsilon): rows (0, d) have the variance (d / 2)^2 exactly
_TIES_FEW_ROWS = [(1.209376335144043, 0.007312749046832323), (2.6081674098968506, 0.0011349812848493457),
                  (1.303229570388794, 0.0009604694205336273), (3.521681547164917, 0.006958675105124712),
                  (3.8095057010650635, 0.0074775200337171555), (1.713051676750183, 0.004383407533168793)]


def _assert_ties(quotient):
    """Each float64 quotient is exactly the midpoint of two adjacent float32s."""
    f = quotient.astype(F32)
    other = np.nextafter(f, np.where(quotient > f, np.inf, -np.inf).astype(F32))
    np.testing.assert_array_equal(quotient, (f.astype(F64) + other.astype(F64)) / 2)


def _tie_places(rng, ordinary, ties):
    """Where `ties` lanes go among `ordinary` others (sorted places in the whole)."""
    return np.sort(rng.choice(ordinary + ties, ties, replace=False))


def _with_ties(ordinary, ties, at):
    """The ordinary lanes with the ties put in at places `at`."""
    return np.insert(ordinary, at - np.arange(len(at)), ties)


def _scale_over_std(var, scale, eps):
    return (1.0 if scale is None else scale.astype(F64)) * (1.0 / np.sqrt(var.astype(F64) + eps))


def test_float32_scale_over_std_at_rounding_ties(isa, rng):
    scaled = tuple(np.array(t, F32) for t in zip(*_TIES_SCALED)) + (1e-5,)
    for tie_var, tie_scale, eps in [scaled] + [(np.array([v], F32), None, eps) for v, eps in _TIES_UNSCALED]:
        _assert_ties(_scale_over_std(tie_var, tie_scale, eps))
        n = int(rng.integers(20, 300))
        at = _tie_places(rng, n, tie_var.size)
        var = _with_ties(rng.uniform(0.25, 4.0, n).astype(F32), tie_var, at)
        scale = None if tie_scale is None else _with_ties(rng.uniform(0.5, 2.0, n).astype(F32), tie_scale, at)
        # x - mean = 1 and no bias: each output is its channel's folded multiplier
        x = np.ones((2, var.size), F32)
        got = simdnorm.batch_normalization(x, np.zeros(var.size, F32), var, scale, None, epsilon=eps)
        want = _scale_over_std(var, scale, eps).astype(F32)
        np.testing.assert_array_equal(bits(got), bits(np.broadcast_to(want, x.shape)), err_msg=f"ties at {at}")


def test_columns_few_rows_float32_inv_std_at_rounding_ties(isa, rng, threads):
    from simdnorm import _core

    for tie_d, eps in _TIES_FEW_ROWS:
        n = int(rng.integers(300, 600))
        at = _tie_places(rng, n, 1)
        d = _with_ties(rng.uniform(0.5, 4.0, n).astype(F32), [tie_d], at)
        d64 = d.astype(F64)
        want = 1.0 / np.sqrt(d64 * d64 / 4 + eps)
        _assert_ties(want[at])
        want = want.astype(F32)
        x = np.stack([np.zeros_like(d), d])
        plan = _core.explain_mvn(x, (0,), None, None, np.empty_like(x), eps, True, True, False, (0, 0.0, 0.0), None,
                                 None, -1, False)
        assert " fused_columns " in plan, plan
        results = []
        for n in (1, 2):
            threads(n)
            results.append(mvn(x, 0, epsilon=eps, out=np.full_like(x, np.nan), return_stats=True))
        _assert_bitwise(results[0], results[1], f"tie at {at}")
        y, mean, inv = results[1]
        np.testing.assert_array_equal(bits(inv[0]), bits(want), err_msg=f"tie at {at}")
        np.testing.assert_array_equal(bits(mean[0]), bits(d / 2))
        np.testing.assert_array_equal(bits(y), bits(np.stack([-d / 2 * want, d / 2 * want])))
        reversed_out = np.full_like(x, np.nan)[:, ::-1]  # (the passes: 1 / std in double, then rounded)
        _assert_bitwise(results[1], mvn(x, 0, epsilon=eps, out=reversed_out, return_stats=True), "reversed output")


# Tasks of whole rows (columns longer than the L2 holds: channels-last batch norm's statistics) are
# summed in chunks of rows fixed by the shape, the chunks over all threads, added in order. Rows
# of a sliced view (the reduced dims do not merge), so the chunks cut through the outer dim; the
# lanes of _mixed_lanes, the settled-apart ones summed again; statistics only too (moments).
@pytest.mark.parametrize("dtype", [F32, F16, F64], ids=dtype_id)
def test_columns_whole_rows_summed_in_chunks(isa, rng, threads, dtype):
    from simdnorm import _core
    outer, rows, lanes = 9, 4000, 32
    x = _mixed_lanes(rng, dtype, outer * (rows + 1), lanes).reshape(outer, rows + 1, lanes)[:, :rows]
    plan = _core.explain_mvn(x, (0, 1), None, None, np.empty_like(x), 1e-3, True, True, False, (0, 0.0, 0.0),
                             None, None, -1, False)
    assert plan.startswith(f"columns groups=1 lanes={lanes} group_size={outer * rows} lanes_per_task={lanes} "), plan
    results, moments = [], []
    for n in (1, 2):
        threads(n)
        out = np.full_like(x, np.nan)
        results.append(mvn(x, (0, 1), out=out, return_stats=True, epsilon=1e-3))
        m = simdnorm.moments(x, (0, 1))
        moments.append((m.mean, m.m2))
    _assert_bitwise(results[0], results[1], dtype_id(dtype))
    _assert_bitwise(moments[0], moments[1], f"moments {dtype_id(dtype)}")
    y, m, inv = results[1]
    assert np.isnan(y[..., 11]).all() and np.isnan(m[..., 11]).all() and np.isnan(inv[..., 11]).all()
    ok = np.arange(lanes) != 11
    check_mvn(y[..., ok], x[..., ok], (0, 1), stats=(m[..., ok], inv[..., ok]), epsilon=1e-3)
    ref = x[..., ok].astype(np.float64)
    np.testing.assert_allclose(moments[1][0][..., ok], ref.mean(axis=(0, 1), keepdims=True), rtol=1e-10)
    np.testing.assert_allclose(moments[1][1][..., ok] / (outer * rows), ref.var(axis=(0, 1), keepdims=True),
                               rtol=1e-9)


# ----------------------------------------------------------------------------------------------
# reductions of 10^6 elements and thread-count independence
# ----------------------------------------------------------------------------------------------


def _both_thread_counts(threads, fn):
    threads(1)
    r1 = fn()
    threads(2)
    r2 = fn()
    return r1, r2


def _assert_bitwise(r1, r2, context):
    for a, b in zip(r1, r2):
        if a is None:
            assert b is None
            continue
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"1 vs 2 threads differ: {context}")


@pytest.mark.parametrize("dtype", [F32, F16, F64], ids=dtype_id)
def test_million_element_row(rng, threads, dtype):
    # one group of 2^20 + 3 elements with mean 100: a few large groups split across threads
    x = (100.0 + rng.normal(0.0, 1.0, size=(2, (1 << 20) + 3))).astype(dtype)
    r1, r2 = _both_thread_counts(threads, lambda: mvn(x, 1, return_stats=True))
    _assert_bitwise(r1, r2, f"row {dtype_id(dtype)}")
    y, m, inv = r2
    if dtype == F64:
        ref_z, _, ref_mean, ref_inv = mvn_terms(x, 1)
        assert_abs_close(y, ref_z, 1e-10)
        check_stats((m, inv), x, 1, ref_mean, ref_inv, stat_rtol=1e-10)
    else:
        check_mvn(y, x, 1, stats=(m, inv), stat_rtol=1e-5)


def test_million_element_channel_planes(rng, threads):
    # MVN over (0, 2, 3) on NCHW: each channel's 2^20 elements spread across the batch
    x = (50.0 + 3.0 * rng.normal(size=(16, 2, 256, 256))).astype(np.float32)
    r1, r2 = _both_thread_counts(threads, lambda: mvn(x, (0, 2, 3), return_stats=True))
    _assert_bitwise(r1, r2, "channel planes")
    y, m, inv = r2
    check_mvn(y, x, (0, 2, 3), stats=(m, inv), stat_rtol=1e-5)


@pytest.mark.parametrize("inner", ["contiguous", "strided"])
def test_channel_planes_with_blocks_ending_inside_a_run(rng, threads, inner):
    # MVN over (0, 2, 3) with planes of 3000 elements: each channel's 36000 cross the 2^15 elements
    # of a block of sums inside a plane. One thread normalizes a channel's planes in the loop that
    # sums the next channel's (a kernel call a channel: normalize_group_and_sum), two split each
    # channel's blocks between them: the same bits. Strided planes take the kernel's unfused loops.
    base = (7.0 + 2.0 * rng.normal(size=(12, 2, 50, 120))).astype(np.float32)
    x = base[..., :60] if inner == "contiguous" else base[..., ::2]
    threads(1)
    out = np.empty(x.shape, np.float32)
    plan = simdnorm._core.explain_mvn(x, (0, 2, 3), None, None, out, 1e-5, True, True, False, (0, 0.0, 0.0),
                                      None, None, -1, False)
    assert plan.startswith("rows groups=2 lanes=1 group_size=36000 fused paired nest"), plan
    r1, r2 = _both_thread_counts(threads, lambda: mvn(x, (0, 2, 3), return_stats=True))
    _assert_bitwise(r1, r2, f"{inner} planes")
    y, m, inv = r1
    check_mvn(y, x, (0, 2, 3), stats=(m, inv), stat_rtol=1e-5)


@pytest.mark.parametrize("case", ["rows", "rows_odd", "columns_nhwc", "instance_nchw", "group_nhwc", "all"])
def test_threads_bitwise_mvn_strategies(rng, threads, case):
    if case == "rows":  # many small groups: layer norm of (4096, 300)
        x = (rng.normal(size=(4096, 300)) + 2.0).astype(np.float32)
        fn = lambda: simdnorm.layer_norm(x, return_stats=True)  # noqa: E731
        axes = (1,)
    elif case == "rows_odd":  # a row count and length that split unevenly
        x = (rng.normal(size=(3001, 337)) * 3.0).astype(np.float16)
        fn = lambda: mvn(x, -1, return_stats=True)  # noqa: E731
        axes = (1,)
    elif case == "columns_nhwc":  # instance norm on channels-last: reduce outer, keep innermost
        x = channels_last_nhwc(rng, (8, 64, 48, 48), np.float32)
        fn = lambda: simdnorm.instance_norm(x, channel_axis=-1, return_stats=True)  # noqa: E731
        axes = (1, 2)
    elif case == "instance_nchw":
        x = (rng.normal(size=(8, 64, 48, 48)) - 1.0).astype(np.float32)
        fn = lambda: simdnorm.instance_norm(x, return_stats=True)  # noqa: E731
        axes = (2, 3)
    elif case == "group_nhwc":
        x = channels_last_nhwc(rng, (8, 64, 48, 48), np.float32)
        fn = lambda: simdnorm.group_norm(x, 8, channel_axis=-1, return_stats=True)  # noqa: E731
        axes = None
    else:  # one group of everything
        x = rng.normal(size=(3, 400, 1000)).astype(np.float32)
        fn = lambda: mvn(x, (0, 1, 2), return_stats=True)  # noqa: E731
        axes = (0, 1, 2)
    assert x.size > 1_000_000
    r1, r2 = _both_thread_counts(threads, fn)
    _assert_bitwise(r1, r2, case)
    y = r2[0]
    if axes == (0, 1, 2):
        check_mvn(y, x, axes, stats=r2[1:], context=case)
    elif axes is not None:  # per-sample groups: check the first two samples
        check_mvn(y[:2], x[:2], axes, context=case)
    else:
        ref, _, _ = group_norm_ref(x[:2], 8, channel_axis=-1)
        np.testing.assert_allclose(y[:2], ref, rtol=1e-4, atol=1e-4)


def test_tolerance_rejects_naive_float32_moments(rng):
    # E[x^2] - E[x]^2 in float32 at mean 1e3, std 1 must fail the large-mean check above
    ratio = 1e3
    x = (ratio + rng.normal(0.0, 1.0, size=(16, 3000))).astype(np.float32)
    ref_z, _, _, _ = mvn_terms(x, 1)
    m = x.mean(axis=1, keepdims=True, dtype=np.float32)
    m2 = (x * x).mean(axis=1, keepdims=True, dtype=np.float32)
    var = np.maximum(m2 - m * m, np.float32(0))
    naive = (x - m) / np.sqrt(var + np.float32(1e-5))
    with pytest.raises(AssertionError):
        assert_abs_close(naive, ref_z, 1e-5 + 4e-7 * ratio)


# Batch norm folds scale into 1/sqrt(var + eps) (one coefficient stream fewer). Where that product
# leaves the compute type's normal range while (x - mean) * inv_std * scale does not, the op keeps
# the factors apart; the results must not show which form ran. The test of the range runs in the
# ISA's kernel (kernels/lane_stats.h): every ISA is checked.
_IDENTITY = (0, 0.0, 0.0)
_FAR = {  # dtype: (x spread, variance, scale) with scale / std out of range, the result in range
    "overflow": {F32: (1e-10, 1e-20, 1e30), BF16: (1e-10, 1e-20, 1e30), F64: (1e-150, 1e-300, 1e300)},
    "underflow": {F32: (1e15, 1e30, 1e-30), BF16: (1e15, 1e30, 1e-30), F64: (1e150, 1e300, 1e-300)},
}


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("kind", list(_FAR))
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_bn_scale_and_inv_std_whose_product_leaves_the_range(rng, threads, isa, dtype, kind, layout):
    from simdnorm import _core

    spread, var, scale = _FAR[kind][dtype]
    pdt = np.float64 if dtype == F64 else np.float32
    c = 48
    x = (rng.standard_normal((3, 40, 6, c) if layout == "nhwc" else (3, c, 6, 40)) * spread).astype(dtype)
    if layout == "nhwc":
        x = x.transpose(0, 3, 1, 2)
    mean = (rng.standard_normal(c) * spread).astype(pdt)
    mean[::3] = 0.0
    variance = np.full(c, var, pdt) * rng.uniform(0.5, 2.0, c).astype(pdt)
    g = np.full(c, scale, pdt) * rng.uniform(0.5, 2.0, c).astype(pdt)
    g[5] = -g[5]
    g[7] = 1.0  # an ordinary channel beside them: one call keeps every channel's factors apart
    b = rng.standard_normal(c).astype(pdt)
    out = simdnorm.batch_normalization(x, mean, variance, g, b, epsilon=0.0)
    check_bn(out, x, mean, variance, g, b, epsilon=0.0)
    plan = _core.explain_batch_norm(x, mean.reshape(1, c, 1, 1), variance.reshape(1, c, 1, 1), g.reshape(1, c, 1, 1),
                                    b.reshape(1, c, 1, 1), np.empty_like(x), 0.0, _IDENTITY, 0, False)
    assert plan.endswith(" scale-apart"), plan
    # ordinary parameters fold
    plan = _core.explain_batch_norm(x, mean.reshape(1, c, 1, 1), variance.reshape(1, c, 1, 1) * 0 + 1,
                                    g.reshape(1, c, 1, 1) * 0 + 1, b.reshape(1, c, 1, 1), np.empty_like(x), 1e-5,
                                    _IDENTITY, 0, False)
    assert not plan.endswith(" scale-apart"), plan


_OWN_PRODUCT_FITS = {  # dtype: (x - mean, variance, scale) where scale / std is 1 and (x - mean) / std
    # overflows, then those of a channel whose scale / std overflows (its result in range)
    F32: ((1e30, 1e-20, 1e-10), (1e-20, 1e-20, 1e30)), BF16: ((1e30, 1e-20, 1e-10), (1e-20, 1e-20, 1e30)),
    F64: ((1e300, 1e-300, 1e-150), (1e-150, 1e-300, 1e300))}


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_bn_channel_whose_product_fits_beside_one_whose_does_not(rng, threads, isa, dtype, layout):
    """A call that keeps the factors apart (a channel's scale / std out of range) keeps each other
    channel's own product when it fits: apart, (x - mean) / std would overflow there, and the
    result is in range (before: inf)."""
    (big, var, scale), (far_x, far_var, far_scale) = _OWN_PRODUCT_FITS[dtype]
    pdt = np.float64 if dtype == F64 else np.float32
    c = 6
    shape = (2, 5, 7, c) if layout == "nhwc" else (2, c, 5, 7)
    x = (big * (1.0 + 0.5 * rng.standard_normal(shape))).astype(dtype)
    if layout == "nhwc":
        x = x.transpose(0, 3, 1, 2)
    mean = np.zeros(c, pdt)
    variance = np.full(c, var, pdt) * rng.uniform(0.5, 2.0, c).astype(pdt)
    g = np.full(c, scale, pdt) * rng.uniform(0.5, 2.0, c).astype(pdt)
    # channel 2: scale / std past the largest finite value, so this call keeps the factors apart
    x[:, 2] = (far_x * rng.standard_normal(x[:, 2].shape)).astype(dtype)
    variance[2], g[2] = far_var, far_scale
    b = rng.standard_normal(c).astype(pdt)
    out = simdnorm.batch_normalization(x, mean, variance, g, b, epsilon=0.0)
    if dtype != F64:
        check_bn(out, x, mean, variance, g, b, epsilon=0.0)
        return
    # float64's own reference overflows the same way: x87 extended precision's range does not
    if np.finfo(np.longdouble).maxexp <= np.finfo(np.float64).maxexp:
        pytest.skip("no wider float type than float64 here")
    per_channel = (1, c, 1, 1)
    wide = [a.astype(np.longdouble).reshape(per_channel) for a in (mean, variance, g, b)]
    ref = ((x.astype(np.longdouble) - wide[0]) / np.sqrt(wide[1]) * wide[2] + wide[3]).astype(np.float64)
    assert np.isfinite(ref).all()
    np.testing.assert_allclose(out, ref, rtol=1e-13, atol=0)


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_bn_input_equal_to_the_mean_gives_exactly_bias(rng, dtype, layout):
    """(x - mean) is kept apart from the folded multiply-add, so x == mean is bias to the last bit
    (a fold into x * a + b would leave mean * a - mean * a's rounding behind)."""
    c = 37
    shape = (2, 5, 7, c) if layout == "nhwc" else (2, c, 5, 7)
    axis = 3 if layout == "nhwc" else 1
    bshape = [1] * 4
    bshape[axis] = c
    mean = (rng.uniform(100.0, 1000.0, c) * rng.choice([-1, 1], c)).astype(dtype)
    x = np.broadcast_to(mean.reshape(bshape), shape).copy()
    x.reshape(-1)[::5] = 0.5  # and ordinary values beside them
    if layout == "nhwc":
        x = x.transpose(0, 3, 1, 2)
    variance = rng.uniform(0.5, 2.0, c).astype(np.float32)
    g = rng.uniform(0.5, 2.0, c).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    out = simdnorm.batch_normalization(x, mean, variance, g, b)
    check_bn(out, x, mean, variance, g, b)
    at_mean = x == mean.reshape(1, c, 1, 1)
    want = np.broadcast_to(b.astype(dtype).reshape(1, c, 1, 1), x.shape)
    np.testing.assert_array_equal(bits(out[at_mean]), bits(want[at_mean]))
