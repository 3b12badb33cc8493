"""simdnorm.dask (SPEC section 11) on the threaded scheduler: every op against the float64 reference,
within the in-memory bound, on many chunkings of the same array (one chunk, uneven chunks, the
normalized axes split across chunks, size-1 chunks) and on cases drawn from the whole space (rank,
shape, dtype, chunking, axes, flags, parameters; SIMDNORM_DASK_FUZZ_CASES); meta, dtype and chunks
as declared before compute; large-mean statistics merged in float64; one simdnorm thread per task;
errors raised at the call. The distributed scheduler: tests/test_dask_distributed.py."""

from __future__ import annotations

import contextlib
import os
import warnings

import numpy as np
import pytest

dask = pytest.importorskip("dask", reason="simdnorm.dask needs dask: pip install '.[dask]' (the test extra has it)")
da = pytest.importorskip("dask.array", reason="simdnorm.dask needs dask[array]")

import simdnorm  # noqa: E402
import simdnorm.dask as sd  # noqa: E402
from simdnorm import _core  # noqa: E402
from cases import AxisError, bits, rand_values, scale_bias_values  # noqa: E402
from reference import (BF16, F16, F32, F64, check_bn, check_close, check_mvn, check_stats, dtype_id,  # noqa: E402
                       group_norm_ref, layer_norm_axes, normalize_axes)
from training_reference import bn_training_ref  # noqa: E402

SHAPE = (4, 6, 3, 5)  # (N, C, H, W)
# name -> chunks of SHAPE; each normalization below meets at least one chunking that splits its axes
CHUNKINGS = {
    "one chunk": -1,
    "uneven": ((3, 1), (4, 2), (3,), (5,)),
    "normalized split": ((4,), (6,), (1, 2), (2, 3)),
    "uneven everywhere": ((1, 3), (2, 1, 3), (2, 1), (3, 2)),
    "size-1": 1,
}
CH = pytest.mark.parametrize("chunking", list(CHUNKINGS))


def lazy(x, chunking):
    return da.from_array(x, chunks=CHUNKINGS[chunking] if isinstance(chunking, str) else chunking)


def materialize(*arrays, scheduler="threads"):
    """Compute dask arrays (None stays None) block by block in one call, checking that every block
    is an ndarray of the declared dtype and chunk shape and that the meta is an empty ndarray of
    that dtype and ndim; return the assembled numpy arrays."""
    live = [a for a in arrays if a is not None]
    for a in live:
        assert isinstance(a, da.Array), type(a)
        assert type(a._meta) is np.ndarray and a._meta.dtype == a.dtype and a._meta.ndim == a.ndim, (a._meta, a.dtype)
    delayed = [a.to_delayed() for a in live]
    blocks = dask.compute(*[d.ravel().tolist() for d in delayed], scheduler=scheduler)
    done = []
    for a, d, got in zip(live, delayed, blocks):
        grid = np.empty(d.shape, dtype=object)
        for idx, blk in zip(np.ndindex(*d.shape), got):
            want = tuple(blk.shape[k] if np.isnan(a.chunks[k][i]) else a.chunks[k][i] for k, i in enumerate(idx))
            assert type(blk) is np.ndarray and blk.shape == want and blk.dtype == a.dtype, (
                type(blk), getattr(blk, "shape", None), want, getattr(blk, "dtype", None), a.dtype)
            grid[idx] = blk
        done.append(np.block(grid.tolist()) if a.ndim else grid[()])
    it = iter(done)
    return [None if a is None else next(it) for a in arrays]


def offset(rng, shape, dtype=F32, loc=2.0, scale=1.5):
    return rand_values(rng, shape, dtype, loc=loc, scale=scale)


# ----------------------------------------------------------------------------------------------------
# against the reference, chunking by chunking

@CH
@pytest.mark.parametrize("axes", [0, 3, (2, 3), (0, 2, 3), (0, 1, 2, 3)])
def test_mvn(rng, chunking, axes):
    x = offset(rng, SHAPE)
    kept = tuple(1 if d in normalize_axes(axes, 4) else s for d, s in enumerate(SHAPE))
    s = scale_bias_values(rng, kept[1:], F32)  # fewer leading dims, dims of 1: broadcast as numpy does
    b = scale_bias_values(rng, kept, F32, "bias")
    X = lazy(x, chunking)
    y, mean, inv = materialize(*sd.mean_variance_normalization(X, axes, s, lazy(b, 2), return_stats=True))
    check_mvn(y, x, axes, s, b, stats=(mean, inv), context=chunking)
    y, mean, inv = materialize(*sd.mean_variance_normalization(X, axes, epsilon_mode="outside", epsilon=0.5,
                                                               activation="gelu", return_stats=True))
    check_mvn(y, x, axes, epsilon=0.5, epsilon_mode="outside", activation="gelu", stats=(mean, inv), context=chunking)


@CH
def test_mvn_without_mean_or_variance(rng, chunking):
    x = offset(rng, SHAPE)
    X = lazy(x, chunking)
    for nm, nv in ((False, True), (True, False), (False, False)):
        y, mean, inv = materialize(*sd.mean_variance_normalization(X, (0, 3), normalize_mean=nm, normalize_variance=nv,
                                                                   activation="relu", return_stats=True))
        check_mvn(y, x, (0, 3), normalize_mean=nm, normalize_variance=nv, activation="relu", stats=(mean, inv),
                  context=f"{chunking} nm={nm} nv={nv}")


@CH
def test_layer_and_rms_norm(rng, chunking):
    x = offset(rng, SHAPE)
    X = lazy(x, chunking)
    for axis in (-1, 2):
        shape = SHAPE[axis:]
        s, b = scale_bias_values(rng, shape, F32), scale_bias_values(rng, shape, F32, "bias")
        axes = layer_norm_axes(4, axis)
        y, mean, inv = materialize(*sd.layer_norm(X, da.from_array(s), b, axis=axis, return_stats=True))
        check_mvn(y, x, axes, s, b, stats=(mean, inv), context=f"{chunking} axis={axis}")
        y, none, inv = materialize(*sd.rms_norm(X, s, axis=axis, activation="silu", return_stats=True))
        assert none is None
        check_mvn(y, x, axes, s, normalize_mean=False, activation="silu", stats=(None, inv), context=chunking)
    assert materialize(sd.layer_norm(X))[0].shape == SHAPE


@CH
@pytest.mark.parametrize("channels", ["first", "last"])
def test_instance_norm(rng, chunking, channels):
    x = offset(rng, SHAPE)
    X = lazy(x, chunking)
    ca = 1
    if channels == "last":
        x, X, ca = x.transpose(0, 2, 3, 1), X.transpose(0, 2, 3, 1), -1
    c = x.shape[ca]
    s, b = scale_bias_values(rng, (c,), F32), scale_bias_values(rng, (c,), F32, "bias")
    y, mean, inv = materialize(*sd.instance_norm(X, s, lazy(b, 4), channel_axis=ca, return_stats=True))
    axes = tuple(d for d in range(1, 4) if d != ca % 4)
    shape = [1] * 4
    shape[ca] = c
    check_mvn(y, x, axes, s.reshape(shape), b.reshape(shape), stats=(mean, inv), context=f"{chunking} {channels}")


@CH
@pytest.mark.parametrize("channels", ["first", "last"])
def test_group_norm(rng, chunking, channels):
    x = offset(rng, SHAPE)
    X = lazy(x, chunking)
    ca = 1
    if channels == "last":
        x, X, ca = x.transpose(0, 2, 3, 1), X.transpose(0, 2, 3, 1), -1
    s, b = scale_bias_values(rng, (6,), F32), scale_bias_values(rng, (6,), F32, "bias")
    for g in (1, 2, 3, 6):
        Y = sd.group_norm(X, g, s, b, channel_axis=ca, activation="leaky_relu", return_stats=True)
        k = 6 // g
        assert all(c % k == 0 for c in Y[0].chunks[ca]), Y[0].chunks  # channel chunks at group boundaries
        assert all(Y[0].chunks[d] == X.chunks[d] for d in range(4) if d != ca % 4)
        y, mean, inv = materialize(*Y)
        # the reference's pre-activation, and its error scale (|x| + |mean| + std) * inv * |s| + |b|
        z, rmean, rinv = group_norm_ref(x, g, s, b, channel_axis=ca)
        xm = np.moveaxis(x.astype(np.float64), ca, 1).reshape((4, g, -1))
        spread = (np.abs(xm) + np.abs(rmean)[..., None] + 1 / rinv[..., None]) * rinv[..., None]
        zscale = np.moveaxis(spread.reshape(np.moveaxis(x, ca, 1).shape), 1, ca) * np.abs(
            s.reshape([-1 if d == ca % 4 else 1 for d in range(4)])) + np.abs(
            b.reshape([-1 if d == ca % 4 else 1 for d in range(4)]))
        check_close(y, z, zscale, "leaky_relu", dtype=F32, context=f"{chunking} {channels} groups={g}")
        assert mean.shape == inv.shape == (4, g) and mean.dtype == inv.dtype == F32
        np.testing.assert_allclose(mean, rmean, rtol=1e-5, atol=1e-5 / rinv.min())
        np.testing.assert_allclose(inv, rinv, rtol=4e-5)


def test_group_norm_moves_channel_chunks_to_group_boundaries(rng):
    x = offset(rng, (2, 12, 4))
    X = da.from_array(x, chunks=((2,), (5, 7), (2, 2)))
    for g, want in ((3, (4, 8)), (6, (4, 8)), (2, (6, 6)), (1, (12,)), (12, (5, 7))):
        y = sd.group_norm(X, g)
        assert y.chunks[1] == want, (g, y.chunks)
        np.testing.assert_allclose(materialize(y)[0], simdnorm.group_norm(x, g), rtol=1e-5, atol=2e-6)


@CH
@pytest.mark.parametrize("form", ["1-D", "same rank", "dask"])
def test_batch_normalization(rng, chunking, form):
    x = offset(rng, SHAPE)
    X = lazy(x, chunking)
    shape = (6,) if form != "same rank" else (1, 6, 3, 1)
    mean = rand_values(rng, shape, F32)
    var = np.abs(rand_values(rng, shape, F32)) + 0.1
    s, b = scale_bias_values(rng, shape, F32), scale_bias_values(rng, shape, F32, "bias")
    if form == "dask":
        mean, var = lazy(mean, 4), lazy(var, 2)
    y = materialize(sd.batch_normalization(X, mean, var, s, b, activation="tanh"))[0]
    check_bn(y, x, np.asarray(mean), np.asarray(var), s, b, activation="tanh", context=f"{chunking} {form}")
    if form != "same rank":  # channels last
        xl, Xl = x.transpose(0, 2, 3, 1), X.transpose(0, 2, 3, 1)
        y = materialize(sd.batch_normalization(Xl, mean, var, s, channel_axis=-1))[0]
        check_bn(y, xl, np.asarray(mean), np.asarray(var), s, channel_axis=-1, context=f"{chunking} {form} NHWC")


def check_training(res, x, s, b, *, epsilon=1e-5, channel_axis=1, fused_add=None, activation=None, context=""):
    y, mean, var = materialize(*res)
    r = bn_training_ref(x, s, b, epsilon=epsilon, channel_axis=channel_axis, fused_add=fused_add)
    check_close(y, r.pre, r.zscale, activation, dtype=x.dtype, context=context)
    sdt = F64 if x.dtype == F64 else F32
    rt = 1e-12 if sdt == F64 else 1e-5
    assert mean.dtype == var.dtype == sdt and mean.shape == var.shape == r.stat_shape, (mean.shape, r.stat_shape)
    assert (np.abs(mean - r.mean) <= rt * (np.abs(r.mean) + np.sqrt(r.var))).all(), context
    assert (np.abs(var - r.var) <= 4 * rt * r.var).all(), context


@CH
@pytest.mark.parametrize("fused", [None, "full", "broadcast"])
def test_batch_normalization_training(rng, chunking, fused):
    x = offset(rng, SHAPE)
    X = lazy(x, chunking)
    s, b = scale_bias_values(rng, (6,), F32), scale_bias_values(rng, (6,), F32, "bias")
    fa = {None: None, "full": offset(rng, SHAPE), "broadcast": offset(rng, (3, 5))}[fused]
    fal = fa if fa is None or fused == "broadcast" else lazy(fa, chunking)
    check_training(sd.batch_normalization_training(X, s, b, fused_add=fal, activation="relu"), x, s, b, fused_add=fa,
                   activation="relu", context=f"{chunking} fused={fused}")
    # same-rank parameters (DirectML): statistics over the dims where they are 1
    sr = scale_bias_values(rng, (1, 6, 3, 1), F32)
    check_training(sd.batch_normalization_training(X, sr, epsilon=1e-3), x, sr, None, epsilon=1e-3,
                   context=f"{chunking} same rank")
    xl, Xl = x.transpose(0, 2, 3, 1), X.transpose(0, 2, 3, 1)
    check_training(sd.batch_normalization_training(Xl, s, channel_axis=-1), xl, s, None, channel_axis=-1,
                   context=f"{chunking} channels last")


@pytest.mark.parametrize("dtype", [F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("chunking", ["one chunk", "uneven everywhere"])
def test_other_dtypes(rng, dtype, chunking):
    x = offset(rng, SHAPE, dtype)
    X = lazy(x, chunking)
    s = scale_bias_values(rng, SHAPE[1:], dtype)
    y, mean, inv = materialize(*sd.mean_variance_normalization(X, (0, 2, 3), s, return_stats=True))
    assert y.dtype == dtype and mean.dtype == inv.dtype == (F64 if dtype == F64 else F32)
    check_mvn(y, x, (0, 2, 3), s, stats=(mean, inv), context=f"{dtype_id(dtype)} {chunking}")
    fa = offset(rng, SHAPE, dtype)
    check_training(sd.batch_normalization_training(X, fused_add=lazy(fa, 2), activation="gelu"), x, None, None,
                   fused_add=fa, activation="gelu", context=f"{dtype_id(dtype)} {chunking}")


# ----------------------------------------------------------------------------------------------------
# drawn from the whole input space: rank, shape, dtype, chunking, axes and parameters independently

DASK_CASES = int(os.environ.get("SIMDNORM_DASK_FUZZ_CASES", "60"))


def _random_chunks(rng, shape):
    """Each dim whole, cut at 1-3 random points, or in chunks of 1; now and then with an empty
    chunk among them (dask allows them)."""
    chunks = []
    for n in shape:
        kind = rng.integers(0, 4)
        if n == 1 or kind == 0:
            chunks.append((n,))
        elif kind == 3:
            chunks.append((1,) * n)
        else:
            cuts = sorted(set(rng.integers(1, n, size=min(int(kind), n - 1)).tolist()))
            edges = [0, *cuts, n]
            chunks.append(tuple(b - a for a, b in zip(edges, edges[1:])))
        if rng.random() < 0.1:
            at = int(rng.integers(0, len(chunks[-1]) + 1))
            chunks[-1] = chunks[-1][:at] + (0,) + chunks[-1][at:]
    return tuple(chunks)


def _maybe_unknown(rng, X, free):
    """Now and then X with its sizes along one of the dims `free` unknown to dask (NaN chunks: a
    dask boolean index keeping every element), and that dim (None: X as it was). Not where X has
    an empty chunk: dask's boolean index then gives its blocks the wrong shapes (2026.8)."""
    if not free or any(0 in c for c in X.chunks) or rng.random() >= 0.2:
        return X, None
    d = int(rng.choice(free))
    keep = da.from_array(np.ones(X.shape[d], bool), chunks=(X.chunks[d],))
    return X[(slice(None),) * d + (keep,)], d


@pytest.mark.parametrize("case", range(DASK_CASES))
def test_drawn_ranks_dtypes_chunkings_and_axes(case):
    rng = np.random.default_rng([20261201, case])
    nd = int(rng.integers(1, 9))
    shape = tuple(int(v) for v in rng.integers(1, 5 if nd > 4 else 12, size=nd))
    dtype = (F32, F16, BF16, F64)[int(rng.integers(0, 4))]
    pdt = F64 if dtype == F64 else F32
    x = offset(rng, shape, dtype, loc=float(rng.choice([0.0, 3.0, 300.0])))
    chunks = _random_chunks(rng, shape)
    X = lazy(x, chunks)
    context = f"case {case}: shape {shape} {dtype_id(dtype)} chunks {chunks}"
    if nd >= 2 and rng.random() < 0.3:  # batch norm training over every dim but a drawn channel axis
        ca = int(rng.integers(0, nd))
        s = scale_bias_values(rng, (shape[ca],), pdt)
        b = scale_bias_values(rng, (shape[ca],), pdt, "bias") if rng.random() < 0.5 else None
        X, hidden = _maybe_unknown(rng, X, [d for d in range(nd) if d != ca])
        check_training(sd.batch_normalization_training(X, s, b, channel_axis=ca, activation="relu"), x, s, b,
                       channel_axis=ca, activation="relu",
                       context=f"{context} bn training channel_axis={ca} unknown sizes along {hidden}")
        return
    axes = tuple(sorted(rng.choice(nd, size=int(rng.integers(1, nd + 1)), replace=False).tolist()))
    kept = tuple(1 if d in axes else n for d, n in enumerate(shape))
    lead = int(rng.integers(0, nd))  # parameters with fewer leading dims broadcast as numpy's do
    s = scale_bias_values(rng, kept[lead:], pdt) if rng.random() < 0.6 else None
    b = scale_bias_values(rng, kept, pdt, "bias") if rng.random() < 0.4 else None
    lazy_b = b if b is None or rng.random() < 0.5 else lazy(b, 1)
    spanned = {d for p in (s, b) if p is not None for d, n in zip(range(nd - p.ndim, nd), p.shape) if n != 1}
    X, hidden = _maybe_unknown(rng, X, [d for d in range(nd) if d not in spanned])
    context += f" unknown sizes along {hidden}"
    kw = dict(normalize_mean=bool(rng.random() < 0.8), normalize_variance=bool(rng.random() < 0.8),
              epsilon_mode=("inside", "outside")[int(rng.integers(0, 2))],
              activation=(None, "relu", "gelu")[int(rng.integers(0, 3))])
    y, mean, inv = materialize(*sd.mean_variance_normalization(X, axes, s, lazy_b, return_stats=True, **kw))
    check_mvn(y, x, axes, s, b, stats=(mean, inv), context=f"{context} axes {axes} {kw}", **kw)


@pytest.mark.parametrize("chunking", ["one chunk", "uneven everywhere"])
def test_unknown_chunk_sizes_along_dims_the_op_does_not_need(rng, chunking):
    # A dask boolean index leaves the sizes along its dim unknown (NaN chunks). Each op runs where
    # it needs none of them: no parameter spans that dim, it is not group norm's channels. Where it
    # needs one, it names that dim.
    x = offset(rng, SHAPE)
    X = lazy(x, chunking)
    c = SHAPE[1]
    s, b = scale_bias_values(rng, (c,), F32), scale_bias_values(rng, (c,), F32, "bias")
    per_channel = (1, c, 1, 1)
    samples, channels = np.array([True, False, True, True]), np.array([True, True, False, True, True, True])
    xn, Xn = x[samples], X[da.from_array(samples, chunks=(X.chunks[0],))]
    xc, Xc = x[:, channels], X[:, da.from_array(channels, chunks=(X.chunks[1],))]
    assert np.isnan(Xn.shape[0]) and np.isnan(Xc.shape[1])
    ctx = f"{chunking} unknown N"
    sl, bl = scale_bias_values(rng, SHAPE[2:], F32), scale_bias_values(rng, SHAPE[2:], F32, "bias")
    y, mean, inv = materialize(*sd.layer_norm(Xn, sl, bl, axis=2, return_stats=True))
    check_mvn(y, xn, (2, 3), sl, bl, stats=(mean, inv), context=ctx)
    y, _, inv = materialize(*sd.rms_norm(Xn, sl, axis=2, return_stats=True))
    check_mvn(y, xn, (2, 3), sl, normalize_mean=False, stats=(None, inv), context=ctx)
    y, mean, inv = materialize(*sd.mean_variance_normalization(Xn, (0, 2, 3), s.reshape(per_channel),
                                                               return_stats=True))
    check_mvn(y, xn, (0, 2, 3), s.reshape(per_channel), stats=(mean, inv), context=ctx)
    y, mean, inv = materialize(*sd.instance_norm(Xn, s, b, return_stats=True))
    check_mvn(y, xn, (2, 3), s.reshape(per_channel), b.reshape(per_channel), stats=(mean, inv), context=ctx)
    for g in (2, 3):
        y, mean, inv = materialize(*sd.group_norm(Xn, g, s, b, return_stats=True))
        wy, wmean, winv = simdnorm.group_norm(xn, g, s, b, return_stats=True)
        np.testing.assert_allclose(y, wy, rtol=1e-5, atol=1e-5, err_msg=ctx)
        np.testing.assert_allclose(mean, wmean, rtol=1e-5, atol=1e-5, err_msg=ctx)
        np.testing.assert_allclose(inv, winv, rtol=1e-5, err_msg=ctx)
    mean, var = rand_values(rng, (c,), F32), np.abs(rand_values(rng, (c,), F32)) + 0.1
    check_bn(materialize(sd.batch_normalization(Xn, mean, var, s, b))[0], xn, mean, var, s, b, context=ctx)
    fa = offset(rng, SHAPE[1:])
    check_training(sd.batch_normalization_training(Xn, s, b, fused_add=fa), xn, s, b, fused_add=fa, context=ctx)
    y, mean, inv = materialize(*sd.group_norm(Xn[:, :0], 2, return_stats=True))
    assert y.shape == (3, 0, 3, 5) and mean.shape == inv.shape == (3, 2) and np.isnan(mean).all()
    # unknown C: the ops that need no size along it
    ctx = f"{chunking} unknown C"
    y, mean, inv = materialize(*sd.layer_norm(Xc, axis=1, return_stats=True))
    check_mvn(y, xc, (1, 2, 3), stats=(mean, inv), context=ctx)
    y, mean, inv = materialize(*sd.instance_norm(Xc, return_stats=True))
    check_mvn(y, xc, (2, 3), stats=(mean, inv), context=ctx)
    check_training(sd.batch_normalization_training(Xc), xc, None, None, context=ctx)
    check_training(sd.batch_normalization_training(Xc.transpose(0, 2, 3, 1), channel_axis=-1),
                   xc.transpose(0, 2, 3, 1), None, None, channel_axis=-1, context=ctx + " channels last")
    for call in (lambda: sd.batch_normalization(Xc, mean[:5], var[:5]), lambda: sd.group_norm(Xc, 5),
                 lambda: sd.instance_norm(Xc, s[:5]), lambda: sd.layer_norm(Xc, np.ones((5, 3, 5), F32), axis=1),
                 lambda: sd.batch_normalization_training(Xc, s[:5]),
                 lambda: sd.mean_variance_normalization(Xc, (2, 3), np.ones((5, 1, 1), F32))):
        with pytest.raises(ValueError, match=r"unknown chunk sizes along axis 1 .*compute_chunk_sizes"):
            call()
    with pytest.raises(ValueError, match=r"unknown chunk sizes along axis 0 .*parameters need"):
        sd.batch_normalization_training(Xn, fused_add=np.ones((3, *SHAPE[1:]), F32))
    # an invalid call's message shows the input's shape as dask has it, beside the stand-in's
    with pytest.raises(ValueError, match=r"no spatial dims.*the input's shape \(nan, 5\): its unknown sizes read "):
        sd.instance_norm(Xn[:, 0, 0])
    # a 1-D input's (C,) parameters run along its one dim, whatever channel_axis says
    v = da.from_array(x[0, 0, 0], chunks=2)
    vn = v[v > -np.inf]
    for call in (lambda: sd.batch_normalization(vn, np.zeros(5, F32), np.ones(5, F32)),
                 lambda: sd.batch_normalization_training(vn, np.ones(5, F32))):
        with pytest.raises(ValueError, match=r"unknown chunk sizes along axis 0 .*parameters need"):
            call()


def test_empty_arrays(rng):
    for shape, axes in (((0, 5), 1), ((4, 0), 1), ((4, 0), 0)):
        x = np.zeros(shape, F32)
        y, mean, inv = materialize(*sd.mean_variance_normalization(da.from_array(x), axes, return_stats=True))
        wy, wmean, winv = simdnorm.mean_variance_normalization(x, axes, return_stats=True)
        assert y.shape == shape and mean.shape == wmean.shape
        np.testing.assert_array_equal(mean, wmean)
        np.testing.assert_array_equal(inv, winv)
    y, mean, inv = materialize(*sd.group_norm(da.zeros((2, 0, 3), dtype=F32), 3, return_stats=True))
    assert y.shape == (2, 0, 3) and mean.shape == (2, 3) and np.isnan(mean).all() and np.isnan(inv).all()
    # the statistics merged across chunks where another dim is empty, or from an empty chunk
    for shape, chunks, axes in (((6, 0), 3, 0), ((6, 0, 4), 3, (0, 2)), ((6, 7), ((3, 0, 3), (7,)), 0),
                                ((6, 7), ((3, 3), (0, 7)), 0)):
        x = offset(rng, shape, F32)
        y, mean, inv = materialize(*sd.mean_variance_normalization(lazy(x, chunks), axes, return_stats=True))
        wy, wmean, winv = simdnorm.mean_variance_normalization(x, axes, return_stats=True)
        np.testing.assert_allclose(y, wy, rtol=1e-6, atol=1e-6, err_msg=f"{shape} {chunks}")
        np.testing.assert_allclose(mean, wmean, rtol=1e-7, err_msg=f"{shape} {chunks}")
        y, bm, bv = materialize(*sd.batch_normalization_training(lazy(x, chunks), channel_axis=x.ndim - 1))
        assert y.shape == shape and bm.shape == bv.shape == (shape[-1],)
    # statistics of no elements, merged from several empty chunks: NaN, as in memory
    X = da.from_array(np.zeros((0, 6), F32), chunks=((0, 0, 0), (6,)))
    y, mean, inv = materialize(*sd.mean_variance_normalization(X, 0, return_stats=True))
    assert y.shape == (0, 6) and mean.shape == inv.shape == (1, 6) and np.isnan(mean).all() and np.isnan(inv).all()
    y, bm, bv = materialize(*sd.batch_normalization_training(X, channel_axis=1))
    assert bm.shape == bv.shape == (6,) and np.isnan(bm).all() and np.isnan(bv).all()


def test_no_numpy_warnings_where_the_in_memory_ops_give_none(rng):
    """The tasks' numpy arithmetic on a constant group with epsilon 0 (0 * inf) or a variance
    float32 cannot hold is as silent as the kernels, with the same values."""
    const = np.full((4, 6), 3.0, F32)
    wide = (3e38 * rng.choice([-1.0, 1.0], (4, 6))).astype(F32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, m, v = materialize(*sd.batch_normalization_training(lazy(const, 2), channel_axis=1, epsilon=0.0,
                                                              fused_add=lazy(const, 2)))
        want = simdnorm.batch_normalization_training(const, channel_axis=1, epsilon=0.0, fused_add=const)
        for got, w in zip((y, m, v), want):
            np.testing.assert_array_equal(got, w)
        y, m, v = materialize(*sd.batch_normalization_training(lazy(wide, 2), channel_axis=1))
        want = simdnorm.batch_normalization_training(wide, channel_axis=1)
        np.testing.assert_allclose(y, want[0], rtol=1e-6)
        np.testing.assert_array_equal(v, want[2])


def test_tiny_spread_beyond_float32_variances(rng):
    # float32 data whose variance is below float32's normal range (spread ~1e-21): the split path
    # cannot hand it to batch norm's float32 variance and normalizes from float64 1 / std instead
    x = (1e-20 + 1e-21 * rng.standard_normal((8, 6))).astype(F32)
    X = da.from_array(x, chunks=(3, 6))
    for mode in ("inside", "outside"):
        y, mean, inv = materialize(*sd.mean_variance_normalization(X, 0, epsilon=0.0, epsilon_mode=mode,
                                                                   return_stats=True))
        check_mvn(y, x, 0, epsilon=0.0, epsilon_mode=mode, stats=(mean, inv), context=mode)
    # float64 with epsilon outside the root past ~1e154, where (std + epsilon) ** 2 overflows double
    x = rng.standard_normal((8, 6))
    for eps in (1e160, 1e300):
        y = materialize(sd.mean_variance_normalization(da.from_array(x, chunks=(3, 6)), 0, epsilon=eps,
                                                       epsilon_mode="outside"))[0]
        check_mvn(y, x, 0, epsilon=eps, epsilon_mode="outside", context=f"float64 outside {eps:g}")


# ----------------------------------------------------------------------------------------------------
# statistics of large-mean data, merged from many chunks

def test_large_mean_statistics_as_accurate_as_in_memory(rng):
    # the data: float32 of mean 1000 and std 0.01, (8192, 1024) in 64 chunks of rows
    x = (1000.0 + 0.01 * rng.standard_normal((8192, 1024))).astype(F32)
    X = da.from_array(x, chunks=(128, 1024))
    xl = x.astype(np.longdouble)
    truth_mean = xl.mean()
    truth_var = float(((xl - truth_mean) ** 2).mean())
    one = np.ones((1, 1), F32)  # a same-rank scale of size 1 everywhere: statistics over both axes
    _, mean, var = materialize(*sd.batch_normalization_training(X, one))
    _, _, in_memory = simdnorm.batch_normalization_training(x, one)
    ours = abs(float(var.ravel()[0]) / truth_var - 1)
    bound = abs(float(in_memory.ravel()[0]) / truth_var - 1)
    assert ours <= max(bound, 2.0 ** -24), (ours, bound)  # the float64 merge, then one float32 rounding
    # MVN over all axes: the same float64 statistics give 1 / std
    _, m, inv = materialize(*sd.mean_variance_normalization(X, (0, 1), epsilon=0.0, return_stats=True))
    assert abs(float(inv.ravel()[0]) * np.sqrt(truth_var) - 1) < 2.0 ** -23
    assert abs(float(m.ravel()[0]) - float(truth_mean)) <= 2.0 ** -24 * 1000


# ----------------------------------------------------------------------------------------------------
# the graph: lazy, typed, deterministic, one thread a task

def test_lazy_typed_and_chunked_like_the_input(rng):
    x = offset(rng, SHAPE)
    X = lazy(x, "uneven everywhere")
    for res in (sd.layer_norm(X, return_stats=True), sd.mean_variance_normalization(X, 0, return_stats=True)):
        y, mean, inv = res
        assert y.chunks == X.chunks and y.dtype == F32 and type(y._meta) is np.ndarray
        assert mean.dtype == inv.dtype == F32 and mean._meta.dtype == F32 and mean._meta.ndim == 4
    def names(a):
        return {k[0] if isinstance(k, tuple) else k for k in dict(a.dask)}
    assert any(n.startswith("simdnorm-moments") for n in names(sd.mean_variance_normalization(X, 0)))
    assert not any(n.startswith("simdnorm-moments") for n in names(sd.layer_norm(X.rechunk({3: -1}))))
    X64 = X.astype(F64)
    assert all(a.dtype == F64 for a in sd.mean_variance_normalization(X64, 0, return_stats=True))


def test_same_bits_on_any_scheduler_and_run(rng):
    x = offset(rng, (40, 30), loc=500.0, scale=0.1)
    X = da.from_array(x, chunks=(7, 9))
    graphs = [sd.mean_variance_normalization(X, 0, return_stats=True),
              sd.group_norm(X.reshape(40, 6, 5), 3, return_stats=True)]
    runs = [materialize(*graphs[0], *graphs[1], scheduler=s) for s in ("threads", "sync", "threads")]
    for run in runs[1:]:
        assert all((bits(a) == bits(b)).all() for a, b in zip(run, runs[0]))


def test_each_task_runs_on_its_own_thread_count(rng, monkeypatch, threads):
    threads(2)
    seen = []
    real = sd.caller_threads

    @contextlib.contextmanager
    def spy(n):
        with real(n):
            seen.append(_core.caller_threads())
            yield

    monkeypatch.setattr(sd, "caller_threads", spy)
    x = offset(rng, (30, 20))
    X = da.from_array(x, chunks=(10, 10))
    for kw, want in (({}, 1), ({"num_threads": 2}, 2), ({"num_threads": 3}, 3)):
        seen.clear()
        materialize(*sd.mean_variance_normalization(X, 0, return_stats=True, **kw),
                    sd.layer_norm(X.rechunk({1: -1}), **kw))
        assert seen and set(seen) == {want}, (kw, seen)
    assert simdnorm.get_num_threads() == 2 and _core.caller_threads() == 2  # nothing changed behind the user


def test_xarray_dataarray_backed_by_dask(rng):
    xr = pytest.importorskip("xarray", reason="xarray is in the test extra")
    x = offset(rng, (24, 10), loc=15.0)
    arr = xr.DataArray(da.from_array(x, chunks=(5, 10)), dims=("time", "station"))
    z = xr.apply_ufunc(sd.mean_variance_normalization, arr, kwargs={"axes": 0}, dask="allowed")
    assert isinstance(z.data, da.Array) and z.dims == arr.dims
    check_mvn(z.values, x, 0, context="xarray")
    with pytest.raises(TypeError, match=r"\.data"):
        sd.layer_norm(arr)


# ----------------------------------------------------------------------------------------------------
# errors, at the call

def test_errors_are_raised_at_the_call():
    X = da.ones((4, 6, 5), chunks=2, dtype=F32)
    with pytest.raises(TypeError, match="out= does not apply"):
        sd.layer_norm(X, out=np.empty((4, 6, 5), F32))
    with pytest.raises(TypeError, match="simdnorm.layer_norm"):
        sd.layer_norm(np.ones((3, 4), F32))
    with pytest.raises(TypeError, match="int32"):
        sd.layer_norm(X.astype(np.int32))
    with pytest.raises(AxisError):
        sd.mean_variance_normalization(X, 3)
    with pytest.raises(ValueError, match="scale"):
        sd.layer_norm(X, np.ones(4, F32))
    with pytest.raises(TypeError, match="float64|dtype"):
        sd.layer_norm(X, da.ones(5, dtype=np.int8))
    with pytest.raises(ValueError, match="num_groups"):
        sd.group_norm(X, 4)
    with pytest.raises(ValueError, match="epsilon"):
        sd.instance_norm(X, epsilon=-1.0)
    with pytest.raises(ValueError, match="activation"):
        sd.batch_normalization(X, np.zeros(6, F32), np.ones(6, F32), activation="nope")
    with pytest.raises(TypeError, match="running_mean"):
        sd.batch_normalization_training(X, running_mean=np.zeros(6, F32), running_var=np.ones(6, F32))
    with pytest.raises(ValueError, match="num_threads"):
        sd.rms_norm(X, num_threads=0)
    with pytest.raises(TypeError, match="num_threads"):
        sd.rms_norm(X, num_threads="2")
    with pytest.raises(TypeError, match="return_stats"):
        sd.rms_norm(X, return_stats=1)
    with pytest.raises(ValueError, match="unknown chunk sizes along axis 1"):  # (more: test_unknown_chunk_sizes...)
        sd.group_norm(X[:, X[0, :, 0] > 0], 2)
    with pytest.raises(TypeError, match="numpy chunks"):
        sd.layer_norm(da.from_array(np.ma.masked_array(np.ones((3, 4), F32)), asarray=False))
    # the plain functions refuse dask arrays, naming simdnorm.dask
    with pytest.raises(TypeError, match="simdnorm.dask"):
        simdnorm.layer_norm(X)


def test_import_simdnorm_never_imports_dask():
    import subprocess
    import sys
    code = ("import sys, simdnorm; assert 'dask' not in sys.modules, 'import simdnorm imported dask'\n"
            "sys.modules['dask'] = None  # as if it were not installed\n"
            "try:\n    import simdnorm.dask\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'simdnorm[dask]'" in out, out
