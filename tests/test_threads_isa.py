"""Every instruction set this machine has, forced with simdnorm.set_isa, against the reference; and
1 vs 2 threads bitwise equal (SPEC §8) on inputs big enough that two threads split the work, and
on odd sizes."""

from __future__ import annotations

import numpy as np
import pytest

import simdnorm
from cases import PARAM_NAMES, act_arg, bits, bn_param_1d, isas_under_test, make_input, make_out, param_values
from reference import (BF16, DTYPES, F16, F32, F64, NONDEFAULT_PARAMS, assert_like_empty_like, check_bn, check_mvn,
                       dtype_id)

bn = simdnorm.batch_normalization
DT = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)


def test_isa_runtime_basics():
    isas = simdnorm.available_isas()
    assert len(isas) >= 1 and len(set(isas)) == len(isas)
    assert simdnorm.isa() in isas
    with pytest.raises(ValueError):
        simdnorm.set_isa("no-such-isa")
    assert simdnorm.isa() in isas


def test_isa_fixture_restores(isa):
    # the fixture forced this ISA; the autouse safety net and the fixture put the previous back
    assert simdnorm.isa() == isa


@DT
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "negative", "unaligned", "zero_stride"])
def test_every_isa_matches_reference(isa, rng, dtype, layout):
    shape = (2, 5, 6, 37)
    x = make_input(rng, shape, dtype, layout)
    p = {n: bn_param_1d(rng, n, shape, 1, dtype) for n in PARAM_NAMES}
    y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation="gelu")
    assert_like_empty_like(y, x)
    check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"], activation="gelu",
             context=f"isa={isa} layout={layout}")
    # full-size parameters (folded on the fly), channels-last coefficients
    q = {n: param_values(rng, n, shape, dtype) for n in PARAM_NAMES}
    y = bn(x, q["mean"], q["variance"], q["scale"], q["bias"])
    check_bn(y, x, q["mean"], q["variance"], q["scale"], q["bias"], context=f"isa={isa} full params")
    r = {n: bn_param_1d(rng, n, shape, -1, dtype) for n in PARAM_NAMES}
    y = bn(x, r["mean"], r["variance"], r["scale"], r["bias"], channel_axis=-1)
    check_bn(y, x, r["mean"], r["variance"], r["scale"], r["bias"], channel_axis=-1, context=f"isa={isa} NXC")


def test_isas_agree_closely(rng):
    # every ISA computes the same float32 math: results within a few ulp of each other
    shape = (3, 4, 8, 29)
    x = make_input(rng, shape, F32)
    p = {n: bn_param_1d(rng, n, shape, 1, F32) for n in PARAM_NAMES}
    prev = simdnorm.isa()
    results = {}
    try:
        for name in simdnorm.available_isas():
            simdnorm.set_isa(name)
            results[name] = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation="tanh")
    finally:
        simdnorm.set_isa(prev)
    first = next(iter(results.values()))
    for name, y in results.items():
        np.testing.assert_allclose(y, first, rtol=1e-5, atol=1e-6, err_msg=name)


def _multipliers_near_midpoints(rng, count, lanes):
    """(var, epsilon) per call: lanes whose 1 / sqrt(var + epsilon) straddles a float32 rounding
    midpoint M by a few units of double's last place (var in steps of one unit of 1 / M^2's last
    place, added to an epsilon just below 1 / M^2), for `count` random M in [0.5, 2)."""
    for f in rng.uniform(0.5, 2.0, count).astype(np.float32):
        midpoint = float(f) + float(np.spacing(f)) / 2
        step = float(np.spacing(1.0 / midpoint**2))  # a power of 2
        var = (np.arange(lanes) * step).astype(np.float32)  # exact: small multiples of a power of 2
        yield var, 1.0 / midpoint**2 - lanes // 2 * step


def test_folded_multiplier_is_the_double_formula_rounded(isa, rng):
    # batch norm's float32 multiplier scale / sqrt(var + eps) is float32(scale * (1.0 / sqrt(var +
    # eps))) computed in double in every ISA (lane_stats.h: the fast units estimate it and take the
    # division near a rounding boundary); x = 1, mean 0, bias 0 make the output that multiplier
    def folded(var, scale, eps):
        x = np.ones((1, var.size), np.float32)
        out = np.full_like(x, np.nan)
        zeros = np.zeros_like(var)
        bn(x, zeros, var, scale, zeros, channel_axis=1, epsilon=eps, out=out)
        return out[0]

    def expected(var, scale, eps):
        s = 1.0 if scale is None else scale.astype(np.float64)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            return (s * (1.0 / np.sqrt(var.astype(np.float64) + eps))).astype(np.float32)

    n = 40_000
    with np.errstate(over="ignore"):
        var = (rng.standard_normal(n) ** 2 * 10.0 ** rng.uniform(-45, 40, n)).astype(np.float32)
    scale = (rng.standard_normal(n) * 10.0 ** rng.uniform(-25, 25, n)).astype(np.float32)
    var[:64] = [0.0, np.inf, -1.0, np.nan] * 16
    scale[64:96:2] = 0.0
    for eps in (1e-5, 0.0):
        for s in (scale, None):
            want, got = expected(var, s, eps), folded(var, s, eps)
            # products outside float32's normal range take the unfolded form: other bits
            fits = (np.abs(want) >= np.finfo(np.float32).tiny) & (np.abs(want) < np.inf)
            assert fits.sum() > n // 2
            np.testing.assert_array_equal(bits(got[fits]), bits(want[fits]), err_msg=f"{isa} eps={eps}")
    near = list(_multipliers_near_midpoints(rng, 64, 64))
    straddled = 0
    for var, eps in near:
        want, got = expected(var, None, eps), folded(var, None, eps)
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"{isa} eps={eps!r}")
        straddled += len(np.unique(want)) == 2  # the lanes do straddle the midpoint
    assert straddled == len(near)


def test_batch_statistics_inv_std_is_the_double_formula_rounded(isa, rng):
    # batch norm training of (8, C) float32: a channel's 1 / std is float32(1.0 / sqrt(var + eps)) of
    # its double variance (lane_stats.h, inv_std_floats_near). Rows of +d and -d: the mean is 0 and
    # the variance d^2, exactly (d = k 2^-30); var + eps sweeps a float32 rounding midpoint of 1 / std
    # in steps finer than a double's last place, and y = d * (1 / std) is one float32 product.
    lanes = 4096
    k = 1 + np.arange(lanes) % 64
    d = (k * 2.0**-30).astype(np.float32)
    x = np.where(np.arange(8)[:, None] % 2 == 0, d, -d).astype(np.float32)
    straddled = 0
    for f in rng.uniform(0.5, 2.0, 8).astype(np.float32):
        midpoint = float(f) + float(np.spacing(f)) / 2
        eps = 1.0 / midpoint**2 - 2.0**-49
        y, mean, var = simdnorm.batch_normalization_training(x, channel_axis=1, epsilon=eps)
        assert not mean.any() and (var == d * d).all()
        inv_std = (1.0 / np.sqrt(d.astype(np.float64) ** 2 + eps)).astype(np.float32)
        np.testing.assert_array_equal(bits(y), bits(x * inv_std), err_msg=f"{isa} eps={eps!r}")
        straddled += len(np.unique(inv_std)) > 1
    assert straddled == 8


# ----------------------------------------------------------------------------------------------
# threads: 1 and 2 bitwise equal, and correct
# ----------------------------------------------------------------------------------------------


def test_set_num_threads_returns_previous(threads):
    threads(1)
    assert simdnorm.set_num_threads(2) == 1
    assert simdnorm.get_num_threads() == 2
    assert simdnorm.set_num_threads(1) == 2


def _run_with_threads(threads_fixture, n, fn):
    threads_fixture(n)
    return fn()


BIG_CASES = {
    # name: (shape, channel_axis, layout, activation, full-size params)
    "nchw": ((4, 32, 96, 96), 1, "contiguous", None, False),
    "nhwc_axis": ((4, 96, 96, 32), -1, "contiguous", "silu", False),
    "nhwc_view": ((4, 32, 96, 96), 1, "channels_last", "elu", False),
    "odd": ((3, 7, 311, 193), 1, "contiguous", "gelu", False),
    "odd_strided": ((3, 7, 311, 193), 1, "negative", "softplus", False),
    "full_params": ((2, 8, 280, 263), 1, "contiguous", "relu", True),
}


def _big_variants():
    """Every case for float32 and float16 on the default ISA; the two main cases for bfloat16 and
    float64, and for the other ISAs (time budget)."""
    out = []
    for dt in (F32, F16, BF16, F64):
        for case in BIG_CASES:
            for which in ("default", "other"):
                main = case in ("nchw", "odd_strided")
                if dt in (BF16, F64) and not main:
                    continue
                if which == "other" and not main:
                    continue
                out.append(pytest.param(case, dt, which, id=f"{case}-{dtype_id(dt)}-{which}_isas"))
    return out


@pytest.mark.parametrize("case,dtype,which_isas", _big_variants())
def test_threads_bitwise_equal_big(rng, threads, case, dtype, which_isas):
    isas = isas_under_test()
    isas = isas[:1] if which_isas == "default" else isas[1:]
    if not isas:
        pytest.skip("no other ISA unit to run: the machine has one, or the sanitizers instrument one")
    for isa in isas:
        simdnorm.set_isa(isa)
        _big_case(rng, threads, case, dtype, isa)


def _big_case(rng, threads, case, dtype, isa):
    shape, ca, layout, act, full = BIG_CASES[case]
    assert int(np.prod(shape)) > 1_000_000
    x = make_input(rng, shape, dtype, layout, scale=2.0)
    if full:
        p = {n: param_values(rng, n, shape, dtype) for n in PARAM_NAMES}
    else:
        p = {n: bn_param_1d(rng, n, shape, ca, dtype) for n in PARAM_NAMES}
    params = NONDEFAULT_PARAMS.get(act) if act else None
    call = lambda: bn(x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=ca,  # noqa: E731
                      activation=act_arg(act, params))
    y1 = _run_with_threads(threads, 1, call)
    y2 = _run_with_threads(threads, 2, call)
    assert y1.shape == y2.shape == shape
    np.testing.assert_array_equal(bits(y1), bits(y2), err_msg=f"1 vs 2 threads differ ({case})")
    # the same through out= in the input's layout
    out = make_out(shape, dtype, layout if layout != "zero_stride" else "contiguous")
    threads(2)
    bn(x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=ca, activation=act_arg(act, params), out=out)
    np.testing.assert_array_equal(bits(out), bits(y1))
    # correctness on the first sample (the reference in float64 is the slow part)
    p0 = {k: (v[:1] if v.ndim == len(shape) else v) for k, v in p.items()}
    check_bn(y2[:1], x[:1], p0["mean"], p0["variance"], p0["scale"], p0["bias"], channel_axis=ca, activation=act,
             act_params=params, context=f"{case} 2 threads isa={isa}")


@pytest.mark.parametrize("n", [1, 2, 3, 7, 63, 64, 65, 1023, 4097, 65537])
def test_threads_bitwise_equal_odd_sizes(rng, threads, n):
    # any size, including sizes that do not split evenly: the same bits with 1 and 2 threads
    x = make_input(rng, (3, n, 5), F32)
    p = {k: bn_param_1d(rng, k, x.shape, 1, F32) for k in PARAM_NAMES}
    call = lambda: bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation="sigmoid")  # noqa: E731
    y1 = _run_with_threads(threads, 1, call)
    y2 = _run_with_threads(threads, 2, call)
    np.testing.assert_array_equal(bits(y1), bits(y2))
    check_bn(y1, x, p["mean"], p["variance"], p["scale"], p["bias"], activation="sigmoid")


def test_more_threads_than_cores(rng, threads):
    # 3 and 5 threads on 2 cores: still correct and bitwise the same as 1
    shape = (2, 3, 509, 1031)
    x = make_input(rng, shape, F32)
    p = {k: bn_param_1d(rng, k, shape, 1, F32) for k in PARAM_NAMES}
    call = lambda: bn(x, p["mean"], p["variance"], p["scale"], p["bias"])  # noqa: E731
    y1 = _run_with_threads(threads, 1, call)
    for n in (3, 5):
        np.testing.assert_array_equal(bits(_run_with_threads(threads, n, call)), bits(y1))


# ----------------------------------------------------------------------------------------------
# float16 / bfloat16 conversions on every ISA: subnormals, inf, NaN, overflow, ties to even
# ----------------------------------------------------------------------------------------------


def _special_values(dtype):
    import ml_dtypes

    fi = ml_dtypes.finfo(dtype)
    tiny_sub = float(fi.smallest_subnormal)
    vals = [tiny_sub, 2 * tiny_sub, 3 * tiny_sub, 5 * tiny_sub, float(fi.tiny) - tiny_sub, float(fi.tiny),
            float(fi.max), float(fi.max) * 0.75, 1.0, 1.5, 3.0, 1000.0, np.inf, np.nan]
    vals += [-v for v in vals]
    # every bit pattern of a few binades, so the mantissa rounding sees odd and even neighbours
    one = 0x3C00 if dtype == F16 else 0x3F80
    grid = np.arange(one, one + 300, dtype=np.uint16).view(dtype).astype(np.float64)
    return np.concatenate([np.array(vals, np.float64), grid, -grid]).astype(dtype)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("mul", [1.0, 0.5, 0.25, 1.0 + 2.0 ** -8, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -12, 1.0003])
def test_half_conversions_exact(isa, dtype, mul):
    # y = x * mul with mean 0, variance 1, epsilon 0 and a float32 scale: the float32 product is
    # exact, so the only rounding is the final one to the output type, which must be
    # round-to-nearest-even exactly (with subnormals, overflow to inf, and NaN kept NaN)
    x = _special_values(dtype)
    n = x.size
    x = x.reshape(1, 1, n)
    scale = np.array([mul], np.float32)
    y = bn(x, np.zeros(1, dtype), np.ones(1, dtype), scale, epsilon=0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        want = (x.astype(np.float32) * np.float32(mul)).astype(dtype)
    yf, wf = y.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    same = (yf == wf) | (np.isnan(yf) & np.isnan(wf))
    if not same.all():
        i = np.flatnonzero(~same)[:6]
        raise AssertionError(f"{(~same).sum()} conversions differ (isa={isa}): x={x.ravel()[i]} "
                             f"got={yf[i]} want={wf[i]}")


# Groups at 1 thread take the fused path, where a group is normalized in the loop that sums the
# next (kernels/fused_rows.h), run by run; at 2 threads, three groups this large are split into
# blocks over both threads (ops/mvn.cpp). The statistics must agree bitwise, including when the
# first element is an outlier and the group is summed a second time around its mean. Layer norm
# rows are one run per group, taken by one kernel call that runs two rows ahead (2 and 3 rows cover
# its start and end); MVN over (0, 2, 3) has one run per sample and channel. Groups past one block of
# sums (32768 elements) are fused run by run, cut where the blocks end (inside a row; inside the
# seventh of a channel's eight planes, the second block taking the rest of it and the eighth).
FUSED_CASES = {"rows_24583": ((3, 24583), (1,)), "rows_32768": ((3, 32768), (1,)),
               "two_rows": ((2, 32768), (1,)), "rows_70001": ((3, 70001), (1,)),
               "planes": ((4, 3, 80, 80), (0, 2, 3)), "planes_past_a_block": ((8, 3, 50, 100), (0, 2, 3))}


@DT
@pytest.mark.parametrize("case", FUSED_CASES)
@pytest.mark.parametrize("outlier", [False, True], ids=["plain", "outlier_first"])
def test_fused_and_split_groups_agree_bitwise(isa, rng, threads, dtype, case, outlier):
    from simdnorm import _core

    shape, axes = FUSED_CASES[case]
    x = make_input(rng, shape, dtype, loc=50.0, scale=2.0)
    if outlier:
        x[(slice(None),) * (len(shape) - 1) + (0,)] = 5000.0  # every run's first element, each group's too
    kept = tuple(1 if d in axes else n for d, n in enumerate(shape))
    g = make_input(rng, kept, dtype)
    explain = lambda: _core.explain_mvn(x, axes, g, g, np.empty_like(x), 1e-5, True, True, False,  # noqa: E731
                                        (0, 0.0, 0.0), None, None, -1, False)
    call = lambda: simdnorm.mean_variance_normalization(x, axes, g, g, return_stats=True)  # noqa: E731
    threads(1)
    assert " fused " in explain()
    y1, m1, s1 = call()
    threads(2)
    assert " split " in explain()
    y2, m2, s2 = call()
    for a, b in ((y1, y2), (m1, m2), (s1, s2)):
        np.testing.assert_array_equal(bits(a), bits(b))
    check_mvn(y1, x, axes, g, g)


# Layer-norm rows of every length around the vector widths (shorter than one vector, a masked head
# and tail only, a few full steps) run through the one-call rows pipeline, which finishes rows two
# or four at a time. Each row's first element (the pivot of its first pass) is an outlier; it lies more than 8
# std from the row's mean, so that the row is summed a second time around its mean, once
# sqrt(row - 1) > 8 (rows of 97 and 255 here). Against the reference (poisoned output), and 1 vs 2
# threads bitwise.
@DT
@pytest.mark.parametrize("row", [1, 2, 3, 5, 8, 15, 16, 17, 31, 33, 47, 64, 97, 255])
def test_short_rows_pipeline_against_reference_and_threads(isa, rng, threads, dtype, row):
    rows = 70000 // row + 3  # past 2 x 32K elements: two threads take a part each
    x = make_input(rng, (rows, row), dtype, loc=30.0, scale=3.0)
    if row > 1:
        x[:, 0] = 3000.0
    _pipelined_layer_norm_matches_reference_and_threads(rng, threads, x, dtype, f"isa={isa} row={row}")


# RMS norm's short rows sum squares only. Rows on both sides of the short rows' bounds (512 bytes
# for 16-bit data, 1 KB for the others; rows shorter than a vector take them too), against the
# reference (poisoned output), 1 vs 2 threads bitwise.
@DT
@pytest.mark.parametrize("row", [3, 100, 128, 255, 256])
def test_rms_norm_rows_around_the_short_rows_bounds(isa, rng, threads, dtype, row):
    rows = 70000 // row + 3
    x = make_input(rng, (rows, row), dtype, loc=3.0, scale=3.0)
    g = make_input(rng, (row,), dtype)
    results = []
    for n in (1, 2):
        threads(n)
        out = make_out(x.shape, dtype)
        y, _, inv_rms = simdnorm.rms_norm(x, g, out=out, return_stats=True)
        assert y is out
        check_mvn(y, x, (1,), g, normalize_mean=False, stats=(None, inv_rms),
                  context=f"isa={isa} row={row} threads={n}")
        results.append((y, inv_rms))
    for a, c in zip(*results):
        np.testing.assert_array_equal(bits(a), bits(c))


def _pipelined_layer_norm_matches_reference_and_threads(rng, threads, x, dtype, context):
    """Layer norm of x over its last axis runs the rows pipeline: against the reference (poisoned
    output), 1 vs 2 threads bitwise."""
    from simdnorm import _core

    axis = x.ndim - 1
    g = make_input(rng, x.shape[-1:], dtype)
    b = make_input(rng, x.shape[-1:], dtype)
    assert " fused pipeline " in _core.explain_mvn(x, (axis,), g, b, np.empty_like(x), 1e-5, True, True, False,
                                                   (0, 0.0, 0.0), None, None, -1, False)
    results = []
    for n in (1, 2):
        threads(n)
        out = make_out(x.shape, dtype)
        y, mean, inv_std = simdnorm.layer_norm(x, g, b, out=out, return_stats=True)
        assert y is out
        check_mvn(y, x, (axis,), g, b, stats=(mean, inv_std), context=f"{context} threads={n}")
        results.append((y, mean, inv_std))
    for a, c in zip(*results):
        np.testing.assert_array_equal(bits(a), bits(c))


# Rows whose kept dims do not merge (layer norm of a slice x[:, :T] of a sequence batch) run as one
# pipeline per stretch of rows at one step. At 2 threads the parts split a stretch in the middle
# (21003 rows in parts of 10502). Against the reference (poisoned output), 1 vs 2 threads bitwise.
@DT
@pytest.mark.parametrize("row", [16, 300])
def test_rows_of_a_sliced_batch_pipeline_stretch_by_stretch(isa, rng, threads, dtype, row):
    batch, seq = 3, (7001 if row == 16 else 401)
    base = make_input(rng, (batch, seq + 2, row), dtype, loc=30.0, scale=3.0)
    x = base[:, 1:seq + 1]
    x[:, ::5, 0] = 3000.0  # some rows summed a second time around their mean
    _pipelined_layer_norm_matches_reference_and_threads(rng, threads, x, dtype, f"isa={isa} row={row}")


# The rows pipeline sums rows k ahead of their normalization and finishes them k at a time (k = 4
# for rows under 1 KB, else 2): every count of rows around those batches, with a last batch cut
# short, for rows on both sides of 1 KB. float16 rows of up to 1024 elements (2 KB) are normalized
# from the float32 copy their sums pass keeps: 1024 and 1025 elements sit on both sides of that.
# Outliers at the start of some rows only (one row of a batch takes a second pass, its neighbours
# do not); a fused activation on the last pass.
@DT
@pytest.mark.parametrize("rows", list(range(1, 10)) + [13])
@pytest.mark.parametrize("row_bytes", [200, 1022, 1024, 2048, 2050])
def test_rows_pipeline_batches_against_reference(isa, rng, threads, dtype, rows, row_bytes):
    from simdnorm import _core

    threads(1)
    row = row_bytes // np.dtype(dtype).itemsize
    x = make_input(rng, (rows, row), dtype, loc=-20.0, scale=4.0)
    x[1::3, 0] = 2000.0
    g = make_input(rng, (row,), dtype)
    b = make_input(rng, (row,), dtype)
    assert " fused pipeline " in _core.explain_mvn(x, (1,), g, b, np.empty_like(x), 1e-5, True, True, False,
                                                   (0, 0.0, 0.0), None, None, -1, False)
    for variant in ("layer", "rms", "gelu"):
        out = make_out(x.shape, dtype)
        if variant == "gelu":
            y = simdnorm.layer_norm(x, g, b, activation="gelu", out=out)
            check_mvn(y, x, (1,), g, b, activation="gelu", context=f"isa={isa} rows={rows} gelu")
        elif variant == "rms":
            y, _, inv_std = simdnorm.rms_norm(x, g, out=out, return_stats=True)
            check_mvn(y, x, (1,), g, None, normalize_mean=False, stats=(None, inv_std),
                      context=f"isa={isa} rows={rows} rms")
        else:
            y, mean, inv_std = simdnorm.layer_norm(x, g, b, out=out, return_stats=True)
            check_mvn(y, x, (1,), g, b, stats=(mean, inv_std), context=f"isa={isa} rows={rows}")
        assert y is out
