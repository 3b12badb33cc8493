"""The forward ops' C++ kernels in torch's dispatcher (cpp/bindings/torch_kernels.cpp): a plain call
of batch, layer, RMS, instance or group norm is computed there, with the bits, shapes, strides and
dtypes of the op's Python route (its twin ``_<op>_general``) and of its .out overload; any call
something else must see (autograd, a dispatch mode, forward AD, the negative bit, an activation, a
layout the kernel does not take) goes to the twin; an exception raised there reaches the caller
as itself; nothing leaks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install '.[torch]'): "
                                           "simdnorm.torch needs it")

import simdnorm.torch  # noqa: E402,F401
from simdnorm import _core  # noqa: E402
from simdnorm.torch import _ops  # noqa: E402

ops = torch.ops.simdnorm
# (simdnorm.torch imports on torch 2.10 and later only, each with the stable ABI the kernels call)
pytestmark = pytest.mark.skipif(
    os.environ.get("SIMDNORM_TORCH_CPP_KERNELS", "1") == "0" or not sys.platform.startswith("linux"),
    reason="the C++ kernels are left out (SIMDNORM_TORCH_CPP_KERNELS=0) or need Linux: the ops run their "
           "Python kernels")


def test_kernels_attach_on_this_torch():
    """Every torch that simdnorm.torch imports on has the stable ABI: the kernels are registered."""
    assert _ops.CPP_KERNELS, f"the C++ kernels did not attach on torch {torch.__version__}"
    for name in _ops._CPP_OPS:
        assert hasattr(ops, f"_{name}_general"), name


def _cases(rng, dtype, pdt):
    """(op, args, kwargs) over the five ops: dense inputs in several memory orders, parameters of
    the input's dtype or float32, present or not."""
    def r(*shape, dt=dtype, positive=False):
        a = rng.standard_normal(shape)
        return torch.from_numpy(np.abs(a) + 0.5 if positive else a).to(dt)

    x = r(2, 6, 5, 4)
    layouts = [x, x.contiguous(memory_format=torch.channels_last), r(4, 5, 6, 2).permute(3, 2, 1, 0)]
    w, b, m, v = r(6, dt=pdt), r(6, dt=pdt), r(6, dt=pdt), r(6, dt=pdt, positive=True)
    cases = []
    for x in layouts:
        cases += [
            ("batch_normalization", (x, m, v, w, b), {}),
            ("batch_normalization", (x, m, v, None, None), {"epsilon": 1e-3}),
            ("batch_normalization", (x.permute(0, 2, 3, 1), m, v, w, None), {"channel_axis": -1}),
            ("layer_norm", (x, r(4, dt=pdt), r(4, dt=pdt)), {}),
            ("layer_norm", (x, r(5, 4, dt=pdt)), {"axis": -2}),
            ("layer_norm", (x,), {"axis": 1, "epsilon": 1e-2}),
            ("rms_norm", (x, r(4, dt=pdt)), {}),
            ("rms_norm", (x,), {"axis": 2}),
            ("instance_norm", (x, w, b), {}),
            ("instance_norm", (x.permute(0, 2, 3, 1), None, b), {"channel_axis": -1}),
            ("group_norm", (x, 3, w, b), {}),
            ("group_norm", (x.permute(0, 2, 3, 1), 2, w, None), {"channel_axis": 3}),
        ]
    x1 = r(7)
    cases += [("layer_norm", (x1, r(7, dt=pdt)), {}), ("rms_norm", (r(2, 3, 2, 2, 2, 2, 2, 3),), {"axis": 1})]
    return cases


def _assert_same(got, want, what):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), f"{what}: result {i}"
        assert torch.equal(a, b), f"{what}: result {i} differs"


@pytest.mark.parametrize("dtype,pdt", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                       (torch.bfloat16, torch.float32), (torch.float64, torch.float64)],
                         ids=["f32", "f16", "bf16-f32", "f64"])
def test_kernel_gives_the_twins_bits(rng, dtype, pdt):
    """The second call of each case (its plan made by the first) is the C++ kernel's: the twin's
    results exactly, and the .out overload's values."""
    for name, args, kwargs in _cases(rng, dtype, pdt):
        what = f"{name} {dtype} {tuple(args[0].shape)} {args[0].stride()} {kwargs}"
        first = getattr(ops, name)(*args, **kwargs)
        computed = _core.torch_kernel_calls()
        got = getattr(ops, name)(*args, **kwargs)
        assert _core.torch_kernel_calls() == computed + 1, f"{what}: not computed by the C++ kernel"
        _assert_same(got, getattr(ops, f"_{name}_general")(*args, **kwargs), what)
        _assert_same(got, first, what)
        out = torch.full_like(args[0], float("nan"))
        rest = getattr(ops, name).out(*args, **kwargs, out=out)
        _assert_same(got[0] if isinstance(got, tuple) else got, out, what + " (.out)")
        if isinstance(got, tuple):
            _assert_same(got[1:], rest if isinstance(rest, tuple) else (rest,), what + " (.out's statistics)")


def _plain_layer(rng):
    x = torch.from_numpy(rng.standard_normal((3, 8, 16))).float()
    w, b = torch.randn(16), torch.randn(16)
    ops.layer_norm(x, w, b)  # (the plan)
    return x, w, b


def _steps_aside(call):
    """call() runs in the twin, not the C++ kernel; its result."""
    computed = _core.torch_kernel_calls()
    r = call()
    assert _core.torch_kernel_calls() == computed, "the C++ kernel computed a call it should leave"
    return r


def test_autograd_calls_go_to_the_twin(rng):
    x, w, b = _plain_layer(rng)
    xg = x.clone().requires_grad_()
    y, _, _ = _steps_aside(lambda: ops.layer_norm(xg, w, b))
    assert y.grad_fn is not None
    (g,) = torch.autograd.grad(y.sum() + (y * y).sum(), xg)
    ref = torch.nn.functional.layer_norm(xg, (16,), w, b)
    (g_ref,) = torch.autograd.grad(ref.sum() + (ref * ref).sum(), xg)
    assert torch.allclose(g, g_ref, atol=1e-4)
    # without grad mode, parameters that require grad do not matter: the kernel computes
    wp = torch.nn.Parameter(w.clone())
    with torch.no_grad():
        computed = _core.torch_kernel_calls()
        y, _, _ = ops.layer_norm(x, wp, b)
        assert _core.torch_kernel_calls() == computed + 1 and y.grad_fn is None


@pytest.mark.filterwarnings("ignore:.*performance drop.*")  # (vmap's fallback over the ops)
def test_modes_forward_ad_and_transforms_see_the_op(rng):
    """A dispatch mode and a __torch_dispatch__ subclass see the op; forward AD gets its tangent, grad its gradient, vmap and
    torch.compile the op's values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w, b = _plain_layer(rng)
    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Log():
        _steps_aside(lambda: ops.layer_norm(x, w, b))
    assert "simdnorm.layer_norm.default" in seen, seen

    class Logged(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            seen.append(str(func))
            with torch._C._DisableTorchDispatch():
                return func(*args, **(kwargs or {}))

    seen.clear()
    with torch.no_grad():
        _steps_aside(lambda: ops.layer_norm(torch.Tensor._make_subclass(Logged, x), w, b))
    assert "simdnorm.layer_norm.default" in seen, seen
    import torch.autograd.forward_ad as fwAD

    t = torch.randn_like(x)
    with fwAD.dual_level():
        y, _, _ = _steps_aside(lambda: ops.layer_norm(fwAD.make_dual(x, t), w, b))
        assert fwAD.unpack_dual(y).tangent is not None
    y = torch.func.vmap(lambda s: ops.layer_norm(s, w, b)[0])(x)
    _assert_same(y, ops.layer_norm(x, w, b)[0], "vmap")
    # (grad and vmap may hand the kernel the plain calls they make below their levels: the values
    # are what is checked)
    (g,) = torch.func.grad(lambda a: ops.layer_norm(a, w, b)[0].square().sum(), argnums=(0,))(x)
    xg = x.clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(ops.layer_norm(xg, w, b)[0].square().sum(), xg)
    assert torch.allclose(g, g_ref, rtol=1e-5, atol=1e-6)
    compiled = torch.compile(lambda a: ops.layer_norm(a, w, b)[0], fullgraph=True, backend="aot_eager")
    _assert_same(compiled(x), ops.layer_norm(x, w, b)[0], "compiled")


def test_other_calls_go_to_the_twin(rng):
    x, w, b = _plain_layer(rng)
    want = ops._layer_norm_general(x, w, b)
    # the negative bit: the memory holds the values' negatives
    _assert_same(_steps_aside(lambda: ops.layer_norm(torch._neg_view(-x), w, b))[0], want[0], "negative bit")
    # an activation
    y = _steps_aside(lambda: ops.layer_norm(x, w, b, activation="relu"))
    _assert_same(y[0], torch.relu(want[0]), "relu")
    # an input with gaps (its output is laid out by torch.empty_like, not by its strides)
    wide = torch.from_numpy(rng.standard_normal((3, 8, 32))).float()
    got = _steps_aside(lambda: ops.layer_norm(wide[..., ::2], w, b))
    _assert_same(got, ops._layer_norm_general(wide[..., ::2].contiguous(), w, b), "strided")
    # no element
    _steps_aside(lambda: ops.layer_norm(torch.empty(0, 16), w, b))


@pytest.mark.parametrize("call,exc", [
    (lambda x, w, b: ops.layer_norm(x, w[:5], b), ValueError),
    (lambda x, w, b: ops.layer_norm(x.to(torch.int32), w, b), TypeError),
    (lambda x, w, b: ops.group_norm(x, 3, w, b), ValueError),
    (lambda x, w, b: ops.batch_normalization(x, w, w, b, b, channel_axis=5), ValueError),
    (lambda x, w, b: ops.rms_norm(x, w, activation="no_such"), ValueError),
])
def test_errors_keep_their_type(rng, call, exc):
    """A call the twin refuses raises the twin's exception, type and message, through the kernel."""
    x, w, b = _plain_layer(rng)
    with pytest.raises(exc) as through_kernel:
        call(x, w, b)
    name = through_kernel.traceback[-1].name  # (raised in Python, below the kernel)
    with pytest.raises(type(through_kernel.value)) as direct:
        with torch.no_grad():
            with torch._C._AutoDispatchBelowAutograd():  # the CPU kernel itself, no C++ kernel
                call(x, w, b)
    assert str(through_kernel.value) == str(direct.value), name


def test_threads_share_the_plans(rng):
    """Calls from several Python threads at once (plans read while others are stored) give the bits
    of one thread's."""
    xs = [torch.from_numpy(rng.standard_normal((2, 4 + i, 32))).float() for i in range(6)]
    w, b = torch.randn(32), torch.randn(32)
    want = [ops._layer_norm_general(x, w, b) for x in xs]
    errors = []

    def work():
        try:
            for _ in range(50):
                for x, r in zip(xs, want):
                    _assert_same(ops.layer_norm(x, w, b), r, "thread")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def _rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def test_no_leaks(rng):
    """Computed calls, calls handed to the twin and refused calls keep the process's memory flat:
    each tensor handle and optional-argument slot the kernel receives is released once."""
    x, w, b = _plain_layer(rng)
    xn = torch._neg_view(-x)
    paths = [lambda: ops.layer_norm(x, w, b), lambda: ops.layer_norm(xn, w, b), lambda: ops.layer_norm(x, None, b)]

    def refused():
        try:
            ops.layer_norm(x, w[:3], b)
        except ValueError:
            pass

    for fn in paths + [refused]:
        for _ in range(500):
            fn()
        before = _rss_mib()
        for _ in range(5000):
            fn()
        assert _rss_mib() - before < 8, "memory grew"


_FAILED_ALLOCATION = r"""
import json, resource, sys
import torch
import simdnorm.torch  # noqa: F401
ops = torch.ops.simdnorm
torch.set_num_threads(1)
x = torch.randn(64, 1 << 18)  # 64 MiB: its output cannot be allocated under the limit below
w, b = torch.randn(1 << 18), torch.randn(1 << 18)
ops.layer_norm(x, w, b)  # (the plan)
simdnorm.torch.empty_cache()  # (its output's block, kept: the calls below must map memory)


def vm():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * 4096


def failure(call):
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm() + (16 << 20), hard))
    try:
        call()
    except Exception as e:  # noqa: BLE001 - reported
        return [type(e).__name__, str(e).splitlines()[0]]
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return None


before = [t._use_count() for t in (x, w, b)]
via_kernel = failure(lambda: ops.layer_norm(x, w, b))
after = [t._use_count() for t in (x, w, b)]
direct = failure(lambda: ops._layer_norm_general(x, w, b))
print(json.dumps({"before": before, "after": after, "via_kernel": via_kernel, "direct": direct}))
"""


@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""), reason="an address-space limit under ASan")
def test_a_failed_allocation_releases_the_arguments():
    """A call whose output cannot be allocated (an exception inside the C++ kernel) releases the
    tensors it was handed and raises the Python kernel's error (in a child process: an address-space
    limit makes torch's allocator fail)."""
    r = subprocess.run([sys.executable, "-c", _FAILED_ALLOCATION], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["direct"] is not None and got["direct"][0] == "RuntimeError", got
    assert got["after"] == got["before"], f"the arguments' references leaked: {got}"
    assert got["via_kernel"] == got["direct"], got


def test_plans_survive_a_miss_between_the_two_clears(rng, monkeypatch):
    """The route's cache full, its miss clears it and the C++ kernels' plans; another thread's miss
    run between the two clears (the GIL may switch there) keeps its plan in both, so that its next
    calls are the C++ kernel's."""
    from simdnorm.torch import _routes

    w, b = torch.randn(16), torch.randn(16)
    other = torch.from_numpy(rng.standard_normal((5, 16))).float()

    class Interleaved(dict):
        def clear(self):
            super().clear()
            monkeypatch.setattr(_routes, "_PLANS_MAX", 1 << 30)
            ops.layer_norm(other, w, b)  # (the other thread's miss, between this clear and the other)

    try:
        monkeypatch.setattr(_routes, "_PLANS", Interleaved({("a key",): None}))
        monkeypatch.setattr(_routes, "_PLANS_MAX", 1)
        _core.torch_plans_clear()  # (as the cache: no plan of `other`'s shapes)
        ops.layer_norm(torch.from_numpy(rng.standard_normal((7, 16))).float(), w, b)  # a miss, the cache full
        assert ("a key",) not in _routes._PLANS
        computed = _core.torch_kernel_calls()
        ops.layer_norm(other, w, b)
        assert _core.torch_kernel_calls() == computed + 1, "the plan is in the route's cache, not the C++ kernel's"
    finally:
        monkeypatch.undo()
        _routes._PLANS.clear()  # (the C++ kernels' plans were cleared under the real cache's entries)
        _core.torch_plans_clear()
