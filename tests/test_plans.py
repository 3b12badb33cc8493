"""The planner picks the loop meant for each layout that matters (the debug hook
`_core.explain_batch_norm` / `_core.explain_mvn` describes the plan a call would run, without
running it). A fast path that silently fell back to the strided loop would still pass every
numeric test; these tests catch that."""

from __future__ import annotations

import platform

import numpy as np
import pytest

import simdnorm
from simdnorm import _core

IDENTITY = (0, 0.0, 0.0)


def bn_plan(x, param_shape, out=None):
    p = np.ones(param_shape, np.float32)
    out = np.empty_like(x) if out is None else out
    return _core.explain_batch_norm(x, p, p, p, p, out, 1e-5, IDENTITY, 0, False)


def mvn_plan(x, axes, scale=None, out=None):
    out = np.empty_like(x) if out is None else out
    return _core.explain_mvn(x, axes, scale, scale, out, 1e-5, True, True, False, IDENTITY, None, None, -1, False)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_nchw_batch_norm_streams_planes_of_constant_coefficients(dtype):
    x = np.zeros((2, 8, 5, 7), dtype)
    plan = bn_plan(x, (1, 8, 1, 1))
    assert "inner=row_stream(stats=const,affine=const)" in plan
    assert "sizes=(2,8,35)" in plan  # H and W merged into one run
    # planes too large for a row stream's gain: each its own contiguous run (float32 with
    # streaming stores)
    big = np.zeros((1, 8, _core.stream_threshold_bytes() // 32, 1), np.float32)
    assert bn_plan(big, (1, 8, 1, 1)).endswith("inner=contiguous(stats=const,affine=const) streaming-stores")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_channels_last_batch_norm_runs_coefficients_along_the_run(dtype):
    x = np.zeros((2, 5, 7, 8), dtype).transpose(0, 3, 1, 2)  # NHWC memory, NCHW view
    plan = bn_plan(x, (1, 8, 1, 1))
    assert "inner=contiguous(stats=vary,affine=vary)" in plan
    # N, H, W merged; C innermost, and with so few channels the coefficients are repeated so that
    # one run covers all 70 pixels (8 channels each) instead of one pixel per run
    assert "sizes=(1,560)" in plan
    # pixels of 64 channels, more than one to a run: one periodic stream
    x = np.zeros((2, 16, 16, 64), dtype).transpose(0, 3, 1, 2)
    assert "inner=periodic_stream(stats=vary,affine=vary)" in bn_plan(x, (1, 64, 1, 1))
    # pixels of 4096 channels: the coefficients and a row outgrow the L1, blocks of columns
    x = np.zeros((2, 3, 3, 4096), dtype).transpose(0, 3, 1, 2)
    assert "inner=column_blocks(stats=vary,affine=vary) block_columns=" in bn_plan(x, (1, 4096, 1, 1))


@pytest.mark.parametrize("kind, inline", [(2, True), (3, True), (17, True), (8, False), (16, False), (19, False)])
def test_out_of_line_activations_take_each_run_on_its_own(kind, inline):
    # relu, leaky_relu, clip inline; sigmoid, gelu, hard_swish a call a vector: no periodic stream
    # and no fused rows loops, which are compiled for the inline ones only; the row stream for all
    act = (kind, 0.1, 0.5)
    x = np.zeros((2, 16, 16, 64), np.float32).transpose(0, 3, 1, 2)
    p = np.ones((1, 64, 1, 1), np.float32)
    plan = _core.explain_batch_norm(x, p, p, p, p, np.empty_like(x), 1e-5, act, 0, False)
    assert ("inner=periodic_stream(" if inline else "inner=contiguous(stats=vary,affine=vary)") in plan, plan
    x = np.zeros((2, 8, 5, 7), np.float16)
    p = np.ones((1, 8, 1, 1), np.float32)
    plan = _core.explain_batch_norm(x, p, p, p, p, np.empty_like(x), 1e-5, act, 0, False)
    assert "inner=row_stream(" in plan, plan
    x = np.zeros((64, 768), np.float32)
    plan = _core.explain_mvn(x, (1,), None, None, np.empty_like(x), 1e-5, True, True, False, act, None, None, -1,
                             False)
    assert (" rows_loop=pipeline " if inline else " rows_loop=separate ") in plan, plan


@pytest.mark.parametrize("kind", [0, 2, 3, 17, 8])
def test_the_periodic_stream_is_planned_for_what_the_unit_runs_inline(isa, kind):
    # The x86 fallback unit (baseline) takes identity alone inline: relu and the piecewise-linear
    # kinds are calls there, and its planner must not choose the stream compiled for inline ones.
    act = (kind, 0.1, 0.5)
    x = np.zeros((2, 16, 16, 64), np.float32).transpose(0, 3, 1, 2)
    p = np.ones((1, 64, 1, 1), np.float32)
    plan = _core.explain_batch_norm(x, p, p, p, p, np.empty_like(x), 1e-5, act, 0, False)
    fallback = isa == "baseline" and platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    inline = kind == 0 or (kind != 8 and not fallback)
    assert ("inner=periodic_stream(" if inline else "inner=contiguous(stats=vary,affine=vary)") in plan, plan


def test_channels_last_runs_are_lengthened_by_a_divisor_of_the_pixel_count():
    x = np.zeros((1, 2, 131, 8), np.float32).transpose(0, 3, 1, 2)  # 262 pixels = 2 x 131
    plan = bn_plan(x, (1, 8, 1, 1))
    assert "sizes=(131,16)" in plan  # 131 pixels per run would exceed the target run: 2 per run


def test_channels_last_with_many_channels_keeps_one_pixel_per_run():
    x = np.zeros((2, 3, 3, 1024), np.float32).transpose(0, 3, 1, 2)
    assert "sizes=(18,1024)" in bn_plan(x, (1, 1024, 1, 1))


def overlap_call(x, out, p):
    return _core.explain_batch_norm(x, p, p, p, p, out, 1e-5, IDENTITY, 1, True)


def test_kernel_declines_when_out_may_overlap_an_operand():
    buf = np.zeros((2, 4, 64), np.float32)
    p = np.ones(4, np.float32)
    assert overlap_call(buf[..., ::2], buf[..., 1::2], p).startswith("declined")  # interleaved
    assert overlap_call(buf[:, :, :32], buf[:, :, 16:48], p).startswith("declined")  # shifted
    params = np.ones(64, np.float32)
    out = params[:8].reshape(2, 4, 1)
    assert _core.explain_batch_norm(np.zeros((2, 4, 1), np.float32), params[4:8], p, p, p, out, 1e-5,
                                    IDENTITY, 1, True).startswith("declined")  # a parameter under out
    assert overlap_call(buf, buf, p).startswith("nest=")  # in place is not an overlap
    assert overlap_call(buf, np.zeros_like(buf), p).startswith("nest=")
    assert overlap_call(buf[..., ::2], buf[..., 1::2].copy(), p).startswith("nest=")


def test_interleaved_out_declined_by_the_kernel_still_runs_into_out():
    # Disjoint elements within one byte range: the kernel declines, numpy finds no overlap, and the
    # call runs straight into out (whose other lanes must stay untouched).
    rng = np.random.default_rng(5)
    buf = rng.standard_normal((3, 4, 64)).astype(np.float32)
    x, out = buf[..., ::2], buf[..., 1::2]
    before_x = x.copy()
    mean, var = rng.standard_normal(4).astype(np.float32), rng.random(4).astype(np.float32) + 0.5
    got = simdnorm.batch_normalization(x, mean, var, out=out)
    assert got is out
    want = (before_x - mean[:, None]) / np.sqrt(var[:, None] + 1e-5)
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(x, before_x)


def test_reversed_input_is_flipped_back_to_a_contiguous_run():
    x = np.zeros((3, 4, 50), np.float32)[:, :, ::-1]
    out = np.zeros((3, 4, 50), np.float32)[:, :, ::-1]
    assert "inner=row_stream" in bn_plan(x, (1, 4, 1), out=out)


def test_strided_views_fall_back_to_the_strided_loop():
    x = np.zeros((2, 4, 10), np.float32)[:, :, ::2]
    assert "inner=strided" in bn_plan(x, (1, 4, 1), out=np.empty((2, 4, 5), np.float32))


def test_streaming_stores_only_for_large_out_of_place_outputs():
    small = np.zeros((2, 4, 16), np.float32)
    assert "streaming-stores" not in bn_plan(small, (1, 4, 1))
    # Streaming once input and output together pass the threshold (np.zeros maps pages lazily,
    # and explaining a plan touches no element).
    threshold = _core.stream_threshold_bytes()
    assert 1 << 19 <= threshold <= 16 << 20
    fits = np.zeros((1, 8, threshold // 64, 1), np.float32)  # input + output = the threshold
    assert "streaming-stores" not in bn_plan(fits, (1, 8, 1, 1))
    big = np.zeros((1, 8, threshold // 64 + 16, 1), np.float32)
    assert bn_plan(big, (1, 8, 1, 1)).endswith("streaming-stores")
    assert "streaming-stores" not in bn_plan(big, (1, 8, 1, 1), out=big)  # in place: the lines are cached


# Inner runs under 1 KB are written plainly however large the call: each run's edges are partial
# lines, which non-temporal stores send to memory in pieces.
def test_short_runs_are_not_streamed():
    threshold = _core.stream_threshold_bytes()
    rows = np.zeros((threshold // 256 + 16, 64), np.float32)  # past the threshold, rows of 256 bytes
    assert "streaming-stores" not in mvn_plan(rows, (1,))
    assert mvn_plan(np.zeros((threshold // 1024 + 16, 256), np.float32), (1,)).endswith("streaming-stores")
    planes = np.zeros((threshold // (8 * 196) + 16, 4, 7, 7), np.float32)
    assert "streaming-stores" not in bn_plan(planes, (1, 4, 1, 1))


@pytest.mark.parametrize("row", [1, 7, 96, 3000])
def test_layer_norm_rows_of_any_length_run_as_one_pipeline(row):
    # short rows too (they used to be batched: a statistics call per row, 1.4-1.7x the time)
    x = np.zeros((4, 6, row), np.float32)
    plan = mvn_plan(x, (2,), scale=np.ones((1, 1, row), np.float32))
    assert plan.startswith(f"rows groups=24 lanes=1 group_size={row} fused pipeline")
    if row > 1:  # each row normalized on its own, in the loop that sums a later row
        assert "inner=contiguous(stats=const,affine=vary)" in plan


@pytest.mark.parametrize("dtype, shape, cut, loop", [
    ("float32", (64, 768), None, "pipeline"),
    ("float16", (64, 768), None, "row_stream"),  # 16-bit rows back to back: one stream of steps
    ("bfloat16", (64, 768), None, "row_stream"),
    ("float16", (64, 776), 768, "pipeline_kept"),  # a gap between rows: the float32 copy kept
    ("bfloat16", (64, 776), 768, "pipeline"),
    ("float32", (64, 64), None, "short_rows"),  # rows under 1 KB (16-bit: 512 bytes): batches summed,
    ("float32", (64, 255), None, "short_rows"),  # then normalized
    ("float64", (64, 72), 63, "short_rows"),
    ("float16", (64, 255), None, "short_rows"),
    ("float32", (64, 5), None, "short_rows"),  # shorter than a vector too
    ("float64", (64, 2), None, "short_rows"),
    ("float32", (64, 256), None, "pipeline"),
    ("float64", (64, 128), None, "pipeline"),
    ("bfloat16", (64, 256), None, "row_stream"),
])
def test_layer_norm_rows_name_the_fused_loop_that_runs(dtype, shape, cut, loop):
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x = np.zeros(shape, dt)[:, :cut]
    n = x.shape[1]
    plan = mvn_plan(x, (1,), scale=np.ones((1, n), np.float32), out=np.empty((shape[0], n), dt))
    assert f" fused pipeline rows_loop={loop} " in plan, plan
    inner = "row_stream" if loop == "row_stream" else "contiguous"
    assert f"inner={inner}(stats=const,affine=vary)" in plan, plan


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_long_rows_run_two_in_step_with_avx512_only(isa, dtype):
    # On a Zen 3 core (AVX2) pairs ran slower than single rows at every offset of the output
    x = np.zeros((64, 4096), dtype)
    plan = mvn_plan(x, (1,), scale=np.ones((1, 4096), np.float32), out=np.empty_like(x))
    loop = "pipeline_paired" if isa.startswith("avx512") else "pipeline"
    assert f" fused pipeline rows_loop={loop} " in plan, plan


def test_rows_of_strided_elements_are_summed_and_normalized_apart():
    x = np.zeros((64, 192), np.float32)[:, ::2]
    plan = mvn_plan(x, (1,), out=np.empty((64, 96), np.float32))
    assert " rows_loop=separate " in plan and plan.endswith("inner=strided"), plan


def test_instance_norm_nchw_is_one_pipeline_over_the_planes():
    x = np.zeros((2, 8, 5, 7), np.float32)
    assert mvn_plan(x, (2, 3)).startswith("rows groups=16 lanes=1 group_size=35 fused pipeline")


def test_rows_with_unmergeable_kept_dims_are_pipelined_stretch_by_stretch():
    # kept dims (4, 6) in the output's order are (6, 4) in the input's: they cannot merge
    x = np.zeros((6, 4, 40), np.float32).transpose(1, 0, 2)
    plan = mvn_plan(x, (2,), out=np.zeros((4, 6, 40), np.float32))
    assert plan.startswith("rows groups=24 lanes=1 group_size=40 fused pipeline")
    # a slice of the sequence axis: rows at one step within each batch element, a gap between
    x = np.zeros((3, 9, 40), np.float32)[:, :7]
    assert mvn_plan(x, (2,)).startswith("rows groups=21 lanes=1 group_size=40 fused pipeline")



def test_channels_last_instance_norm_accumulates_across_channel_lanes():
    x = np.zeros((2, 5, 7, 32), np.float32).transpose(0, 3, 1, 2)
    plan = mvn_plan(x, (2, 3))
    assert plan.startswith("columns groups=2 lanes=32 group_size=35")
    assert "inner=periodic_stream(stats=vary,affine=const)" in plan
    # 4096 channels: a row of them and their statistics outgrow the L1, blocks of columns
    x = np.zeros((2, 5, 7, 4096), np.float32).transpose(0, 3, 1, 2)
    assert "inner=column_blocks(stats=vary,affine=const)" in mvn_plan(x, (2, 3))


@pytest.mark.parametrize("scale", [False, True])
def test_channels_last_instance_norm_never_gathers(scale):
    # without scale and bias the scale is folded (read as 1): the statistics still vary along the
    # channels and the bias is constant, a contiguous pair that must not fall back to the strided
    # loop (it did, 7.7x the time of the same call with scale and bias)
    x = np.zeros((2, 56, 56, 64), np.float32)
    s = np.ones((1, 1, 1, 64), np.float32) if scale else None
    plan = mvn_plan(x, (1, 2), scale=s)
    assert "inner=strided" not in plan
    assert f"(stats=vary,affine={'vary' if scale else 'const'})" in plan


def test_mvn_over_the_channels_takes_whole_planes_as_lanes():
    # ConvNeXt's LayerNorm2d (NCHW, normalized over C): the kept H and W merge into one dim of lanes
    # before the lanes are taken, so a task is a sample's C x (H W) block (lanes of W alone made
    # tasks of 56-element rows)
    x = np.zeros((8, 64, 56, 56), np.float32)
    assert mvn_plan(x, (1,)).startswith("columns groups=8 lanes=3136 group_size=64")
    x = np.zeros((2, 3, 5, 7, 4), np.float32)
    assert mvn_plan(x, (1, 2)).startswith("columns groups=2 lanes=28 group_size=15")


def test_mvn_over_batch_and_space_groups_each_channel():
    x = np.zeros((4, 8, 5, 7), np.float32)  # each channel's four planes a lane group
    assert mvn_plan(x, (0, 2, 3)).startswith("columns groups=1 lanes=280 group_size=4 lane_group=35")
    x = np.zeros((4, 8, 21, 20), np.float32)  # planes past 400 elements: a channel's runs a row
    assert mvn_plan(x, (0, 2, 3)).startswith("rows groups=8 lanes=1 group_size=1680")


def test_nchw_group_norm_with_affine_on_small_planes_runs_a_group_as_one_row():
    # (N, G, C/G, H, W) with (G, C/G, 1, 1) scale and bias: copied along the 7x7 planes, they vary
    # as the data do, and the group's channels and planes merge into one run, as without them
    x = np.zeros((2, 4, 8, 7, 7), np.float32)
    affine = np.ones((4, 8, 1, 1), np.float32)
    plan = mvn_plan(x, (2, 3, 4), affine)
    assert plan.startswith("rows groups=8 lanes=1 group_size=392 fused pipeline")
    assert "sizes=(2,4,392)" in plan and "scale=(0,1568,4)" in plan and "affine=vary" in plan
    assert mvn_plan(x, (2, 3, 4)).startswith("rows groups=8 lanes=1 group_size=392 fused pipeline")
    # planes of 256 elements or more keep a run each (the copies would not pay), as do outputs that
    # could not merge the dims anyway
    big = np.zeros((2, 4, 8, 16, 16), np.float32)
    assert "sizes=(2,4,8,256)" in mvn_plan(big, (2, 3, 4), affine)
    strided_out = np.zeros((2, 4, 8, 7, 14), np.float32)[..., ::2]
    assert "sizes=(2,4,8,49)" in mvn_plan(x, (2, 3, 4), affine, out=strided_out)


def test_channels_last_group_norm_takes_lane_groups():
    # (N, H, W, G, C/G): the runs of a group's channels merge with the groups into lanes
    x = np.zeros((2, 6, 5, 4, 8), np.float32)
    assert mvn_plan(x, (1, 2, 4)).startswith("columns groups=2 lanes=32 group_size=30 lane_group=8")
    # a short run with more rows than its length outside it: MVN over (0, 2, 3) of 7x7 planes
    x = np.zeros((64, 16, 7, 7), np.float32)
    assert mvn_plan(x, (0, 2, 3)).startswith("columns groups=1 lanes=784 group_size=64 lane_group=49")
    # a run of up to 400 elements with 2 rows or more: its runs' fixed costs would outweigh the lanes'
    x = np.zeros((8, 16, 7, 7), np.float32)
    plan = mvn_plan(x, (0, 2, 3))
    assert plan.startswith("columns groups=1 lanes=784 group_size=8 lane_group=49")
    assert "(stats=vary" in plan  # a few vectors: normalized as lanes
    for dtype in ("float32", "float16", "float64"):
        x = np.zeros((8, 16, 14, 14), dtype)
        plan = mvn_plan(x, (0, 2, 3))
        assert plan.startswith("columns groups=1 lanes=3136 group_size=8 lane_group=196 lane_group_tasks")
        assert "inner=row_stream(stats=const" in plan or "inner=contiguous(stats=const" in plan  # as runs
    x = np.zeros((2, 4, 20, 20), np.float32)
    assert mvn_plan(x, (0, 2, 3)).startswith("columns groups=1 lanes=1600 group_size=2 lane_group=400")
    # a longer run, or a single one: each lane's sums would cost more than the runs
    x = np.zeros((8, 4, 401), np.float32)
    assert mvn_plan(x, (0, 2)).startswith("rows groups=4 lanes=1 group_size=3208")
    x = np.zeros((1, 16, 7, 7), np.float32)
    assert mvn_plan(x, (0, 2, 3)).startswith("rows groups=16 lanes=1 group_size=49")


def test_a_single_huge_group_is_split_over_blocks():
    x = np.zeros((1, 1 << 20), np.float32)
    assert "rows groups=1 lanes=1 group_size=1048576" in mvn_plan(x, (1,))


# The NCHW loops for short planes (a row stream; float32 with streaming stores: unpeeled rows) and
# the lengthened channels-last runs, checked against the float64 reference: every plane length
# around the vector widths (2 to 16 lanes), offsets that put rows at every alignment, and a
# fused activation whose lanes must take their own row's coefficients.
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("plane", [(1, 7), (3, 5), (4, 4), (1, 17), (7, 7), (3, 11), (5, 13)])
def test_short_planes_match_the_reference(isa, rng, dtype, plane):
    import ml_dtypes
    from reference import check_bn

    dt = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    shape = (3, 37) + plane

    def at_offset(a, k):  # a copy of a starting k elements past numpy's alignment
        buf = np.empty(a.size + k, a.dtype)
        v = buf[k:].reshape(a.shape)
        v[...] = a
        return v

    for offset in (0, 1, 5):
        x = at_offset(rng.standard_normal(shape).astype(dt), offset)
        mean, var, scale, bias = (rng.standard_normal(37).astype(np.float32) for _ in range(4))
        var = np.abs(var) + 0.5
        out = at_offset(np.full(shape, np.nan, dt), (offset * 3) % 7)
        simdnorm.batch_normalization(x, mean, var, scale, bias, activation="leaky_relu", out=out)
        check_bn(out, x, mean, var, scale, bias, activation="leaky_relu", context=f"offset {offset}")


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("channels", [1, 3, 8, 24, 64, 100])
def test_lengthened_channels_last_runs_match_the_reference(isa, rng, dtype, channels):
    from reference import check_bn

    x = rng.standard_normal((2, 6, 10, channels)).astype(dtype).transpose(0, 3, 1, 2)
    mean, var, scale, bias = (rng.standard_normal(channels).astype(np.float32) for _ in range(4))
    var = np.abs(var) + 0.5
    out = np.full((2, 6, 10, channels), np.nan, dtype).transpose(0, 3, 1, 2)
    simdnorm.batch_normalization(x, mean, var, scale, bias, activation="elu", out=out)
    check_bn(out, x, mean, var, scale, bias, activation="elu")


@pytest.mark.parametrize("shape, dtype, strategy", [
    ((8, 16, 7, 7), np.float32, "two-pass"),  # runs of 196 bytes: memory order
    ((2, 16, 16, 16), np.float32, "two-pass"),  # 1 KB
    ((2, 16, 17, 17), np.float32, "groups"),  # over 1 KB, in the caches: a channel at a time
    ((2, 16, 32, 32), np.float16, "groups"),
    ((32, 128, 28, 28), np.float32, "two-pass"),  # from memory: runs up to 4 KB
    ((32, 128, 28, 28), np.float64, "groups"),
])
def test_backward_of_small_planes_walks_memory_order(shape, dtype, strategy):
    # batch norm's backward on small NCHW planes: a channel's runs lie a sample apart, too short
    # for the prefetchers, and the two passes walk the data in memory order instead (and never
    # the forward's short lane groups, as MVN over (0, 2, 3) of 7x7 planes takes)
    x = np.zeros(shape, dtype)
    c = np.ones(shape[1], dtype)
    sums = [np.zeros(shape[1], np.float64) for _ in range(2)]
    plan = _core.mvn_backward(x, x, (0, 2, 3), c, c, c, c, None, np.empty_like(x), *sums, 1e-5, True, True, False,
                              IDENTITY, True, False, 1, True, False)
    assert plan.startswith(strategy + " groups=" + str(shape[1])), plan
    if strategy == "two-pass":
        assert "nest=sizes=(%d,%d,%d)" % (shape[0], shape[1], shape[2] * shape[3]) in plan, plan


@pytest.mark.parametrize("k, dtype, folds", [(8, np.float32, True), (64, np.float32, True),
                                             (65, np.float32, False), (128, np.float16, True)])
def test_channels_last_group_norm_backward_runs_all_the_channels(k, dtype, folds):
    # group norm's backward on channels-last data (split as N, G, K, H, W: each group's K channels
    # reduced with H and W): the statistics spread along the K channels, the channels one run of
    # G K lanes (lane_fold=K), up to 256-byte runs of a group's channels; NCHW keeps the groups
    groups = 4
    x = np.zeros((2, 5, 7, groups, k), dtype).transpose(0, 3, 4, 1, 2)
    st = np.ones((2, groups, 1, 1, 1), dtype)
    c = np.ones((1, groups, k, 1, 1), dtype)
    sums = [np.zeros(groups * k, np.float64) for _ in range(2)]
    args = (c, c, None, np.empty_like(x), *sums, 1e-5, True, True, False, IDENTITY, True, False, -1, True, False)
    plan = _core.mvn_backward(x, x, (2, 3, 4), st, st, *args)
    if folds:
        assert plan.startswith(f"two-pass groups={2 * groups} lane_fold={k} "), plan
        assert f"nest=sizes=(2,35,{groups * k})" in plan, plan
    else:
        assert "lane_fold" not in plan, plan
    nchw = np.zeros((2, groups, k, 5, 7), dtype)
    assert "lane_fold" not in _core.mvn_backward(nchw, nchw, (2, 3, 4), st, st, *args)


@pytest.mark.parametrize("plane, spread", [((12, 12), True), ((8, 16), True), ((11, 11), False), ((7, 7), False)])
def test_channels_last_backward_spreads_parameters_over_statistics(plane, spread):
    # instance and (spread) group norm of channels-last data, statistics per sample and channel,
    # parameters per channel: where a statistics element has 128 or more elements, the two passes
    # give it its own copy of its parameters; never batch norm (already sharing the statistics'
    # layout) nor NCHW data (each group whole in the caches)
    c = 64

    def plan(x, axes, stats, params):
        sums = [np.zeros(c, np.float64) for _ in range(2)]
        return _core.mvn_backward(x, x, axes, stats, stats, params, params, None, np.empty_like(x), *sums, 1e-5,
                                  True, True, False, IDENTITY, True, False, -1, True, False)

    x = np.zeros((2, *plane, c), np.float32).transpose(0, 3, 1, 2)
    channel = np.ones((1, c, 1, 1), np.float32)
    assert ("params-per-statistic" in plan(x, (2, 3), np.ones((2, c, 1, 1), np.float32), channel)) == spread
    xg = x.reshape(2, 8, 8, *plane)  # 8 groups of 8 channels
    got = plan(xg, (2, 3, 4), np.ones((2, 8, 1, 1, 1), np.float32), channel.reshape(1, 8, 8, 1, 1))
    assert ("params-per-statistic" in got) == spread and "lane_fold=8" in got, got
    assert "params-per-statistic" not in plan(x, (0, 2, 3), channel, channel)
    nchw = np.zeros((2, c, *plane), np.float32)
    assert "params-per-statistic" not in plan(nchw, (2, 3), np.ones((2, c, 1, 1), np.float32), channel)


def test_backward_statistics_follow_the_input_memory_order():
    # the backward's compact statistics and parameters are laid out in the input's memory order:
    # layer norm of a Fortran-ordered array reduces its outermost dim, and its statistics run
    # with the data along the inner dims (in the order of the dims they took a stride of 24
    # elements a step, and every element a gather)
    x = np.zeros((4, 6, 40), np.float32, order="F")
    sums = [np.zeros(40, np.float64) for _ in range(2)]
    st, p = np.ones((4, 6, 1), np.float32), np.ones((1, 1, 40), np.float32)
    plan = _core.mvn_backward(x, x, (2,), st, st, p, p, None, np.empty_like(x), *sums, 1e-5, True, True, False,
                              IDENTITY, True, False, -1, True, False)
    assert plan.startswith("two-pass groups=24 ") and " nest=sizes=(40,24) " in plan and " mul=(0,4) " in plan, plan


@pytest.mark.parametrize("shape, columns", [((64, 16384), 1024), ((128, 4096), 512), ((33, 4096), 2048),
                                            ((256, 1024), None), ((2048, 256), None)])
def test_backward_sums_of_wide_channel_rows_go_by_columns(shape, columns):
    # batch norm's backward over rows of many channels: where every chunk of elements would hold
    # all the channels' partial sums (to clear, flush and merge) past an eighth of its data, the
    # sums pass takes blocks of the channels instead, each over every row, its partials its own
    # (a few rows go by column chunks: below)
    x = np.zeros(shape, np.float32)
    c = np.ones((1, shape[1]), np.float32)
    sums = [np.zeros(shape[1], np.float64) for _ in range(2)]
    plan = _core.mvn_backward(x, x, (0,), c, c, c, c, None, np.empty_like(x), *sums, 1e-5, True, True, False,
                              IDENTITY, True, False, 1, True, False)
    assert plan.startswith("two-pass "), plan
    assert (f" sum_columns={columns}" in plan) if columns else "sum_columns" not in plan, plan


@pytest.mark.parametrize("shape, lanes", [((2, 65536), 8192), ((8, 16384), 4096), ((8, 4096), 4096),
                                          ((32, 4096), 1024), ((3, 20000), 6720), ((5, 100), 128), ((33, 4096), None),
                                          ((2, 64, 1, 1), 64)])
@pytest.mark.parametrize("terms", [True, False], ids=["training", "global"])
def test_backward_few_rows_of_many_channels_go_by_column_chunks(shape, lanes, terms):
    # up to 32 rows whose every channel has its own statistics and parameters (batch norm of (N, C)
    # data, of channels-last data of few pixels) go by chunks of channels, the lanes shared evenly
    # in multiples of 64, each chunk's sums, coefficients, grad_input and parameter sums in turn;
    # the sums pass writes there too without statistics terms
    x = np.zeros(shape, np.float32)
    if x.ndim == 4:
        x = np.zeros((shape[0], shape[2], shape[3], shape[1]), np.float32).transpose(0, 3, 1, 2)
    c = np.ones((1, shape[1]) + (1,) * (x.ndim - 2), np.float32)
    sums = [np.zeros(shape[1], np.float64) for _ in range(2)]
    axes = (0,) + tuple(range(2, x.ndim))
    plan = _core.mvn_backward(x, x, axes, c, c, c, c, None, np.empty_like(x), *sums, 1e-5, True, True, False,
                              IDENTITY, terms, False, 1, True, False)
    assert plan.startswith("two-pass "), plan
    assert (f" column_chunks={lanes}" in plan) if lanes else "column_chunks" not in plan, plan
    # (one sweep a chunk where the group sums derive from the parameters', or without terms; past 8
    # rows only rows spread over the L1's sets, not these of 16 KB or more)
    assert (" sweep" in plan) == (lanes is not None and (shape[0] <= 8 or shape[1] * 4 % 4096 != 0)), plan
    assert ("sums-write" in plan) == (not terms), plan
    # grad_input not asked for: nothing to chunk (the sums alone)
    if terms:
        plan = _core.mvn_backward(x, x, axes, c, c, c, c, None, None, *sums, 1e-5, True, True, False, IDENTITY,
                                  terms, False, 1, True, False)
        assert "column_chunks" not in plan, plan


def test_wide_channel_rows_streamed_by_the_sums_pass_keep_whole_rows():
    # without statistics terms (training=False) the sums pass writes grad_input; from memory it
    # streams it, and then takes whole rows (blocks of columns measured slower there)
    x = np.zeros((1024, 16384), np.float32)
    c = np.ones((1, 16384), np.float32)
    sums = [np.zeros(16384, np.float64) for _ in range(2)]

    def plan(terms):
        return _core.mvn_backward(x, x, (0,), c, c, c, c, None, np.empty_like(x), *sums, 1e-5, True, True, False,
                                  IDENTITY, terms, False, 1, True, False)

    assert "sums-write" in plan(False) and "streaming-stores" in plan(False), plan(False)
    assert "sum_columns" not in plan(False), plan(False)
    assert "sum_columns=256" in plan(True), plan(True)


def test_backward_two_passes_go_in_slabs_only_from_memory_and_apart():
    # From memory, the two passes go slab by slab (each summed, then written from the L2): slabs of
    # whole samples where the statistics are per sample (instance norm of channels-last data), any
    # range where grad_input needs the sums (without statistics terms it is written in the sums
    # pass: one pass). Never in the caches, nor where every slab would reach every statistic
    # (batch norm's batch statistics of channels-last data), nor samples past the L2.
    def plan(shape, axes, per_sample, terms=True):
        x = np.zeros(shape, np.float32)
        stats = np.ones((shape[0] if per_sample else 1, 1, 1, shape[-1]), np.float32)
        c = np.ones(shape[-1], np.float32)
        sums = [np.zeros(shape[-1], np.float64) for _ in range(2)]
        return _core.mvn_backward(x, x, axes, stats, stats, c, c, None, np.empty_like(x), *sums, 1e-5, True, True,
                                  False, IDENTITY, terms, False, -1, True, False)

    n = _core.stream_threshold_bytes() // (3 * 4 * 8 * 8 * 64) + 1
    assert "slabs=" in plan((n, 8, 8, 64), (1, 2), True)
    assert "slabs=" not in plan((2, 8, 8, 64), (1, 2), True)  # in the caches
    assert "slabs=" not in plan((n, 8, 8, 64), (0, 1, 2), False)  # batch statistics
    # global statistics: no slabs, the sums pass writes grad_input too, from memory or not
    for rows in (n, 2):
        got = plan((rows, 8, 8, 64), (0, 1, 2), False, terms=False)
        assert "sums-write" in got and "slabs=" not in got, got
    assert "sums-write" not in plan((n, 8, 8, 64), (1, 2), True)
    big = _core.stream_threshold_bytes() // (3 * 4 * 64) + 1  # one sample past the L2: no slab
    assert "slabs=" not in plan((2, big // 128, 64, 64), (1, 2), True)


def test_backward_small_nchw_planes_go_in_blocks_of_channels():
    # Batch statistics of NCHW data with small planes (two passes in memory order): where x and dy
    # pass one slab (512 KB), blocks of channels with all their samples, each summed, then written
    # from the L2, from memory or not; one slab's worth runs whole; statistics of the runs' own dim
    # only (channels last) have no dim to cut.
    def plan(shape, channel_axis=1):
        x = np.zeros(shape, np.float32)
        c = shape[channel_axis]
        st = np.ones([c if d == channel_axis else 1 for d in range(len(shape))], np.float32)
        sums = [np.zeros(c, np.float64) for _ in range(2)]
        axes = tuple(d for d in range(len(shape)) if d != channel_axis)
        return _core.mvn_backward(x, x, axes, st, st, st, st, None, np.empty_like(x), *sums, 1e-5, True, True, False,
                                  IDENTITY, True, False, channel_axis, True, False)

    got = plan((8, 512, 7, 7))  # 1.6 MB of x and dy: blocks of 160 channels (whole rows of 32 slots)
    assert got.startswith("two-pass ") and " slabs=4" in got, got
    assert " slabs=" not in plan((2, 256, 7, 7))  # 200 KB: one slab
    assert " slabs=" not in plan((8, 7, 7, 512), channel_axis=3)
