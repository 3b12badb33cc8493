"""simdnorm.torch's drop-in modules and convert() (SPEC §10) against torch.nn's own: a small CNN and a
small transformer block converted in place train three steps beside their torch.nn twins (outputs,
gradients, running statistics and state_dict equal within float32 rounding), then agree in eval
mode; every module in its configurations (momentum=None, no affine, no running statistics,
unbatched instance norm, RMSNorm's eps=None, channels last, mixed precision); state_dict both ways
(old checkpoints without num_batches_tracked too); what simdnorm does not take goes to torch.nn;
torch.compile(fullgraph=True) and torch.export of converted models; bfloat16 end to end."""
from __future__ import annotations

import collections
import copy
import gc
import inspect
import math
import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install '.[torch]'): "
                                           "simdnorm.torch needs it")

from torch import nn  # noqa: E402

import simdnorm  # noqa: E402
import simdnorm.torch as snt  # noqa: E402
from ml_dtypes import bfloat16 as BF16  # noqa: E402
from simdnorm.torch import _modules, _routes  # noqa: E402


def rand(rng, *shape, dtype=torch.float32, loc=0.0):
    return torch.from_numpy(rng.standard_normal(shape) + loc).to(dtype)


NORMS = tuple(getattr(nn, c) for c in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LayerNorm", "GroupNorm",
                                       "RMSNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"))


def randomize(model, rng):
    """The normalization modules' parameters and running statistics away from their initial ones and
    zeros, by about 0.3 (the other layers keep torch's initialization: the nets stay well scaled)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, NORMS):
                for name, t in list(m.named_parameters()) + list(m.named_buffers()):
                    if t.dtype.is_floating_point:
                        v = 0.3 * rand(rng, *t.shape)
                        t.copy_(v.abs() + 1 if name == "running_var" else v + 1 if name == "weight" else v)
    return model


def assert_close(got, want, what, rtol=1e-4, atol=1e-5):
    """Normwise: max |got - want| <= rtol * max |want| + atol (float32 sums of many terms differ in
    their last bits wherever they cancel, element by element)."""
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    bound = rtol * (want.double().abs().max().item() if got.numel() else 0.0) + atol
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def assert_grads_close(model, ref, what, rtol=1e-4):
    """Each parameter's gradient, within rtol of the largest gradient of the model too (a bias
    before a batch norm has a gradient of 0: rounding noise of the others' size)."""
    scale = max(q.grad.abs().max().item() for q in ref.parameters())
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"{what}: gradient of {n}", rtol=rtol, atol=rtol * scale)


class SmallCNN(nn.Module):
    """(No bias before a normalization: its gradient would be 0, a difference of rounding noise.)"""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.gn = nn.GroupNorm(4, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.inorm = nn.InstanceNorm2d(8, affine=True, track_running_stats=True)
        self.fc = nn.Linear(8 * 8 * 8, 6, bias=False)
        self.bn1 = nn.BatchNorm1d(6, momentum=None)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = self.inorm(self.conv2(torch.relu(self.gn(x))))
        # (flattened, not pooled: a pooled instance norm is nearly the same for every sample, and
        # BatchNorm1d would divide by that tiny spread)
        return self.bn1(self.fc(torch.relu(x).flatten(1)))


class Block(nn.Module):
    """A pre-norm transformer block: LayerNorm before attention, RMSNorm before the MLP."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.rms = nn.RMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))

    def forward(self, x):
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.rms(x))


# (model, input shape, output shape); a batch of 16: BatchNorm1d normalizes over it
MODELS = {"cnn": (SmallCNN, (16, 3, 8, 8), (16, 6)), "transformer": (Block, (3, 5, 16), (3, 5, 16))}


def twins(make, rng):
    torch.manual_seed(int(rng.integers(2 ** 31)))
    ref = randomize(make(), rng)
    return ref, copy.deepcopy(ref)


def step(model, opt, x, target):
    opt.zero_grad()
    y = model(x)
    ((y - target) ** 2).mean().backward()
    opt.step()
    return y.detach()


def test_convert_swaps_in_place_keeping_every_object():
    model = SmallCNN()
    params = {n: p for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    modules = dict(model.named_modules())
    assert snt.convert(model) is model
    assert {n: p for n, p in model.named_parameters()} == params  # (dict equality: the same objects)
    assert all(b is buffers[n] for n, b in model.named_buffers())
    assert all(m is modules[n] for n, m in model.named_modules())
    assert type(model.bn) is snt.BatchNorm2d and isinstance(model.bn, nn.BatchNorm2d)
    assert type(model.gn) is snt.GroupNorm and type(model.inorm) is snt.InstanceNorm2d
    assert type(model.bn1) is snt.BatchNorm1d and type(model.conv1) is nn.Conv2d
    assert snt.convert(model) is model and type(model.bn) is snt.BatchNorm2d  # twice: nothing more
    root = snt.convert(nn.LayerNorm(4))
    assert type(root) is snt.LayerNorm

    class Mine(nn.BatchNorm2d):  # a subclass of the user's own: left alone
        pass

    assert type(snt.convert(nn.Sequential(Mine(3)))[0]) is Mine
    with pytest.raises(TypeError, match="torch.nn.Module"):
        snt.convert(object())


@pytest.mark.parametrize("name", MODELS)
def test_three_training_steps_then_eval_match_torch_nn(rng, name):
    make, shape, out_shape = MODELS[name]
    ref, ours = twins(make, rng)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)  # made before convert: keeps working
    snt.convert(ours)
    assert sum(type(m).__module__ == _modules.__name__ for m in ours.modules()) >= 2
    for i in range(3):
        x, target = rand(rng, *shape, loc=1.0), rand(rng, *out_shape)
        y_ref, y = step(ref, opt_ref, x, target), step(ours, opt_ours, x, target)
        assert_close(y, y_ref, f"step {i}: output")
        assert_grads_close(ours, ref, f"step {i}")
        sd, sd_ref = ours.state_dict(), ref.state_dict()
        assert sd.keys() == sd_ref.keys()
        for k in sd:
            if k.endswith("num_batches_tracked"):  # (batch norms count batches, instance norms do not)
                assert int(sd[k]) == int(sd_ref[k]) == (i + 1 if k.startswith("bn") else 0), k
            else:
                assert_close(sd[k], sd_ref[k], f"step {i}: state_dict[{k!r}]")
    ref.eval()
    ours.eval()
    x = rand(rng, *shape)
    with torch.no_grad():
        assert_close(ours(x), ref(x), "eval output")


# ----------------------------------------------------------------------------------------------------
# each module, against its torch.nn class

CONFIGS = [
    ("BatchNorm1d", (6,), {}, (5, 6)),
    ("BatchNorm1d", (6,), {"momentum": None}, (4, 6, 7)),
    ("BatchNorm2d", (6,), {"eps": 1e-3, "momentum": 0.3}, (3, 6, 4, 5)),
    ("BatchNorm2d", (6,), {"affine": False, "track_running_stats": False}, (3, 6, 4, 5)),
    ("BatchNorm3d", (4,), {"momentum": None}, (2, 4, 3, 2, 5)),
    ("InstanceNorm1d", (6,), {}, (4, 6, 9)),
    ("InstanceNorm1d", (6,), {"affine": True, "track_running_stats": True}, (6, 9)),  # unbatched
    ("InstanceNorm2d", (6,), {"affine": True, "track_running_stats": True, "momentum": 0.2}, (3, 6, 4, 5)),
    ("InstanceNorm3d", (4,), {"track_running_stats": True, "momentum": None}, (2, 4, 3, 2, 5)),
    ("LayerNorm", ((5, 4),), {}, (3, 6, 5, 4)),
    ("LayerNorm", (7,), {"bias": False, "eps": 1e-3}, (2, 3, 7)),
    ("LayerNorm", (7,), {"elementwise_affine": False}, (4, 7)),
    ("GroupNorm", (3, 6), {}, (3, 6, 4, 5)),
    ("GroupNorm", (2, 6), {"affine": False, "eps": 1e-2}, (3, 6, 7)),
    ("RMSNorm", (7,), {}, (2, 3, 7)),
    ("RMSNorm", ((5, 4),), {"eps": 1e-3}, (3, 5, 4)),
    ("RMSNorm", (7,), {"elementwise_affine": False}, (4, 7)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("cls, args, kwargs, shape", CONFIGS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CONFIGS)])
def test_module_matches_torch_nn_in_train_and_eval(rng, cls, args, kwargs, shape, dtype):
    ref = randomize(getattr(nn, cls)(*args, **kwargs), rng).to(dtype)
    ours = snt.convert(copy.deepcopy(ref))
    assert type(ours) is getattr(snt, cls)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    for i, train in enumerate((True, True, False)):  # the running statistics move twice, then serve
        ref.train(train)
        ours.train(train)
        x = rand(rng, *shape, dtype=dtype, loc=2.0)
        g = rand(rng, *shape, dtype=dtype)
        outs = []
        for m in (ref, ours):
            xr = x.clone().requires_grad_(True)
            y = m(xr)
            y.backward(g)
            outs.append((y.detach(), xr.grad) + tuple(p.grad for p in m.parameters()))
            for p in m.parameters():
                p.grad = None
        for k, (a, b) in enumerate(zip(outs[1], outs[0])):
            assert_close(a, b, f"step {i} (train={train}): {'output' if k == 0 else 'gradient ' + str(k)}", **tol)
        for (n, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
            assert_close(a, b, f"step {i} (train={train}): {n}", **tol)


@pytest.mark.parametrize("cls, args, kwargs, shape", CONFIGS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CONFIGS)])
def test_negated_input_is_read_as_its_values(rng, cls, args, kwargs, shape):
    """An input with the negative bit set (its memory holds the values' negatives, as z.conj().imag's
    does) gives the bits of its resolved copy: output, gradients and running statistics, with and
    without autograd, in train and eval modes."""
    a = snt.convert(randomize(getattr(nn, cls)(*args, **kwargs), rng))
    b = copy.deepcopy(a)
    for train, grad in ((True, False), (True, True), (False, False), (False, True)):
        a.train(train)
        b.train(train)
        x = rand(rng, *shape, loc=2.0)
        g = rand(rng, *shape)
        outs = []
        for m, xin in ((a, x), (b, torch._neg_view(-x))):
            assert xin.is_neg() == (m is b) and torch.equal(xin, x)
            with torch.set_grad_enabled(grad):
                xr = xin.detach().requires_grad_(grad)
                y = m(xr)
                if grad:
                    y.backward(g)
            outs.append((y.detach(),) + ((xr.grad,) + tuple(p.grad for p in m.parameters()) if grad else ()))
            for p in m.parameters():
                p.grad = None
        for k, (u, v) in enumerate(zip(*outs)):
            assert torch.equal(u, v), f"train={train}, grad={grad}: {'output' if k == 0 else 'gradient ' + str(k)}"
        for (n, u), v in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(u, v), f"train={train}, grad={grad}: {n}"


def _layouts(rng, shape, dtype):
    """x of logical shape `shape` in each memory layout: C order, dims stored reversed, every other
    element of the last dim (not dense), channels last (4-D), unaligned (one element in)."""
    def make(s):
        return rand(rng, *s, loc=1.0).to(dtype)

    out = {"c": make(shape), "reversed": make(shape[::-1]).permute(*range(len(shape) - 1, -1, -1)),
           "strided": make(shape[:-1] + (2 * shape[-1],))[..., ::2],
           "unaligned": make((int(np.prod(shape)) + 1,))[1:].view(shape)}
    if len(shape) == 4:
        out["channels_last"] = make(shape).contiguous(memory_format=torch.channels_last)
    return out


def _np(t):
    if t is None:
        return None
    t = t.detach()
    return t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()


# (module, input shape, the plain function the per-call route must match bit for bit)
ROUTES = [
    (lambda: nn.BatchNorm2d(6).eval(), (3, 6, 4, 5),
     lambda m, x: simdnorm.batch_normalization(x, _np(m.running_mean), _np(m.running_var), _np(m.weight),
                                               _np(m.bias), epsilon=m.eps)),
    (lambda: nn.BatchNorm1d(5, affine=False).eval(), (4, 5),
     lambda m, x: simdnorm.batch_normalization(x, _np(m.running_mean), _np(m.running_var), epsilon=m.eps)),
    (lambda: nn.LayerNorm((5, 4)), (3, 6, 5, 4),
     lambda m, x: simdnorm.layer_norm(x, _np(m.weight), _np(m.bias), axis=-2, epsilon=m.eps)),
    (lambda: nn.LayerNorm(3, bias=False), (2,) * 7 + (3,),
     lambda m, x: simdnorm.layer_norm(x, _np(m.weight), axis=-1, epsilon=m.eps)),
    (lambda: nn.RMSNorm(7, eps=1e-3), (2, 3, 7), lambda m, x: simdnorm.rms_norm(x, _np(m.weight), epsilon=1e-3)),
    (lambda: nn.GroupNorm(3, 6), (3, 6, 4, 5),
     lambda m, x: simdnorm.group_norm(x, 3, _np(m.weight), _np(m.bias), epsilon=m.eps)),
    (lambda: nn.GroupNorm(2, 4, affine=False), (2, 4) + (2,) * 6,  # 8 dims: the kernel's split makes 9
     lambda m, x: simdnorm.group_norm(x, 2, epsilon=m.eps)),
    (lambda: nn.InstanceNorm2d(6, affine=True), (3, 6, 4, 5),
     lambda m, x: simdnorm.instance_norm(x, _np(m.weight), _np(m.bias), epsilon=m.eps)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                         ids=["f32", "f64", "f16", "bf16"])
@pytest.mark.parametrize("case", range(len(ROUTES)))
def test_per_call_route_gives_the_plain_functions_bits(rng, case, dtype, monkeypatch):
    """Without autograd the modules hand the tensors to the kernels themselves (plans cached by
    shapes and dtypes): in every layout, each dtype (16-bit data with the module's float32
    parameters, torch.nn's mixed precision, and with its own), the output is the plain function's
    on numpy views, bit for bit, and a fresh tensor like torch.empty_like(x)."""
    make, shape, plain = ROUTES[case]
    monkeypatch.setattr(_modules, "_plain", None)  # (the general path would fail: the route must run)
    for params in (torch.float32, dtype) if dtype in (torch.float16, torch.bfloat16) else (dtype,):
        m = snt.convert(randomize(make(), rng)).to(params)
        for name, x in _layouts(rng, shape, dtype).items():
            for _ in range(2):  # a miss, then a hit
                with torch.no_grad():
                    y = m(x)
                want = plain(m, _np(x))
                assert type(y) is torch.Tensor and y.dtype == x.dtype and y.stride() == torch.empty_like(x).stride()
                np.testing.assert_array_equal(_np(y), want, err_msg=f"{name}, parameters {params}")


def test_batch_norm_channels_last_keeps_the_memory_format(rng):
    ref = randomize(nn.BatchNorm2d(8), rng)
    ours = snt.convert(copy.deepcopy(ref))
    x = rand(rng, 4, 8, 5, 6).contiguous(memory_format=torch.channels_last)
    for train in (True, False):
        ref.train(train)
        ours.train(train)
        y, y_ref = ours(x), ref(x)
        assert y.is_contiguous(memory_format=torch.channels_last) and y.stride() == y_ref.stride()
        assert_close(y.detach(), y_ref.detach(), f"channels last, train={train}")


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # (torch.nn's RMSNorm says so)
@pytest.mark.parametrize("cls, args, shape", [("BatchNorm2d", (8,), (4, 8, 3, 3)), ("LayerNorm", (6,), (4, 5, 6)),
                                              ("GroupNorm", (2, 8), (4, 8, 5)), ("RMSNorm", (6,), (4, 5, 6)),
                                              ("InstanceNorm1d", (8,), (4, 8, 6))])
def test_mixed_precision_bfloat16_data_float32_module(rng, cls, args, shape):
    # torch.nn takes 16-bit data with float32 parameters (the output in the data's dtype): so do we
    kwargs = {"affine": True, "track_running_stats": True} if cls == "InstanceNorm1d" else {}
    ref = randomize(getattr(nn, cls)(*args, **kwargs), rng)
    ours = snt.convert(copy.deepcopy(ref))
    x = rand(rng, *shape, dtype=torch.bfloat16, loc=1.0)
    for train in (True, False):
        ref.train(train)
        ours.train(train)
        with torch.no_grad():
            y, y_ref = ours(x), ref(x)
        assert y.dtype == torch.bfloat16
        assert_close(y.float(), y_ref.float(), f"{cls} bf16 train={train}", rtol=2e-2, atol=2e-2)
    for a, b in zip(ours.buffers(), ref.buffers()):
        assert_close(a.float(), b.float(), f"{cls}: running statistics", rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_rms_norm_eps_none_is_the_computation_types_epsilon(rng, dtype):
    # values whose mean square (1e-8) is below float32's epsilon (1.2e-7): the eps chosen shows
    x = rand(rng, 4, 16, dtype=torch.float64).mul(1e-4).to(dtype)
    ours, ref = snt.RMSNorm(16), nn.RMSNorm(16)
    with torch.no_grad():
        y, y_ref = ours(x), ref(x)
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    want = x.double() / torch.sqrt(x.double().square().mean(-1, keepdim=True) + eps)
    tol = 1e-12 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 1e-2
    assert (y.double() - want).abs().max() <= tol * want.abs().max()
    assert (y.double() - y_ref.double()).abs().max() <= 2 * tol * want.abs().max()


# ----------------------------------------------------------------------------------------------------
# state_dict

def test_state_dict_both_ways_and_old_checkpoints(rng):
    ref = randomize(SmallCNN(), rng)
    ours = snt.convert(SmallCNN())
    ours.load_state_dict(ref.state_dict())  # (strict: the same keys)
    back = SmallCNN()
    back.load_state_dict(ours.state_dict())
    x = rand(rng, 2, 3, 8, 8)
    ref.eval(), ours.eval(), back.eval()
    with torch.no_grad():
        assert_close(ours(x), ref(x), "torch.nn's checkpoint in the converted model")
        assert torch.equal(back(x), ref(x))
    # a checkpoint from before num_batches_tracked (no version metadata): torch.nn's rule fills it in
    old = collections.OrderedDict((k, v) for k, v in ref.state_dict().items() if "num_batches_tracked" not in k)
    fresh = snt.convert(SmallCNN())
    fresh.load_state_dict(old)
    assert int(fresh.bn.num_batches_tracked) == 0
    fresh.train()
    fresh(x)
    assert int(fresh.bn.num_batches_tracked) == 1


def test_convert_sync_batchnorm_sees_batch_norms():
    model = snt.convert(SmallCNN())
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert type(synced.bn) is nn.SyncBatchNorm and type(synced.bn1) is nn.SyncBatchNorm


# ----------------------------------------------------------------------------------------------------
# what simdnorm does not take: torch.nn's own forward

@pytest.fixture
def no_simdnorm_ops(monkeypatch):
    """Fail on any simdnorm op the modules call: what follows must take torch.nn's path."""
    def refuse(*args, **kwargs):
        raise AssertionError("a simdnorm op ran")

    for attr in ("_bn", "_bn_training", "_update", "_layer_norm", "_rms_norm", "_group_norm", "_instance_norm"):
        monkeypatch.setattr(_modules, attr, refuse)
    for attr in ("_mvn", "_batch_norm"):  # the per-call route's kernels
        monkeypatch.setattr(_routes, attr, refuse)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_tensors_simdnorm_does_not_take_go_to_torch_nn(rng, no_simdnorm_ops, grad):
    with torch.set_grad_enabled(grad):  # (without grad the modules take the per-call route)
        _not_taken(rng)


def _not_taken(rng):
    bn = snt.BatchNorm2d(4)
    # off the CPU (the meta device stands in for an accelerator here)
    y = snt.convert(nn.BatchNorm2d(4, device="meta"))(torch.empty(2, 4, 3, 3, device="meta"))
    assert y.device.type == "meta" and y.shape == (2, 4, 3, 3)
    # an empty batch: torch.nn's result, its running statistics and counter
    y = bn(torch.empty(0, 4, 3, 3))
    assert y.shape == (0, 4, 3, 3) and int(bn.num_batches_tracked) == 1
    # float64 data with float32 parameters: torch.nn's error, not a different answer
    with pytest.raises(RuntimeError):
        bn(rand(rng, 2, 4, 3, 3, dtype=torch.float64))
    # integer data and shapes torch.nn refuses: torch.nn's errors
    with pytest.raises(RuntimeError):
        snt.LayerNorm(3)(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(RuntimeError):
        snt.LayerNorm(3)(rand(rng, 2, 4))
    with pytest.raises(RuntimeError):
        snt.GroupNorm(3, 6)(rand(rng, 2, 5, 4))
    with pytest.raises(RuntimeError):
        snt.RMSNorm((2, 3))(rand(rng, 3, 2))
    with pytest.raises(RuntimeError):  # GroupNorm(2, 4)'s parameters on 6 channels (2 divides 6)
        snt.GroupNorm(2, 4)(rand(rng, 2, 6, 5))
    with pytest.raises(RuntimeError):  # float16 parameters, float32 data
        snt.LayerNorm(5).half()(rand(rng, 2, 5))
    # a nested (jagged) tensor: torch.nn normalizes each row; refused (GroupNorm) as torch.nn refuses
    rows = [rand(rng, 3, 4, 8), rand(rng, 5, 4, 8)]
    for make in (lambda: nn.LayerNorm(8), lambda: nn.LayerNorm((4, 8)), lambda: nn.RMSNorm(8)):
        theirs = make()
        ours = snt.convert(make())
        y = ours(torch.nested.nested_tensor(rows, layout=torch.jagged))
        want = theirs(torch.nested.nested_tensor(rows, layout=torch.jagged))
        assert y.is_nested and all(torch.equal(a, b) for a, b in zip(y.unbind(), want.unbind()))
    with pytest.raises(Exception) as theirs:
        nn.GroupNorm(2, 4)(torch.nested.nested_tensor(rows, layout=torch.jagged))
    with pytest.raises(type(theirs.value)):
        snt.GroupNorm(2, 4)(torch.nested.nested_tensor(rows, layout=torch.jagged))
    # a nested tensor of the strided layout (it has no shape to read): torch.nn's LayerNorm takes it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch: the strided layout is a prototype)
        strided = torch.nested.nested_tensor([r[0] for r in rows])
    theirs, ours = nn.LayerNorm(8), snt.LayerNorm(8)
    assert all(torch.equal(a, b) for a, b in zip(ours(strided).unbind(), theirs(strided).unbind()))


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("make, shape", [
    (lambda: nn.LayerNorm(5, eps=-1e-3), (3, 5)),
    (lambda: nn.LayerNorm(5, eps=math.inf), (3, 5)),
    (lambda: nn.RMSNorm(5, eps=math.nan), (3, 5)),
    (lambda: nn.GroupNorm(2, 4, eps=-1e-3), (2, 4, 3)),
    (lambda: nn.InstanceNorm1d(3, eps=-1e-3), (2, 3, 5)),
    (lambda: nn.InstanceNorm1d(3, momentum=2.0, track_running_stats=True), (2, 3, 5)),
    (lambda: nn.BatchNorm1d(3, momentum=2.0), (4, 3)),
    (lambda: nn.BatchNorm1d(3, momentum=-0.5), (4, 3)),
    (lambda: nn.BatchNorm1d(3, eps=0.0), (4, 3)),  # (torch.nn's ValueError in training)
    (lambda: nn.BatchNorm1d(3, eps=-1.0), (4, 3)),
], ids=lambda v: "" if callable(v) else str(v))
def test_attributes_simdnorm_does_not_take_are_torch_nns(rng, make, shape, grad):
    """eps and momentum values torch.nn computes with (negative, infinite or NaN eps, momentum
    outside [0, 1]) or refuses (batch norm's eps <= 0 with batch statistics): torch.nn's result or
    error, not simdnorm's refusal or a result torch.nn does not give."""
    ref = make().train()
    mine = snt.convert(copy.deepcopy(ref))
    x = rand(rng, *shape)
    with torch.set_grad_enabled(grad):
        try:
            want = ref(x.clone())
        except (ValueError, RuntimeError) as e:
            with pytest.raises(type(e)):
                mine(x.clone())
            return
        got = mine(x.clone())
    torch.testing.assert_close(got, want, equal_nan=True)
    for name, buf in ref.named_buffers():
        torch.testing.assert_close(dict(mine.named_buffers())[name], buf, equal_nan=True)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_a_plan_another_module_made_keeps_each_modules_checks(rng, grad):
    """The per-call route's plans are keyed by shapes, dtypes and attributes, not by module: a
    shape one module took is still refused by another whose own checks refuse it."""
    with torch.set_grad_enabled(grad):
        x = rand(rng, 2, 4, 3, 3)
        snt.BatchNorm2d(4).eval()(x)
        with pytest.raises(ValueError, match="expected 2D or 3D input"):
            snt.BatchNorm1d(4).eval()(x)
        snt.GroupNorm(2, 4)(x)
        with pytest.raises(RuntimeError):
            snt.GroupNorm(2, 6)(x)
        snt.LayerNorm(3)(x)
        with pytest.raises(RuntimeError):
            snt.LayerNorm(4)(x)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("make, shape, train", [
    (lambda: nn.BatchNorm1d(4), (1, 4), True),
    (lambda: nn.BatchNorm1d(4, track_running_stats=False), (1, 4), False),  # batch statistics in eval
    (lambda: nn.BatchNorm2d(3, track_running_stats=False), (1, 3, 1, 1), False),
    (lambda: nn.BatchNorm1d(4), (1, 4), False),  # running statistics: no error
    (lambda: nn.GroupNorm(4, 4), (1, 4), True),  # one sample of one-element groups
    (lambda: nn.GroupNorm(3, 3, affine=False), (1, 3, 1), False),
    (lambda: nn.GroupNorm(2, 4), (1, 4), True),  # groups of two: no error
    (lambda: nn.InstanceNorm1d(3), (2, 3, 1), True),
])
def test_the_drop_ins_refuse_one_value_where_torch_nn_does(rng, make, shape, train, grad):
    """A statistic of a single value: the drop-in raises torch.nn's ValueError exactly where
    torch.nn's module does (whatever its route), and otherwise gives torch.nn's result."""
    ref = make().train(train)
    mine = snt.convert(copy.deepcopy(ref))
    x = rand(rng, *shape)
    with torch.set_grad_enabled(grad):
        try:
            want = ref(x.clone())
        except ValueError as e:
            with pytest.raises(ValueError, match="Expected more than 1"):
                mine(x.clone())
            assert "Expected more than 1" in str(e)
            return
        assert_close(mine(x.clone()).detach(), want.detach(), "output")


# ----------------------------------------------------------------------------------------------------
# bfloat16 end to end

def test_bfloat16_model_end_to_end(rng):
    # The converted model in bfloat16 against its float64 twin, beside torch.nn's own bfloat16 twin:
    # outputs, the input's and every parameter's gradient, the running statistics. Through three
    # bf16 convolutions both are 0.1% to 70% of a tensor's largest value off, each tensor's error a
    # matter of chance; over all of them ours is no further off than torch.nn's (1.5x: the chance).
    ref, ours = twins(SmallCNN, rng)
    ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    ref = ref.double()
    ours = snt.convert(ours).to(torch.bfloat16)
    x, g = rand(rng, 16, 3, 8, 8), rand(rng, 16, 6)
    results = []
    for m, dtype in ((ref, torch.float64), (ref_bf16, torch.bfloat16), (ours, torch.bfloat16)):
        xr = x.to(dtype).requires_grad_(True)
        y = m(xr)
        y.backward(g.to(dtype))
        assert y.dtype == dtype and xr.grad.dtype == dtype
        named = [("output", y), ("input gradient", xr.grad)] + [(f"gradient of {n}", p.grad)
                                                               for n, p in m.named_parameters()]
        named += [(n, b) for n, b in m.named_buffers() if b.dtype.is_floating_point]
        results.append([(n, t.detach().double()) for n, t in named])
    ours_err, torch_err = [], []
    for (what, want), (_, theirs), (_, got) in zip(*results):
        scale = want.abs().max().item()
        ours_err.append((got - want).abs().max().item() / scale)
        torch_err.append((theirs - want).abs().max().item() / scale)
        assert ours_err[-1] <= 3 * torch_err[-1] + 0.05, \
            f"{what}: error {ours_err[-1]:.3g} (torch.nn's {torch_err[-1]:.3g})"
    assert np.mean(ours_err) <= 1.5 * np.mean(torch_err) + 0.005, (ours_err, torch_err)


# ----------------------------------------------------------------------------------------------------
# torch.compile and torch.export

class Both(nn.Module):
    def __init__(self):
        super().__init__()
        self.cnn, self.block = SmallCNN(), Block()

    def forward(self, x, tokens):
        return self.cnn(x), self.block(tokens)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # (inductor's)
def test_compile_fullgraph_of_converted_models(rng):
    ref, ours = twins(Both, rng)
    snt.convert(ours)
    compiled = torch.compile(ours, fullgraph=True)
    x, tokens = rand(rng, 16, 3, 8, 8), rand(rng, 3, 5, 16)
    outs, outs_ref = compiled(x, tokens), ref(x, tokens)
    (outs[0].square().sum() + outs[1].square().sum()).backward()
    (outs_ref[0].square().sum() + outs_ref[1].square().sum()).backward()
    # inductor compiles the layers around the simdnorm ops in its own order of float32 operations:
    # torch.nn's own compiled twin of this model is up to 7e-4 of the largest gradient from float64
    for a, b, what in zip(outs, outs_ref, ("cnn", "transformer")):
        assert_close(a.detach(), b.detach(), f"compiled {what} output", rtol=1e-3)
    assert_grads_close(ours, ref, "compiled", rtol=1e-3)
    for (n, a), b in zip(ours.named_buffers(), ref.buffers()):
        assert_close(a, b, f"compiled: buffer {n}", rtol=1e-3)


def test_export_of_a_converted_model_holds_simdnorm_ops(rng):
    model = snt.convert(randomize(SmallCNN(), rng))
    x = rand(rng, 4, 3, 8, 8)
    found = {}
    for train in (False, True):
        model.train(train)
        program = torch.export.export(model, (x,))
        found[train] = {str(n.target) for n in program.graph.nodes if str(n.target).startswith("simdnorm.")}
        if not train:
            with torch.no_grad():
                assert_close(program.module()(x), model(x), "exported program")
    assert found[False] == {"simdnorm.batch_normalization.default", "simdnorm.group_norm.default"}
    assert found[True] == {"simdnorm.batch_normalization_training.default", "simdnorm.update_running_stats_.default",
                           "simdnorm.group_norm.default"}


def test_batch_norm_under_checkpoint_updates_running_stats_once_a_step(rng):
    # torch.nn's updates twice under non-reentrant checkpointing (docs/torch.rst says why); the
    # drop-in's statistics after a checkpointed step equal an unchecked step's, the gradients torch.nn's
    from torch.utils.checkpoint import checkpoint

    x = rand(rng, 6, 4, 3)
    plain, checked, theirs = (snt.BatchNorm1d(4), snt.BatchNorm1d(4), nn.BatchNorm1d(4))
    grads = []
    for m, wrap in ((plain, False), (checked, True), (theirs, True)):
        xi = x.clone().requires_grad_(True)
        y = checkpoint(m, xi, use_reentrant=False) if wrap else m(xi)
        grads.append(torch.autograd.grad(y.sin().sum(), xi)[0])
    for k, v in plain.state_dict().items():
        assert torch.equal(checked.state_dict()[k], v), k
    assert int(theirs.num_batches_tracked) == 2 and int(checked.num_batches_tracked) == 1
    assert torch.allclose(grads[1], grads[2], rtol=1e-5, atol=1e-6) and torch.equal(grads[0], grads[1])


class EveryNorm(nn.Module):
    """The nine drop-in classes in one net (RMSNorm apart: torch.onnx's TorchScript exporter has
    no translation of torch.nn's own)."""

    def __init__(self, rms: bool = True):
        super().__init__()
        self.bn3, self.in3 = nn.BatchNorm3d(4), nn.InstanceNorm3d(4, affine=True, track_running_stats=True)
        self.bn2, self.in2, self.gn = nn.BatchNorm2d(4), nn.InstanceNorm2d(4), nn.GroupNorm(2, 4)
        self.bn1, self.in1 = nn.BatchNorm1d(4, momentum=None), nn.InstanceNorm1d(4, affine=True)
        self.ln = nn.LayerNorm(90)
        self.rms = nn.RMSNorm(90) if rms else nn.Identity()

    def forward(self, x):  # x: (N, 4, 3, 5, 6)
        h = self.in3(self.bn3(x)).flatten(3)
        h = self.gn(torch.relu(self.in2(self.bn2(h)))).flatten(2)
        return self.rms(self.ln(self.in1(self.bn1(h))))


def _onnx_export(model, x, dynamo, train, path):
    """The ONNX model torch.onnx makes of model, or the exception's class."""
    import warnings

    import onnx

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the exporters' own deprecation and progress notes)
            if dynamo:
                torch.onnx.export(model, (x,), dynamo=True, verbose=False).save(str(path))
            else:
                mode = torch.onnx.TrainingMode.PRESERVE if train else torch.onnx.TrainingMode.EVAL
                torch.onnx.export(model, (x,), str(path), dynamo=False, training=mode)
    except Exception as e:  # noqa: BLE001 - compared with torch.nn's outcome
        return type(e)
    return onnx.load(str(path))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_onnx_export_of_a_converted_model_is_torch_nns(rng, tmp_path, dynamo, train):
    # torch.onnx translates torch.nn's normalizations into ONNX's own nodes and has no translation
    # of simdnorm's ops: under an export the drop-ins run torch.nn's forward, so the file is the one
    # torch.nn's model gives (or the export fails as torch.nn's does)
    onnx = pytest.importorskip("onnx", reason="onnx is not installed (the test extra installs it)")
    if dynamo:
        pytest.importorskip("onnxscript", reason="torch.onnx's dynamo exporter needs onnxscript (the test extra)")
    from onnx.reference import ReferenceEvaluator

    for rms in ((True, False) if not dynamo else (True,)):
        ref, ours = twins(lambda: EveryNorm(rms), rng)
        snt.convert(ours).train(train), ref.train(train)
        kinds = [type(m) for m in ours.modules()]
        state = copy.deepcopy(ours.state_dict())
        x = rand(rng, 2, 4, 3, 5, 6)
        got = _onnx_export(ours, x, dynamo, train, tmp_path / "ours.onnx")
        want = _onnx_export(ref, x, dynamo, train, tmp_path / "ref.onnx")
        if isinstance(want, type):
            assert got is want, f"rms={rms}: torch.nn's export raised {want.__name__}, ours gave {got}"
            continue
        assert not isinstance(got, type), f"rms={rms}: the converted model's export raised {got.__name__}"
        assert [(n.op_type, n.domain) for n in got.graph.node] == [(n.op_type, n.domain) for n in want.graph.node]
        assert sorted(i.name for i in got.graph.initializer) == sorted(i.name for i in want.graph.initializer)
        x2 = rand(rng, 2, 4, 3, 5, 6).numpy()
        y_got = ReferenceEvaluator(got).run(None, {got.graph.input[0].name: x2})
        y_want = ReferenceEvaluator(want).run(None, {want.graph.input[0].name: x2})
        for a, b in zip(y_got, y_want):
            np.testing.assert_array_equal(a, b)
        assert [type(m) for m in ours.modules()] == kinds  # (still the drop-ins, their state untouched)
        for k, v in ours.state_dict().items():
            assert torch.equal(v, state[k]), k


def test_fx_symbolic_trace_calls_the_drop_ins(rng):
    # torch.fx's tracer keeps torch.nn's modules as call_module nodes (it knows them by their module
    # path); the drop-ins make the same node of themselves, so the GraphModule runs simdnorm
    ref, ours = twins(EveryNorm, rng)
    snt.convert(ours)
    traced, traced_ref = torch.fx.symbolic_trace(ours), torch.fx.symbolic_trace(ref)
    nodes = [(n.op, str(n.target)) for n in traced.graph.nodes]
    assert nodes == [(n.op, str(n.target)) for n in traced_ref.graph.nodes]
    assert {t for op, t in nodes if op == "call_module"} == {n for n, m in ours.named_children()
                                                             if not isinstance(m, nn.Identity)}
    for name, m in ours.named_children():
        assert traced.get_submodule(name) is m
    for train in (True, False):
        ours.train(train), ref.train(train), traced.train(train)
        x = rand(rng, 2, 4, 3, 5, 6)
        with torch.no_grad():
            y, y_model, y_ref = traced(x), ours(x) if not train else None, ref(x)
        assert_close(y, y_ref, f"traced, train={train}")
        if not train:
            assert torch.equal(y, y_model)
    for (n, a), b in zip(ours.named_buffers(), ref.buffers()):  # (the train step updated both alike)
        assert_close(a, b, f"buffer {n}")


def test_fx_tracer_with_a_proxy_class_of_its_own(rng):
    # (tracers such as transformers' make their own Proxy subclass)
    class OwnProxy(torch.fx.Proxy):
        pass

    class OwnTracer(torch.fx.Tracer):
        def proxy(self, node):
            return OwnProxy(node, self)

    ours = snt.convert(EveryNorm())
    graph = OwnTracer().trace(ours)
    assert [n.op for n in graph.nodes].count("call_module") == 9
    x = rand(rng, 2, 4, 3, 5, 6)
    with torch.no_grad():
        assert torch.equal(torch.fx.GraphModule(ours, graph)(x), ours(x))


@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(6), lambda: nn.GroupNorm(2, 4), lambda: nn.RMSNorm(6),
                                  lambda: nn.BatchNorm1d(4), lambda: nn.InstanceNorm1d(4)],
                         ids=["layer", "group", "rms", "batch1d", "instance1d"])
def test_fx_symbolic_trace_of_a_drop_in_itself_is_torch_nns(make):
    # the traced root is traced through, torch.nn's forward: its graph, or torch.nn's error
    def trace(m):
        try:
            return [(n.op, str(n.target)) for n in torch.fx.symbolic_trace(m).graph.nodes]
        except Exception as e:  # noqa: BLE001 - compared with torch.nn's outcome
            return type(e)

    assert trace(snt.convert(make())) == trace(make())


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (TorchScript's own)
def test_jit_script_of_a_converted_model_scripts_torch_nns(rng):
    ref, ours = twins(lambda: EveryNorm(rms=True), rng)
    snt.convert(ours)
    params = {n: p for n, p in ours.named_parameters()}
    with pytest.warns(UserWarning, match="in the drop-in's place in the model") as caught:
        scripted = torch.jit.script(ours)
    assert len([w for w in caught if issubclass(w.category, UserWarning)]) == 9  # (one per drop-in)
    scripted_ref = torch.jit.script(ref)
    x = rand(rng, 2, 4, 3, 5, 6)
    for train in (False, True):
        scripted.train(train), scripted_ref.train(train)
        assert_close(scripted(x), scripted_ref(x), f"scripted, train={train}")
    for (n, a), b in zip(scripted.named_buffers(), scripted_ref.buffers()):
        assert_close(a, b, f"scripted buffer {n}")
    for n, p in ours.named_parameters():  # (torch.nn's modules in the drop-ins' place share their tensors)
        assert p is params[n]
    assert all(type(m).__module__.startswith("torch.nn") for m in ours.children())  # (as the warning says)
    snt.convert(ours)
    assert all(type(m).__module__.startswith("simdnorm") for m in ours.children() if not isinstance(m, nn.Identity))


def test_revert_swaps_torch_nns_classes_back_in_place(rng):
    ref, ours = twins(Both, rng)
    objects = {n: (m, type(m)) for n, m in ours.named_modules()}
    tensors = {n: t for n, t in list(ours.named_parameters()) + list(ours.named_buffers())}
    snt.convert(ours)
    assert any(type(m).__module__.startswith("simdnorm") for m in ours.modules())
    assert snt.revert(ours) is ours
    for n, m in ours.named_modules():
        assert m is objects[n][0] and type(m) is objects[n][1], n
    for n, t in list(ours.named_parameters()) + list(ours.named_buffers()):
        assert t is tensors[n], n
    ln = snt.LayerNorm(5)
    assert type(snt.revert(ln)) is nn.LayerNorm
    with pytest.raises(TypeError, match="torch.nn.Module"):
        snt.revert(object())


def test_fuse_modules_after_revert(rng):
    # torch.ao's fuser knows its modules by their exact classes: revert() first, as the docs say
    class ConvBn(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.relu = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()

        def forward(self, x):
            return self.relu(self.bn(self.conv(x)))

    ref, ours = twins(ConvBn, rng)
    ref.eval(), snt.convert(ours).eval()
    x = rand(rng, 2, 3, 6, 6)
    fused = torch.ao.quantization.fuse_modules(snt.revert(ours), [["conv", "bn", "relu"]])
    assert_close(fused(x).detach(), ref(x).detach(), "fused")


def _plain_attribute_weight(m, value):
    """m's weight (and bias) as plain attributes, no longer registered parameters (as an old-style
    weight_norm leaves them, or a tensor set by hand)."""
    for name, v in (("weight", value), ("bias", value - 0.5)):
        del m._parameters[name]
        setattr(m, name, torch.full_like(v, 0) + v)
    return m


@pytest.mark.parametrize("make,shape", [(lambda: nn.LayerNorm(6), (3, 6)), (lambda: nn.RMSNorm(6), (3, 6)),
                                        (lambda: nn.GroupNorm(2, 6), (3, 6, 4)),
                                        (lambda: nn.BatchNorm2d(6), (3, 6, 2, 2)),
                                        (lambda: nn.BatchNorm2d(6).eval(), (3, 6, 2, 2))],
                         ids=["layer", "rms", "group", "bn-train", "bn-eval"])
def test_plain_attribute_parameters_are_read(rng, make, shape):
    ref = make()
    value = torch.linspace(0.5, 2.0, 6)
    if isinstance(ref, nn.RMSNorm):
        del ref._parameters["weight"]
        ref.weight = value.clone()
    else:
        _plain_attribute_weight(ref, value)
    mine = snt.convert(copy.deepcopy(ref))
    x = rand(rng, *shape)
    torch.testing.assert_close(mine(x), ref(x), rtol=1e-5, atol=1e-5)


def test_weight_norm_on_a_drop_in(rng):
    ref, mine = nn.LayerNorm(5), snt.LayerNorm(5)
    for m in (ref, mine):
        with pytest.warns(FutureWarning):
            nn.utils.weight_norm(m, dim=0)
        with torch.no_grad():
            m.weight_g.fill_(3.0)
    x = rand(rng, 4, 5)
    torch.testing.assert_close(mine(x), ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make,shape", [(lambda c: nn.BatchNorm2d(c), (2, 4, 5, 5)),
                                        (lambda c: nn.BatchNorm2d(c).eval(), (2, 4, 5, 5)),
                                        (lambda c: nn.BatchNorm1d(c, affine=False), (2, 4)),
                                        (lambda c: nn.InstanceNorm1d(c, track_running_stats=True), (2, 4, 5))],
                         ids=["bn-train", "bn-eval", "bn1d-no-affine", "instance-running"])
def test_a_wrong_channel_count_raises_torch_nns_error(rng, make, shape):
    ref = make(3)
    mine = snt.convert(copy.deepcopy(ref))
    x = rand(rng, *shape)
    with pytest.raises(Exception) as theirs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref(x)
    with pytest.raises(type(theirs.value), match=re.escape(str(theirs.value))), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine(x)


def test_a_sparse_input_gets_torch_nns_error(rng):
    x = rand(rng, 3, 4).to_sparse()
    with pytest.raises(Exception) as theirs:
        nn.LayerNorm(4)(x)
    with pytest.raises(type(theirs.value)):
        snt.LayerNorm(4)(x)


def _cyclic_garbage(step):
    """What one call of step leaves in reference cycles (freed by the garbage collector only, with
    every tensor they hold: outputs on the huge-page blocks then map new ones each call), described;
    "" when nothing. step runs twice first (first calls import and cache)."""
    step()
    step()
    # (the youngest generation alone: with the collector off, whatever the step makes stays there)
    gc.collect(0)
    was_enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        step()
        if gc.collect(0) == 0:
            return ""
        kinds = collections.Counter(type(o).__name__ for o in gc.garbage)
        frames = sorted({f"{o.f_code.co_name} ({o.f_code.co_filename})" for o in gc.garbage if inspect.isframe(o)})
        return f"{dict(kinds)}; frames: {frames}"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()


_SMALL = {"BatchNorm1d": ((6,), (4, 6, 5)), "BatchNorm2d": ((6,), (4, 6, 3, 3)), "BatchNorm3d": ((6,), (2, 6, 2, 3, 3)),
          "LayerNorm": ((8,), (4, 3, 8)), "GroupNorm": ((2, 6), (4, 6, 3, 3)), "RMSNorm": ((8,), (4, 3, 8)),
          "InstanceNorm1d": ((6,), (4, 6, 5)), "InstanceNorm2d": ((6,), (4, 6, 3, 3)),
          "InstanceNorm3d": ((6,), (2, 6, 2, 3, 3))}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("cls", sorted(_SMALL))
def test_a_step_leaves_no_reference_cycle(rng, cls, dtype, train):
    """A drop-in's forward and backward free their tensors when the caller drops them, as torch.nn's
    do: a cycle (an exception kept in a local once held the bfloat16 calls' frames) kept each step's
    outputs until a collection, so that the next step's mapped new pages (the bench, which runs
    with the collector off, freed none)."""
    args, shape = _SMALL[cls]
    extra = {"affine": True, "track_running_stats": True} if cls.startswith("Instance") else {}
    m = randomize(snt.convert(getattr(nn, cls)(*args, **extra)), rng).to(dtype).train(train)
    x, dy = rand(rng, *shape, dtype=dtype), rand(rng, *shape, dtype=dtype)

    def forward_then_forward_backward():
        with torch.no_grad():
            m(x)
        xg = x.detach().requires_grad_()
        torch.autograd.grad(m(xg), (xg, *m.parameters()), dy)

    assert _cyclic_garbage(forward_then_forward_backward) == ""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=lambda d: str(d)[6:])
def test_the_plain_functions_on_tensors_leave_no_reference_cycle(rng, dtype):
    x = rand(rng, 4, 6, 3, 3, dtype=dtype)
    mean, var = rand(rng, 6, dtype=dtype), rand(rng, 6, dtype=dtype).abs() + 0.5

    def step():
        xg = x.detach().requires_grad_()
        ys = [simdnorm.layer_norm(xg), simdnorm.group_norm(xg, 2), simdnorm.instance_norm(xg), simdnorm.rms_norm(xg),
              simdnorm.mean_variance_normalization(xg, axes=(0, 2, 3)),
              simdnorm.batch_normalization(xg, mean, var)]
        torch.autograd.grad([y.sum() for y in ys], xg)

    assert _cyclic_garbage(step) == ""


@pytest.mark.parametrize("make, shape, layout", [
    (lambda: nn.BatchNorm2d(6), (4, 6, 5, 5), "channels_last"),
    (lambda: nn.BatchNorm3d(6), (2, 6, 3, 4, 4), "channels_last_3d"),
    (lambda: nn.GroupNorm(2, 6), (4, 6, 5, 5), "channels_last"),
    (lambda: nn.InstanceNorm2d(6, affine=True), (4, 6, 5, 5), "channels_last"),
    (lambda: nn.LayerNorm(6), (4, 5, 6), "transposed"),
    (lambda: nn.RMSNorm(6), (4, 5, 6), "transposed"),
], ids=["bn2d", "bn3d", "group", "instance", "layer", "rms"])
@pytest.mark.parametrize("dy_kind", ["contiguous", "expanded"])
def test_a_gradient_laid_out_unlike_the_input_is_the_inputs_layout_for_the_kernel(rng, make, shape, layout, dy_kind,
                                                                                  monkeypatch):
    """A channels-last (or transposed) input's gradient arriving contiguous or expanded (from a loss,
    a .view, a .sum()) was read element by element by the backward kernel; it is
    put in the input's layout first, so the gradients are those of a dy already laid out so."""
    kernel, seen = _routes._mvn_backward, []

    def recording(x, dy, *args):
        seen.append((x.stride(), dy.stride()))
        return kernel(x, dy, *args)

    monkeypatch.setattr(_routes, "_mvn_backward", recording)
    m = randomize(snt.convert(make()), rng)
    x = rand(rng, *shape)
    if layout == "transposed":
        x = rand(rng, shape[0], shape[2], shape[1]).transpose(1, 2)
    else:
        x = x.contiguous(memory_format=getattr(torch, layout))
    dy = rand(rng, *shape) if dy_kind == "contiguous" else torch.full((), 0.75).expand(shape)
    like_x = torch.empty_like(x).copy_(dy)
    assert like_x.stride() == x.stride() and dy.stride() != x.stride()
    got, want = ([*torch.autograd.grad(m(xg), (xg, *m.parameters()), g)]
                 for xg, g in ((x.detach().requires_grad_(), dy), (x.detach().requires_grad_(), like_x)))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert len(seen) == 2 and all(xs == ds == x.stride() for xs, ds in seen), seen
    from simdnorm.torch._ops import _laid_out_as
    assert _laid_out_as(like_x, x) is like_x
    one = rand(rng, 3, 1, 4)  # (a size-1 dim's stride says nothing of the layout: no copy)
    assert _laid_out_as(one.as_strided(one.shape, (4, 99, 1)), one).stride() == (4, 99, 1)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("cls", sorted(_SMALL))
def test_an_inference_tensor_input_with_parameters_wanting_gradients(rng, cls, train):
    """An input made under torch.inference_mode, with the module's parameters requiring gradients:
    autograd cannot save the inference tensor itself, so the drop-in saves its copy (torch.nn.RMSNorm,
    a composite, saves intermediates of its own and works; torch.nn's other norms raise). The output
    and the parameters' gradients are those of the same values in an ordinary tensor."""
    args, shape = _SMALL[cls]
    extra = {"affine": True, "track_running_stats": True} if cls.startswith("Instance") else {}
    ours, twin = (randomize(snt.convert(getattr(nn, cls)(*args, **extra)), np.random.default_rng(7)).train(train)
                  for _ in range(2))
    values, dy = rand(rng, *shape), rand(rng, *shape)
    with torch.inference_mode():
        x = values.clone()
    assert x.is_inference()
    y = ours(x)
    assert y.requires_grad
    got = torch.autograd.grad(y, tuple(ours.parameters()), dy)
    want_y = twin(values.clone())
    want = torch.autograd.grad(want_y, tuple(twin.parameters()), dy)
    assert torch.equal(y, want_y)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(ours.buffers(), twin.buffers()):
        assert torch.equal(a, b)
    if cls == "RMSNorm":  # (torch.nn's own takes it too)
        ref = nn.RMSNorm(*args)
        ref.load_state_dict(twin.state_dict())
        for a, b in zip(torch.autograd.grad(ref(x), tuple(ref.parameters()), dy), want):
            assert_close(a, b, "torch.nn.RMSNorm's gradient")
