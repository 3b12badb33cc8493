"""The float64 training reference (tests/training_reference.py) checked on its own, before it is used
to judge the package: every backward reference against central finite differences of its forward
(every op, activation and flag), against PyTorch's autograd in float64 when PyTorch is installed,
running statistics against torch.nn.BatchNorm2d, and hand-derived values. Nothing here calls the
package's training ops."""

from __future__ import annotations

import math

import numpy as np
import pytest

from training_reference import (
    BACKWARD_ACTIVATIONS,
    OPS,
    activation_grad,
    bn_training_ref,
    fd_gradients,
    random_problem,
    running_update_ref,
    sum_to,
)

ACTS = [(a, None) for a in BACKWARD_ACTIVATIONS] + [("leaky_relu", {"alpha": 0.3})]
ACT_IDS = [f"{a}" + ("-a0.3" if p else "") for a, p in ACTS]

# the flag variants of each op: (kwargs of random_problem)
VARIANTS = {
    "batch_norm": [dict(), dict(fused_add=True), dict(channel_axis=-1, shape=(4, 3, 5), fused_add=True),
                   dict(scale=None, bias=None)],
    "batch_norm_eval": [dict(), dict(fused_add=True), dict(channel_axis=-1, shape=(4, 3, 5))],
    "mvn": [dict(normalize_mean=nm, normalize_variance=nv, epsilon_mode=mode, epsilon=eps)
            for nm in (True, False) for nv in (True, False) for mode, eps in (("inside", 1e-3), ("outside", 0.3))
            if nv or mode == "inside"] + [dict(axes=(0, 2)), dict(axes=(0, 1, 2))],
    "layer_norm": [dict(), dict(axis=1), dict(scale=None, bias=None)],
    "rms_norm": [dict(), dict(axis=1, epsilon=0.1)],
    "instance_norm": [dict(), dict(channel_axis=-1, shape=(2, 5, 3))],
    "group_norm": [dict(num_groups=3), dict(num_groups=2, channel_axis=-1, shape=(2, 3, 6)), dict(num_groups=1)],
}
CASES = [(op, i) for op in OPS for i in range(len(VARIANTS[op]))]


def _problem(rng, op, variant, act, params, dtype=np.float64):
    kw = dict(VARIANTS[op][variant])
    for _ in range(50):  # relu / leaky_relu: no pre-activation value within 1e-3 of the kink
        p = random_problem(rng, op, activation=act, act_params=params, dtype=dtype, **kw)
        if act not in ("relu", "leaky_relu") or np.min(np.abs(p.pre_activation())) > 1e-3:
            return p
    raise AssertionError("could not draw data away from the kink")


def _assert_fd_close(got, want, name, ctx, rtol=1e-6):
    scale = max(float(np.max(np.abs(want))), 1e-3)
    err = float(np.max(np.abs(np.asarray(got) - want)))
    assert got.shape == want.shape, (name, got.shape, want.shape, ctx)
    assert err <= rtol * scale, f"{name}: max |ref - fd| = {err:.3g} (scale {scale:.3g}) {ctx}"


@pytest.mark.parametrize("act,params", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("op,variant", CASES, ids=[f"{o}-{i}" for o, i in CASES])
def test_reference_backward_matches_finite_differences(rng, op, variant, act, params):
    p = _problem(rng, op, variant, act, params)
    w = rng.normal(size=p.x.shape)
    g = p.backward(w)
    fd = fd_gradients(p, w)
    ctx = f"{op} {VARIANTS[op][variant]} act={act}"
    _assert_fd_close(g.grad_input, fd["x"], "grad_input", ctx)
    if p.scale is not None:
        _assert_fd_close(g.grad_scale, fd["scale"], "grad_scale", ctx)
    if p.bias is not None:
        _assert_fd_close(g.grad_bias, fd["bias"], "grad_bias", ctx)
    if p.fused_add is not None:
        _assert_fd_close(g.grad_fused_add, fd["fused_add"], "grad_fused_add", ctx)


@pytest.mark.parametrize("mode", ["inside", "outside"])
def test_reference_same_rank_batch_norm_and_broadcast_params(rng, mode):
    # DirectML's same-rank rule: statistics over the dims where scale/bias have size 1; and MVN
    # with scale/bias broadcast along some dims and fewer leading dims
    x = rng.normal(0.5, 1.5, size=(3, 4, 5))
    s = rng.uniform(0.5, 2.0, size=(1, 4, 5))
    b = rng.normal(size=(1, 4, 5))
    p = random_problem(rng, "batch_norm", shape=(3, 4, 5), scale=s, bias=b, fused_add=rng.normal(size=(4, 1)),
                       activation="silu")
    p.x[...] = x
    w = rng.normal(size=x.shape)
    g = p.backward(w)
    fd = fd_gradients(p, w)
    for n, k in (("grad_input", "x"), ("grad_scale", "scale"), ("grad_bias", "bias"), ("grad_fused_add", "fused_add")):
        _assert_fd_close(getattr(g, n), fd[k], n, "same-rank bn")
    assert g.grad_scale.shape == (1, 4, 5) and g.grad_fused_add.shape == (4, 1)
    q = random_problem(rng, "mvn", shape=(3, 4, 5), axes=(0, 2), scale=rng.uniform(0.5, 2, size=(4, 1)),
                       bias=rng.normal(size=(5,)), epsilon_mode=mode, epsilon=0.2, activation="gelu")
    g = q.backward(w)
    fd = fd_gradients(q, w)
    for n, k in (("grad_input", "x"), ("grad_scale", "scale"), ("grad_bias", "bias")):
        _assert_fd_close(getattr(g, n), fd[k], n, f"mvn broadcast params {mode}")


def test_reference_batch_norm_1d_input(rng):
    # a 1-D input: the same-rank rule (1,) reduces over everything
    p = random_problem(rng, "batch_norm", shape=(7,), scale=rng.uniform(0.5, 2, size=(1,)),
                       bias=rng.normal(size=(1,)), activation="gelu")
    w = rng.normal(size=7)
    g = p.backward(w)
    fd = fd_gradients(p, w)
    _assert_fd_close(g.grad_input, fd["x"], "grad_input", "1-D")
    _assert_fd_close(g.grad_scale, fd["scale"], "grad_scale", "1-D")


# ----------------------------------------------------------------------------------------------
# against PyTorch's autograd, float64
# ----------------------------------------------------------------------------------------------


def _torch():
    return pytest.importorskip("torch", reason="PyTorch not installed: the autograd cross-checks need it")


def torch_forward(torch, p, x, s, b, fa):
    """The problem's forward written with torch.nn.functional (torch tensors in, tensor out)."""
    F = torch.nn.functional
    k = p.kw
    eps = p.epsilon
    nd = x.ndim
    ca = k.get("channel_axis", 1) % nd
    if p.op in ("batch_norm", "batch_norm_eval", "instance_norm", "group_norm"):
        xm = torch.movedim(x, ca, 1)
        if p.op == "batch_norm":
            z = F.batch_norm(xm, None, None, s, b, training=True, eps=eps)
        elif p.op == "batch_norm_eval":
            rm, rv = (torch.tensor(a, dtype=x.dtype) for a in p.eval_stats)
            z = F.batch_norm(xm, rm, rv, s, b, training=False, eps=eps)
        elif p.op == "instance_norm":
            z = F.instance_norm(xm, weight=s, bias=b, eps=eps)
        else:
            z = F.group_norm(xm, k["num_groups"], s, b, eps=eps)
        z = torch.movedim(z, 1, ca)
        if fa is not None:
            z = z + fa
    elif p.op == "layer_norm":
        z = F.layer_norm(x, x.shape[k.get("axis", -1) % nd:], s, b, eps=eps)
    elif p.op == "rms_norm":
        z = F.rms_norm(x, x.shape[k.get("axis", -1) % nd:], s, eps=eps)
    else:  # MVN written out
        axes = tuple(sorted(a % nd for a in (k["axes"] if isinstance(k["axes"], tuple) else (k["axes"],))))
        c = x - x.mean(dim=axes, keepdim=True) if k.get("normalize_mean", True) else x
        if k.get("normalize_variance", True):
            m2 = (c * c).mean(dim=axes, keepdim=True)
            if k.get("epsilon_mode", "inside") == "inside":
                c = c / torch.sqrt(m2 + eps)
            else:
                c = c / (torch.sqrt(m2) + eps)
        z = c
        if s is not None:
            z = z * s
        if b is not None:
            z = z + b
    act = p.activation
    if act == "relu":
        z = F.relu(z)
    elif act == "leaky_relu":
        z = F.leaky_relu(z, (p.act_params or {}).get("alpha", 0.01))
    elif act == "silu":
        z = F.silu(z)
    elif act == "gelu":
        z = F.gelu(z)
    return z


def torch_grads(torch, p, w, dtype):
    """PyTorch's autograd gradients of sum(w * forward) (x, scale, bias, fused_add as present), as
    float64 numpy arrays; inputs converted to the torch dtype `dtype`."""
    def t(a):
        if a is None:
            return None
        return torch.tensor(np.asarray(a, np.float64)).to(dtype).requires_grad_(True)

    x, s, b, fa = t(p.x), t(p.scale), t(p.bias), t(p.fused_add)
    y = torch_forward(torch, p, x, s, b, fa)
    wt = torch.tensor(np.asarray(w, np.float64)).to(dtype)
    inputs = [a for a in (x, s, b, fa) if a is not None]
    grads = torch.autograd.grad(y, inputs, grad_outputs=wt)
    it = iter(grads)
    out = {}
    for name, a in (("x", x), ("scale", s), ("bias", b), ("fused_add", fa)):
        if a is not None:
            out[name] = next(it).to(torch.float64).numpy()
    return out, y.detach().to(torch.float64).numpy()


@pytest.mark.parametrize("act,params", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("op,variant", CASES, ids=[f"{o}-{i}" for o, i in CASES])
def test_reference_matches_torch_autograd_float64(rng, op, variant, act, params):
    torch = _torch()
    p = _problem(rng, op, variant, act, params)
    w = rng.normal(size=p.x.shape)
    tg, ty = torch_grads(torch, p, w, torch.float64)
    np.testing.assert_allclose(p.forward(), ty, rtol=1e-10, atol=1e-12)
    g = p.backward(w)
    ctx = f"{op} {VARIANTS[op][variant]} act={act}"
    _assert_fd_close(g.grad_input, tg["x"], "grad_input", ctx, rtol=1e-10)
    for n, k in (("grad_scale", "scale"), ("grad_bias", "bias"), ("grad_fused_add", "fused_add")):
        if k in tg:
            _assert_fd_close(getattr(g, n), tg[k], n, ctx, rtol=1e-10)


# ----------------------------------------------------------------------------------------------
# running statistics and the batch statistics
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.1, 0.25, None], ids=["m0.1", "m0.25", "cumulative"])
def test_reference_running_stats_match_torch_batchnorm2d(rng, momentum):
    torch = _torch()
    C = 3
    m = torch.nn.BatchNorm2d(C, momentum=momentum, eps=1e-5, dtype=torch.float64)
    m.train()
    rm, rv = np.zeros(C), np.ones(C)
    for step in range(1, 5):
        x = rng.normal(2.0, 3.0, size=(4, C, 3, 5))
        m(torch.tensor(x))
        r = bn_training_ref(x)
        kw = dict(momentum="cumulative", num_batches_tracked=step) if momentum is None else dict(momentum=momentum)
        rm, rv = running_update_ref(rm, rv, r.mean, r.var, r.count, **kw)
        np.testing.assert_allclose(rm, m.running_mean.numpy(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(rv, m.running_var.numpy(), rtol=1e-12, atol=1e-14)
        assert int(m.num_batches_tracked) == step


def test_reference_running_stats_onnx_hand_derived():
    # ONNX BatchNormalization-15: running = m * running + (1 - m) * batch, population variance
    x = np.array([[1.0], [3.0]])  # N=2, C=1: mean 2, population variance 1, unbiased 2
    r = bn_training_ref(x)
    assert r.count == 2 and r.mean.tolist() == [2.0] and r.var.tolist() == [1.0]
    rm, rv = running_update_ref(np.array([10.0]), np.array([5.0]), r.mean, r.var, r.count, momentum_convention="onnx")
    np.testing.assert_allclose(rm, [0.9 * 10 + 0.1 * 2])
    np.testing.assert_allclose(rv, [0.9 * 5 + 0.1 * 1])
    rm, rv = running_update_ref(np.array([10.0]), np.array([5.0]), r.mean, r.var, r.count, momentum=0.5,
                                momentum_convention="onnx")
    np.testing.assert_allclose([rm[0], rv[0]], [6.0, 3.0])
    rm, rv = running_update_ref(np.array([10.0]), np.array([5.0]), r.mean, r.var, r.count)  # pytorch, 0.1
    np.testing.assert_allclose([rm[0], rv[0]], [0.9 * 10 + 0.1 * 2, 0.9 * 5 + 0.1 * 2])


def test_reference_batch_statistics_shapes():
    x = np.arange(24.0).reshape(2, 3, 4)
    r = bn_training_ref(x)
    assert r.stat_shape == (3,) and r.axes == (0, 2) and r.count == 8
    np.testing.assert_allclose(r.mean, x.mean(axis=(0, 2)))
    r = bn_training_ref(x, np.ones((1, 3, 4)))
    assert r.stat_shape == (1, 3, 4) and r.axes == (0,) and r.count == 2
    r = bn_training_ref(x, channel_axis=-1)
    assert r.stat_shape == (4,) and r.axes == (0, 1)
    r = bn_training_ref(x[0, 0], np.ones(1))
    assert r.stat_shape == (1,) and r.count == 4


# ----------------------------------------------------------------------------------------------
# hand-derived values
# ----------------------------------------------------------------------------------------------


def test_activation_derivatives_hand_derived():
    z = np.array([-2.0, -0.0, 0.0, 1e-30, 3.0])
    np.testing.assert_array_equal(activation_grad(z, "relu"), [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(activation_grad(z, "leaky_relu"), [0.01, 0.01, 0.01, 1, 1])
    np.testing.assert_array_equal(activation_grad(z, "leaky_relu", {"alpha": 0.3}), [0.3, 0.3, 0.3, 1, 1])
    np.testing.assert_allclose(activation_grad(np.array([0.0]), "silu"), [0.5])
    np.testing.assert_allclose(activation_grad(np.array([0.0]), "gelu"), [0.5])
    # gelu'(1) = Phi(1) + phi(1)
    phi1 = math.exp(-0.5) / math.sqrt(2 * math.pi)
    np.testing.assert_allclose(activation_grad(np.array([1.0]), "gelu"), [0.5 * math.erfc(-1 / math.sqrt(2)) + phi1])
    s = 1 / (1 + math.exp(-2.0))
    np.testing.assert_allclose(activation_grad(np.array([2.0]), "silu"), [s * (1 + 2 * (1 - s))])


def test_layer_norm_backward_hand_derived():
    # x = (-1, 1): mean 0, variance 1, eps 0: y = x; dy = (1, 0): g = dy, M(g) = 1/2,
    # M(g y) = -1/2: grad = (1 - 1/2 - (-1)(-1/2), 0 - 1/2 - (1)(-1/2)) = (0, 0)
    p = random_problem(np.random.default_rng(0), "layer_norm", shape=(1, 2), scale=None, bias=None, epsilon=0.0)
    p.x[...] = [[-1.0, 1.0]]
    g = p.backward(np.array([[1.0, 0.0]]))
    np.testing.assert_allclose(g.grad_input, [[0.0, 0.0]], atol=1e-15)
    # dy = (1, 1): everything shifts together, grad 0; a scalar bias collects both elements
    p.bias = np.zeros(1)
    g = p.backward(np.array([[1.0, 1.0]]))
    np.testing.assert_allclose(g.grad_input, [[0.0, 0.0]], atol=1e-15)
    np.testing.assert_allclose(g.grad_bias, [2.0])
    # x = (0, 3, 6) (variance 6, eps 0, inv 1/sqrt 6), dy = (1, 0, 0):
    # y = (-3, 0, 3)/sqrt6; M(g) = 1/3; M(gy) = -3/(3 sqrt6) = -1/sqrt6
    # grad = inv (g - 1/3 + y / sqrt6) = inv * (1 - 1/3 - 1/2, -1/3, -1/3 + 1/2) = inv * (1/6, -1/3, 1/6)
    q = random_problem(np.random.default_rng(0), "layer_norm", shape=(3,), scale=None, bias=None, epsilon=0.0)
    q.x[...] = [0.0, 3.0, 6.0]
    g = q.backward(np.array([1.0, 0.0, 0.0]))
    np.testing.assert_allclose(g.grad_input, np.array([1 / 6, -1 / 3, 1 / 6]) / math.sqrt(6), rtol=1e-14)


def test_constant_group_reference():
    # a constant group (variance 0): y = 0, grad_input = inv (g - M(g)); the outside-epsilon k-term
    # (k = 1 / (1 - eps inv) = inf here) counts as 0
    x = np.full((2, 4), 3.0)
    for mode in ("inside", "outside"):
        p = random_problem(np.random.default_rng(1), "mvn", shape=(2, 4), axes=(1,), scale=None, bias=None,
                           epsilon=0.25, epsilon_mode=mode)
        p.x[...] = x
        dy = np.array([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 1.0, -1.0]])
        g = p.backward(dy)
        inv = 1 / math.sqrt(0.25) if mode == "inside" else 1 / 0.25
        np.testing.assert_allclose(g.grad_input, inv * (dy - dy.mean(axis=1, keepdims=True)), rtol=1e-14)


def test_constant_group_reference_inexact_mean():
    # 84651 copies of 0.1: the long-double mean rounds off 0.1, so the computed variance is not 0;
    # the group is still constant, and its outside-epsilon k-term still counts as 0 (not inf * 0)
    n = 84651
    p = random_problem(np.random.default_rng(2), "mvn", shape=(1, n), axes=(0, 1), scale=None, bias=None,
                       epsilon=0.5, epsilon_mode="outside")
    p.x[...] = 0.1
    dy = np.random.default_rng(3).standard_normal((1, n))
    g = p.backward(dy)
    np.testing.assert_allclose(g.grad_input, 2.0 * (dy - dy.mean()), rtol=1e-12, atol=1e-15)


def test_sum_to():
    a = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(sum_to(a, (4,)), a.sum(axis=(0, 1)))
    np.testing.assert_array_equal(sum_to(a, (3, 1)), a.sum(axis=(0, 2)).reshape(3, 1))
    np.testing.assert_array_equal(sum_to(a, (1, 3, 4)), a.sum(axis=0, keepdims=True))
    np.testing.assert_array_equal(sum_to(a, (2, 3, 4)), a)
