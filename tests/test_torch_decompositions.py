"""The forward ops' torch-ops decompositions (simdnorm/torch/_decompositions.py): what torch.onnx's
exporter writes for a model that calls torch.ops.simdnorm or the plain functions itself. Each
decomposition against its op on fresh random data (every activation with default and other
parameters; MVN's axes, flags and epsilon modes; batch norm training's statistics forms and
fused_add), an ONNX export of such a model run by onnx's reference evaluator against the eager
model, and that torch.export and its default decompositions keep simdnorm's ops. (The route fuzzer,
tests/torch_fuzz.py, checks the decompositions over every parameter layout too.)"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install '.[torch]'): "
                                           "simdnorm.torch needs it")

import simdnorm  # noqa: E402
import simdnorm.torch  # noqa: E402,F401
from reference import ACTIVATION_NAMES, NONDEFAULT_PARAMS  # noqa: E402
from simdnorm import ACTIVATIONS  # noqa: E402
from simdnorm.torch import _decompositions  # noqa: E402
from torch_fuzz import assert_decomposition_close  # noqa: E402

ops = torch.ops.simdnorm


def rand(rng, *shape, dtype=torch.float32, scale=1.0, loc=0.0):
    return torch.from_numpy(rng.standard_normal(shape) * scale + loc).to(dtype)


ACT_CASES = [(n, None) for n in ACTIVATION_NAMES] + [(n, p) for n, p in NONDEFAULT_PARAMS.items()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name,params", ACT_CASES, ids=[f"{n}{'-params' if p else ''}" for n, p in ACT_CASES])
def test_activations_as_the_kernels_apply_them(rng, name, params, dtype):
    # layer norm's output spread over [-12, 12] by the scale, then the activation
    x = rand(rng, 16, 64, dtype=dtype)
    w, b = rand(rng, 64, dtype=dtype, scale=4.0), rand(rng, 64, dtype=dtype)
    values = [params[k] for k in ACTIVATIONS[name]] if params else None
    kw = dict(axis=-1, epsilon=1e-5, activation=name, activation_params=values)
    assert_decomposition_close(name, _decompositions.layer_norm(x, w, b, **kw), ops.layer_norm(x, w, b, **kw))


def _mvn_cases():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for axes in ([1], [0, 2], [2, 3], [0, 1, 2, 3], [-1, 1]):
            for nm, nv in ((True, True), (False, True), (True, False)):
                for mode in ("inside", "outside"):
                    yield dtype, axes, nm, nv, mode


@pytest.mark.parametrize("dtype,axes,nm,nv,mode", list(_mvn_cases()))
def test_mean_variance_normalization(rng, dtype, axes, nm, nv, mode):
    x = rand(rng, 3, 4, 5, 6, dtype=dtype, loc=2.0)
    scale = rand(rng, 5, 1, dtype=dtype)  # (right-aligned, lower rank)
    bias = rand(rng, 4, 1, 6, dtype=torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)
    kw = dict(normalize_mean=nm, normalize_variance=nv, epsilon=1e-3, epsilon_mode=mode, activation="silu")
    assert_decomposition_close("mvn", _decompositions.mean_variance_normalization(x, axes, scale, bias, **kw),
                   ops.mean_variance_normalization(x, axes, scale, bias, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["f32", "bf16", "f64"])
@pytest.mark.parametrize("form", ["none", "channels", "same_rank", "fused_add", "one_dim", "last_axis"])
def test_batch_normalization_training(rng, dtype, form):
    shape, ca = ((7,), 0) if form == "one_dim" else ((4, 3, 5, 2), -1 if form == "last_axis" else 1)
    x = rand(rng, *shape, dtype=dtype, loc=-3.0)
    c = shape[ca]
    pshape = (1, 3, 1, 2) if form == "same_rank" else (c,)
    scale = None if form == "none" else rand(rng, *pshape, dtype=dtype)
    bias = None if form == "none" else rand(rng, *pshape, dtype=dtype)
    fused = rand(rng, *shape, dtype=dtype) if form == "fused_add" else None
    kw = dict(epsilon=1e-5, channel_axis=ca, activation="leaky_relu", activation_params=[0.2])
    assert_decomposition_close(form, _decompositions.batch_normalization_training(x, scale, bias, fused, **kw),
                   ops.batch_normalization_training(x, scale, bias, fused, **kw))


class CallsTheOps(torch.nn.Module):
    """A model calling torch.ops.simdnorm and the plain functions itself (no drop-in modules); its
    parameters require grad, so its activations are those with a backward op."""

    def __init__(self, rng):
        super().__init__()
        p = lambda *s, loc=0.0: torch.nn.Parameter(rand(rng, *s, loc=loc))  # noqa: E731
        self.w, self.b, self.g, self.h = p(8, loc=1.0), p(8), p(6, loc=1.0), p(6)
        self.register_buffer("mean", rand(rng, 8))
        self.register_buffer("var", rand(rng, 8).abs() + 0.5)

    def forward(self, x):  # x: (N, 8, 4, 6)
        h = ops.batch_normalization(x, self.mean, self.var, self.w, self.b, activation="relu")
        h = simdnorm.group_norm(h, 4, self.w, self.b, activation="silu")
        h = ops.instance_norm(h, self.w, None, activation="gelu")[0]
        h = simdnorm.mean_variance_normalization(h, axes=(0, 2), epsilon_mode="outside")
        h = ops.layer_norm(h, self.g, self.h, activation="leaky_relu", activation_params=[0.25])[0]
        return simdnorm.rms_norm(h, self.g, activation="gelu")


_COMPILE_WHERE_CI_IS_SET = """
import torch, simdnorm.torch
ops = torch.ops.simdnorm
g = torch.Generator().manual_seed(5)
x = torch.randn(4, 8, 5, 6, generator=g, requires_grad=True)
w, b = (torch.randn(8, generator=g, requires_grad=True) for _ in range(2))
mean, var = torch.randn(8, generator=g), torch.rand(8, generator=g) + 0.5

def every_forward_op(x):  # (each of them has a decomposition in torch._decomp's table)
    h = ops.batch_normalization(x, mean, var, w, b)
    h = ops.batch_normalization_training(h, w, b, None, activation="relu")[0]
    h = ops.group_norm(h, 4, w, b)[0] + ops.instance_norm(h, w, b)[0]
    h = ops.mean_variance_normalization(h, [0, 2])[0]
    return ops.rms_norm(ops.layer_norm(h, w[:6], b[:6])[0], w[:6])[0]

compiled = torch.compile(every_forward_op, fullgraph=True)
for f in (compiled, every_forward_op):
    y = f(x)
    y.square().sum().backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    x.grad = w.grad = b.grad = None
    if f is compiled:
        got = [y.detach()] + grads
want = [y.detach()] + grads
for a, e in zip(got, want):
    torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
"""


def test_inductor_compiles_the_ops_where_ci_is_set():
    # With CI set, inductor's implicit fallback raises for an op that has a decomposition in
    # torch._decomp's table; simdnorm declares the ops' fallbacks. In a child: a fallback once
    # declared (implicitly, by an earlier compile in this process) hides the error; caches are off
    # so that inductor lowers the graph.
    import os
    import subprocess
    import sys

    env = dict(os.environ, CI="1", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    r = subprocess.run([sys.executable, "-c", _COMPILE_WHERE_CI_IS_SET], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


def test_onnx_export_of_a_model_calling_the_ops(rng, tmp_path):
    onnx = pytest.importorskip("onnx", reason="onnx is not installed (the test extra installs it)")
    pytest.importorskip("onnxscript", reason="torch.onnx's dynamo exporter needs onnxscript (the test extra)")
    from onnx.reference import ReferenceEvaluator

    model = CallsTheOps(rng)
    x = rand(rng, 2, 8, 4, 6, loc=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the exporter's progress notes)
        torch.onnx.export(model, (x,), dynamo=True, verbose=False).save(str(tmp_path / "m.onnx"))
    exported = onnx.load(str(tmp_path / "m.onnx"))
    assert not [n.op_type for n in exported.graph.node if "simdnorm" in n.domain or "simdnorm" in n.op_type]
    x2 = rand(rng, 2, 8, 4, 6, loc=-0.5)
    (got,) = ReferenceEvaluator(exported).run(None, {exported.graph.input[0].name: x2.numpy()})
    with torch.no_grad():
        want = model(x2)
    err = np.abs(got - want.numpy()).max() / max(1.0, float(want.abs().max()))
    assert err <= 1e-4, f"the ONNX model's output: max error {err:.3g}"


# (torch's own run_decompositions with a newer typing_extensions, as onnxscript's installs)
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")
def test_export_and_its_default_decompositions_keep_simdnorm_ops(rng):
    model = CallsTheOps(rng)
    program = torch.export.export(model, (rand(rng, 2, 8, 4, 6),))
    for p in (program, program.run_decompositions()):
        found = {str(n.target) for n in p.graph.nodes if str(n.target).startswith("simdnorm.")}
        assert found == {f"simdnorm.{n}.default" for n in ("batch_normalization", "group_norm", "instance_norm",
                                                          "mean_variance_normalization", "layer_norm", "rms_norm")}
    # torch.compile's (inductor's) table leaves them out too; torch.onnx's exporter takes them
    from torch._inductor.decomposition import select_decomp_table
    from torch.onnx._internal.exporter._decomp import create_onnx_friendly_decomposition_table

    assert not [op for op in select_decomp_table() if "simdnorm" in str(op)]
    onnx_table = create_onnx_friendly_decomposition_table(set())
    assert {str(op) for op in onnx_table if "simdnorm" in str(op)} == {
        f"simdnorm.{n}.default" for n in _decompositions.FORWARD}
