"""simdnorm under torch.func's transforms and forward-mode AD: jvp, grad, jacrev, jacfwd, vmap,
vmap(grad) (per-sample gradients) and torch.autograd.forward_ad's dual tensors, through the plain
functions, the torch.ops.simdnorm ops and the drop-in modules, against torch's own functions on the
same float64 data. Where simdnorm cannot follow (a derivative of a gradient; a function without an
op), a clear error, never a tangent silently dropped. (gradcheck of every op's forward-mode
derivative against finite differences: test_torch_ops.test_gradcheck_float64.)"""
from __future__ import annotations

import copy
import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install '.[torch]'): "
                                           "simdnorm.torch needs it")

import simdnorm  # noqa: E402
import simdnorm.torch as st  # noqa: E402

F = torch.nn.functional
func = torch.func
fwAD = torch.autograd.forward_ad
D = torch.float64

pytestmark = pytest.mark.filterwarnings("ignore:.*performance drop.*")  # (vmap's fallback over the ops)

# Dynamo traces the plain functions' own Python from torch 2.13 on (docs/torch.rst); under 2.10-2.12
# it stops at their locals() or a tuple's hash, then fails inside their checks: their calls under
# torch.compile are not supported there (the operators' and the modules' are).
PLAIN_COMPILES = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
PLAIN_COMPILE_SKIP = f"torch.compile of the plain functions needs torch 2.13; this is {torch.__version__}"

ACTS = {None: lambda z: z, "relu": F.relu, "leaky_relu": lambda z: F.leaky_relu(z, 0.01), "silu": F.silu,
        "gelu": F.gelu}


def _mvn(x, axes, w, b, eps=1e-5, outside=False, nm=True, nv=True):
    """MVN from torch's own operations (the reference's derivatives are autograd's)."""
    d = x - x.mean(axes, keepdim=True) if nm else x
    if nv:
        var = x.var(axes, keepdim=True, unbiased=False) if nm else (x * x).mean(axes, keepdim=True)
        d = d / (var.sqrt() + eps) if outside else d / (var + eps).sqrt()
    return d * w + b


def _ops_layer_norm(x, w, b, a):
    return torch.ops.simdnorm.layer_norm(x, w, b, activation=a)[0]


# name: (simdnorm's call, torch's, which parameters (channels C = 4 or the last dim L = 5))
def _cases():
    rm, rv = torch.linspace(-1, 1, 4, dtype=D), torch.linspace(0.5, 2, 4, dtype=D)
    return {
        "layer": (lambda x, w, b, a: simdnorm.layer_norm(x, w, b, activation=a),
                  lambda x, w, b: F.layer_norm(x, (5,), w, b), "L"),
        "op.layer": (_ops_layer_norm, lambda x, w, b: F.layer_norm(x, (5,), w, b), "L"),
        "rms": (lambda x, w, b, a: simdnorm.rms_norm(x, w, activation=a),
                lambda x, w, b: F.rms_norm(x, (5,), w, eps=1e-5), "L"),
        "group": (lambda x, w, b, a: simdnorm.group_norm(x, 2, w, b, activation=a),
                  lambda x, w, b: F.group_norm(x, 2, w, b), "C"),
        "instance": (lambda x, w, b, a: simdnorm.instance_norm(x, w, b, activation=a),
                     lambda x, w, b: F.instance_norm(x, weight=w, bias=b), "C"),
        "bn": (lambda x, w, b, a: simdnorm.batch_normalization(x, rm, rv, w, b, activation=a),
               lambda x, w, b: F.batch_norm(x, rm, rv, w, b), "C"),
        "bn-train": (lambda x, w, b, a: simdnorm.batch_normalization_training(x, w, b, activation=a)[0],
                     lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), "C"),
        "mvn02": (lambda x, w, b, a: simdnorm.mean_variance_normalization(x, (0, 2), w, b, activation=a),
                  lambda x, w, b: _mvn(x, (0, 2), w, b), "L"),
        "mvn-outside": (lambda x, w, b, a: simdnorm.mean_variance_normalization(
                            x, 1, w, b, epsilon_mode="outside", activation=a),
                        lambda x, w, b: _mvn(x, (1,), w, b, outside=True), "L"),
        "mvn-no-mean": (lambda x, w, b, a: simdnorm.mean_variance_normalization(
                            x, 2, w, b, normalize_mean=False, activation=a),
                        lambda x, w, b: _mvn(x, (2,), w, b, nm=False), "L"),
        "mvn-no-variance": (lambda x, w, b, a: simdnorm.mean_variance_normalization(
                                x, 2, w, b, normalize_variance=False, activation=a),
                            lambda x, w, b: _mvn(x, (2,), w, b, nv=False), "L"),
    }


CASES = _cases()

# transform: (x, w, b, f) -> results; f(x, w, b) of one (3, 4, 5) tensor
TRANSFORMS = {
    "jvp": lambda x, w, b, t, f: func.jvp(f, (x, w, b), t)[1],
    "forward_ad": lambda x, w, b, t, f: _dual(f, (x, w, b), t),
    "grad": lambda x, w, b, t, f: func.grad(lambda *p: (f(*p) * t[0]).sum(), argnums=(0, 1, 2))(x, w, b),
    "jacrev": lambda x, w, b, t, f: func.jacrev(f, argnums=(0, 1, 2))(x, w, b),
    "jacfwd": lambda x, w, b, t, f: func.jacfwd(f, argnums=(0, 1, 2))(x, w, b),
    "vmap": lambda x, w, b, t, f: func.vmap(lambda x: f(x[None], w, b))(x),
    "vmap(grad)": lambda x, w, b, t, f: func.vmap(func.grad(lambda x, w, b: f(x[None], w, b).sin().sum(),
                                                            argnums=(0, 1, 2)), in_dims=(0, None, None))(x, w, b),
}


def _dual(f, primals, tangents):
    with fwAD.dual_level():
        return fwAD.unpack_dual(f(*[fwAD.make_dual(p, t) for p, t in zip(primals, tangents)])).tangent


def _flat(r):
    return torch.cat([t.reshape(-1) for t in (r if isinstance(r, tuple) else (r,))])


def _data(rng, kind):
    x = torch.from_numpy(rng.standard_normal((3, 4, 5)) + 0.5)
    n = 5 if kind == "L" else 4
    w, b = (torch.from_numpy(rng.standard_normal(n)) for _ in range(2))
    t = tuple(torch.from_numpy(rng.standard_normal(a.shape)) for a in (x, w, b))
    return x, w, b, t


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("case", CASES)
def test_transforms_match_torch(rng, case, act, transform):
    ours, theirs, kind = CASES[case]
    x, w, b, t = _data(rng, kind)
    if act in ("relu", "leaky_relu"):  # (no pre-activation at the kink, where the two may differ)
        x = x + 0.25 * torch.sign(x)
    T = TRANSFORMS[transform]
    got = T(x, w, b, t, lambda x, w, b: ours(x, w, b, act))
    want = T(x, w, b, t, lambda x, w, b: ACTS[act](theirs(x, w, b)))
    got, want = _flat(got), _flat(want)
    assert got.shape == want.shape
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-300)
    assert err < 1e-10, f"{case} {act} {transform}: max error {err:.3g} of the largest |torch|"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_jvp_and_per_sample_grads_in_other_dtypes(rng, dtype, tol):
    # against torch in float64 on the same (rounded) values; float32 parameters with 16-bit data too
    x, w, b, t = _data(rng, "L")
    x, t = x.to(dtype), tuple(u.to(dtype) for u in t)
    for pd in {dtype, torch.float32}:
        p = (w.to(pd), b.to(pd))
        tp = (t[0], t[1].to(pd), t[2].to(pd))
        for transform in ("jvp", "vmap(grad)"):
            got = TRANSFORMS[transform](x, *p, tp, lambda x, w, b: simdnorm.layer_norm(x, w, b, activation="silu"))
            want = TRANSFORMS[transform](x.double(), *(a.double() for a in p), tuple(a.double() for a in tp),
                                         lambda x, w, b: F.silu(F.layer_norm(x, (5,), w, b)))
            assert all(g.dtype == a.dtype for g, a in zip(got if isinstance(got, tuple) else (got,), (x, *p)))
            got, want = _flat(got).double(), _flat(want)
            assert (got - want).abs().max() <= tol * want.abs().max(), (transform, pd)


def test_batch_norm_statistics_as_inputs_forward_mode(rng):
    # the statistics' tangents (torch's own batch_norm refuses them under functorch): against the formula's
    x = torch.from_numpy(rng.standard_normal((2, 4, 3)))
    m, v = torch.from_numpy(rng.standard_normal(4)), torch.from_numpy(rng.random(4) + 0.5)
    w, b = torch.from_numpy(rng.standard_normal(4)), torch.from_numpy(rng.standard_normal(4))
    tm, tv = torch.from_numpy(rng.standard_normal(4)), torch.from_numpy(rng.standard_normal(4))
    c = lambda p: p.reshape(1, 4, 1)  # noqa: E731

    def formula(m, v):
        return F.silu((x - c(m)) / (c(v) + 1e-5).sqrt() * c(w) + c(b))

    for transform in ("jvp", "forward_ad"):
        go = func.jvp if transform == "jvp" else None
        f = lambda m, v: simdnorm.batch_normalization(x, m, v, w, b, activation="silu")  # noqa: E731
        got = go(f, (m, v), (tm, tv))[1] if go else _dual(f, (m, v), (tm, tv))
        want = func.jvp(formula, (m, v), (tm, tv))[1]
        assert (got - want).abs().max() <= 1e-12 * want.abs().max(), transform


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(2, 8), torch.nn.SiLU(),
        torch.nn.InstanceNorm2d(8, affine=True), torch.nn.Flatten(2), torch.nn.LayerNorm(16),
        torch.nn.RMSNorm(16)).double()


def test_converted_model_per_sample_gradients_and_jvp(rng):
    ref = _model()
    ours = st.convert(copy.deepcopy(ref))
    x = torch.from_numpy(rng.standard_normal((5, 3, 4, 4)))
    t = torch.from_numpy(rng.standard_normal((5, 3, 4, 4)))
    for name, m in (("torch.nn", ref), ("simdnorm", ours)):
        params = {k: v.detach() for k, v in m.named_parameters()}

        def loss(p, x, m=m):
            return func.functional_call(m, p, (x[None],)).sin().sum()

        grads = func.vmap(func.grad(loss), in_dims=(None, 0))(params, x)
        tangent = func.jvp(lambda x, m=m: m(x), (x,), (t,))[1]
        if name == "torch.nn":
            want_grads, want_tangent = grads, tangent
    largest = max(g.abs().max() for g in want_grads.values())  # (3.weight's is 0 up to rounding: LayerNorm(16))
    for k in want_grads:
        assert grads[k].shape == (5,) + tuple(params[k].shape)
        assert (grads[k] - want_grads[k]).abs().max() <= 1e-10 * largest, k
    assert (tangent - want_tangent).abs().max() <= 1e-10 * want_tangent.abs().max()


def test_batch_norm_module_training_under_jvp_updates_running_stats_once(rng):
    # torch.nn refuses (an in-place update of a captured buffer); the drop-in updates it as eagerly
    x = torch.from_numpy(rng.standard_normal((4, 3, 2, 2)))
    t = torch.from_numpy(rng.standard_normal((4, 3, 2, 2)))
    bn = torch.nn.BatchNorm2d(3).double()
    ours, eager = st.convert(copy.deepcopy(bn)), st.convert(copy.deepcopy(bn))
    eager(x)
    _, tangent = func.jvp(ours, (x,), (t,))
    want = func.jvp(torch.nn.BatchNorm2d(3, track_running_stats=False).double(), (x,), (t,))[1]
    assert (tangent - want).abs().max() <= 1e-12 * want.abs().max()
    bn(x)
    for k, v in eager.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
        assert torch.allclose(v, bn.state_dict()[k], rtol=1e-14, atol=0), k


def test_derivatives_of_gradients_raise_never_vanish(rng):
    # hessian = jacfwd(jacrev): a tangent through a backward op must raise, not come out zero
    x = torch.from_numpy(rng.standard_normal((2, 5)))
    f = lambda x: simdnorm.layer_norm(x, activation="silu").sin().sum()  # noqa: E731
    with pytest.raises(RuntimeError, match="no autograd formula"):
        func.hessian(f)(x)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        func.jacrev(func.jacrev(f))(x)
    with fwAD.dual_level():
        d = fwAD.make_dual(x, torch.ones_like(x))
        m, s = torch.ops.simdnorm.layer_norm(x)[1:]
        with pytest.raises(RuntimeError, match="no forward-mode derivative"):
            torch.ops.simdnorm.layer_norm_backward(d, x, m, s)


_NESTED = {
    "jacfwd(jacfwd)": lambda f, x, t: func.jacfwd(func.jacfwd(f))(x),
    "jacrev(jacfwd)": lambda f, x, t: func.jacrev(func.jacfwd(f))(x),
    "grad(jvp)": lambda f, x, t: func.grad(lambda x: func.jvp(f, (x,), (t,))[1])(x),
    "jvp(jvp)": lambda f, x, t: func.jvp(lambda x: func.jvp(f, (x,), (t,))[1], (x,), (t,))[1],
    "jvp(grad)": lambda f, x, t: func.jvp(func.grad(f), (x,), (t,))[1],  # (the usual Hessian-vector product)
    "vjp(jvp)": lambda f, x, t: func.vjp(lambda x: func.jvp(f, (x,), (t,))[1], x)[1](torch.ones((), dtype=D))[0],
}


@pytest.mark.parametrize("nesting", sorted(_NESTED))
@pytest.mark.parametrize("through", ["op", "module", "batch_norm"])
def test_nested_forward_mode_derivatives_raise_never_vanish(rng, nesting, through):
    """A transform over a forward-mode one took the inner derivative as a constant: Hessians of
    zeros, no error. They raise as a double backward does."""
    x = torch.from_numpy(rng.standard_normal((2, 3)))
    t, c = torch.from_numpy(rng.standard_normal((2, 3))), torch.from_numpy(rng.standard_normal((2, 3)))
    norm = {"op": lambda x: torch.ops.simdnorm.layer_norm(x)[0], "module": st.LayerNorm(3, dtype=D),
            "batch_norm": lambda x: simdnorm.batch_normalization(x, x[0] * 0, x[0].exp(), activation="silu")}[through]
    f = lambda x: (norm(x) ** 2 * c).sum()  # noqa: E731
    with pytest.raises(RuntimeError, match="no autograd formula"):
        _NESTED[nesting](f, x, t)


def test_functions_without_an_op_refuse_transformed_tensors(rng):
    x = torch.from_numpy(rng.standard_normal((3, 4, 5)))
    for call in (lambda x: simdnorm.moments(x, (1, 2)).mean,
                 lambda x: simdnorm.layer_norm_backward(x, x, *simdnorm.layer_norm(x.detach(), return_stats=True)[1:])[0],
                 lambda x: simdnorm.layer_norm(x, out=torch.empty(x.shape, dtype=D))):
        for transform in (lambda f: func.vmap(f)(x), lambda f: func.jvp(f, (x,), (x,)),
                          lambda f: _dual(f, (x,), (x,))):
            with pytest.raises(TypeError, match="torch.func transform|forward-mode"):
                transform(call)


def test_vmap_of_batch_norm_training_against_torchs(rng):
    # each sample's statistics its own (the rule's same-rank parameters), as torch's batch norm under vmap
    x = torch.from_numpy(rng.standard_normal((3, 4, 2, 5)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = func.vmap(lambda x: torch.ops.simdnorm.batch_normalization_training(x)[0])(x)
    want = func.vmap(lambda x: F.batch_norm(x, None, None, training=True))(x)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # (shape checks, torch.nn's as well as ours)
@pytest.mark.parametrize("grad", [False, True])
def test_jit_trace_records_the_ops(rng, grad):
    # torch.jit.trace records dispatched ops only: a call that ran the kernels past the dispatcher
    # would trace as an uninitialized tensor. Traced without the tracer's own check, run on new data:
    x, x2 = (torch.from_numpy(rng.standard_normal((2, 8, 4, 4))).float() for _ in range(2))
    modules = [torch.nn.BatchNorm2d(8).eval(), torch.nn.InstanceNorm2d(8), torch.nn.GroupNorm(2, 8),
               torch.nn.LayerNorm(4), torch.nn.RMSNorm(4), torch.nn.BatchNorm2d(8, affine=False).train()]
    cases = [(st.convert(copy.deepcopy(m)), m) for m in modules]
    cases.append((lambda x: simdnorm.layer_norm(x, activation="silu") * 2, lambda x: F.silu(F.layer_norm(x, (4,))) * 2))
    for ours, theirs in cases:
        with torch.set_grad_enabled(grad):
            traced = torch.jit.trace(ours, x, check_trace=False)
            got, want = traced(x2), theirs(x2)
        assert any(n.kind().startswith("simdnorm::") for n in traced.graph.nodes()), ours
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), ours
    with pytest.raises(TypeError, match="torch.jit.trace"):
        torch.jit.trace(lambda x: simdnorm.moments(x, (1, 2)).mean, x, check_trace=False)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("make", [lambda: torch.nn.BatchNorm2d(3), lambda: torch.nn.BatchNorm2d(3, momentum=None),
                                  lambda: torch.nn.BatchNorm1d(3, momentum=1.0),
                                  lambda: torch.nn.InstanceNorm2d(3, track_running_stats=True)],
                         ids=["bn2d", "bn2d-cumulative", "bn1d-momentum-1", "instance2d"])
def test_jit_trace_of_training_updates_running_stats_of_each_batch(rng, make):
    """The count behind the unbiased variance was traced as the traced batch's constant: a model
    traced on 2 samples and run on 64 kept 2/1 where 64/63 was due."""
    m = make().train()
    ours, eager = st.convert(copy.deepcopy(m)), st.convert(copy.deepcopy(m))
    shape = {torch.nn.BatchNorm1d: lambda n: (n, 3, 5), torch.nn.BatchNorm2d: lambda n: (n, 3, 2, 3),
             torch.nn.InstanceNorm2d: lambda n: (2, 3, 2, n)}[type(m)]  # (instance norm: a count of each sample)
    draw = lambda n: torch.from_numpy(rng.standard_normal(shape(n)) * 2 + 1).float()  # noqa: E731
    traced = torch.jit.trace(ours, draw(2), check_trace=False)
    ours.load_state_dict(m.state_dict())  # (undo the tracing call's own update)
    for n in (64, 2, 7):
        x = draw(n)
        traced(x), eager(x), m(x)
        for k, v in eager.state_dict().items():
            assert torch.equal(ours.state_dict()[k], v), (n, k)
            assert torch.allclose(v.double(), m.state_dict()[k].double(), rtol=1e-6, atol=0), (n, k)


@pytest.mark.parametrize("make", [lambda: torch.nn.BatchNorm2d(3), lambda: torch.nn.BatchNorm2d(3, momentum=None),
                                  lambda: torch.nn.InstanceNorm2d(3, affine=True, track_running_stats=True)],
                         ids=["bn2d", "bn2d-cumulative", "instance2d"])
def test_vmap_ensemble_in_training_updates_each_members_buffers(rng, make):
    """stack_module_state + vmap(functional_call): torch.nn's updates each member's running
    statistics; the drop-ins found no vmap rule for their update and raised."""
    E = 3
    members = [make().double() for _ in range(E)]
    for i, m in enumerate(members):
        if m.weight is not None:
            with torch.no_grad():
                m.weight.add_(i), m.bias.sub_(i)  # (members of their own)
        if m.num_batches_tracked is not None:
            m.num_batches_tracked.fill_(i)  # (momentum=None: each member's own count)
    x = torch.from_numpy(rng.standard_normal((E, 4, 3, 2, 5)) * 3 + 1)

    def ensemble(ms):
        params, buffers = func.stack_module_state(ms)
        base = copy.deepcopy(ms[0]).to("meta")
        return func.vmap(lambda p, b, x: func.functional_call(base, (p, b), (x,)))(params, buffers, x), buffers

    got, got_buffers = ensemble([st.convert(copy.deepcopy(m)) for m in members])
    if members[0].momentum is not None:  # (torch.nn's reads its count with .item(): not under vmap)
        want, want_buffers = ensemble([copy.deepcopy(m) for m in members])
        assert (got - want).abs().max() <= 1e-12 * want.abs().max()
        for k, v in want_buffers.items():
            assert torch.allclose(got_buffers[k], v, rtol=1e-13, atol=0), k
    for i, m in enumerate(members):  # (each member as if run alone)
        want = m(x[i])
        assert (got[i] - want).abs().max() <= 1e-12 * want.abs().max()
        for k, v in m.named_buffers():
            assert torch.allclose(got_buffers[k][i], v, rtol=1e-13, atol=0), (i, k)


def test_vmap_update_of_unbatched_running_stats_is_refused(rng):
    rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)
    mean, var = (torch.from_numpy(rng.random((4, 3))) for _ in range(2))
    with pytest.raises(RuntimeError, match="the same running_mean, running_var, which is not batched"):
        func.vmap(lambda m, v: (torch.ops.simdnorm.update_running_stats_(rm, rv, m, v, count=5), m)[1])(mean, var)
    assert torch.equal(rm, torch.zeros(3, dtype=D)) and torch.equal(rv, torch.ones(3, dtype=D))
    rms, rvs = torch.zeros(4, 3, dtype=D), torch.ones(3, 4, dtype=D)  # (batched at different dims)
    func.vmap(lambda a, b, m, v: (torch.ops.simdnorm.update_running_stats_(a, b, m, v, count=5, momentum=0.5), m)[1],
              in_dims=(0, 1, 0, 0))(rms, rvs, mean, var)
    assert torch.allclose(rms, 0.5 * mean, rtol=1e-15) and torch.allclose(rvs.T, 0.5 + 0.5 * var * 5 / 4, rtol=1e-15)


def _plain_calls(rng):
    """(name, function of x, parameters) for each plain function with an op: a model's call of it on
    tensors (return_stats and activations too)."""
    c = lambda *s: torch.from_numpy(rng.standard_normal(s)).float()  # noqa: E731
    w8, b8, w4 = c(8) + 1, c(8), c(4) + 1
    mean, var = c(8), c(8).abs() + 0.5
    return [
        ("batch_normalization", lambda x, w, b: simdnorm.batch_normalization(x, mean, var, w, b, activation="relu"),
         (w8, b8)),
        ("mean_variance_normalization", lambda x, w, b: simdnorm.mean_variance_normalization(
            x, (0, 2), w[:, None, None], b[:, None, None], epsilon_mode="outside", return_stats=True), (w8, b8)),
        ("layer_norm", lambda x, w, b: simdnorm.layer_norm(x, w, b, activation="silu", return_stats=True), (w4, None)),
        ("rms_norm", lambda x, w, b: simdnorm.rms_norm(x, w, axis=-2, return_stats=True), (c(4, 4) + 1, None)),
        ("instance_norm", lambda x, w, b: simdnorm.instance_norm(x, w, b, activation="gelu"), (w8, b8)),
        ("group_norm", lambda x, w, b: simdnorm.group_norm(x, 2, w, b, return_stats=True), (w8, b8)),
        # (array-like parameters: a numpy array, a list)
        ("layer_norm", lambda x, w, b: simdnorm.layer_norm(x, w, np.linspace(-1, 1, 4, dtype=np.float32)), (w4, None)),
        ("group_norm", lambda x, w, b: simdnorm.group_norm(x, 2, w, [0.5] * 8), (w8, None)),
        ("batch_normalization_training", lambda x, w, b: simdnorm.batch_normalization_training(
            x, w, b, activation="leaky_relu"), (w8, b8)),
    ]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # (inductor's)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("how", ["compile_fullgraph", "export"])
def test_plain_functions_under_compile_and_export(rng, how, grad):
    if how == "compile_fullgraph" and not PLAIN_COMPILES:
        pytest.skip(PLAIN_COMPILE_SKIP)
    # their tensors there have no memory (fake tensors): the plain functions take their ops, which
    # the graph records, with gradients or without (the plain route would read the memory)
    x, x2 = (torch.from_numpy(rng.standard_normal((2, 8, 4, 4)) + 1).float() for _ in range(2))
    for name, call, params in _plain_calls(rng):
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w, self.b = (None if p is None else torch.nn.Parameter(p.clone(), requires_grad=grad)
                                  for p in params)

            def forward(self, x):
                return call(x, self.w, self.b)

        m = M()
        with torch.set_grad_enabled(grad):
            if how == "export":
                program = torch.export.export(m, (x,))
                assert any(str(n.target) == f"simdnorm.{name}.default" for n in program.graph.nodes), name
                run = program.module()
            else:
                torch._dynamo.reset()
                run = torch.compile(m, fullgraph=True, backend="aot_eager")
            got, want = run(x2), m(x2)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        assert [g is None for g in got] == [w is None for w in want], name  # (rms_norm's mean)
        got, want = [g for g in got if g is not None], [w for w in want if w is not None]
        for g, w in zip(got, want):
            assert type(g) is torch.Tensor and g.shape == w.shape and g.dtype == w.dtype, name
            assert (g - w).abs().max() <= 1e-5 * max(1.0, float(w.detach().abs().max())), name
        if grad:  # (gradients through the compiled or exported graph)
            wrt = [p for p in m.parameters()]
            g1 = torch.autograd.grad(sum(t.sum() for t in got if t.requires_grad), wrt)
            g2 = torch.autograd.grad(sum(t.sum() for t in want if t.requires_grad), wrt)
            for a, b in zip(g1, g2):
                assert (a - b).abs().max() <= 1e-4 * max(1.0, float(b.abs().max())), name


def _backward_calls(rng):
    """(name, function of x and grad_output) for each plain backward function: the forward's
    statistics, then the gradients (some not asked for, fused_add's, rms's None)."""
    c = lambda *s: torch.from_numpy(rng.standard_normal(s)).float()  # noqa: E731
    w8, b8, w4 = c(8) + 1, c(8), c(4) + 1
    fa = c(2, 8, 4, 4)

    def bn(x, g):
        _, m, v = simdnorm.batch_normalization_training(x, w8, b8, fused_add=fa, activation="relu")
        return simdnorm.batch_normalization_backward(g, x, m, v, w8, b8, fused_add=fa, activation="relu",
                                                     grad_bias=False)

    def mvn(x, g):
        _, m, s = simdnorm.mean_variance_normalization(x, (0, 2), return_stats=True)
        return simdnorm.mean_variance_normalization_backward(g, x, (0, 2), m, s)

    def layer(x, g):
        _, m, s = simdnorm.layer_norm(x, w4, None, return_stats=True)
        return simdnorm.layer_norm_backward(g, x, m, s, w4, None, activation="silu", grad_input=False)

    def rms(x, g):
        _, _, r = simdnorm.rms_norm(x, w4, return_stats=True)
        return simdnorm.rms_norm_backward(g, x, r, w4)

    def instance(x, g):
        _, m, s = simdnorm.instance_norm(x, w8, b8, return_stats=True)
        return simdnorm.instance_norm_backward(g, x, m, s, w8, b8)

    def group(x, g):
        _, m, s = simdnorm.group_norm(x, 2, w8, b8, return_stats=True)
        return simdnorm.group_norm_backward(g, x, 2, m, s, w8, b8, grad_scale=False)

    return [bn, mvn, layer, rms, instance, group]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # (inductor's)
@pytest.mark.parametrize("how", ["compile_fullgraph", "export"])
def test_backward_functions_under_compile_and_export(rng, how):
    if how == "compile_fullgraph" and not PLAIN_COMPILES:
        pytest.skip(PLAIN_COMPILE_SKIP)
    # the plain backward functions take their ops too; None stays None where a gradient was not asked for
    x, x2, g, g2 = (torch.from_numpy(rng.standard_normal((2, 8, 4, 4)) + 1).float() for _ in range(4))
    for call in _backward_calls(rng):
        class M(torch.nn.Module):
            def forward(self, x, g):
                return call(x, g)

        if how == "export":
            program = torch.export.export(M(), (x, g))
            assert any(str(n.target).endswith("_backward.default") for n in program.graph.nodes), call.__name__
            run = program.module()
        else:
            torch._dynamo.reset()
            run = torch.compile(M(), fullgraph=True, backend="aot_eager")
        got, want = run(x2, g2), call(x2, g2)
        assert isinstance(got, tuple) and [a is None for a in got] == [b is None for b in want], call.__name__
        for a, b in zip(got, want):
            if b is not None:
                assert a.shape == b.shape and (a - b).abs().max() <= 1e-5 * max(1.0, float(b.abs().max())), call.__name__


# (Dynamo's note on the graph break at simdnorm's C function)
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin:UserWarning")
def test_moments_under_compile_and_export(rng):
    # moments has no op: torch.export (fake tensors) refuses it clearly; a torch.compile without
    # fullgraph runs it outside its graph
    x = torch.from_numpy(rng.standard_normal((3, 8))).float()

    class Moments(torch.nn.Module):
        def forward(self, x):
            return torch.from_numpy(simdnorm.moments(x, (0,)).mean) + x

    with pytest.raises(TypeError, match="torch.export"):
        torch.export.export(Moments(), (x,))
    torch._dynamo.reset()
    assert torch.equal(torch.compile(Moments(), backend="aot_eager")(x), Moments()(x))


def test_out_overloads_refuse_tangents(rng):
    # as torch's out= functions: a tangent would not reach out (the running statistics' update takes
    # the values, as torch.nn's buffers do)
    x = torch.from_numpy(rng.standard_normal((3, 4)))
    with fwAD.dual_level():
        d = fwAD.make_dual(x, torch.ones_like(x))
        with pytest.raises(RuntimeError, match="forward AD with simdnorm::layer_norm.out"):
            torch.ops.simdnorm.layer_norm.out(d, out=torch.empty(3, 4, dtype=D))
        torch.ops.simdnorm.layer_norm.out(x, out=torch.empty(3, 4, dtype=D))  # (no tangent: fine)
        rm, rv = torch.zeros(4, dtype=D), torch.ones(4, dtype=D)
        torch.ops.simdnorm.update_running_stats_(rm, rv, d[0], torch.ones(4, dtype=D), count=3)
        assert fwAD.unpack_dual(rm).tangent is None and torch.equal(rm, 0.1 * x[0])
    with pytest.raises(RuntimeError, match="forward AD with simdnorm::layer_norm.out"):
        func.jvp(lambda x: torch.ops.simdnorm.layer_norm.out(x, out=torch.empty(3, 4, dtype=D)), (x,), (x,))


# ----------------------------------------------------------------------------------------------------
# vmap rules (simdnorm/torch/_batching.py): one batched call, the per-sample calls' results

def _vmap_cases(rng, dtype):
    """(name, call(x, w, b) -> tuple of results, x's sample shape, the parameters' sample shapes)."""
    ops = torch.ops.simdnorm
    C = 6

    def backward_of(forward, backward, n_stats, **fkw):
        """call(x, w, b): the backward op on the forward's statistics, grad_output drawn from x."""
        def call(x, w, b):
            r = forward(x, w, b)
            return backward(x.sin(), x, *r[1:1 + n_stats], w, b)
        return call

    return [
        ("layer", lambda x, w, b: ops.layer_norm(x, w, b, axis=-2, activation="silu"), (3, 4, 5), (4, 5), (5,)),
        ("layer-axis1", lambda x, w, b: ops.layer_norm(x, w, b, axis=1), (3, 4, 5), (4, 5), (4, 5)),
        ("rms", lambda x, w, b: ops.rms_norm(x, w, epsilon=1e-3), (3, 4, 5), (5,), None),
        ("mvn", lambda x, w, b: ops.mean_variance_normalization(x, [0, -1], w, b, epsilon_mode="outside"),
         (3, 4, 5), (4, 1), (5,)),
        ("mvn-no-variance", lambda x, w, b: ops.mean_variance_normalization(x, [1], w, b, normalize_variance=False),
         (3, 4, 5), (5,), None),
        ("bn", lambda x, w, b: ops.batch_normalization(x, w + 1, w.abs() + 0.5, w, b, activation="relu"),
         (2, C, 4), (C,), (C,)),
        ("bn-channels-last", lambda x, w, b: ops.batch_normalization(x, b, w.abs() + 0.5, w, b, channel_axis=-1),
         (2, 4, C), (C,), (C,)),
        ("bn-1d-sample", lambda x, w, b: ops.batch_normalization(x, b, w.abs() + 0.5, w, b, channel_axis=0),
         (C,), (C,), (C,)),
        ("bn-1d-sample-broadcast", lambda x, w, b: ops.batch_normalization(  # ((1,) statistics: one channel)
            x, b[:1], w[:1].abs() + 0.5, w[:1], b[1:2], channel_axis=0), (C,), (C,), (C,)),
        ("bn-1d-sample-mixed", lambda x, w, b: ops.batch_normalization(x, b[:1], w.abs() + 0.5, w, b[:1]), (C,),
         (C,), (C,)),
        ("instance", lambda x, w, b: ops.instance_norm(x, w, b, activation="gelu"), (2, C, 3, 4), (C,), (C,)),
        ("instance-channels-last", lambda x, w, b: ops.instance_norm(x, w, b, channel_axis=-1), (2, 3, 4, C),
         (C,), (C,)),
        ("group", lambda x, w, b: ops.group_norm(x, 3, w, b), (2, C, 3, 4), (C,), (C,)),
        ("group-channels-last", lambda x, w, b: ops.group_norm(x, 2, w, b, channel_axis=-1, epsilon=1e-3),
         (2, 5, C), (C,), (C,)),
        ("group-no-spatial", lambda x, w, b: ops.group_norm(x, 2, w, b), (3, C), (C,), (C,)),
        ("bn-train", lambda x, w, b: ops.batch_normalization_training(x, w, b, activation="relu"), (2, C, 4), (C,),
         (C,)),
        ("bn-train-fused-add", lambda x, w, b: ops.batch_normalization_training(x, None, None, x.cos()[0], epsilon=0.1),
         (3, C, 2), (C,), (C,)),
        ("bn-train-same-rank", lambda x, w, b: ops.batch_normalization_training(x, w.reshape(1, C, 1), None,
                                                                                channel_axis=1), (2, C, 4), (C,), None),
        ("bn-train-channels-last-1d", lambda x, w, b: ops.batch_normalization_training(x, w, b, channel_axis=-1),
         (5, C), (C,), (C,)),
        ("bn-train-1d-sample", lambda x, w, b: ops.batch_normalization_training(x, w, b, channel_axis=0), (C,), (C,),
         (C,)),
        ("bn-backward-train", backward_of(lambda x, w, b: ops.batch_normalization_training(x, w, b),
                                          lambda go, x, m, v, w, b: ops.batch_normalization_backward(
                                              go, x, m, v, w, b, activation="silu"), 2), (2, C, 4), (C,), (C,)),
        ("bn-backward-fused-add", lambda x, w, b: ops.batch_normalization_backward(
            x.sin(), x, *ops.batch_normalization_training(x, w, None, x[0].cos())[1:], w, None, x[0].cos()),
         (3, C, 2), (C,), None),
        ("bn-backward-given", lambda x, w, b: ops.batch_normalization_backward(
            x.sin(), x, b, w.abs() + 0.5, w, b, training=False, activation="leaky_relu"), (2, C, 4), (C,), (C,)),
        ("bn-backward-given-1d-sample-broadcast", lambda x, w, b: ops.batch_normalization_backward(
            x.sin(), x, b[:1], w[:1].abs() + 0.5, w[:1], None, training=False, channel_axis=0), (C,), (C,), (C,)),
        ("bn-train-1d-sample-broadcast", lambda x, w, b: ops.batch_normalization_training(x, w[:1], b[:1]), (C,),
         (C,), (C,)),
        ("bn-backward-given-same-rank", lambda x, w, b: ops.batch_normalization_backward(
            x.sin(), x, b.reshape(1, C, 1), w.abs().reshape(1, C, 1) + 0.5, w.reshape(1, C, 1), None, training=False,
            channel_axis=1), (2, C, 4), (C,), (C,)),
        ("layer-backward", backward_of(lambda x, w, b: ops.layer_norm(x, w, b, axis=-2),
                                       lambda *a: ops.layer_norm_backward(*a, axis=-2), 2), (3, 4, 5), (4, 5), (5,)),
        ("rms-backward", lambda x, w, b: ops.rms_norm_backward(x.cos(), x, ops.rms_norm(x, w)[1], w, activation="silu"),
         (3, 4, 5), (5,), None),
        ("mvn-backward", backward_of(lambda x, w, b: ops.mean_variance_normalization(x, [0, 2], w, b),
                                     lambda go, x, m, s, w, b: ops.mean_variance_normalization_backward(
                                         go, x, [0, 2], m, s, w, b, grad_bias=False), 2), (3, 4, 5), (4, 5), (5,)),
        ("instance-backward", backward_of(lambda x, w, b: ops.instance_norm(x, w, b, channel_axis=-1),
                                          lambda *a: ops.instance_norm_backward(*a, channel_axis=-1,
                                                                                activation="leaky_relu"), 2),
         (2, 3, 4, C), (C,), (C,)),
        ("group-backward", backward_of(lambda x, w, b: ops.group_norm(x, 3, w, b),
                                       lambda go, x, m, s, w, b: ops.group_norm_backward(go, x, 3, m, s, w, b,
                                                                                         grad_input=False), 2),
         (2, C, 3, 4), (C,), (C,)),
        ("group-backward-channels-last", backward_of(
            lambda x, w, b: ops.group_norm(x, 2, w, b, channel_axis=-1),
            lambda go, x, m, s, w, b: ops.group_norm_backward(go, x, 2, m, s, w, b, channel_axis=-1), 2),
         (2, 3, C), (C,), (C,)),
    ]


VMAP_CASES = [c[0] for c in _vmap_cases(np.random.default_rng(0), D)]


@pytest.mark.parametrize("dtype", [D, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batched", ["x", "x-dim-1", "params", "all", "all-dim-last"])
@pytest.mark.parametrize("case", VMAP_CASES)
def test_vmap_rules_give_the_per_sample_results(rng, case, batched, dtype):
    _, call, xs, ws, bs = next(c for c in _vmap_cases(rng, dtype) if c[0] == case)
    B = 4

    def draw(shape, d):
        return torch.from_numpy(rng.standard_normal((B,) + tuple(shape))).to(dtype).movedim(0, d)

    xd = {"x": 0, "x-dim-1": 1, "params": None, "all": 0, "all-dim-last": -1}[batched]
    pd = {"x": None, "x-dim-1": None, "params": 0, "all": 0, "all-dim-last": -1}[batched]
    x = draw(xs, xd) if xd is not None else torch.from_numpy(rng.standard_normal(xs)).to(dtype)
    w = draw(ws, pd) if pd is not None else torch.from_numpy(rng.standard_normal(ws)).to(dtype)
    b = None if bs is None else draw(bs, pd) if pd is not None else torch.from_numpy(rng.standard_normal(bs)).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (torch's "performance drop" of its per-sample fallback: no rule ran)
        got = func.vmap(call, in_dims=(xd, pd, None if b is None else pd))(x, w, b)
    pick = lambda t, d, i: t if d is None or t is None else t.select(d, i)  # noqa: E731
    rows = [call(pick(x, xd, i), pick(w, pd, i), pick(b, pd, i)) for i in range(B)]
    got = got if isinstance(got, tuple) else (got,)
    rows = [r if isinstance(r, tuple) else (r,) for r in rows]
    tol = {D: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1.6e-2}[dtype]
    for k, g in enumerate(got):
        want = torch.stack([r[k] for r in rows])
        assert g.shape == want.shape and g.dtype == want.dtype, (k, g.shape, want.shape)
        scale = max(float(want.double().abs().max()), 1e-300) if want.numel() else 1.0
        err = float((g.double() - want.double()).abs().max()) / scale if want.numel() else 0.0
        assert err <= tol, f"{case} result {k}: max error {err:.3g} of the largest"


@pytest.mark.parametrize("case", ["layer", "group", "instance", "layer-backward", "group-backward"])
def test_vmap_of_samples_of_eight_dims(rng, case):
    # the batched tensors would have 9 dims (10: group norm's split): the rules then call per sample
    ops = torch.ops.simdnorm
    x = torch.from_numpy(rng.standard_normal((3, 2, 4, 1, 2, 1, 2, 1, 3)))
    calls = {
        "layer": lambda x: ops.layer_norm(x, axis=-3),
        "group": lambda x: ops.group_norm(x, 2),
        "instance": lambda x: ops.instance_norm(x, channel_axis=-1),
        "layer-backward": lambda x: ops.layer_norm_backward(x.sin(), x, *ops.layer_norm(x, axis=2)[1:], axis=2),
        "group-backward": lambda x: ops.group_norm_backward(x.sin(), x, 2, *ops.group_norm(x, 2)[1:]),
    }
    got = func.vmap(calls[case])(x)
    rows = [calls[case](s) for s in x]
    for k, g in enumerate(got):
        want = torch.stack([r[k] for r in rows])
        assert g.shape == want.shape and torch.equal(g, want), k


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_make_fx_records_the_plain_functions_ops(rng, mode):
    # make_fx traces through a dispatch mode, which sees ops only: a plain call must become its op
    # (a call reading memory directly would be missing from the graph), and moments (no op) refuses
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, dy):
        y, mean, inv_std = simdnorm.layer_norm(x, return_stats=True)
        return y, simdnorm.layer_norm_backward(dy, x, mean, inv_std)[0]

    x, dy = (torch.from_numpy(rng.standard_normal((3, 5))) for _ in range(2))
    gm = make_fx(step, tracing_mode=mode)(x, dy)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "simdnorm.layer_norm.default" in targets and "simdnorm.layer_norm_backward.default" in targets, targets
    x2, dy2 = (torch.from_numpy(rng.standard_normal((3, 5))) for _ in range(2))
    for got, want in zip(gm(x2, dy2), step(x2, dy2)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="dispatch mode"):
        make_fx(lambda x: torch.from_numpy(simdnorm.moments(x, (0,)).mean) + x, tracing_mode=mode)(x)

    def train(x, rm, rv):  # the running statistics' update is an op of the graph too
        return simdnorm.batch_normalization_training(x, running_mean=rm, running_var=rv, channel_axis=-1)[0]

    gm = make_fx(train, tracing_mode=mode)(x, torch.zeros(5, dtype=D), torch.ones(5, dtype=D))
    assert "simdnorm.update_running_stats_.default" in [str(n.target) for n in gm.graph.nodes]
    got_stats, want_stats = (torch.zeros(5, dtype=D), torch.ones(5, dtype=D)), (torch.zeros(5, dtype=D),
                                                                              torch.ones(5, dtype=D))
    torch.testing.assert_close(gm(x2, *got_stats), train(x2, *want_stats), rtol=0, atol=0)
    for got, want in zip(got_stats, want_stats):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_plain_function_errors_under_vmap_as_without(rng):
    x = torch.from_numpy(rng.standard_normal((3, 4, 5)))
    with pytest.raises(ValueError) as alone:
        simdnorm.group_norm(x[0], 2)
    with pytest.raises(type(alone.value), match=re.escape(str(alone.value))):
        func.vmap(lambda a: simdnorm.group_norm(a, 2))(x)
