"""Fuzzer of the torch per-call route (simdnorm/torch/_routes.py): torch.ops.simdnorm forward ops,
the drop-in modules without autograd and the plain functions called with tensors hand the tensors
to the kernels themselves, with plans cached by shapes and dtypes. Each case draws, independently:
the op, rank 1..8, sizes (0 and 1 included), dtype, the input's layout (dims permuted, channels
last, steps, expanded dims of stride 0, an odd storage offset), each parameter's presence, form
(1-D or same rank with size-1 dims), dtype and layout, the attributes (axis, channel_axis,
groups, epsilon). The op (batch norm with given or batch statistics, layer, RMS, instance or
group norm) runs twice (a plan's miss, then its hit) and must give the bits of its .out overload,
which runs the plain function on numpy views (the path tests/fuzz_space.py checks against
float64), and so must the plain function called with the tensors; a module, the bits of the plain
function. Each op case runs its backward op too (the route's miss and hit) against the backward
function on numpy views. Of the op cases but batch norm training's, a quarter of the float32 and
float64 ones also check the forward-mode derivative (dual tensors, every tensor argument given a
tangent) against autograd's backward: <J t, g> = <t, J^T g>; a fifth run under vmap (two samples,
the batch dim anywhere, the parameters batched or not) against the op per sample; a quarter check
the op's torch-ops decomposition (what torch.onnx exports) against the op. Case i of a seed is
rebuilt from (seed, i) alone.

    python tests/torch_fuzz.py --seed N --cases 20000        # a long run, in child processes
    python tests/torch_fuzz.py --seed N --replay I           # one case here, traceback and all
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import traceback

import numpy as np

FLOATS = ("float32", "float16", "bfloat16", "float64")
OPS = ("layer_norm", "rms_norm", "instance_norm", "group_norm", "batch_normalization", "batch_normalization_training",
       "module")


def _pick(rng, options):
    return options[int(rng.integers(len(options)))]


def _layout(torch, rng, base_shape, dtype):
    """A tensor of logical shape base_shape in a drawn layout (fresh standard normal values)."""
    nd = len(base_shape)
    kind = _pick(rng, ("c", "c", "perm", "channels_last", "steps", "expanded", "offset"))
    if kind == "perm" and nd > 1:
        perm = [int(p) for p in rng.permutation(nd)]
        store = [base_shape[p] for p in perm]
        t = torch.from_numpy(rng.standard_normal(store)).to(dtype).permute(*np.argsort(perm).tolist())
    elif kind == "channels_last" and nd > 2:
        order = [0] + list(range(2, nd)) + [1]
        t = torch.from_numpy(rng.standard_normal([base_shape[p] for p in order])).to(dtype)
        t = t.permute(*np.argsort(order).tolist())
    elif kind == "steps":
        d = int(rng.integers(nd))
        wide = list(base_shape)
        wide[d] = 2 * wide[d]
        t = torch.from_numpy(rng.standard_normal(wide)).to(dtype)[tuple(
            slice(None, None, 2) if e == d else slice(None) for e in range(nd))]
    elif kind == "expanded":
        keep = [bool(rng.random() < 0.5) for _ in range(nd)]
        small = [s if k else 1 for s, k in zip(base_shape, keep)]
        t = torch.from_numpy(rng.standard_normal(small)).to(dtype).expand(*base_shape)
    elif kind == "offset":
        n = int(np.prod(base_shape))
        t = torch.from_numpy(rng.standard_normal(n + 1)).to(dtype)[1:].view(*base_shape)
    else:
        t = torch.from_numpy(rng.standard_normal(base_shape)).to(dtype)
    assert tuple(t.shape) == tuple(base_shape)
    return t


def draw_case(torch, seed, index):
    """(description, run) for case `index` of `seed`; run() raises AssertionError on a mismatch."""
    import simdnorm
    rng = np.random.default_rng([seed, index])
    dtype = getattr(torch, _pick(rng, FLOATS))
    op = _pick(rng, OPS)
    nd = int(rng.integers(3 if op in ("instance_norm", "module") else 2 if op == "group_norm" else 1, 9))
    shape = [1 if rng.random() < 0.15 else int(rng.integers(1, 5 if nd > 4 else 9)) for _ in range(nd)]
    if rng.random() < 0.03:
        shape[int(rng.integers(nd))] = 0
    pdt = _pick(rng, (dtype, torch.float32)) if dtype in (torch.float16, torch.bfloat16) else dtype
    eps = _pick(rng, (1e-5, 1e-3, 0.5))

    def param(pshape, dt=None):
        return _layout(torch, rng, tuple(pshape), dt or pdt) if rng.random() < 0.7 else None

    if op in ("layer_norm", "rms_norm"):
        axis = int(rng.integers(-nd, nd))
        tail = shape[axis % nd:]
        args_kw = {"axis": axis, "epsilon": eps}
        params = [param([s if rng.random() < 0.7 else 1 for s in tail])]
        if op == "layer_norm":
            params.append(param([s if rng.random() < 0.7 else 1 for s in tail]))
    elif op in ("instance_norm", "group_norm"):
        ca = _pick(rng, [1, -1] + list(range(2, nd)))
        args_kw = {"channel_axis": ca, "epsilon": eps}
        if op == "group_norm":
            g, k = int(rng.integers(1, 4)), int(rng.integers(1, 4))
            shape[ca % nd] = g * k
        params = [param([shape[ca % nd]]), param([shape[ca % nd]])]
    elif op == "batch_normalization":
        ca = _pick(rng, [1, -1, 0]) if nd > 1 else 0
        ca = ca if ca < nd else 0
        args_kw = {"channel_axis": ca, "epsilon": eps}
        c = shape[ca % nd]

        def bn_param(positive=False):
            p = _layout(torch, rng, (c,), pdt) if rng.random() < 0.6 else _layout(
                torch, rng, tuple(s if d == ca % nd or rng.random() < 0.3 else 1 for d, s in enumerate(shape)), pdt)
            return p.abs() + 0.5 if positive else p

        params = [bn_param(), bn_param(True), param([c]), param([c])]
        if params[2] is not None and params[2].dim() != 1 or params[3] is not None and params[3].dim() != 1:
            params[2:] = [None, None]
    elif op == "batch_normalization_training":  # the batch's statistics: scale and bias each (C,) or same-rank
        ca = _pick(rng, [1, -1, 0]) if nd > 1 else 0
        ca = ca if ca < nd else 0
        args_kw = {"channel_axis": ca, "epsilon": eps}
        c = shape[ca % nd]
        params = [_layout(torch, rng, (c,) if rng.random() < 0.6 else tuple(
            s if d == ca % nd else 1 for d, s in enumerate(shape)), pdt) if rng.random() < 0.7 else None
            for _ in range(2)]
    else:  # a drop-in module, eval or train, in torch.no_grad()
        return _module_case(torch, rng, dtype, pdt, shape, eps, seed, index)
    x = _layout(torch, rng, tuple(shape), dtype)
    pos = (x,) + tuple(params)
    if op == "group_norm":
        pos = (x, g) + tuple(params)
    dual = dtype in (torch.float32, torch.float64) and rng.random() < 0.25  # (drawn last: the rest as before)
    vmapped = rng.random() < 0.2
    vmap_at, vmap_params, vmap_apart = int(rng.integers(0, x.dim() + 1)), bool(rng.random() < 0.5), bool(
        rng.random() < 0.5)
    decomposed = rng.random() < 0.25
    if op == "batch_normalization_training":  # (its route's bits and its backward's only)
        dual = vmapped = decomposed = False
    desc = (f"case {seed}:{index}: {op} {dtype} shape={tuple(x.shape)} strides={x.stride()} {args_kw} "
            f"params={[None if p is None else (tuple(p.shape), p.stride(), p.dtype) for p in params]}"
            f"{' dual' if dual else ''}{f' vmap at {vmap_at}' + (' with params' if vmap_params else '') + (' apart' if vmap_apart else '') if vmapped else ''}"
            f"{' decomposed' if decomposed else ''}")

    def run():
        fn = getattr(torch.ops.simdnorm, op)
        for attempt in ("miss", "hit"):
            try:
                got = fn(*pos, **args_kw)
            except (TypeError, ValueError) as e:  # a refusal must be the plain function's own
                with_out = None
                try:
                    fn.out(*pos, **args_kw, out=torch.empty_like(x))
                except (TypeError, ValueError) as e2:
                    with_out = e2
                assert with_out is not None and type(with_out) is type(e), f"{attempt}: {e!r} vs {with_out!r}"
                return
            got = got if isinstance(got, tuple) else (got,)
            out = torch.full_like(x, float("nan"))
            rest = fn.out(*pos, **args_kw, out=out)
            want = (out,) + (rest if isinstance(rest, tuple) else () if rest is None else (rest,))
            assert len(got) == len(want), attempt
            for i, (a, b) in enumerate(zip(got, want)):
                assert a.dtype == b.dtype and a.shape == b.shape, f"{attempt}: result {i} {a.shape} vs {b.shape}"
                same = a.isnan() == b.isnan()
                assert bool(same.all()) and torch.equal(a.nan_to_num(), b.nan_to_num()), \
                    f"{attempt}: result {i} differs from the .out overload's"
            assert got[0].stride() == torch.empty_like(x).stride(), attempt
            # the plain function on the same tensors (its own route) gives the same bits
            if op == "batch_normalization":
                plain = (getattr(simdnorm, op)(*pos, **args_kw),)
            elif op == "batch_normalization_training":
                plain = getattr(simdnorm, op)(*pos, **args_kw)
            else:
                plain = tuple(t for t in getattr(simdnorm, op)(*pos, **args_kw, return_stats=True) if t is not None)
            for i, (a, b) in enumerate(zip(plain, want)):
                assert type(a) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape, f"{attempt}: plain {i}"
                assert bool((a.isnan() == b.isnan()).all()) and torch.equal(a.nan_to_num(), b.nan_to_num()), \
                    f"{attempt}: the plain function's result {i} differs from the .out overload's"
        _backward_matches_plain(torch, np.random.default_rng([seed, index, 2]), op, pos, args_kw, got)
        if dual and x.numel():
            _dual_matches_backward(torch, np.random.default_rng([seed, index, 1]), op, pos, args_kw)
        if vmapped:
            _vmap_matches_samples(torch, op, pos, args_kw, vmap_at, vmap_params, vmap_apart)
        if decomposed:
            _decomposition_matches(torch, op, pos, args_kw, got)

    return desc, run


# max |decomposition - op| over max(1, max |op|), by dtype: the decomposition computes in the
# compute type with torch's reductions, the kernels merge theirs in double; then one rounding
DECOMPOSITION_RTOL = {"float64": 1e-10, "float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def _decomposition_matches(torch, op, pos, kw, got):
    """The op's torch-ops decomposition (simdnorm/torch/_decompositions.py, what torch.onnx exports)
    gives the op's results."""
    from simdnorm.torch import _decompositions

    assert_decomposition_close(op, _decompositions.FORWARD[op](*pos, **kw), got, _centering_slack(torch, op, pos, kw, got))


def _centering_slack(torch, op, pos, kw, got):
    """What the decomposition's mean, reduced in the compute type, may add to the output: a few of
    that type's ulps of the largest |x|, times 1/std and the largest parameter. A group of equal
    values (zero strides) has the op's x - mean exactly 0 and the decomposition's an ulp or two
    (float32: 1e-4 of the output, with 1/std = 316)."""
    x = pos[0]
    if not isinstance(got, tuple) or len(got) != 3 or not x.numel():  # (batch_normalization: one tensor)
        return 0.0
    inv = got[2].double()
    if op == "batch_normalization_training":
        inv = torch.rsqrt(inv + kw.get("epsilon", 1e-5))
    params = [a for a in list(pos[1:]) + list(kw.values()) if isinstance(a, torch.Tensor) and a.numel()]
    largest = max([1.0] + [float(a.double().abs().max()) for a in params])
    eps = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
    amplified = float(inv.nan_to_num().max()) if inv.numel() else 1.0  # (no variance normalized)
    return 4 * eps * float(x.double().abs().max()) * amplified * largest


def assert_decomposition_close(what, decomposed, op_results, slack=0.0):
    """Each of a decomposition's results within DECOMPOSITION_RTOL of the op's (the first, the output,
    also within an absolute `slack`), NaN where the op's is NaN, of its shape and dtype."""
    want = decomposed if isinstance(decomposed, tuple) else (decomposed,)
    got = op_results if isinstance(op_results, tuple) else (op_results,)
    assert len(want) == len(got), f"{what}: the decomposition gives {len(want)} results, the op {len(got)}"
    for i, (d, g) in enumerate(zip(want, got)):
        assert d.shape == g.shape and d.dtype == g.dtype, \
            f"{what}: decomposition's result {i}: {tuple(d.shape)} {d.dtype}, the op's {tuple(g.shape)} {g.dtype}"
        if not g.numel():
            continue
        dd, gd = d.double(), g.double()
        assert bool((dd.isnan() == gd.isnan()).all()), f"{what}: decomposition's result {i}: NaNs differ"
        scale = max(1.0, float(gd.nan_to_num().abs().max()))
        err = float((dd - gd).nan_to_num().abs().max()) / scale
        tol = DECOMPOSITION_RTOL[str(g.dtype).replace("torch.", "")] + (slack / scale if i == 0 else 0.0)
        assert err <= tol, f"{what}: decomposition's result {i}: max error {err:.3g} of max(1, the largest)"


def _vmap_matches_samples(torch, op, pos, kw, at, params, apart):
    """vmap of the op (its rule: one batched call) over two samples against the op per sample, the
    batch dim at `at`: apart, the second sample 1 + the first (a new tensor); else both the input
    itself, a stride-0 batch dim over its drawn layout; with params, the parameters batched too."""
    import warnings

    fn = getattr(torch.ops.simdnorm, op)

    def two(t, d, k):  # samples t and a * t + c in one tensor, batch dim at d
        both = torch.stack([t, t * k[0] + k[1]]) if t.numel() else t.expand(2, *t.shape)
        return both.movedim(0, d)

    x = pos[0]
    xb = two(x, at, (1.0, 1.0)) if apart else x.unsqueeze(at).expand(*x.shape[:at], 2, *x.shape[at:])
    in_dims = [at] + [0 if params and isinstance(a, torch.Tensor) else None for a in pos[1:]]
    args = [xb] + [two(a, 0, (0.75, 0.25)) if d == 0 else a for a, d in zip(pos[1:], in_dims[1:])]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = torch.func.vmap(lambda *a: fn(*a, **kw), in_dims=tuple(in_dims))(*args)
    except (TypeError, ValueError) as e:  # a refusal: the per-sample call's own
        try:
            fn(*[a.select(d, 0) if d is not None else a for a, d in zip(args, in_dims)], **kw)
        except (TypeError, ValueError) as e2:
            assert type(e2) is type(e), f"vmap: {e!r} vs the sample's {e2!r}"
            return
        raise
    rows = [fn(*[a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)], **kw) for i in range(2)]
    got = got if isinstance(got, tuple) else (got,)
    rows = [r if isinstance(r, tuple) else (r,) for r in rows]
    tol = 1e-12 if x.dtype == torch.float64 else 2e-6 if x.dtype == torch.float32 else 2e-2
    for k, g in enumerate(got):
        want = torch.stack([r[k] for r in rows])
        assert g.shape == want.shape and g.dtype == want.dtype, f"vmap result {k}: {g.shape} vs {want.shape}"
        if want.numel():
            gd, wd = g.double(), want.double()
            assert bool((gd.isnan() == wd.isnan()).all()), f"vmap result {k}: NaNs differ"
            scale = max(float(wd.nan_to_num().abs().max()), 1e-300)
            err = float((gd - wd).nan_to_num().abs().max()) / scale
            assert err <= tol, f"vmap result {k}: max error {err:.3g} of the largest"


def _backward_matches_plain(torch, rng, op, pos, kw, got):
    """The forward op's backward op (its statistics, a grad_output in a drawn layout, each gradient
    asked for or not, batch norm's training form or not), twice (the route's miss, then its hit),
    gives the bits of simdnorm's backward function on numpy views of the same tensors."""
    import simdnorm
    from simdnorm.torch._ops import _as_numpy

    x = pos[0]
    go = _layout(torch, rng, tuple(x.shape), x.dtype)
    params = [p for p in pos[1:] if isinstance(p, torch.Tensor) or p is None]
    if op == "batch_normalization":
        mean, var, scale, bias = params
        args, names = (go, x, mean, var, scale, bias), ("scale", "bias")
        kw = dict(kw, training=bool(rng.random() < 0.5))
    elif op == "batch_normalization_training":
        args, names = (go, x, got[1], got[2], *params), ("scale", "bias")
        kw = dict(kw, training=bool(rng.random() < 0.8))
    elif op == "rms_norm":
        args, names = (go, x, got[1], params[0]), ("scale",)
    elif op == "group_norm":
        args, names = (go, x, pos[1], got[1], got[2], *params), ("scale", "bias")
    else:
        args, names = (go, x, got[1], got[2], *params), ("scale", "bias")
    present = dict(zip(names, [a for a in args if a is None or isinstance(a, torch.Tensor)][-len(names):]))
    flags = {"grad_input": bool(rng.random() < 0.8)}
    for n in names:
        flags["grad_" + n] = _pick(rng, (None, False) + ((True,) if present[n] is not None else ()))
    name = "batch_normalization_backward" if op.startswith("batch_normalization") else op + "_backward"
    np_args = [_as_numpy(a) if isinstance(a, torch.Tensor) else a for a in args]
    # (into what the op writes, torch.empty_like(x): the sums' order follows the operands' layouts)
    out = {"out": _as_numpy(torch.empty_like(x))} if flags["grad_input"] else {}
    try:
        want = getattr(simdnorm, name)(*np_args, **kw, **flags, **out)
    except (TypeError, ValueError) as e:  # (batch norm's statistics: the backward takes fewer shapes)
        for attempt in ("miss", "hit"):
            try:
                getattr(torch.ops.simdnorm, name)(*args, **kw, **flags)
            except (TypeError, ValueError) as e2:
                assert type(e2) is type(e), f"backward {attempt}: {e2!r} vs {e!r}"
            else:
                raise AssertionError(f"backward {attempt}: the op took what simdnorm.{name} refused: {e!r}")
        return
    for attempt in ("miss", "hit"):
        res = getattr(torch.ops.simdnorm, name)(*args, **kw, **flags)
        for i, (a, b) in enumerate(zip(res, want)):
            if b is None:
                assert a.numel() == 0, f"backward {attempt}: gradient {i} was not asked for"
                continue
            b = torch.from_numpy(b.view(np.int16)).view(torch.bfloat16) if a.dtype == torch.bfloat16 else \
                torch.from_numpy(np.ascontiguousarray(b))
            assert a.dtype == b.dtype and a.shape == b.shape, f"backward {attempt}: gradient {i} {a.shape} vs {b.shape}"
            assert bool((a.isnan() == b.isnan()).all()) and torch.equal(a.nan_to_num(), b.nan_to_num()), \
                f"backward {attempt}: gradient {i} {flags} differs from simdnorm.{name}'s"


def _dual_matches_backward(torch, rng, op, pos, kw):
    """The forward-mode derivative (dual tensors) against the backward (autograd) by the identity
    <J t, g> = <t, J^T g>, every tensor argument given a tangent in its own layout (stride 0 too)."""
    import torch.autograd.forward_ad as fwAD

    fn = getattr(torch.ops.simdnorm, op)

    def like(t):  # values in t's own layout, over fresh memory
        n = t.untyped_storage().nbytes() // t.element_size()
        return torch.from_numpy(rng.standard_normal(n)).to(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    which = [i for i, a in enumerate(pos) if isinstance(a, torch.Tensor)]
    tangents = {i: like(pos[i]) for i in which}
    with fwAD.dual_level():
        args = [fwAD.make_dual(a, tangents[i]) if i in tangents else a for i, a in enumerate(pos)]
        y = fn(*args, **kw)
        jt = fwAD.unpack_dual(y[0] if isinstance(y, tuple) else y).tangent
    leaves = [a.detach().requires_grad_(True) if i in tangents else a for i, a in enumerate(pos)]
    y = fn(*leaves, **kw)
    # (the natural scale: |t_x| |g| u w, u the largest 1 / std: groups of one element, whose J is 0,
    # carry the rounding of x - mean times u)
    if isinstance(y, tuple):
        u_max = float(y[-1].detach().double().max())
    else:
        u_max = float((pos[2].double() + kw["epsilon"]).rsqrt().max())
    scale_arg = pos[3] if op == "batch_normalization" else next(
        (a for a in pos[1:] if isinstance(a, torch.Tensor)), None)
    w_max = max(1.0, float(scale_arg.double().abs().max())) if scale_arg is not None else 1.0
    y = y[0] if isinstance(y, tuple) else y
    g = torch.from_numpy(rng.standard_normal(tuple(y.shape))).to(y.dtype)
    grads = torch.autograd.grad(y, [leaves[i] for i in which], g, allow_unused=True)
    lhs = (jt.double() * g.double())
    rhs = [tangents[i].double() * (0 if gr is None else gr.double()) for i, gr in zip(which, grads)]
    got, want = float(lhs.sum()), sum(float(r.sum()) for r in rhs)
    natural = float((tangents[0].double().abs() * g.double().abs()).sum()) * u_max * w_max
    scale = float(lhs.abs().sum()) + sum(float(r.abs().sum()) for r in rhs) + natural
    tol = 1e-10 if y.dtype == torch.float64 else 2e-5
    assert abs(got - want) <= tol * scale, f"<J t, g> {got:.9g} vs <t, J^T g> {want:.9g} (scale {scale:.3g})"


def _module_case(torch, rng, dtype, pdt, shape, eps, seed, index):
    import simdnorm
    import simdnorm.torch as snt
    nn = torch.nn
    nd = len(shape)
    kind = _pick(rng, ("BatchNorm", "LayerNorm", "RMSNorm", "GroupNorm", "InstanceNorm"))
    c = shape[1]
    if kind == "BatchNorm":
        cls = {3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}.get(nd)
        if cls is None:
            shape, cls = shape[:4], nn.BatchNorm2d
        m = cls(c, eps=eps, affine=bool(rng.random() < 0.8)).eval()
    elif kind == "LayerNorm":
        k = int(rng.integers(1, nd + 1))
        m = nn.LayerNorm(shape[nd - k:], eps=eps, elementwise_affine=bool(rng.random() < 0.8))
    elif kind == "RMSNorm":
        k = int(rng.integers(1, nd + 1))
        m = nn.RMSNorm(shape[nd - k:], eps=eps)
    elif kind == "GroupNorm":
        g = int(rng.integers(1, 4))
        shape[1] = g * int(rng.integers(1, 4))
        m = nn.GroupNorm(g, shape[1], eps=eps, affine=bool(rng.random() < 0.8))
    else:
        shape = shape[:5]
        cls = {3: nn.InstanceNorm1d, 4: nn.InstanceNorm2d, 5: nn.InstanceNorm3d}[len(shape)]
        m = cls(shape[1], eps=eps, affine=bool(rng.random() < 0.7))
    with torch.no_grad():
        for p in list(m.parameters()) + [b for b in m.buffers() if b.dtype.is_floating_point]:
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape))).abs() + 0.5)
    ref = __import__("copy").deepcopy(m).to(pdt)  # torch.nn's own: what a refusal must match
    m = snt.convert(m).to(pdt)
    x = _layout(torch, rng, tuple(shape), dtype)
    desc = f"case {seed}:{index}: module {type(m).__name__} {dtype} shape={tuple(x.shape)} strides={x.stride()}"

    def np_of(t):
        if t is None:
            return None
        t = t.detach()
        if t.dtype == torch.bfloat16:
            import ml_dtypes
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    def plain():
        """The plain function into an output laid out as the module's (torch.empty_like(x): where
        x has zero strides, numpy's empty_like orders the dims otherwise, and the kernels' order of
        summation follows the layout)."""
        xs, w, b = np_of(x), np_of(getattr(m, "weight", None)), np_of(getattr(m, "bias", None))
        out = np_of(torch.empty_like(x))
        if kind == "BatchNorm":
            return simdnorm.batch_normalization(xs, np_of(m.running_mean), np_of(m.running_var), w, b, epsilon=eps,
                                                out=out)
        if kind == "LayerNorm":
            return simdnorm.layer_norm(xs, w, b, axis=-len(m.normalized_shape), epsilon=eps, out=out)
        if kind == "RMSNorm":
            return simdnorm.rms_norm(xs, w, axis=-len(m.normalized_shape), epsilon=eps, out=out)
        if kind == "GroupNorm":
            return simdnorm.group_norm(xs, m.num_groups, w, b, epsilon=eps, out=out)
        return simdnorm.instance_norm(xs, w, b, epsilon=eps, out=out)

    def run():
        if x.numel() == 0:
            return  # (torch.nn's own forward: another path)
        for attempt in ("miss", "hit"):
            with torch.no_grad():
                try:
                    y = m(x)
                except Exception as e:  # noqa: BLE001 - torch.nn's own refusal, passed on
                    try:
                        ref(x)
                    except Exception as e2:  # noqa: BLE001
                        assert type(e2) is type(e), f"{attempt}: {e!r}, torch.nn's {e2!r}"
                        return
                    raise
            want = plain()
            got = np_of(y)
            assert got.shape == want.shape and got.dtype == want.dtype, attempt
            assert np.array_equal(got, want, equal_nan=True), f"{attempt}: differs from the plain function"

    return desc, run


def run_cases(seed, start, count, draw=None):
    """Run cases [start, start + count) of draw (this fuzzer's draw_case by default) here; print
    FAIL lines; return the number of failures."""
    import torch
    import simdnorm.torch  # noqa: F401 - registers the ops

    torch.set_num_threads(1)
    failures = 0
    for i in range(start, start + count):
        desc, run = (draw or draw_case)(torch, seed, i)
        print(f"@@ START {i}", flush=True)
        try:
            run()
        except Exception as e:  # noqa: BLE001 - each failure reported, the run goes on
            failures += 1
            print(f"@@ FAIL {desc}: {type(e).__name__}: {e}", flush=True)
    return failures


def run_in_children(seed, cases, batch=500, timeout=600, module="torch_fuzz"):
    """Cases in child processes of `batch` each (module's run_cases: this fuzzer's or another's):
    a child that dies fails the case it was running and the rest of its batch goes to the next
    child. Returns (failure lines, crash lines)."""
    here = os.path.dirname(os.path.abspath(__file__))
    fails, crashes = [], []
    start, end = 0, cases
    while start < end:
        count = min(batch, end - start)
        code = f"import sys; sys.path.insert(0, {here!r}); import {module}; {module}.run_cases({seed}, {start}, {count})"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
        lines = r.stdout.splitlines()
        fails += [ln for ln in lines if ln.startswith("@@ FAIL")]
        started = [int(ln.split()[2]) for ln in lines if ln.startswith("@@ START")]
        if r.returncode != 0:
            last = started[-1] if started else start
            crashes.append(f"case {seed}:{last} crashed (exit {r.returncode}): {r.stderr[-2000:]}")
            start = last + 1
        else:
            start += count
    return fails, crashes


def main(argv=None, module="torch_fuzz"):
    """The command line of this fuzzer, or of another with the same draw_case (module's)."""
    fuzzer = importlib.import_module(module)
    ap = argparse.ArgumentParser(description=fuzzer.__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--replay", type=int)
    a = ap.parse_args(argv)
    if a.replay is not None:
        import torch
        import simdnorm.torch  # noqa: F401
        desc, run = fuzzer.draw_case(torch, a.seed, a.replay)
        print(desc)
        try:
            run()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            return 1
        print("ok")
        return 0
    fails, crashes = run_in_children(a.seed, a.cases, module=module)
    for line in fails + crashes:
        print(line)
    print(f"{a.cases} cases, seed {a.seed}: {len(crashes)} crashed, {len(fails)} failed")
    return 1 if fails or crashes else 0


if __name__ == "__main__":
    sys.exit(main())
