"""Framework tensors through DLPack (SPEC section 10), with real producers (torch; numpy arrays
exported through DLPack 1.x by a wrapper):

* no copy: the array simdnorm reads is the tensor's memory (data pointers, strides), an out= tensor
  is written where it lies (its data pointer is the result's), in place included;
* the result follows the input: a torch input gives torch outputs of the input's dtype, with
  torch.empty_like's strides (channels last kept, a non-dense input giving a dense output), and
  torch statistics; other producers give numpy arrays; out= (a torch tensor or a numpy array,
  whatever the input) is returned itself; the running statistics may be torch tensors;
* float16 and bfloat16 tensors end to end (numpy's from_dlpack cannot take bfloat16);
* every forward op, the training op and the backward ops, and compiled operators, against float64
  references (the backward ops against torch's autograd in float64);
* read-only producers are never written; a tensor that requires grad, with grad mode on, goes through autograd
  and read through its detached alias under no_grad; dask and xarray objects are refused, naming
  simdnorm.dask; ``import simdnorm`` (and a call with numpy arrays or another producer) does not
  import torch.

The malformed producers (and the deleter's count) are tests/test_dlpack_hostile.py's.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import simdnorm
from cases import BF16, F16, F32, F64
from reference import check_bn, check_mvn, check_stats, group_norm_ref, instance_norm_axes, layer_norm_axes

torch = pytest.importorskip("torch")

from simdnorm._compile import as_input  # noqa: E402

# Dynamo traces simdnorm's Python (the plain functions, the compiled operators) from torch 2.13 on
PLAIN_COMPILES = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)

TDT = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16, F64: torch.float64}
DTYPES = [F32, F16, BF16, F64]
DT_IDS = ["f32", "f16", "bf16", "f64"]
POISON = -7.25


def np_of(t):
    """A numpy view of a CPU tensor's memory (bfloat16 through int16: torch's .numpy() lacks it); an
    ndarray as it is."""
    if isinstance(t, np.ndarray):
        return t
    t = t.resolve_neg()  # (a negated view: its values, as torch's own .numpy() wants them)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def tensor(rng, shape, dtype, layout="contiguous"):
    """A tensor of logical shape `shape` in a given memory layout (fresh random values)."""
    if layout == "channels_last":
        t = torch.from_numpy(rng.standard_normal(shape)).to(TDT[dtype]).to(memory_format=torch.channels_last)
        assert not t.is_contiguous()
    elif layout == "strided":  # not dense: every other element of the last dim
        t = torch.from_numpy(rng.standard_normal(shape[:-1] + (2 * shape[-1],))).to(TDT[dtype])[..., ::2]
    elif layout == "permuted":  # dense, dims stored in another order
        t = torch.from_numpy(rng.standard_normal(shape[::-1])).to(TDT[dtype]).permute(*range(len(shape) - 1, -1, -1))
    elif layout == "negated":  # the negative bit set: the memory holds the values' negatives
        t = negated_view(torch.from_numpy(rng.standard_normal(shape)).to(TDT[dtype]))
    else:
        t = torch.from_numpy(rng.standard_normal(shape)).to(TDT[dtype])
    assert tuple(t.shape) == shape
    return t


def negated_view(t):
    """A tensor of t's values whose memory holds their negatives (the negative bit set), as
    ``z.conj().imag`` of a complex z is; torch exports that memory through DLPack unmarked."""
    n = torch._neg_view(-t)
    assert n.is_neg() and torch.equal(n, t)
    return n


def poisoned_like(t):
    return torch.full_like(t, POISON)


def byte_strides(t):
    return tuple(s * t.element_size() for s in t.stride())


# ----------------------------------------------------------------------------------------------
# no copy
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided", "permuted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_input_is_read_where_it_lies(rng, dtype, layout):
    t = tensor(rng, (2, 3, 4, 5), dtype, layout)
    a = as_input(t)
    assert type(a) is np.ndarray and a.dtype == dtype and a.shape == tuple(t.shape)
    assert a.__array_interface__["data"][0] == t.data_ptr(), "the input's memory was copied"
    assert a.strides == byte_strides(t)
    np.testing.assert_array_equal(a.astype(np.float64), t.double().numpy())
    # and the op reads that memory: a change to the tensor shows in the next result
    y0 = simdnorm.layer_norm(t)
    t.mul_(2).add_(1)
    check_mvn(np_of(simdnorm.layer_norm(t)), np_of(t), layer_norm_axes(4))
    assert not torch.equal(y0, simdnorm.layer_norm(t))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_out_tensor_is_written_where_it_lies(rng, dtype):
    x = tensor(rng, (2, 6, 3, 4), dtype)
    m, v = torch.from_numpy(rng.standard_normal(6)).float(), torch.from_numpy(rng.random(6) + 0.5).float()
    for xin in (x, np_of(x)):  # a torch out= whatever the input
        out = poisoned_like(x)
        ptr = out.data_ptr()
        assert simdnorm.batch_normalization(xin, m, v, out=out) is out
        assert out.data_ptr() == ptr
        check_bn(np_of(out), np_of(x), m.numpy(), v.numpy())
        out = poisoned_like(x).to(memory_format=torch.channels_last)  # any strides
        y, mean, inv = simdnorm.group_norm(xin, 3, out=out, return_stats=True)
        assert y is out
        want, wm, wi = group_norm_ref(np_of(x), 3)
        tol = {F32: 1e-5, F64: 1e-12, F16: 2e-3, BF16: 1e-2}[dtype]
        np.testing.assert_allclose(np_of(out).astype(np.float64), want, rtol=tol, atol=tol * np.abs(want).max())
        np.testing.assert_allclose(np.asarray(mean, np.float64), wm, rtol=1e-5, atol=1e-6)
        assert isinstance(mean, torch.Tensor) == isinstance(xin, torch.Tensor)  # the statistics follow the input


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_in_place_on_a_tensor(rng, dtype):
    x = tensor(rng, (3, 4, 10), dtype, "strided")
    before = np_of(x).copy()
    ptr = x.data_ptr()
    assert simdnorm.layer_norm(x, out=x) is x
    assert x.data_ptr() == ptr
    check_mvn(np_of(x), before, layer_norm_axes(3))


# ----------------------------------------------------------------------------------------------
# the result follows the input
# ----------------------------------------------------------------------------------------------

def _forward_cases(rng, x, dtype):
    """(name, call(x, out) -> result or tuple, check(result tuple)) for each forward op."""
    nd = x.dim()
    c = x.shape[1]
    pdt = TDT[F32] if dtype != F64 else TDT[F64]
    mean = torch.from_numpy(rng.standard_normal(c)).to(pdt)
    var = torch.from_numpy(rng.random(c) + 0.5).to(pdt)
    scale = torch.from_numpy(rng.standard_normal(c)).to(TDT[dtype])  # the input's dtype: bf16 included
    bias = torch.from_numpy(rng.standard_normal(c)).to(TDT[dtype])
    last = torch.from_numpy(rng.standard_normal(x.shape[-1])).to(pdt)
    xs = np_of(x)
    S, B, L = np_of(scale), np_of(bias), np_of(last)
    cshape = (1, c) + (1,) * (nd - 2)

    def ck_bn(r):
        check_bn(np_of(r[0]), xs, mean.numpy(), var.numpy(), S, B)

    def ck_mvn(axes, scale_=None, bias_=None, nm=True):
        def ck(r):
            check_mvn(np_of(r[0]), xs, axes, scale_, bias_, normalize_mean=nm,
                      stats=(None if r[1] is None else np_of(r[1]), np_of(r[2])))
        return ck

    def ck_gn(r):
        want, wm, wi = group_norm_ref(xs, 2, S, B)
        tol = {F32: 1e-5, F64: 1e-12, F16: 2e-3, BF16: 1e-2}[dtype]
        np.testing.assert_allclose(np_of(r[0]).astype(np.float64), want, rtol=tol, atol=tol * np.abs(want).max())
        np.testing.assert_allclose(np_of(r[1]).astype(np.float64), wm, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np_of(r[2]).astype(np.float64), wi, rtol=1e-5)

    return [
        ("batch_normalization", lambda x, out: (simdnorm.batch_normalization(x, mean, var, scale, bias, out=out),),
         ck_bn),
        ("mean_variance_normalization",
         lambda x, out: simdnorm.mean_variance_normalization(x, (0, 2), scale.reshape(cshape), out=out,
                                                             return_stats=True),
         ck_mvn((0, 2), S.reshape(cshape))),
        ("layer_norm", lambda x, out: simdnorm.layer_norm(x, last, out=out, return_stats=True),
         ck_mvn(layer_norm_axes(nd), L)),
        ("rms_norm", lambda x, out: simdnorm.rms_norm(x, out=out, return_stats=True),
         ck_mvn(layer_norm_axes(nd), nm=False)),
        ("instance_norm", lambda x, out: simdnorm.instance_norm(x, scale, bias, out=out, return_stats=True),
         ck_mvn(instance_norm_axes(nd), S.reshape(cshape), B.reshape(cshape))),
        ("group_norm", lambda x, out: simdnorm.group_norm(x, 2, scale, bias, out=out, return_stats=True), ck_gn),
    ]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided", "negated"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_torch_in_torch_out(rng, dtype, layout):
    x = tensor(rng, (3, 4, 5, 6), dtype, layout)
    sdt = torch.float64 if dtype == F64 else torch.float32
    for name, call, check in _forward_cases(rng, x, dtype):
        r = call(x, None)
        y = r[0]
        assert type(y) is torch.Tensor and y.dtype == x.dtype and y.shape == x.shape, name
        assert y.stride() == torch.empty_like(x).stride(), f"{name}: strides {y.stride()}, not empty_like's"
        if layout == "channels_last":
            assert y.is_contiguous(memory_format=torch.channels_last), name
        for s in r[1:]:
            assert s is None or (type(s) is torch.Tensor and s.dtype == sdt), (name, type(s))
        check(r)
        # the same with a poisoned torch out=: returned itself, same values
        out = poisoned_like(x)
        r2 = call(x, out)
        assert r2[0] is out, name
        np.testing.assert_array_equal(np_of(out), np_of(y))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_negated_views_are_read_as_their_values_and_never_written(rng, dtype):
    """A tensor with the negative bit set, as input, parameter, statistic or gradient, gives the
    bits its resolved copy gives (``z.conj().imag``, the public way to make one, included); as out=
    or a running statistic it is refused before anything is written."""
    x = tensor(rng, (3, 4, 5, 2), dtype)
    w, b = (torch.from_numpy(rng.standard_normal(4)).to(TDT[dtype]) for _ in range(2))
    sdt = torch.float64 if dtype == F64 else torch.float32
    mean, var = torch.from_numpy(rng.standard_normal(4)).to(sdt), torch.from_numpy(rng.random(4) + 0.5).to(sdt)
    dy = tensor(rng, (3, 4, 5, 2), dtype)
    calls = {
        "batch_normalization": lambda x, w, b, m, v, dy: simdnorm.batch_normalization(x, m, v, w, b),
        "layer_norm": lambda x, w, b, m, v, dy: simdnorm.layer_norm(x, w[:2], b[:2], return_stats=True),
        "group_norm": lambda x, w, b, m, v, dy: simdnorm.group_norm(x, 2, w, b, return_stats=True),
        "training": lambda x, w, b, m, v, dy: simdnorm.batch_normalization_training(x, w, b),
        "instance_norm_backward": lambda x, w, b, m, v, dy: simdnorm.instance_norm_backward(
            dy, x, *simdnorm.instance_norm(x.resolve_neg(), w, b, return_stats=True)[1:], w, b),
        "batch_normalization_backward": lambda x, w, b, m, v, dy: simdnorm.batch_normalization_backward(
            dy, x, m, v, w, b, training=False),
    }
    args = (x, w, b, mean, var, dy)
    for name, call in calls.items():
        want = call(*args)
        want = want if isinstance(want, tuple) else (want,)
        for i in range(len(args)):  # each tensor argument negated in turn, the others as they are
            got = call(*[negated_view(a) if k == i else a for k, a in enumerate(args)])
            got = got if isinstance(got, tuple) else (got,)
            for g, e in zip(got, want):
                assert (g is None) == (e is None) and (g is None or torch.equal(g, e)), (name, i)
    if dtype == F32:  # the public route to a negated view
        z = torch.complex(torch.zeros(3, 8), -x.reshape(3, -1)[:, :8].float())
        assert z.conj().imag.is_neg()
        assert torch.equal(simdnorm.layer_norm(z.conj().imag), simdnorm.layer_norm(x.reshape(3, -1)[:, :8]))
    out = negated_view(poisoned_like(x))
    with pytest.raises(ValueError, match=r"^out: a torch tensor with the negative bit set"):
        simdnorm.layer_norm(x, out=out)
    with pytest.raises(ValueError, match=r"^running_mean: a torch tensor with the negative bit set"):
        simdnorm.batch_normalization_training(x, running_mean=negated_view(mean.clone()), running_var=var.clone())
    assert torch.all(out == POISON)  # (its values: nothing written)


@pytest.mark.parametrize("call", [
    lambda x, c: simdnorm.layer_norm(x, epsilon=np.array(1e-5)),
    lambda x, c: simdnorm.layer_norm(x, epsilon=[1e-5]),
    lambda x, c: simdnorm.layer_norm(x, axis=[1]),
    lambda x, c: simdnorm.rms_norm(x, axis=2.0),
    lambda x, c: simdnorm.group_norm(x, [2]),
    lambda x, c: simdnorm.group_norm(x, 3),
    lambda x, c: simdnorm.instance_norm(x, epsilon=-1.0),
    lambda x, c: simdnorm.instance_norm(x, channel_axis=0),
    lambda x, c: simdnorm.batch_normalization(x, c, c, epsilon={}),
    lambda x, c: simdnorm.batch_normalization(x, c[:3], c),
], ids=["eps-array", "eps-list", "axis-list", "axis-float", "groups-list", "groups-3", "eps-negative",
        "channel-axis-0", "eps-dict", "mean-short"])
def test_torch_calls_refuse_what_numpy_calls_refuse(rng, call):
    """Tensors take a faster route than arrays for small calls (plans cached by their attributes);
    an attribute it cannot key by or a call the plain function refuses gives the same error,
    word for word, as the same call on numpy arrays."""
    x = tensor(rng, (2, 4, 3, 5), F32)
    c = torch.ones(4)
    with pytest.raises(Exception) as with_numpy:
        call(x.numpy(), c.numpy())
    for _ in range(2):  # (a second time: a miss must not have stored anything)
        with pytest.raises(type(with_numpy.value)) as with_torch:
            call(x, c)
        assert str(with_torch.value) == str(with_numpy.value)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_numpy_in_gives_numpy_results_and_numpy_out_is_returned(rng, dtype):
    x = tensor(rng, (2, 4, 3, 5), dtype)
    xs = np_of(x)
    for name, call, check in _forward_cases(rng, x, dtype):
        r = call(xs, None)
        assert all(s is None or type(s) is np.ndarray for s in r), name
        check(r)
        out = np.full(xs.shape, POISON, xs.dtype)  # torch in, numpy out: out returned, statistics torch
        r2 = call(x, out)
        assert r2[0] is out, name
        assert all(type(s) is torch.Tensor for s in r2[1:] if s is not None), name
        np.testing.assert_array_equal(out, np_of(r[0]) if isinstance(r[0], torch.Tensor) else r[0])


def test_other_producers_give_numpy_arrays(rng):
    """A DLPack producer that is not torch (here a wrapper of a numpy array): numpy results, its
    memory read in place."""
    a = rng.standard_normal((3, 8)).astype(F32)

    class Producer:
        def __dlpack__(self, **kw):
            return a.__dlpack__(**kw)

    y, mean, inv = simdnorm.layer_norm(Producer(), return_stats=True)
    assert type(y) is np.ndarray and type(mean) is np.ndarray
    check_mvn(y, a, (1,), stats=(mean, inv))
    assert np.shares_memory(as_input(Producer()), a)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_torch_memory_is_given_back():
    """Each call exports its input and output through DLPack; the views' deleters give the tensors
    back to torch: 200 calls making 4 MB outputs leave the resident memory where it was (it would
    grow by 800 MB if an output were kept)."""
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    x = torch.randn(1024, 1024)
    for _ in range(5):
        simdnorm.layer_norm(x)
    before = rss()
    for _ in range(200):
        y = simdnorm.layer_norm(x, return_stats=True)[0]
    del y
    assert rss() - before < 100 << 20, f"resident memory grew by {(rss() - before) >> 20} MB"


def test_zero_size_and_zero_dim_tensors():
    y = simdnorm.layer_norm(torch.empty(0, 4))
    assert type(y) is torch.Tensor and y.shape == (0, 4)
    with pytest.raises(ValueError, match=r"^input: 0 dimensions"):
        simdnorm.layer_norm(torch.tensor(1.0))


# ----------------------------------------------------------------------------------------------
# training and backward
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=["f32", "bf16", "f64"])
def test_training_with_torch_tensors_and_running_stats(rng, dtype):
    x = tensor(rng, (4, 3, 5, 2), dtype, "channels_last")
    sdt = torch.float64 if dtype == F64 else torch.float32
    w = torch.from_numpy(rng.standard_normal(3)).to(TDT[dtype])
    b = torch.from_numpy(rng.standard_normal(3)).to(TDT[dtype])
    rm, rv = torch.from_numpy(rng.standard_normal(3)).to(sdt), torch.from_numpy(rng.random(3) + 0.5).to(sdt)
    rm0, rv0 = rm.double().clone(), rv.double().clone()
    trm, trv = rm0.clone(), rv0.clone()  # torch's running statistics, updated by F.batch_norm below
    out = simdnorm.batch_normalization_training(x, w, b, running_mean=rm, running_var=rv, momentum=0.1)
    y, mean, var = out
    assert type(y) is torch.Tensor and y.dtype == x.dtype and y.stride() == torch.empty_like(x).stride()
    assert type(mean) is torch.Tensor and mean.dtype == sdt and type(var) is torch.Tensor
    # torch's own training batch norm (float64) for the result and the running statistics
    want = torch.nn.functional.batch_norm(x.double(), trm, trv, w.double(), b.double(), training=True, momentum=0.1)
    tol = {F32: 1e-5, F64: 1e-12, BF16: 1e-2}[dtype]
    np.testing.assert_allclose(y.double().numpy(), want.numpy(), rtol=tol, atol=tol * want.abs().max().item())
    assert not torch.equal(trm, rm0) and not torch.equal(trv, rv0)
    np.testing.assert_allclose(rm.numpy(), trm.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rv.numpy(), trv.numpy(), rtol=1e-5, atol=1e-6)
    xd = x.double()
    np.testing.assert_allclose(mean.double().numpy(), xd.mean(dim=(0, 2, 3)).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var.double().numpy(), xd.var(dim=(0, 2, 3), unbiased=False).numpy(), rtol=1e-5)


def _autograd(fn, x, *params):
    """torch's float64 gradients of sum(fn(x, *params) * g) for a fixed random g."""
    leaves = [t.detach().double().requires_grad_() for t in (x,) + params]
    y = fn(*leaves)
    g = torch.from_numpy(np.random.default_rng(5).standard_normal(tuple(y.shape)))
    return g, torch.autograd.grad(y, leaves, g)


@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
def test_backward_ops_with_torch_tensors(rng, dtype):
    F = torch.nn.functional
    x = tensor(rng, (3, 4, 5, 2), dtype)
    w = torch.from_numpy(rng.standard_normal(4)).to(TDT[dtype])
    b = torch.from_numpy(rng.standard_normal(4)).to(TDT[dtype])
    tol = 1e-4 if dtype == F32 else 1e-10
    cases = {
        "batch_norm": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                       lambda g: simdnorm.batch_normalization_backward(
                           g, x, *simdnorm.batch_normalization_training(x, w, b)[1:], w, b)),
        "instance_norm": (lambda x, w, b: F.instance_norm(x, weight=w, bias=b),
                          lambda g: simdnorm.instance_norm_backward(
                              g, x, *simdnorm.instance_norm(x, w, b, return_stats=True)[1:], w, b)),
        "group_norm": (lambda x, w, b: F.group_norm(x, 2, w, b),
                       lambda g: simdnorm.group_norm_backward(
                           g, x, 2, *simdnorm.group_norm(x, 2, w, b, return_stats=True)[1:], w, b)),
    }
    for name, (fwd, ours) in cases.items():
        g, want = _autograd(fwd, x, w, b)
        got = ours(g.to(TDT[dtype]))
        assert all(type(t) is torch.Tensor for t in got), (name, [type(t) for t in got])
        for gt, wt, what in zip(got, want, ("grad_input", "grad_scale", "grad_bias")):
            assert gt.dtype == TDT[dtype] and gt.shape == wt.shape, (name, what)
            np.testing.assert_allclose(gt.double().numpy(), wt.numpy(), rtol=tol, atol=tol * wt.abs().max().item(),
                                       err_msg=f"{name} {what}")
    # layer norm: grad_input into a poisoned torch out=, returned itself
    g, want = _autograd(lambda x, w: F.layer_norm(x, (2,), w), x, w[:2])
    y, m, inv = simdnorm.layer_norm(x, w[:2], return_stats=True)
    out = poisoned_like(x)
    gi, gs, gb = simdnorm.layer_norm_backward(g.to(TDT[dtype]), x, m, inv, w[:2], out=out)
    assert gi is out and gb is None and type(gs) is torch.Tensor
    np.testing.assert_allclose(out.double().numpy(), want[0].numpy(), rtol=tol, atol=tol * want[0].abs().max().item())
    # grad_input=False: no output tensor is made, the parameter gradient is torch
    gi, gs, _ = simdnorm.rms_norm_backward(g.to(TDT[dtype]), x, simdnorm.rms_norm(x, return_stats=True)[2], w[:2],
                                           grad_input=False)
    assert gi is None and type(gs) is torch.Tensor


# ----------------------------------------------------------------------------------------------
# compiled operators
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_compiled_operators_follow_the_input(rng, dtype):
    x = tensor(rng, (2, 4, 6), dtype, "strided")
    td = simdnorm.TensorDesc
    m, v = torch.zeros(4), torch.ones(4)
    op = simdnorm.compile(simdnorm.BatchNormalizationDesc(td(dtype, x.shape), td(F32, (4,)), td(F32, (4,))))
    y = op(x, m, v)
    assert type(y) is torch.Tensor and y.stride() == torch.empty_like(x).stride()
    check_bn(np_of(y), np_of(x), np.zeros(4, F32), np.ones(4, F32))
    out = poisoned_like(x)
    assert op(x, m, v, out=out) is out and torch.equal(out, y)
    out = poisoned_like(x)
    assert op(np_of(x), m, v, out=out) is out and torch.equal(out, y)  # numpy in, torch out=
    mop = simdnorm.compile(simdnorm.MeanVarianceNormalizationDesc(td(dtype, x.shape), (2,)))
    r, mean, inv = mop(x, return_stats=True)
    assert type(r) is torch.Tensor and type(mean) is torch.Tensor
    check_mvn(np_of(r), np_of(x), (2,), stats=(mean.numpy(), inv.numpy()))
    grad = simdnorm.compile(simdnorm.MeanVarianceNormalizationGradDesc(td(dtype, x.shape), (2,), td(F32, (2, 4, 1)),
                                                                       td(F32, (2, 4, 1))))
    gi, _, _ = grad(x, x, mean, inv)
    assert type(gi) is torch.Tensor and gi.dtype == x.dtype
    want, _, _ = simdnorm.mean_variance_normalization_backward(np_of(x), np_of(x), (2,), mean.numpy(), inv.numpy())
    np.testing.assert_array_equal(np_of(gi), want)
    train = simdnorm.compile(simdnorm.BatchNormalizationTrainingDesc(td(dtype, x.shape)))
    rm, rv = torch.zeros(4), torch.ones(4)
    yt, bm, bv = train(x, running_mean=rm, running_var=rv)
    assert type(yt) is torch.Tensor and type(bm) is torch.Tensor
    np.testing.assert_allclose(rm.numpy(), 0.1 * bm.numpy(), rtol=1e-6)


def test_compiled_operators_differentiate_with_their_descriptors_attributes(rng):
    """A compiled operator on a tensor that requires grad runs the torch op (SPEC section 10) with
    the descriptor's epsilon, activation, channel axis and axes, not the functions' defaults; its
    tensors are checked against the descriptors as arrays are."""
    pytest.importorskip("simdnorm.torch", reason="simdnorm.torch needs torch")
    td = simdnorm.TensorDesc
    x = tensor(rng, (2, 3, 4, 5), F32)
    m, v = tensor(rng, (5,), F32), torch.rand(5) + 0.5
    op = simdnorm.compile(simdnorm.BatchNormalizationDesc(td(F32, x.shape), td(F32, (5,)), td(F32, (5,)),
                                                          epsilon=3.0, activation="leaky_relu", channel_axis=-1))
    mop = simdnorm.compile(simdnorm.MeanVarianceNormalizationDesc(td(F32, x.shape), (1, 3), epsilon=0.5,
                                                                  epsilon_mode="outside", activation="relu"))
    for f, args in ((op, (m, v)), (mop, ())):
        want = f(x, *args)
        xg = x.clone().requires_grad_()
        got = f(xg, *args)
        assert got.grad_fn is not None
        assert torch.equal(got.detach(), want), f.desc
        # the gradient of the described op, not of the defaults'
        g = torch.autograd.grad(got, xg, torch.ones_like(got))[0]
        eps = 1e-3
        xp, xm = x.clone(), x.clone()
        xp[0, 1, 2, 3] += eps
        xm[0, 1, 2, 3] -= eps
        fd = (f(xp, *args).double().sum() - f(xm, *args).double().sum()) / (2 * eps)
        assert abs(g[0, 1, 2, 3].item() - fd.item()) < 2e-2 * max(1.0, abs(fd.item())), (g[0, 1, 2, 3], fd)
    with pytest.raises(simdnorm.DescriptorError, match="input: shape"):
        op(torch.zeros(2, 3, 4, 6, requires_grad=True), m, v)
    with pytest.raises(TypeError, match="mean: dtype float64"):
        op(x.clone().requires_grad_(), m.double(), v)
    with pytest.raises(simdnorm.DescriptorError, match="no scale tensor"):
        op(x.clone().requires_grad_(), m, v, torch.ones(5))
    if PLAIN_COMPILES:  # (dynamo traces a compiled operator's Python, as the plain functions', from 2.13)
        f = torch.compile(lambda t: mop(t), fullgraph=True)
        assert torch.equal(f(x), mop(x))


def test_compiled_training_operators_differentiate_and_trace(rng):
    """The compiled training and backward operators as their functions: a tensor requiring grad
    runs the differentiable op with the descriptor's attributes, and torch.compile records them."""
    pytest.importorskip("simdnorm.torch", reason="simdnorm.torch needs torch")
    td = simdnorm.TensorDesc
    x, dy = tensor(rng, (4, 3, 5, 2), F32), tensor(rng, (4, 3, 5, 2), F32)
    w, b = torch.rand(3) + 0.5, tensor(rng, (3,), F32)
    c = td(F32, (3,))
    kw = dict(epsilon=0.5, activation="relu")
    train = simdnorm.compile(simdnorm.BatchNormalizationTrainingDesc(td(F32, x.shape), c, c, **kw))
    want = simdnorm.batch_normalization_training(x, w, b, **kw)
    xg = x.clone().requires_grad_()
    got = train(xg, w, b)
    assert got[0].grad_fn is not None and all(torch.equal(g.detach(), h) for g, h in zip(got, want))
    xf = x.clone().requires_grad_()
    ref = simdnorm.batch_normalization_training(xf, w, b, **kw)[0]
    assert torch.equal(torch.autograd.grad(got[0], xg, dy)[0], torch.autograd.grad(ref, xf, dy)[0])
    grad = simdnorm.compile(simdnorm.BatchNormalizationGradDesc(td(F32, x.shape), c, c, c, c, **kw))
    assert grad.__name__ == "batch_normalization_backward"
    if not PLAIN_COMPILES:
        pytest.skip(f"torch.compile of a compiled operator needs torch 2.13; this is {torch.__version__}")
    assert torch.equal(torch.compile(lambda t: train(t, w, b)[0], fullgraph=True)(x), want[0])
    bwd = simdnorm.batch_normalization_backward(dy, x, want[1], want[2], w, b, **kw)
    traced = torch.compile(lambda g, t: grad(g, t, want[1], want[2], w, b), fullgraph=True)(dy, x)
    for g, h in zip(traced, bwd):
        torch.testing.assert_close(g, h)


# ----------------------------------------------------------------------------------------------
# what is refused, and what is never written
# ----------------------------------------------------------------------------------------------

def test_requires_grad_goes_through_autograd_and_no_grad_reads_in_place(rng):
    """SPEC section 10: a torch input (or parameter) that requires grad, with grad mode on, runs the
    torch.ops.simdnorm op, and its gradients are torch.nn's; under no_grad it is read in place."""
    pytest.importorskip("simdnorm.torch", reason="simdnorm.torch needs torch")
    bn = torch.nn.BatchNorm2d(4).eval()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2.0)
        bn.bias.uniform_(-1, 1)
        bn.running_mean.uniform_(-1, 1)
    x = tensor(rng, (2, 4, 3, 3), F32)
    args = (bn.running_mean, bn.running_var, bn.weight, bn.bias)
    dy = tensor(rng, (2, 4, 3, 3), F32)
    y = simdnorm.batch_normalization(x, *args, epsilon=bn.eps)
    assert y.requires_grad
    (gs,) = torch.autograd.grad(y, bn.weight, dy)
    (want,) = torch.autograd.grad(bn(x), bn.weight, dy)
    np.testing.assert_allclose(gs.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    xg = x.clone().requires_grad_()
    ln = torch.nn.LayerNorm(9)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 2.0)
    got = simdnorm.layer_norm(xg.reshape(2, 4, 9), ln.weight, ln.bias, return_stats=True)
    assert len(got) == 3 and got[0].requires_grad and not got[1].requires_grad
    g_got = torch.autograd.grad(got[0], (xg, ln.weight), dy.reshape(2, 4, 9))
    g_want = torch.autograd.grad(ln(xg.reshape(2, 4, 9)), (xg, ln.weight), dy.reshape(2, 4, 9))
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match=r"out= with a tensor that autograd follows"):
        simdnorm.layer_norm(xg, out=torch.empty_like(xg))
    with pytest.raises(TypeError, match=r"^grad_output: a torch tensor that requires grad"):
        simdnorm.layer_norm_backward(dy.clone().requires_grad_(), x, *simdnorm.layer_norm(x, return_stats=True)[1:])
    with torch.no_grad():
        y = simdnorm.batch_normalization(x, *args, epsilon=bn.eps)
        want = bn(x)
    assert type(y) is torch.Tensor and not y.requires_grad
    np.testing.assert_allclose(y.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["list", "tuple", "numpy", "numpy_float64"])
def test_requires_grad_with_array_like_parameters(rng, form):
    # the differentiable route takes parameters as the plain functions do: any array-like (a numpy
    # array, a list of numbers), converted to a tensor (the op's schema wants one)
    pytest.importorskip("simdnorm.torch", reason="simdnorm.torch needs torch")
    x = tensor(rng, (3, 4, 6), F32).requires_grad_()
    w = rng.standard_normal(6) + 1.0
    param = {"list": list(w), "tuple": tuple(w), "numpy": w.astype(np.float32), "numpy_float64": w}[form]
    if form == "numpy_float64":  # (float64 parameters of float32 data: simdnorm's TypeError, as without grad)
        with pytest.raises(TypeError):
            simdnorm.layer_norm(x, param)
        return
    y = simdnorm.layer_norm(x, param, activation="relu")
    want = torch.relu(torch.nn.functional.layer_norm(x, (6,)) * torch.as_tensor(w, dtype=torch.float32))
    np.testing.assert_allclose(y.detach().numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-6)
    dy = tensor(rng, (3, 4, 6), F32)
    (g,), (g_want,) = torch.autograd.grad(y, x, dy), torch.autograd.grad(want, x, dy)
    np.testing.assert_allclose(g.numpy(), g_want.numpy(), rtol=1e-4, atol=1e-5)


def test_training_requires_grad_updates_running_statistics(rng):
    pytest.importorskip("simdnorm.torch", reason="simdnorm.torch needs torch")
    bn = torch.nn.BatchNorm2d(3)
    x = tensor(rng, (4, 3, 5, 5), F32).requires_grad_()
    rm, rv = torch.zeros(3), torch.ones(3)
    y, mean, var = simdnorm.batch_normalization_training(x, bn.weight, bn.bias, epsilon=bn.eps, running_mean=rm,
                                                         running_var=rv, momentum=0.1)
    want = bn(x)
    np.testing.assert_allclose(y.detach().numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rm.numpy(), bn.running_mean.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(rv.numpy(), bn.running_var.numpy(), rtol=1e-5, atol=1e-7)
    dy = tensor(rng, (4, 3, 5, 5), F32)
    for a, b in zip(torch.autograd.grad(y, (x, bn.weight), dy), torch.autograd.grad(want, (x, bn.weight), dy)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)


def _read_only_producer(a):
    """numpy's DLPack 1.x export of a read-only array carries the read-only flag."""
    a.flags.writeable = False

    class ReadOnly:
        def __dlpack__(self, **kw):
            return a.__dlpack__(**kw)

    return ReadOnly()


def _numpy_exports_read_only():
    a = np.ones(1, F32)
    a.flags.writeable = False
    try:
        a.__dlpack__(max_version=(1, 0))
    except (BufferError, TypeError):  # (numpy before 2.1: no DLPack 1.x, whose flag says read-only)
        return False
    return True


@pytest.mark.skipif(not _numpy_exports_read_only(),
                    reason=f"numpy {np.__version__} cannot export a read-only array through DLPack")
def test_read_only_producer_is_never_written(rng):
    a = rng.standard_normal((3, 8)).astype(F32)
    before = a.copy()
    p = _read_only_producer(a)
    assert not as_input(p).flags.writeable
    y = simdnorm.layer_norm(p)
    check_mvn(y, before, (1,))
    with pytest.raises(ValueError, match=r"^out: the ReadOnly is read-only \(its DLPack export says so\)"):
        simdnorm.layer_norm(before, out=p)
    with pytest.raises(ValueError, match=r"^out: the ReadOnly is read-only"):
        simdnorm.layer_norm(p, out=p)
    with pytest.raises(ValueError, match=r"^running_mean: the ReadOnly is read-only"):
        simdnorm.batch_normalization_training(np.ones((4, 8), F32), channel_axis=1,
                                              running_mean=_read_only_producer(np.zeros(8, F32)),
                                              running_var=np.ones(8, F32))
    np.testing.assert_array_equal(a, before)


def test_expanded_tensor_refused_as_out():
    """torch refuses to write an expanded tensor (one memory location for several elements); so does
    simdnorm, before writing anything."""
    out = torch.full((4,), POISON).expand(3, 4)
    with pytest.raises(ValueError, match=r"^out: DLPack strides\[0\] is 0 with size 3"):
        simdnorm.layer_norm(torch.ones(3, 4), out=out)
    assert torch.all(out == POISON)


def test_non_cpu_tensor_is_refused():
    t = torch.ones(2, 3, device="meta")
    with pytest.raises((TypeError, ValueError), match=r"^input: ") as e:
        simdnorm.layer_norm(t)
    assert "\n" not in str(e.value), "torch's stack trace belongs to the chained error, not the message"


@pytest.mark.parametrize("module,cls", [("dask.array.core", "Array"), ("xarray.core.dataarray", "DataArray")])
def test_dask_and_xarray_name_simdnorm_dask(module, cls):
    """A lazy or labelled array would be computed whole by np.asarray: refused before that."""
    def array(self, *a, **k):
        raise AssertionError("computed")

    obj = type(cls, (), {"__module__": module, "__array__": array, "shape": (2, 3), "dtype": np.dtype(F32)})()
    lib = module.split(".")[0]
    with pytest.raises(TypeError, match=rf"^input: a {lib} {cls}; .*simdnorm.dask"):
        simdnorm.layer_norm(obj)
    with pytest.raises(TypeError, match=rf"^scale: a {lib} {cls}; .*simdnorm.dask"):
        simdnorm.layer_norm(np.ones((2, 3), F32), obj)


def test_import_and_numpy_calls_do_not_import_torch():
    code = ("import sys, numpy as np, simdnorm\n"
            "a = np.ones((2, 3), np.float32)\n"
            "class P:\n"
            "    def __dlpack__(self, **kw):\n"
            "        return a.__dlpack__(**kw)\n"
            "simdnorm.layer_norm(a); simdnorm.layer_norm(P()); simdnorm.layer_norm(a, out=np.empty_like(a))\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
