"""The torch.ops.simdnorm operators (simdnorm.torch, SPEC §10): one per function of SPEC §2-§4 and
§9 with the schemas docs/torch.rst lists; torch.library.opcheck on every op and .out overload
(schema, autograd registration, fake kernel, AOT dispatch with dynamic shapes); values against
float64 references, outputs poisoned before .out runs; torch.autograd.gradcheck in float64; no
copies (the numpy arrays simdnorm receives are the tensors' own memory); bfloat16 end to end;
running statistics against torch.nn's; clear errors; no double backward; and that ``import
simdnorm`` does not import torch."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install '.[torch]'): "
                                           "simdnorm.torch needs it")

import simdnorm  # noqa: E402
import simdnorm.torch  # noqa: E402,F401
from simdnorm import _core  # noqa: E402
from simdnorm.torch import _ops, _routes  # noqa: E402

from reference import apply_activation, batch_norm_ref, group_norm_ref, mvn_ref  # noqa: E402
from training_reference import bn_training_ref  # noqa: E402

ops = torch.ops.simdnorm
DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "torch.rst")

# relative to the largest |reference|: about two roundings of the output type
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}
FORWARD = ("batch_normalization", "mean_variance_normalization", "layer_norm", "rms_norm", "instance_norm",
           "group_norm", "batch_normalization_training")
BACKWARD = ("batch_normalization_backward", "mean_variance_normalization_backward", "layer_norm_backward",
            "rms_norm_backward", "instance_norm_backward", "group_norm_backward")


def rand(rng, *shape, dtype=torch.float32, loc=0.0, scale=1.0, positive=False):
    a = rng.standard_normal(shape) * scale + loc
    return torch.from_numpy(np.abs(a) + 0.5 if positive else a).to(dtype)


def f64(t):
    return None if t is None else t.detach().to(torch.float64).numpy()


def assert_close(got, want, dtype, what=""):
    if want is None:
        assert got.numel() == 0, f"{what}: expected an empty tensor (not computed), got {tuple(got.shape)}"
        return
    got = got.detach().to(torch.float64).numpy()
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(np.abs(want).max(), 1e-300)
    err = np.abs(got - want).max() / scale
    assert err <= TOL[dtype], f"{what}: max error {err:.3g} of max |reference| > {TOL[dtype]:.3g}"


# ----------------------------------------------------------------------------------------------------
# cases: (op name, args, kwargs, float64 references of every output; None for an empty one)

def forward_cases(rng, dtype=torch.float32, pdtype=None):
    """Every forward op, with its parameters (scale, bias, fused_add, activation, flags) varied."""
    pdtype = pdtype or dtype
    x = rand(rng, 2, 6, 5, 4, dtype=dtype, loc=3.0)
    w, b = rand(rng, 6, dtype=pdtype), rand(rng, 6, dtype=pdtype)
    mean, var = rand(rng, 6, dtype=pdtype, loc=3.0), rand(rng, 6, dtype=pdtype, positive=True)
    lw, lb = rand(rng, 5, 4, dtype=pdtype), rand(rng, 4, dtype=pdtype)
    fa = rand(rng, 5, 4, dtype=dtype)
    xs, ws, bs, lws, lbs = f64(x), f64(w), f64(b), f64(lw), f64(lb)
    cases = []
    cases.append(("batch_normalization", (x, mean, var, w, b), {"epsilon": 1e-3, "activation": "silu"},
                  [batch_norm_ref(xs, f64(mean), f64(var), ws, bs, epsilon=1e-3, activation="silu")]))
    xl = x.permute(0, 2, 3, 1)  # channels last, as a view: any strides
    cases.append(("batch_normalization", (xl, mean, var), {"channel_axis": -1, "activation": "leaky_relu",
                                                          "activation_params": [0.25]},
                  [batch_norm_ref(f64(xl), f64(mean), f64(var), channel_axis=-1, activation="leaky_relu",
                                  act_params={"alpha": 0.25})]))
    y, m, s = mvn_ref(xs, (1, 3), None, lbs, epsilon_mode="outside")
    cases.append(("mean_variance_normalization", (x, [1, 3], None, lb), {"epsilon_mode": "outside"}, [y, m, s]))
    y, m, s = mvn_ref(xs, (2, 3), lws, normalize_mean=False)
    cases.append(("mean_variance_normalization", (x, [-2, -1], lw), {"normalize_mean": False}, [y, None, s]))
    y, m, s = mvn_ref(xs, (0, 2), normalize_variance=False, activation="relu")
    cases.append(("mean_variance_normalization", (x, [0, 2]), {"normalize_variance": False, "activation": "relu"},
                  [y, m, None]))
    y, m, s = mvn_ref(xs, (2, 3), lws, lbs, activation="gelu")
    cases.append(("layer_norm", (x, lw, lb), {"axis": -2, "activation": "gelu"}, [y, m, s]))
    y, _, s = mvn_ref(xs, (3,), lbs, normalize_mean=False, epsilon=1e-2)
    cases.append(("rms_norm", (x, lb), {"epsilon": 1e-2}, [y, s]))
    y, m, s = mvn_ref(xs, (2, 3), ws.reshape(6, 1, 1), bs.reshape(6, 1, 1))
    cases.append(("instance_norm", (x, w, b), {}, [y, m, s]))
    y, m, s = group_norm_ref(xs, 3, ws, bs, epsilon=1e-4)
    cases.append(("group_norm", (x, 3, w, b), {"epsilon": 1e-4, "activation": "tanh"},
                  [apply_activation(y, "tanh"), m, s]))
    r = bn_training_ref(xs, ws, bs, fused_add=f64(fa), activation="relu")
    cases.append(("batch_normalization_training", (x, w, b, fa), {"activation": "relu"}, [r.out, r.mean, r.var]))
    r = bn_training_ref(f64(xl), channel_axis=-1)
    cases.append(("batch_normalization_training", (xl,), {"channel_axis": -1}, [r.out, r.mean, r.var]))
    return cases


def backward_cases(rng, dtype=torch.float64):
    """Every backward op on the statistics its forward op returned, with some gradients not asked for."""
    x = rand(rng, 2, 6, 3, 4, dtype=dtype, loc=1.0)
    go = rand(rng, 2, 6, 3, 4, dtype=dtype)
    w, b = rand(rng, 6, dtype=dtype), rand(rng, 6, dtype=dtype)
    lw, lb = rand(rng, 4, dtype=dtype), rand(rng, 4, dtype=dtype)
    fa = rand(rng, 3, 4, dtype=dtype)
    cases = []
    _, m, v = ops.batch_normalization_training(x, w, b, fa)
    cases.append(("batch_normalization_backward", (go, x, m, v, w, b, fa), {"activation": "silu"}))
    cases.append(("batch_normalization_backward", (go, x, m + 0.5, v + 1.0, w),
                  {"training": False, "grad_scale": False}))
    _, m, s = ops.mean_variance_normalization(x, [1, 3], None, lb)
    cases.append(("mean_variance_normalization_backward", (go, x, [1, 3], m, s, None, lb), {}))
    _, _, s = ops.mean_variance_normalization(x, [2, 3], normalize_mean=False)
    cases.append(("mean_variance_normalization_backward", (go, x, [2, 3], None, s), {"normalize_mean": False}))
    _, m, s = ops.layer_norm(x, lw, lb)
    cases.append(("layer_norm_backward", (go, x, m, s, lw, lb), {"activation": "gelu", "grad_bias": False}))
    _, s = ops.rms_norm(x, lw)
    cases.append(("rms_norm_backward", (go, x, s, lw), {}))
    _, m, s = ops.instance_norm(x, w, b)
    cases.append(("instance_norm_backward", (go, x, m, s, w, b), {"activation": "leaky_relu"}))
    _, m, s = ops.group_norm(x, 2, w, b)
    cases.append(("group_norm_backward", (go, x, 2, m, s, w, b), {}))
    return cases


def _call_simdnorm(name, args, kwargs):
    """The same call to simdnorm's numpy function (the reference for the backward ops' values)."""
    conv = [f64(a) if isinstance(a, torch.Tensor) else a for a in args]
    kw = dict(kwargs)
    act, params = kw.pop("activation", None), kw.pop("activation_params", None)
    if act is not None:
        kw["activation"] = simdnorm.Activation(act, **dict(zip(simdnorm.ACTIVATIONS[act], params or ())))
    if name == "batch_normalization_backward" and len(conv) > 6:
        kw["fused_add"] = conv.pop(6)
    r = list(getattr(simdnorm, name)(*conv, **kw))
    if name == "batch_normalization_backward" and len(r) == 3:
        r.append(None)
    return r[:2] if name == "rms_norm_backward" else r


# ----------------------------------------------------------------------------------------------------
# import, names, schemas

def _python(code: str) -> str:
    """What a fresh interpreter running code prints (it must exit cleanly)."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_import_simdnorm_does_not_import_torch():
    code = "import sys, simdnorm; simdnorm.layer_norm([[1.0, 2.0]]); print('torch' in sys.modules)"
    assert _python(code).strip() == "False"


@pytest.mark.parametrize("version, imports", [("2.9.1+cu128", False), ("1.13.1", False), ("2.10.0a0+git1234", True),
                                              ("3.0.0", True)])
def test_torch_older_than_the_minimum_is_refused_by_name(version, imports):
    # torch 2.5-2.9 imported simdnorm.torch and then refused every tensor (no DLPack C exchange API),
    # 2.4 failed inside the import: an older torch is now named at import, by simdnorm.torch and by a
    # plain function given a tensor; numpy calls need no torch. (The version is stood in for here.)
    code = ("import torch, numpy as np\n"
            f"torch.__version__ = {version!r}\n"
            "import simdnorm\n"
            "simdnorm.layer_norm(np.ones((2, 3), np.float32))\n"
            "try:\n"
            "    simdnorm.layer_norm(torch.ones(2, 3))\n"
            "except ImportError as e:\n"
            "    print('plain:', e)\n"
            "try:\n"
            "    import simdnorm.torch\n"
            "except ImportError as e:\n"
            "    print('import:', e)\n"
            "else:\n"
            "    print('imported')\n")
    out = _python(code)
    if imports:
        assert out.strip() == "imported", out
    else:
        want = f"simdnorm.torch needs torch 2.10 or later; this is torch {version}"
        lines = out.splitlines()
        assert len(lines) == 2 and all(want in line for line in lines), out
        assert lines[0].startswith("plain:") and lines[1].startswith("import:"), out


def test_bfloat16_tensors_without_importing_ml_dtypes_first():
    # ml_dtypes (numpy's bfloat16) is imported at the first bfloat16 tensor, not with simdnorm.torch
    code = ("import sys, torch, simdnorm.torch as st\n"
            "assert 'ml_dtypes' not in sys.modules, 'import simdnorm.torch imported ml_dtypes'\n"
            "x = torch.randn(4, 8, dtype=torch.bfloat16)\n"
            "y = torch.ops.simdnorm.layer_norm(x)[0]\n"
            "want = torch.nn.functional.layer_norm(x.float(), [8])\n"
            "assert y.dtype == torch.bfloat16 and (y.float() - want).abs().max() < 0.05\n"
            "print('ml_dtypes' in sys.modules)")
    assert _python(code).strip() == "True"


def test_one_op_per_function_under_its_name():
    for name in FORWARD + BACKWARD:
        assert callable(getattr(simdnorm, name))  # the function the op is named after
        packet = getattr(ops, name)
        assert set(packet.overloads()) == {"default", "out"}, name
    assert set(ops.update_running_stats_.overloads()) == {"default"}


def test_schemas_are_the_ones_the_docs_list():
    with open(DOCS, encoding="utf-8") as f:
        listed = re.findall(r"^\s+(simdnorm::\S+\(.*\) -> .*)$", f.read(), flags=re.M)
    registered = {}
    for name in FORWARD + BACKWARD + ("update_running_stats_",):
        for overload in getattr(ops, name).overloads():
            op = getattr(getattr(ops, name), overload)
            registered[op._schema.name + ("." + overload if overload != "default" else "")] = op._schema
    parsed = {}
    for line in listed:
        s = torch._C.parse_schema(line)
        parsed[s.name + ("." + s.overload_name if s.overload_name else "")] = s
    assert parsed.keys() == registered.keys()
    for k, s in parsed.items():
        assert s == registered[k], f"docs/torch.rst's {k} differs from the registered schema:\n{s}\n{registered[k]}"


def test_a_keyword_has_one_default_in_every_schema():
    # (the autograd backward and the modules leave out keyword arguments equal to the default the
    # name has in _ops._KW_DEFAULTS: a schema giving it another would change those calls)
    defaults = {}
    for name in FORWARD + BACKWARD + ("update_running_stats_",):
        for arg in getattr(ops, name).default._schema.arguments:
            if arg.kwarg_only:
                d = arg.default_value if arg.has_default_value() else None
                assert defaults.setdefault(arg.name, d) == d, f"{name}: {arg.name}={d!r}, elsewhere {defaults[arg.name]!r}"
    assert defaults == _ops._KW_DEFAULTS


# ----------------------------------------------------------------------------------------------------
# opcheck

def _opcheck(op, args, kwargs):
    with warnings.catch_warnings():
        # (torch 2.14's AOT check reads .grad of the non-leaf copies of the inputs it makes itself)
        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf", UserWarning)
        result = torch.library.opcheck(op, args, kwargs)
    failed = {k: v for k, v in result.items() if v != "SUCCESS"}
    assert not failed, f"{op}: {failed}"


def test_opcheck_forward_ops_and_their_out_overloads(rng):
    for name, args, kwargs, _ in forward_cases(rng, torch.float64):
        grads = tuple(a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args)
        if kwargs.get("activation") not in _ops.BACKWARD_ACTIVATIONS:
            grads = args  # (forward only: an activation without a backward op)
        _opcheck(getattr(ops, name).default, grads, kwargs)
        _opcheck(getattr(ops, name).out, args, {**kwargs, "out": torch.full_like(args[0], float("nan"))})


def test_opcheck_backward_ops_and_their_out_overloads(rng):
    for name, args, kwargs in backward_cases(rng):
        _opcheck(getattr(ops, name).default, args, kwargs)
        _opcheck(getattr(ops, name).out, args, {**kwargs, "out": torch.full_like(args[1], float("nan"))})


def test_opcheck_update_running_stats(rng):
    for momentum, nbt in ((0.25, None), (None, torch.tensor(3))):
        args = (rand(rng, 6), rand(rng, 6, positive=True), rand(rng, 6), rand(rng, 6, positive=True), nbt)
        _opcheck(ops.update_running_stats_.default, args, {"count": 7, "momentum": momentum})


# ----------------------------------------------------------------------------------------------------
# values

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=lambda d: str(d)[6:])
def test_forward_ops_match_float64_references(rng, dtype):
    for name, args, kwargs, refs in forward_cases(rng, dtype):
        got = getattr(ops, name)(*args, **kwargs)
        got = got if isinstance(got, tuple) else (got,)
        assert len(got) == len(refs)
        assert got[0].dtype == dtype and got[0].shape == args[0].shape
        assert got[0].stride() == torch.empty_like(args[0]).stride(), f"{name}: not laid out like empty_like"
        for i, (g, r) in enumerate(zip(got, refs)):
            if i:  # the statistics: float32 (float64 for float64 data), like return_stats=True
                assert g.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
            assert_close(g, r, dtype if i == 0 else torch.float32 if dtype != torch.float64 else dtype,
                         f"{name} output {i} ({dtype})")


def test_mixed_precision_parameters(rng):
    # 16-bit data with float32 parameters (torch.nn's mixed precision): output in the data's dtype
    for name, args, kwargs, refs in forward_cases(rng, torch.bfloat16, torch.float32):
        got = getattr(ops, name)(*args, **kwargs)
        got = got if isinstance(got, tuple) else (got,)
        assert got[0].dtype == torch.bfloat16
        assert_close(got[0], refs[0], torch.bfloat16, name)


def test_out_overloads_write_out_and_return_the_rest(rng):
    for name, args, kwargs, refs in forward_cases(rng):
        out = torch.full_like(args[0], float("nan"))  # poisoned: every element must be written
        ptr = out.data_ptr()
        rest = getattr(ops, name).out(*args, **kwargs, out=out)
        rest = () if rest is None else rest if isinstance(rest, tuple) else (rest,)
        assert out.data_ptr() == ptr
        assert len(rest) == len(refs) - 1
        assert_close(out, refs[0], torch.float32, name + ".out")
        for i, (g, r) in enumerate(zip(rest, refs[1:])):
            assert_close(g, r, torch.float32, f"{name}.out statistic {i}")


def _route_cases(rng, dtype):
    """(op, args, kwargs) of the forward ops the per-call route takes (no activation, no out=), in
    every layout of the input: C order, dims stored reversed, not dense, unaligned, 8 dims."""
    pd = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    shape = (3, 6, 5, 4)
    base = rand(rng, *shape, dtype=dtype, loc=2.0)
    layouts = [base, rand(rng, *shape[::-1], dtype=dtype).permute(3, 2, 1, 0), base[..., ::2],
               rand(rng, int(np.prod(shape)) + 1, dtype=dtype)[1:].view(shape),
               base.contiguous(memory_format=torch.channels_last)]
    w, b = rand(rng, 6, dtype=pd), rand(rng, 6, dtype=pd)
    mean, var = rand(rng, 6, dtype=pd), rand(rng, 6, dtype=pd, positive=True)
    cases = []
    for x in layouts:
        n = x.shape[-1]
        cases += [
            ("layer_norm", (x, rand(rng, n, dtype=pd), rand(rng, n, dtype=pd)), {}),
            ("layer_norm", (x, rand(rng, 5, n, dtype=dtype)), {"axis": -2, "epsilon": 1e-3}),
            ("rms_norm", (x, rand(rng, n, dtype=pd)), {}),
            ("instance_norm", (x, w, b), {}),
            ("instance_norm", (x.permute(0, 2, 3, 1), None, b[:1].expand(6)), {"channel_axis": -1}),
            ("group_norm", (x, 3, w, b), {}),
            ("group_norm", (x.permute(0, 2, 3, 1), 2, w), {"channel_axis": 3}),
            ("batch_normalization", (x, mean, var, w, b), {}),
            ("batch_normalization", (x.permute(0, 2, 3, 1), mean, var, None, b), {"channel_axis": -1}),
        ]
    x8 = rand(rng, 2, 4, 2, 2, 2, 2, 2, 3, dtype=dtype)
    cases += [("group_norm", (x8, 2, w[:4], b[:4]), {}), ("layer_norm", (x8,), {"axis": 1})]
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=["f32", "f16", "bf16", "f64"])
def test_per_call_route_gives_the_out_overloads_bits(rng, dtype, monkeypatch):
    """A forward op without an activation or out= hands the tensors to the kernels itself (plans
    cached by shapes and dtypes, the route the drop-in modules take without autograd; a hit of a
    dense input in the op's C++ kernel); its output and statistics are the bits the .out overload's
    plain function gives, twice (a miss, a hit)."""
    ran = []
    for attr in ("_mvn", "_batch_norm"):
        fn = getattr(_routes, attr)
        monkeypatch.setattr(_routes, attr, lambda *a, _fn=fn: ran.append(1) or _fn(*a))
    for name, args, kwargs in _route_cases(rng, dtype):
        for _ in range(2):
            ran.clear()
            computed = _core.torch_kernel_calls()
            got = getattr(ops, name)(*args, **kwargs)
            assert ran or _core.torch_kernel_calls() > computed, f"{name}: neither the route nor the C++ kernel ran"
            got = got if isinstance(got, tuple) else (got,)
            out = torch.full_like(args[0], float("nan"))
            rest = getattr(ops, name).out(*args, **kwargs, out=out)
            want = (out,) + (rest if isinstance(rest, tuple) else () if rest is None else (rest,))
            assert got[0].stride() == torch.empty_like(args[0]).stride(), name
            for i, (g, w) in enumerate(zip(got, want)):
                assert g.dtype == w.dtype and g.shape == w.shape, (name, i)
                assert torch.equal(g, w) or (g.isnan() == w.isnan()).all() and torch.equal(
                    g.nan_to_num(), w.nan_to_num()), f"{name} {kwargs}: result {i} differs"


def test_backward_ops_equal_simdnorms_functions(rng):
    # the backward ops are simdnorm's backward functions (tested against references in
    # test_training.py): the same values, unrequested gradients as empty tensors
    for name, args, kwargs in backward_cases(rng):
        got = getattr(ops, name)(*args, **kwargs)
        want = _call_simdnorm(name, args, kwargs)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            if w is None:
                assert g.numel() == 0, f"{name}: gradient {i} was not asked for"
            else:
                np.testing.assert_array_equal(g.numpy(), w, err_msg=f"{name}: gradient {i}")
        out = torch.full_like(args[1], float("nan"))
        rest = getattr(ops, name).out(*args, **kwargs, out=out)
        np.testing.assert_array_equal(out.numpy(), want[0])
        rest = rest if isinstance(rest, tuple) else (rest,)
        assert len(rest) == len(want) - 1


def test_unrequested_gradients(rng):
    x = rand(rng, 3, 8, dtype=torch.float64)
    w, b = rand(rng, 8, dtype=torch.float64), rand(rng, 8, dtype=torch.float64)
    y, m, s = ops.layer_norm(x, w, b)
    gi, gw, gb = ops.layer_norm_backward(torch.ones_like(x), x, m, s, w, b, grad_input=False, grad_scale=False)
    assert gi.numel() == 0 and gw.numel() == 0 and gb.shape == b.shape
    # through autograd: None for what does not require grad, and no gradient for the statistics
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, m, s = ops.layer_norm(xr, wr, b)
    assert not m.requires_grad and not s.requires_grad
    y.sum().backward()
    assert xr.grad is not None and wr.grad is not None and b.grad is None


# ----------------------------------------------------------------------------------------------------
# gradients

def _gradcheck_cases(rng):
    d = torch.float64
    x = rand(rng, 2, 4, 3, 3, dtype=d, loc=0.5)
    w, b = rand(rng, 4, dtype=d), rand(rng, 4, dtype=d)
    lw, lb = rand(rng, 3, dtype=d), rand(rng, 3, dtype=d)
    mean, var = rand(rng, 4, dtype=d), rand(rng, 4, dtype=d, positive=True)
    fa = rand(rng, 3, 3, dtype=d)
    return [
        ("batch_normalization", (x, mean, var, w, b), {"activation": "gelu"}),
        ("batch_normalization", (x, mean.reshape(1, 4, 1, 1), var.reshape(1, 4, 1, 1)), {"epsilon": 0.1}),
        # each parameter 1-D or same-rank on its own (SPEC §2), the backward given one joint shape
        ("batch_normalization", (x, rand(rng, 1, 4, 3, 1, dtype=d), var, w, rand(rng, 1, 4, 1, 3, dtype=d)),
         {"activation": "silu"}),
        ("mean_variance_normalization", (x, [1, 3], None, lb), {"epsilon_mode": "outside", "activation": "silu"}),
        ("mean_variance_normalization", (x, [2, 3], lw), {"normalize_mean": False}),
        ("mean_variance_normalization", (x, [0, 2], lw, lb), {"normalize_variance": False}),
        ("layer_norm", (x, lw, lb), {"axis": -1}),
        ("layer_norm", (x, lw.expand(3, 3).contiguous(), None), {"axis": -2, "activation": "gelu"}),
        ("rms_norm", (x, lw), {"epsilon": 1e-3}),
        ("instance_norm", (x, w, b), {"activation": "silu"}),
        ("group_norm", (x, 2, w, b), {}),
        ("batch_normalization_training", (x, w, b, fa), {"activation": "silu"}),
        ("batch_normalization_training", (x, w.reshape(1, 4, 1, 1), None), {}),
    ]


@pytest.mark.filterwarnings("ignore:.*performance drop.*")  # (vmap's fallback over the ops)
def test_gradcheck_float64(rng):
    for name, args, kwargs in _gradcheck_cases(rng):
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        inputs = tuple(args[i].detach().clone().requires_grad_(True) for i in tensors)

        def f(*ts, name=name, args=args, kwargs=kwargs, tensors=tensors):
            full = list(args)
            for i, t in zip(tensors, ts):
                full[i] = t
            r = getattr(ops, name)(*full, **kwargs)
            return r[0] if isinstance(r, tuple) else r

        # (forward mode too: each op's jvp against finite differences; and both under vmap)
        assert torch.autograd.gradcheck(f, inputs, check_forward_ad=True, check_batched_grad=True,
                                        check_batched_forward_grad=True), name


def test_double_backward_raises(rng):
    x = rand(rng, 2, 4, 5, dtype=torch.float64).requires_grad_(True)
    w = rand(rng, 5, dtype=torch.float64).requires_grad_(True)
    y = ops.layer_norm(x, w)[0]
    (gx,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        gx.sum().backward()


def test_out_overloads_have_no_autograd(rng):
    x = rand(rng, 2, 4, 5).requires_grad_(True)
    with pytest.raises(RuntimeError, match="out=... arguments don't support automatic differentiation"):
        ops.layer_norm.out(x, out=torch.empty(2, 4, 5))
    with torch.no_grad():
        ops.layer_norm.out(x, out=torch.empty(2, 4, 5))  # (without grad mode: fine)


def test_out_overloads_and_running_stats_bump_the_version_autograd_checks(rng):
    # writing into a tensor autograd saved must fail its backward, as torch's own in-place ops do
    for write in (lambda t: ops.layer_norm.out(rand(rng, 2, 4, 5), out=t),
                  lambda t: ops.update_running_stats_(t, torch.ones(2, 4, 5), rand(rng, 2, 4, 5),
                                                      torch.ones(2, 4, 5), count=3)):
        a = rand(rng, 2, 4, 5).requires_grad_(True)
        y = a * 2
        z = y.sin()  # (saves y)
        with torch.no_grad():
            write(y.detach())  # (a detached view shares y's version counter)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward()


def test_activation_without_a_backward_op_refused_when_differentiated(rng):
    x = rand(rng, 2, 4, 5).requires_grad_(True)
    with pytest.raises(ValueError, match="activation 'tanh' has no backward op"):
        ops.layer_norm(x, activation="tanh")
    with torch.no_grad():
        assert ops.layer_norm(x, activation="tanh")[0].shape == x.shape


# ----------------------------------------------------------------------------------------------------
# no copies

@pytest.fixture
def received(monkeypatch):
    """The data pointers of the numpy arrays each simdnorm function receives, and of the tensors the
    per-call route hands the kernels."""
    seen = []

    def watch(module, attr):
        fn = getattr(module, attr)

        def spy(*args, _fn=fn, **kwargs):
            args_ = list(args) + list(kwargs.values())
            seen.append({a.__array_interface__["data"][0] for a in args_ if isinstance(a, np.ndarray)}
                        | {a.data_ptr() for a in args_ if isinstance(a, torch.Tensor)})
            return _fn(*args, **kwargs)

        monkeypatch.setattr(module, attr, spy)

    for attr in dir(_ops):
        if attr.startswith("_sn_"):
            watch(_ops, attr)
    for attr in ("_mvn", "_batch_norm", "_mvn_backward"):
        watch(_routes, attr)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_inputs_and_outputs_are_never_copied(rng, received, dtype):
    base = rand(rng, 4, 9, 6, 8, dtype=dtype)
    views = {"contiguous": base, "channels_last": base.contiguous(memory_format=torch.channels_last),
             "strided": base[:, ::2, 1:, :]}
    for label, x in views.items():
        c = x.shape[1]
        w, b = rand(rng, c, dtype=dtype), rand(rng, c, dtype=dtype)
        calls = [("batch_normalization", (x, w, b.abs() + 1, w, b)), ("layer_norm", (x, w[:1].expand(8))),
                 ("group_norm", (x, 1, w, b)), ("batch_normalization_training", (x, w, b))]
        for name, args in calls:
            received.clear()
            computed = _core.torch_kernel_calls()
            y = getattr(ops, name)(*args)
            y = y[0] if isinstance(y, tuple) else y
            if _core.torch_kernel_calls() > computed:  # (the op's C++ kernel: what it read and wrote)
                received.append(set(_core.torch_kernel_pointers()))
            assert len(received) == 1
            for a in args:
                if isinstance(a, torch.Tensor):
                    assert a.data_ptr() in received[0], f"{name} ({label}): an input was copied"
            assert y.data_ptr() in received[0], f"{name} ({label}): the output was not written in place"
            out = torch.full_like(x, float("nan"))
            received.clear()
            getattr(ops, name).out(*args, out=out)
            assert out.data_ptr() in received[0], f"{name}.out ({label}): out was not the array written"
            assert not torch.isnan(out).any()


def test_backward_through_autograd_copies_nothing(rng, received):
    # (a gradient in the input's layout: one laid out otherwise is put in it first, as torch.nn's
    # backward does; tests/test_torch_modules.py)
    x = rand(rng, 4, 6, 5, 5).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    w = rand(rng, 6).requires_grad_(True)
    received.clear()
    y = ops.group_norm(x, 3, w)[0]
    g = rand(rng, 4, 6, 5, 5).contiguous(memory_format=torch.channels_last)
    y.backward(g)
    assert len(received) == 2  # the forward, then the backward
    assert {x.data_ptr(), w.data_ptr(), g.data_ptr(), y.data_ptr()} <= received[0] | received[1]
    assert x.grad.data_ptr() in received[1] and x.grad.is_contiguous(memory_format=torch.channels_last)


# ----------------------------------------------------------------------------------------------------
# bfloat16 end to end

def test_bfloat16_forward_and_backward(rng):
    # bf16 data, float32 parameters (torch.nn's mixed precision): gradients against float64 autograd
    x = rand(rng, 3, 8, 4, 4, dtype=torch.bfloat16, loc=2.0).requires_grad_(True)
    w = rand(rng, 8, dtype=torch.float32).requires_grad_(True)
    b = rand(rng, 8, dtype=torch.float32).requires_grad_(True)
    g = rand(rng, 3, 8, 4, 4, dtype=torch.bfloat16)
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    for op, ref in ((lambda *a: ops.group_norm(a[0], 4, *a[1:])[0],
                     lambda *a: torch.nn.functional.group_norm(a[0], 4, *a[1:], eps=1e-5)),
                    (lambda *a: ops.batch_normalization_training(*a)[0],
                     lambda *a: torch.nn.functional.batch_norm(a[0], None, None, *a[1:], training=True, eps=1e-5))):
        for t in (x, w, b, x64, w64, b64):
            t.grad = None
        y = op(x, w, b)
        assert y.dtype == torch.bfloat16
        y.backward(g)
        y64 = ref(x64, w64, b64)
        y64.backward(g.double())
        assert_close(y, y64.detach().numpy(), torch.bfloat16, "output")
        assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
        for got, want, name in ((x.grad, x64.grad, "x"), (w.grad, w64.grad, "w"), (b.grad, b64.grad, "b")):
            err = (got.double() - want).abs().max() / want.abs().max()
            assert err < 3e-2, f"grad {name}: {err:.3g}"


# ----------------------------------------------------------------------------------------------------
# running statistics

def test_update_running_stats_as_torch_nn(rng):
    x = rand(rng, 5, 6, 3, 2, loc=1.0)
    for momentum in (0.1, 0.5):
        rm, rv = rand(rng, 6), rand(rng, 6, positive=True)
        trm, trv = rm.clone(), rv.clone()
        _, mean, var = ops.batch_normalization_training(x)
        nbt = torch.tensor(4)
        ops.update_running_stats_(rm, rv, mean, var, nbt, count=30, momentum=momentum)
        torch.nn.functional.batch_norm(x, trm, trv, training=True, momentum=momentum)
        assert int(nbt) == 5
        torch.testing.assert_close(rm, trm, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rv, trv, rtol=1e-6, atol=1e-6)
    # momentum=None: the cumulative average over num_batches_tracked, incremented first
    rm, rv, nbt = rand(rng, 6), rand(rng, 6, positive=True), torch.tensor(3)
    want_m = rm.double() * 3 / 4 + mean.double() / 4
    ops.update_running_stats_(rm, rv, mean, var, nbt, count=30, momentum=None)
    assert int(nbt) == 4
    torch.testing.assert_close(rm.double(), want_m, rtol=1e-6, atol=1e-7)
    # onnx: r = m r + (1 - m) batch, the population variance
    rm, rv = rand(rng, 6), rand(rng, 6, positive=True)
    want_v = 0.9 * rv.double() + 0.1 * var.double()
    ops.update_running_stats_(rm, rv, mean, var, count=30, momentum=0.9, momentum_convention="onnx")
    torch.testing.assert_close(rv.double(), want_v, rtol=1e-6, atol=1e-7)


def test_update_running_stats_refusals_leave_everything_untouched(rng):
    rm, rv, nbt = rand(rng, 6), rand(rng, 6, positive=True), torch.tensor(2)
    mean, var = rand(rng, 6), rand(rng, 6, positive=True)
    before = (rm.clone(), rv.clone())
    bad = [({"count": 1}, ValueError, "unbiased variance is undefined"),
           ({"count": 8, "momentum": 1.5}, ValueError, "momentum"),
           ({"count": 8, "momentum_convention": "keras"}, ValueError, "momentum_convention")]
    for kw, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            ops.update_running_stats_(rm, rv, mean, var, nbt, **kw)
    with pytest.raises(ValueError, match="shape"):
        ops.update_running_stats_(rm, rv, mean[:5], var, nbt, count=8)
    with pytest.raises(ValueError, match="num_batches_tracked"):
        ops.update_running_stats_(rm, rv, mean, var, count=8, momentum=None)
    with pytest.raises(TypeError, match="0-d integer tensor"):
        ops.update_running_stats_(rm, rv, mean, var, torch.tensor(2.0), count=8)
    for i in range(4):  # a buffer or statistic of another dtype, refused before the counter moves
        args = [rm, rv, mean, var]
        args[i] = args[i].to(torch.int32)
        with pytest.raises(TypeError, match="unsupported dtype int32"):
            ops.update_running_stats_(*args, nbt, count=8)
    assert int(nbt) == 2 and torch.equal(rm, before[0]) and torch.equal(rv, before[1])


# ----------------------------------------------------------------------------------------------------
# errors: TypeError / ValueError naming the problem, never a crash

def test_invalid_inputs_raise_clear_errors(rng):
    x = rand(rng, 2, 4, 5)
    with pytest.raises(TypeError, match="int64"):
        ops.layer_norm(torch.ones(2, 4, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match="float8_e4m3fn is not accepted"):
        ops.layer_norm(x.to(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="complex"):
        ops.rms_norm(torch.ones(2, 3, dtype=torch.complex64))
    with pytest.raises((ValueError, IndexError), match="axes"):
        ops.mean_variance_normalization(x, [5])
    with pytest.raises(ValueError, match="no_such"):
        ops.layer_norm(x, activation="no_such")
    with pytest.raises(ValueError, match="given without an activation"):
        ops.layer_norm(x, activation_params=[1.0])
    with pytest.raises(ValueError, match="2 values for 'leaky_relu', which takes 1"):
        ops.layer_norm(x, activation="leaky_relu", activation_params=[0.1, 0.2])
    with pytest.raises(ValueError, match="num_groups"):
        ops.group_norm(x, 3)
    with pytest.raises(ValueError, match="scale"):
        ops.batch_normalization(x, torch.zeros(4), torch.ones(4), torch.ones(3))
    with pytest.raises((TypeError, ValueError), match="out"):
        ops.layer_norm.out(x, out=torch.empty(2, 4, 4))
    with pytest.raises((TypeError, ValueError), match="out"):
        ops.layer_norm.out(x, out=torch.empty(2, 4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="grad_output"):
        ops.layer_norm_backward(x[:1], x, *ops.layer_norm(x)[1:])


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def test_a_tensor_on_another_device_is_refused(rng):
    # (a meta argument sends the call to the op's fake kernel, which must not hand back CPU tensors
    # it never computed)
    x, c = rand(rng, 2, 4, 3), rand(rng, 4, positive=True)
    w = rand(rng, 3)
    same = "Expected all tensors to be on the same device"
    calls = [lambda: ops.layer_norm(x, _meta(w)), lambda: ops.rms_norm(x, _meta(w)),
             lambda: ops.group_norm(x, 2, _meta(c)), lambda: ops.instance_norm(x, None, _meta(c)),
             lambda: ops.batch_normalization(x, c, _meta(c)), lambda: ops.batch_normalization_training(x, _meta(c)),
             lambda: ops.mean_variance_normalization(x, [0, 2], None, _meta(c).reshape(1, 4, 1)),
             lambda: ops.layer_norm.out(x, out=_meta(x)),
             lambda: ops.layer_norm_backward(x, x, *ops.layer_norm(x)[1:], _meta(w))]
    for call in calls:
        with pytest.raises(RuntimeError, match=same):
            call()
    rm, rv = torch.zeros(4), torch.ones(4)
    _, mean, var = ops.batch_normalization_training(x)
    with pytest.raises(RuntimeError, match=same):
        ops.update_running_stats_(_meta(rm), rv, mean, var, count=6)
    assert torch.equal(rv, torch.ones(4))


def test_out_overloads_refuse_an_out_that_cannot_hold_the_result(rng):
    x = rand(rng, 3, 4)
    base = torch.zeros(1, 4)
    with pytest.raises(ValueError, match=r"out: strides\[0\] is 0 with size 3"):
        ops.layer_norm.out(x, out=base.expand(3, 4))
    assert torch.equal(base, torch.zeros(1, 4))
    for call in (lambda o: ops.layer_norm.out(x, out=o),
                 lambda o: ops.batch_normalization.out(x, torch.zeros(4), torch.ones(4), channel_axis=-1, out=o)):
        with pytest.raises(ValueError, match="out: a torch tensor with the negative bit set"):
            call(torch._neg_view(torch.empty(3, 4)))


@pytest.mark.parametrize("case", ["running f16", "axis float", "num_groups bool", "momentum str", "axes tensor",
                                  "group divides", "no spatial dims"])
def test_plain_functions_refuse_alike_with_and_without_autograd(rng, case):
    # a tensor that requires grad goes through the op (autograd records it): the plain function's
    # own error all the same, and the running statistics untouched
    x0 = rand(rng, 6, 4, 5)
    rm, rv = torch.zeros(4, dtype=torch.float16), torch.ones(4, dtype=torch.float16)
    call = {
        "running f16": lambda x: simdnorm.batch_normalization_training(x, running_mean=rm, running_var=rv),
        "axis float": lambda x: simdnorm.layer_norm(x, axis=1.0),
        "num_groups bool": lambda x: simdnorm.group_norm(x, True),
        "momentum str": lambda x: simdnorm.batch_normalization_training(
            x, running_mean=torch.zeros(4), running_var=torch.ones(4), momentum="abc"),
        "axes tensor": lambda x: simdnorm.mean_variance_normalization(x, 1.5),
        "group divides": lambda x: simdnorm.group_norm(x, 3),
        "no spatial dims": lambda x: simdnorm.instance_norm(x[:, :, 0], channel_axis=-1),
    }[case]
    with pytest.raises(Exception) as plain:
        call(x0)
    with pytest.raises(type(plain.value), match=re.escape(str(plain.value))):
        call(x0.clone().requires_grad_())
    assert torch.equal(rm, torch.zeros(4, dtype=torch.float16)) and torch.equal(rv, torch.ones(4, dtype=torch.float16))


def test_a_sparse_tensor_is_a_type_error(rng):
    x = rand(rng, 3, 4)
    with pytest.raises(TypeError, match="input: a torch tensor of layout torch.sparse_coo"):
        simdnorm.layer_norm(x.to_sparse())
    with pytest.raises(TypeError, match="scale: a torch tensor of layout torch.sparse_coo"):
        simdnorm.layer_norm(x, torch.ones(4).to_sparse())


@pytest.mark.parametrize("call", [
    lambda t: torch.ops.simdnorm.layer_norm(t, axis=7),
    lambda t: torch.ops.simdnorm.rms_norm(t, axis=-4),
    lambda t: torch.ops.simdnorm.mean_variance_normalization(t, [0, 0]),
    lambda t: torch.ops.simdnorm.mean_variance_normalization(t, [1], epsilon=float("nan")),
    lambda t: torch.ops.simdnorm.group_norm(t, 2),
    lambda t: torch.ops.simdnorm.instance_norm(t, channel_axis=0),
    lambda t: torch.ops.simdnorm.batch_normalization(t, t.new_zeros(3), t.new_ones(3), epsilon=-1.0),
    lambda t: torch.ops.simdnorm.batch_normalization_training(t, channel_axis=5),
], ids=["layer-axis", "rms-axis", "mvn-twice", "mvn-nan-eps", "group-divide", "instance-axis0", "bn-eps",
        "bn-train-axis"])
def test_fake_kernels_refuse_what_the_op_refuses(call):
    """A trace or an export meets the op's error on its attributes (concrete shapes), not a program
    whose outputs' shapes are made up and which fails only when run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(ValueError) as eager:
        call(torch.randn(2, 3, 4))
    with FakeTensorMode(), pytest.raises(type(eager.value)) as fake:
        call(torch.empty(2, 3, 4))
    assert str(fake.value) == str(eager.value)


def test_export_of_an_invalid_call_raises_the_ops_error():
    class M(torch.nn.Module):
        def forward(self, t):
            return simdnorm.layer_norm(t, axis=7, return_stats=True)[1]

    with pytest.raises(simdnorm.DescriptorAxisError, match="axis 7 is out of range"):
        torch.export.export(M(), (torch.randn(2, 3, 4),))
