"""Fuzzer of the drop-in modules under autograd (simdnorm.torch.convert): each case trains a
converted torch.nn normalization module for a few steps and checks its output, its gradients
(input, weight, bias) and its state_dict against the same torch.nn module run in float64 on a
contiguous copy of the data (the float64 reference: torch.nn's own CPU kernels have been wrong on
some strided layouts, never on contiguous float64 data), and that it raises exactly where torch.nn
raises on the same tensor (the same exception class). Each case draws, independently: the module
(BatchNorm1d/2d/3d, LayerNorm, RMSNorm, GroupNorm, InstanceNorm1d/2d/3d) and its constructor
arguments (affine, track_running_stats, momentum None/0/1, eps, elementwise_affine, bias, groups),
the shape (unbatched and empty batches included), the data's dtype, mixed precision (16-bit data,
float32 module), the layout (channels last, permuted, steps, an odd storage offset, expanded dims
of stride 0), the values' offset and spread, train or eval, the number of steps, what requires
grad (the input, the parameters, nothing; no_grad), and the gradient's form (random, or a sum's
expanded ones); a fifth of the cases check the last step's forward-mode derivative (a dual input,
torch.autograd.forward_ad) in place of its gradients, and about one in seven calls the drop-in through
a torch.fx GraphModule (its call_module node). Case i of a seed is rebuilt from (seed, i) alone.

    python tests/torch_module_fuzz.py --seed N --cases 3000     # in child processes
    python tests/torch_module_fuzz.py --seed N --replay I       # one case here, traceback and all
"""
from __future__ import annotations

import copy
import sys

import numpy as np

import torch_fuzz

CLASSES = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LayerNorm", "RMSNorm", "GroupNorm",
           "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d")
# max |got - ref| / max(|ref|) allowed for each data dtype (16-bit: a few roundings of the result)
TOLERANCE = {"float32": 2e-5, "float64": 1e-9, "float16": 4e-3, "bfloat16": 3e-2}


def _pick(rng, options):
    return options[int(rng.integers(len(options)))]


def _module_and_shape(rng):
    """(class name, constructor args, kwargs, input shape)."""
    cls = _pick(rng, CLASSES)
    c = int(_pick(rng, (1, 2, 3, 4, 6, 8)))
    n = int(_pick(rng, (0, 1, 1, 2, 2, 3, 4))) if rng.random() < 0.9 else 2
    small = lambda: int(rng.integers(1, 6))  # noqa: E731
    if cls.startswith("BatchNorm") or cls.startswith("InstanceNorm"):
        kw = dict(eps=float(_pick(rng, (1e-5, 1e-3, 0.1))), momentum=_pick(rng, (0.1, None, 0.0, 1.0, 0.5)),
                  affine=bool(rng.random() < 0.7), track_running_stats=bool(rng.random() < 0.6))
        spatial = int(cls[-2])
        if cls == "BatchNorm1d":
            spatial = int(rng.integers(0, 2))
        lead = [] if cls.startswith("InstanceNorm") and rng.random() < 0.2 else [n]  # unbatched instance norm
        return cls, (c,), kw, lead + [c] + [small() for _ in range(spatial)]
    if cls == "GroupNorm":
        g = int(_pick(rng, [d for d in (1, 2, 3, 4, 6, 8) if c % d == 0]))
        kw = dict(eps=float(_pick(rng, (1e-5, 1e-3))), affine=bool(rng.random() < 0.7))
        return cls, (g, c), kw, [n, c] + [small() for _ in range(int(rng.integers(0, 3)))]
    norm = [small() for _ in range(int(rng.integers(1, 4)))]
    lead = [n if i == 0 else small() for i in range(int(rng.integers(0, 3)))]
    if cls == "LayerNorm":
        kw = dict(eps=float(_pick(rng, (1e-5, 1e-3))), elementwise_affine=bool(rng.random() < 0.8),
                  bias=bool(rng.random() < 0.7))
    else:
        kw = dict(eps=_pick(rng, (None, 1e-6, 1e-3)), elementwise_affine=bool(rng.random() < 0.8))
    return cls, (norm,), kw, lead + norm


def _laid_out(torch, rng, values, kind):
    """values in a layout of kind (a view of other memory: the same values, other strides)."""
    nd = values.dim()
    if kind == "perm" and nd > 1:
        perm = [int(p) for p in rng.permutation(nd)]
        leaf = values.permute(*perm).contiguous()
        return leaf.permute(*np.argsort(perm).tolist())
    if kind == "channels_last" and nd > 2:
        order = [0] + list(range(2, nd)) + [1]
        leaf = values.permute(*order).contiguous()
        return leaf.permute(*np.argsort(order).tolist())
    if kind == "steps" and nd > 0:
        d = int(rng.integers(nd))
        wide = list(values.shape)
        wide[d] *= 2
        leaf = torch.from_numpy(rng.standard_normal(wide)).to(values.dtype)
        index = tuple(slice(None, None, 2) if e == d else slice(None) for e in range(nd))
        with torch.no_grad():
            leaf[index] = values
        return leaf[index]
    if kind == "offset":
        leaf = torch.cat([values.new_zeros(1), values.reshape(-1)])
        return leaf[1:].view(values.shape)
    if kind == "expanded" and nd > 0:
        keep = [bool(rng.random() < 0.5) or s == 0 for s in values.shape]
        leaf = values[tuple(slice(None) if k else slice(0, 1) for k in keep)].contiguous()  # (values repeat)
        return leaf.expand(*values.shape)
    return values.contiguous()


def draw_case(torch, seed, index):
    """(description, run): run() raises AssertionError on a mismatch."""
    from torch import nn
    import torch.autograd.forward_ad as fwAD
    import simdnorm.torch as snt

    rng = np.random.default_rng([seed, index])
    cls, args, kw, shape = _module_and_shape(rng)
    dtype_name = _pick(rng, ("float32", "float32", "float16", "bfloat16", "float64"))
    dtype = getattr(torch, dtype_name)
    mixed = dtype_name in ("float16", "bfloat16") and rng.random() < 0.3  # float32 module, 16-bit data
    kind = _pick(rng, ("c", "c", "perm", "channels_last", "steps", "offset", "expanded"))
    loc, spread = _pick(rng, ((0.0, 1.0), (3.0, 2.0), (-20.0, 3.0), (300.0, 30.0), (1000.0, 10.0)))
    train = bool(rng.random() < 0.6)
    steps = int(rng.integers(1, 4))
    grad_mode = _pick(rng, ("input", "input", "params", "none", "no_grad"))
    frozen = bool(rng.random() < 0.2)  # parameters not requiring grad
    summed = bool(rng.random() < 0.25)  # the loss a sum: grad_output is expanded ones
    data_seed = int(rng.integers(2 ** 31))
    tangent = bool(rng.random() < 0.2)  # the last step's forward-mode derivative instead of its backward
    via_fx = bool(rng.random() < 0.15)  # the drop-in called by a torch.fx GraphModule (its call_module node)
    desc = (f"{seed}:{index} {cls}{args} {kw} shape={shape} {dtype_name}"
            f"{' (float32 module)' if mixed else ''} layout={kind} N({loc}, {spread}) "
            f"{'train' if train else 'eval'} steps={steps} grad={grad_mode}"
            f"{' frozen' if frozen else ''}{' summed' if summed else ''}{' tangent' if tangent else ''}"
            f"{' fx' if via_fx else ''}")

    def run():
        torch.manual_seed(data_seed)
        gen = np.random.default_rng(data_seed)
        base = getattr(nn, cls)(*args, **kw)
        with torch.no_grad():  # parameters and running statistics away from their initial values
            for name, t in list(base.named_parameters()) + list(base.named_buffers()):
                if t.dtype.is_floating_point:
                    v = torch.from_numpy(gen.standard_normal(tuple(t.shape)) * 0.5)
                    t.copy_(v.abs() + 0.5 if name == "running_var" else v + 1 if name == "weight" else v)
        module_dtype = torch.float32 if mixed else dtype
        ref_nn = copy.deepcopy(base).to(module_dtype).train(train)
        mine = snt.convert(copy.deepcopy(ref_nn))
        ref64 = copy.deepcopy(base).double().train(train)
        with torch.no_grad():  # the float64 reference holds the module's own (rounded) values
            for t64, t in zip(list(ref64.parameters()) + list(ref64.buffers()),
                              list(ref_nn.parameters()) + list(ref_nn.buffers())):
                t64.copy_(t)
        if cls == "RMSNorm" and kw["eps"] is None:  # the data's compute type's epsilon, not float64's
            ref64.eps = torch.finfo(torch.float64 if dtype_name == "float64" else torch.float32).eps
        for m in (mine, ref64):
            for p in m.parameters():
                p.requires_grad_(not frozen and grad_mode != "no_grad")
        xs = [torch.from_numpy(gen.standard_normal(shape) * spread + loc).to(dtype) for _ in range(steps)]
        x_last = _laid_out(torch, gen, xs[-1], kind)
        dy = torch.from_numpy(gen.standard_normal(shape)).to(dtype)
        # x's tangent in x's own layout (make_dual refuses to copy one into stride-0 dims)
        t = torch.from_numpy(gen.standard_normal(x_last.untyped_storage().nbytes() // x_last.element_size())).to(
            dtype).as_strided(x_last.shape, x_last.stride(), x_last.storage_offset()) if tangent else None

        # torch.nn in the same dtype and layout: where it raises, the drop-in must raise the same
        probe = copy.deepcopy(ref_nn)
        try:
            with torch.no_grad():
                for x in xs[:-1]:
                    probe(x)
                want = probe(x_last)
        except Exception as e:  # noqa: BLE001 - (torch.nn's own IndexError on empty instance norm batches too)
            try:
                for x in xs[:-1]:
                    mine(x)
                mine(x_last)
            except type(e):
                return
            raise AssertionError(f"torch.nn raises {type(e).__name__} ({e}); the drop-in does not")

        def forward_backward(m, x, call=None):
            """The module's steps (through call, when given), the last on x (a view requiring grad
            where the input's gradient is wanted: a leaf of its own, whatever its strides);
            (output, gradients, state_dict)."""
            call = m if call is None else call
            x = x.detach().requires_grad_(grad_mode == "input" and not tangent)
            with torch.set_grad_enabled(grad_mode != "no_grad"):
                for earlier in xs[:-1]:
                    call(earlier.to(x.dtype))
                if tangent:  # (the output's tangent is the one "gradient")
                    with fwAD.dual_level():
                        tx = t.to(x.dtype)
                        dual = fwAD.unpack_dual(call(fwAD.make_dual(x, tx if tx.stride() == x.stride() else
                                                                    tx.contiguous())))
                    state = {k: v.detach().clone() for k, v in m.state_dict().items()}
                    return dual.primal.detach(), () if dual.tangent is None else (dual.tangent.detach(),), state
                y = call(x)
            wrt = ([x] if grad_mode == "input" else []) + [p for p in m.parameters() if p.requires_grad]
            grads = ()
            if wrt and y.requires_grad:
                grads = torch.autograd.grad(y.sum() if summed else y, wrt, None if summed else dy.to(y.dtype))
            return y.detach(), grads, {k: v.detach().clone() for k, v in m.state_dict().items()}

        y, grads, state = forward_backward(mine, x_last, _fx_wrapped(torch, mine) if via_fx else None)
        y64, grads64, state64 = forward_backward(ref64, x_last.double().contiguous())

        assert y.shape == want.shape and y.dtype == want.dtype, \
            f"output {y.shape} {y.dtype}, torch.nn's {want.shape} {want.dtype}"
        # Errors are measured against each result's natural scale where the result itself is much
        # smaller (a constant group's output is its bias; a group of one or two elements has a
        # vanishing input gradient): the terms that cancel there carry the rounding. The kernels
        # normalize with the mean rounded to the compute type (float32; float64 for float64):
        # x - mean carries |x| u of its ulps.
        tol = TOLERANCE[dtype_name]
        w = getattr(ref64, "weight", None)
        w_max = max(1.0, float(w.detach().abs().max())) if w is not None and w.numel() else 1.0
        x64 = x_last.double()
        u_max = _inv_std_max(cls, kw, x64, ref64, train)
        x_max = float(x64.abs().max()) if x64.numel() else 0.0
        ulp = 2.0 ** -53 if dtype_name == "float64" else 2.0 ** -24  # the compute type's
        mean_ulps = 2 * x_max * u_max * ulp
        _close(y, y64, "output", tol, natural=w_max, extra=mean_ulps * w_max)
        assert len(grads) == len(grads64), f"{len(grads)} gradients, the reference {len(grads64)}"
        dy_max = (float(t.double().abs().max()) if t.numel() else 0.0) if tangent else 1.0 if summed else \
            float(dy.double().abs().max()) if dy.numel() else 0.0
        per_param = x64.numel() / max(1, w.numel()) if w is not None else 1.0
        for i, (g, g64) in enumerate(zip(grads, grads64)):
            assert g.shape == g64.shape, f"gradient {i}: shape {tuple(g.shape)}, the reference {tuple(g64.shape)}"
            if (grad_mode == "input" or tangent) and i == 0:  # (the input's gradient, or the output's tangent)
                natural = dy_max * w_max * u_max
                extra = natural * mean_ulps
            else:  # a sum of per_param terms dy * y (or dy) of random signs
                natural = dy_max * per_param ** 0.5
                extra = natural * per_param ** 0.5 * mean_ulps
            _close(g, g64, f"gradient {i}", max(tol, _tolerance(g)), natural, extra)
        assert state.keys() == state64.keys()
        for k in state:
            # (running statistics: a mean near 0 cancels terms of the data's spread; a constant
            # group's variance carries the rounding of x^2 terms)
            if state[k].dtype.is_floating_point:
                rounding = ulp * (x_max * x_max if "var" in k else x_max)
                _close(state[k], state64[k], k, _tolerance(state[k]), natural=spread * spread if "var" in k else spread,
                       extra=4 * rounding)
            else:
                assert torch.equal(state[k], state64[k]), f"{k}: {state[k]} vs {state64[k]}"

    return desc, run


def _fx_wrapped(torch, m):
    """A torch.fx GraphModule calling m: the drop-in's trace must be one call_module node."""
    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x)

    traced = torch.fx.symbolic_trace(Wrap())
    ops = [n.op for n in traced.graph.nodes]
    assert ops == ["placeholder", "call_module", "output"], f"torch.fx traced {ops}"
    return traced


def _tolerance(t):
    """TOLERANCE of a result's own dtype."""
    return TOLERANCE[str(t.dtype).split(".")[1]]


def _inv_std_max(cls, kw, x, module, train):
    """The largest 1 / std the module normalizes x's groups with (float64)."""
    import torch

    eps = kw.get("eps") or 1e-5
    running = getattr(module, "running_var", None)
    if not train and running is not None and (cls.startswith("BatchNorm") or cls.startswith("InstanceNorm")):
        return float(1.0 / torch.sqrt(running.min() + eps)) if running.numel() else 1.0
    if x.numel() == 0:
        return 1.0
    if cls.startswith("BatchNorm"):
        dims = [0] + list(range(2, x.dim()))
    elif cls.startswith("InstanceNorm"):
        dims = list(range(x.dim() - (int(cls[-2])), x.dim()))
    elif cls == "GroupNorm":
        x, dims = x.reshape(x.shape[0], module.num_groups, -1), [2]
    else:
        dims = list(range(x.dim() - len(module.normalized_shape), x.dim()))
    second = (x * x).mean(dims) if cls == "RMSNorm" else x.var(dims, unbiased=False)
    return float(1.0 / torch.sqrt(second.min() + eps))


def _close(got, want, what, tol, natural=0.0, extra=0.0):
    """max |got - want| <= tol * max(max |want|, natural) + extra, want rounded to got's dtype
    first (a result past the dtype's range is its infinity)."""
    got, want = got.double(), want.to(got.dtype).double()
    if got.numel() == 0:
        return
    finite = want.isfinite()
    assert _all_equal(want.isnan(), got.isnan()) and _all_equal(got[want.isinf()], want[want.isinf()]) \
        and _all_equal(finite, got.isfinite()), f"{what}: non-finite values differ"
    got, want = got[finite], want[finite]
    if want.numel() == 0:
        return
    scale = max(float(want.abs().max()), natural)
    err = float((got - want).abs().max())
    assert err <= tol * scale + extra, f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g} + {extra:.3g}"


def _all_equal(a, b):
    return bool((a == b).all())


def run_cases(seed, start, count):
    return torch_fuzz.run_cases(seed, start, count, draw=draw_case)


if __name__ == "__main__":
    sys.exit(torch_fuzz.main(module="torch_module_fuzz"))
