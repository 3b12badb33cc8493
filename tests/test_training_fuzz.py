"""Fuzzer of the training ops (SPEC §9) over the input space as tests/fuzz_space.py draws it, each
case in a child process so that a crash is a reported case, not a dead test run.

A case is drawn from numpy's Generator seeded with (seed, index) alone, each axis independently:
the op (batch_normalization_training, batch_normalization_backward with training True and False,
mean_variance_normalization_backward and the four conveniences' backward ops), rank 1-8 where the
op allows it, sizes (now and then 0, now and then big enough for the thread pool to split), the
dtype, the layout of every array (tests/fuzz_space.draw_layout: any axis order, steps of either
sign, zero strides for inputs, odd byte strides, any byte offset), parameter shapes by every rule
(1-D or same-rank for batch norm, numpy broadcasting for MVN and layer/RMS norm), parameter dtypes
(input or float32), the activation, which gradients are asked for, out= (new or a poisoned region),
running statistics and their convention, the data's location and scale, the thread count, and (the
ops with a descriptor) the function or the operator compiled from its descriptor. Every array is a
strided view inside one poisoned arena (tests/fuzz_harness.Arena); after the call no byte outside
out (and the running statistics) may have changed, and every result must match the float64
reference (tests/training_reference.py) within its tolerance. The statistics a
backward op takes are the reference's, rounded to the compute dtype.

    python tests/test_training_fuzz.py --seed S --cases 5000 --jobs 2    # a long run
    python tests/test_training_fuzz.py --seed S --replay I                # case I here, with its traceback

Environment for the pytest run: SIMDNORM_TRAINING_FUZZ_SEED (default: a fresh random seed, printed
and named in a failure), SIMDNORM_TRAINING_FUZZ_CASES (default CI_CASES).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
import traceback

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np

CI_CASES = 2000
TAG = "@@tfuzz "
OPS = ("bn_training", "batch_norm", "batch_norm_eval", "mvn", "layer_norm", "rms_norm", "instance_norm",
       "group_norm")
ACTS = [None, None, "relu", "leaky_relu", "leaky_relu0.3", "silu", "gelu"]


# ----------------------------------------------------------------------------------------------
# drawing a case (numpy only: the parent draws to describe a failure)
# ----------------------------------------------------------------------------------------------


# Now and then data whose inv_std squared leaves the compute type's range (test_training.py::
# test_extreme_magnitudes), for the ops given inv_std (batch norm's backward takes the variance,
# which float32 cannot hold at such spreads; float16 cannot hold the data).
INV_STD_OPS = ("mvn", "layer_norm", "rms_norm", "instance_norm", "group_norm")
COMPILED = ("bn_training", "batch_norm", "batch_norm_eval", "mvn")  # ops with a descriptor to compile


def draw_case(seed: int, index: int) -> dict:
    from fuzz_harness import DATA_KINDS
    from fuzz_space import _pick, draw_axes, draw_keep, draw_layout, draw_sb_shape, draw_shape
    from reference import DTYPES

    rng = np.random.default_rng([seed, index, 41])
    op = _pick(rng, OPS)
    lo = {"instance_norm": 3, "group_norm": 2}.get(op, 1)
    nd = int(rng.integers(lo, 9))
    shape = list(draw_shape(rng, nd))
    c = dict(op=op, dtype=np.dtype(_pick(rng, DTYPES)).name, params={}, kw={})
    act = _pick(rng, ACTS + (["tanh", "hard_swish"] if op == "bn_training" else []))
    c["act"] = act
    pdt = lambda: _pick(rng, ["input", "input", "float32"])  # noqa: E731
    if op in ("bn_training", "batch_norm", "batch_norm_eval"):
        ca = int(rng.integers(-nd, nd)) if nd > 1 else _pick(rng, [0, -1, 1])
        c["kw"]["channel_axis"] = ca
        rule = "same_rank" if nd == 1 else _pick(rng, ["1d", "1d", "same_rank"])
        keep = draw_keep(rng, nd, ca % nd)
        pshape = (shape[ca % nd],) if rule == "1d" else tuple(s if k else 1 for s, k in zip(shape, keep))
        present = [n for n in ("scale", "bias") if rng.random() < 0.7]
        if nd == 1 and not present:
            present = ["scale"]
        for n in present:
            c["params"][n] = (pshape, pdt(), draw_layout(rng, len(pshape)))
        c["stat_shape"] = pshape if (present and rule == "same_rank") else (shape[ca % nd],)
        if rng.random() < 0.4:
            fshape = draw_sb_shape(rng, shape)
            c["params"]["fused_add"] = (fshape, pdt(), draw_layout(rng, len(fshape)))
        if op == "bn_training" and rng.random() < 0.5:
            conv = _pick(rng, ["pytorch", "pytorch", "onnx"])
            mom = _pick(rng, [None, 0.1, 0.3] + (["cumulative"] if conv == "pytorch" else []))
            c["running"] = dict(convention=conv, momentum=mom, dtype=_pick(rng, ["float32", "float64", "input"]),
                                nbt=int(rng.integers(1, 6)), layout=draw_layout(rng, len(c["stat_shape"]),
                                                                                allow_zero=False))
        c["epsilon"] = _pick(rng, [1e-5, 1e-3, 0.5])
    elif op == "mvn":
        c["kw"]["axes"], c["norm_axes"] = draw_axes(rng, nd)
        for n in ("scale", "bias"):
            if rng.random() < 0.6:
                ps = draw_sb_shape(rng, shape)
                c["params"][n] = (ps, pdt(), draw_layout(rng, len(ps)))
        c["kw"]["normalize_mean"] = bool(rng.random() < 0.6)
        c["kw"]["normalize_variance"] = bool(rng.random() < 0.75)
        c["kw"]["epsilon_mode"] = _pick(rng, ["inside", "outside"])
        c["epsilon"] = _pick(rng, [1e-5, 1e-3, 0.5])
    elif op in ("layer_norm", "rms_norm"):
        axis = _pick(rng, [0, -nd]) if rng.random() < 0.3 else int(rng.integers(-nd, nd))
        c["kw"]["axis"] = axis
        a = axis % nd
        for n in ("scale",) if op == "rms_norm" else ("scale", "bias"):
            if rng.random() < 0.7:
                r = rng.random()
                ps = tuple(shape[a:]) if r < 0.5 else draw_sb_shape(rng, shape[a:])
                c["params"][n] = (ps, pdt(), draw_layout(rng, len(ps)))
        c["epsilon"] = _pick(rng, [1e-5, 1e-3, 0.5])
    else:
        ca = _pick(rng, [1, -1] + list(range(2, nd)))
        if rng.random() < 0.5:
            ca = ca - nd if ca > 0 else ca + nd
        c["kw"]["channel_axis"] = ca
        if op == "group_norm":
            g, k = int(rng.integers(1, 5)), int(rng.integers(1, 4))
            shape[ca % nd] = g * k
            c["kw"]["num_groups"] = g
        for n in ("scale", "bias"):
            if rng.random() < 0.7:
                c["params"][n] = ((shape[ca % nd],), pdt(), draw_layout(rng, 1))
        c["epsilon"] = _pick(rng, [1e-5, 1e-3, 0.5])
    c["shape"] = tuple(shape)
    c["x_layout"] = draw_layout(rng, nd)
    c["dy_layout"] = draw_layout(rng, nd)
    c["stats_layout"] = draw_layout(rng, nd, allow_zero=False)  # group norm: redrawn for (N, G) below
    c["stats1_layout"] = draw_layout(rng, 1, allow_zero=False)
    c["stats2_layout"] = draw_layout(rng, 2, allow_zero=False)
    c["out_kind"] = _pick(rng, ["new", "separate", "separate"] + (["in_place"] if op == "bn_training" else []))
    c["out_layout"] = draw_layout(rng, nd, allow_zero=False)
    c["flags"] = dict(grad_input=bool(rng.random() < 0.85),
                      grad_scale=_pick(rng, [None, None, True, False]),
                      grad_bias=_pick(rng, [None, None, True, False]))
    c["data"] = _pick(rng, DATA_KINDS)
    if op in INV_STD_OPS and c["dtype"] != "float16" and rng.random() < 0.08:
        c["data"] = (0.0, 1e170 if c["dtype"] == "float64" else 1e25)
    c["threads"] = _pick(rng, [1, 2, 2, 3])
    c["seed"] = int(rng.integers(0, 2 ** 32))
    c["gap"] = _pick(rng, [0, 1, 7, 16, 64])
    # the op compiled from its descriptor (the ops that have one) instead of the function
    c["compiled"] = op in COMPILED and bool(rng.random() < 0.2)
    return c


def describe(c) -> str:
    skip = {"seed", "gap"}
    return ", ".join(f"{k}={v!r}" for k, v in c.items() if k not in skip)


# ----------------------------------------------------------------------------------------------
# running a case
# ----------------------------------------------------------------------------------------------


def _values(rng, shape, dtype, kind):
    if kind == "scale":
        v = rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    elif kind == "bias":
        v = rng.normal(0.0, 1.0, size=shape)
    elif kind == "dy":
        v = rng.normal(0.0, 1.0, size=shape)
    elif kind == "running_var":
        v = rng.uniform(0.5, 2.0, size=shape)
    else:
        loc, sc = kind
        v = rng.normal(loc, sc, size=shape)
    v = np.where(np.abs(v) < 1e-3, 1e-3 + np.abs(v), v)
    return np.asarray(v).astype(dtype)


def execute(c):
    """Run case c in this process; raise AssertionError on a wrong result."""
    import simdnorm
    from cases import act_arg
    from fuzz_harness import Arena, fill
    from reference import BF16, assert_like_empty_like, check_close, compute_dtype, f64
    from training_reference import Problem, bn_reduced_axes, bn_training_ref, check_grads, quiet, running_update_ref

    op, shape = c["op"], c["shape"]
    dtype = BF16 if c["dtype"] == "bfloat16" else np.dtype(c["dtype"])
    ct = compute_dtype(dtype)
    nd = len(shape)
    act = c["act"]
    params = None
    if act == "leaky_relu0.3":
        act, params = "leaky_relu", {"alpha": 0.3}
    rng = np.random.default_rng(c["seed"])
    arena = Arena()
    arena.add("x", shape, dtype, c["x_layout"], c["gap"])
    if op != "bn_training":
        arena.add("dy", shape, dtype, c["dy_layout"], c["gap"])
    pd = {}
    for n, (ps, pdt, lay) in c["params"].items():
        pd[n] = np.dtype(dtype if pdt == "input" else np.float32)
        arena.add(n, ps, pd[n], lay, c["gap"])
    kw = dict(c["kw"])
    eps = c["epsilon"]
    # the statistics a backward op takes (reference values, compute dtype), placed in the arena
    stat_names = []
    if op in ("batch_norm", "batch_norm_eval"):
        ss = c["stat_shape"]
        stat_names = [("mean", ss), ("variance", ss)]
    elif op in ("mvn", "layer_norm", "rms_norm", "instance_norm"):
        if op == "mvn":
            red = c["norm_axes"]
        elif op in ("layer_norm", "rms_norm"):
            red = tuple(range(kw["axis"] % nd, nd))
        else:
            cax = kw["channel_axis"] % nd
            red = tuple(d for d in range(1, nd) if d != cax)
        kept = tuple(1 if d in red else s for d, s in enumerate(shape))
        nm = kw.get("normalize_mean", True) and op != "rms_norm"
        nv = kw.get("normalize_variance", True)
        stat_names = ([("mean", kept)] if nm else []) + ([("inv", kept)] if nv else [])
    elif op == "group_norm":
        stat_names = [("mean", (shape[0], kw["num_groups"])), ("inv", (shape[0], kw["num_groups"]))]
    for n, ss in stat_names:
        lay = {1: c["stats1_layout"], 2: c["stats2_layout"]}.get(len(ss)) if len(ss) != nd else c["stats_layout"]
        if lay is not None and len(lay.perm) != len(ss):
            lay = None
        arena.add(n, ss, ct, lay, c["gap"])
    run = c.get("running")
    if run is not None:
        rdt = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64), "input": dtype}[run["dtype"]]
        for n in ("rm", "rv"):
            arena.add(n, c["stat_shape"], rdt, run["layout"], c["gap"])
    x_has_zero = c["x_layout"] is not None and any(c["x_layout"].zero)
    out_kind = c["out_kind"]
    if out_kind == "in_place" and x_has_zero:
        out_kind = "separate"
    if out_kind == "separate":
        arena.add("out", shape, dtype, c["out_layout"], c["gap"])
    views = arena.build()
    x = views["x"]
    x0 = fill(x, _values(rng, shape, dtype, c["data"]))
    dy0 = fill(views["dy"], _values(rng, shape, dtype, "dy")) if "dy" in views else None
    p0 = {n: fill(views[n], _values(rng, views[n].shape, pd[n], "scale" if n == "scale" else "bias"))
          for n in c["params"]}
    if run is not None:
        rm0 = fill(views["rm"], _values(rng, c["stat_shape"], views["rm"].dtype, "bias"))
        rv0 = fill(views["rv"], _values(rng, c["stat_shape"], views["rv"].dtype, "running_var"))
    problem_op = "batch_norm" if op == "bn_training" else op
    prob = Problem(problem_op, x0, p0.get("scale"), p0.get("bias"), p0.get("fused_add"),
                   dict(kw, epsilon=eps), act, params)
    if op == "batch_norm_eval":
        prob.eval_stats = ((_values(rng, c["stat_shape"], ct, "bias")),
                           (_values(rng, c["stat_shape"], ct, "running_var")))
    stats = {}
    if stat_names:
        with quiet():
            exact = prob.eval_stats if op == "batch_norm_eval" else prob.stats()
        exact = [a for a in exact if a is not None]
        for (n, ss), a in zip(stat_names, exact):
            stats[n] = fill(views[n], np.asarray(a).astype(ct).reshape(ss))
    activation = act_arg(act, params)
    ctx = f"[{op} {c['dtype']} shape={shape} x.strides={x.strides} out={out_kind} threads={c['threads']}]"
    before = arena.buf.copy()
    prev = simdnorm.set_num_threads(c["threads"])
    out = views["out"] if out_kind == "separate" else x if out_kind == "in_place" else None
    td = lambda a: None if a is None else simdnorm.TensorDesc(a.dtype, a.shape)  # noqa: E731

    def bn_training(x, scale, bias, fused_add=None, **kwargs):
        if not c.get("compiled"):
            return simdnorm.batch_normalization_training(x, scale, bias, fused_add=fused_add, **kwargs)
        attrs = {k: kwargs.pop(k) for k in ("epsilon", "channel_axis", "activation")}
        desc = simdnorm.BatchNormalizationTrainingDesc(td(x), td(scale), td(bias), td(fused_add), **attrs)
        return simdnorm.compile(desc)(x, scale, bias, fused_add, **kwargs)

    try:
        if op == "bn_training":
            kwargs = dict(epsilon=eps, channel_axis=kw["channel_axis"], activation=activation, out=out,
                          fused_add=views.get("fused_add"))
            count = int(np.prod([shape[d] for d in bn_reduced_axes(shape, c["stat_shape"], kw["channel_axis"])],
                                dtype=np.int64))
            n_stats = int(np.prod(c["stat_shape"], dtype=np.int64))
            if run is not None:
                kwargs.update(running_mean=views["rm"], running_var=views["rv"],
                              momentum_convention=run["convention"])
                if run["momentum"] is not None:
                    kwargs["momentum"] = run["momentum"]
                if run["momentum"] == "cumulative":
                    kwargs["num_batches_tracked"] = run["nbt"]
            if run is not None and count == 1 and n_stats == 0:  # no channel, so none of count 1: either way
                try:
                    bn_training(x, views.get("scale"), views.get("bias"), **kwargs)
                except ValueError:
                    pass
                return
            if run is not None and count == 1:
                try:
                    bn_training(x, views.get("scale"), views.get("bias"), **kwargs)
                except ValueError:
                    pass
                else:
                    raise AssertionError(f"a count of 1 with running_var must be a ValueError {ctx}")
                changed = arena.buf != before
                assert not changed.any(), f"the call raised but wrote {int(changed.sum())} bytes {ctx}"
                return
            res = bn_training(x, views.get("scale"), views.get("bias"), **kwargs)
        else:
            flags = {k: v for k, v in c["flags"].items() if v is not None}
            if "scale" not in c["params"] and flags.get("grad_scale"):
                flags["grad_scale"] = False
            if ("bias" not in c["params"] or op == "rms_norm") and flags.get("grad_bias"):
                flags["grad_bias"] = False
            if op == "rms_norm":
                flags.pop("grad_bias", None)
            if not flags.get("grad_input", True):
                out = None
            com = dict(epsilon=eps, activation=activation, out=out, **flags)
            s, b = views.get("scale"), views.get("bias")
            dy = views["dy"]
            if op in ("batch_norm", "batch_norm_eval") and c.get("compiled"):
                fa = views.get("fused_add")
                o = com.pop("out")
                desc = simdnorm.BatchNormalizationGradDesc(
                    td(x), td(views["mean"]), td(views["variance"]), td(s), td(b), td(fa),
                    channel_axis=kw["channel_axis"], training=op == "batch_norm", **com)
                res = simdnorm.compile(desc)(dy, x, views["mean"], views["variance"], s, b, fa, out=o)
            elif op in ("batch_norm", "batch_norm_eval"):
                if "fused_add" in views:
                    com["fused_add"] = views["fused_add"]
                res = simdnorm.batch_normalization_backward(dy, x, views["mean"], views["variance"], s, b,
                                                            channel_axis=kw["channel_axis"],
                                                            training=op == "batch_norm", **com)
            elif op == "mvn" and c.get("compiled"):
                o = com.pop("out")
                mean, inv = views.get("mean"), views.get("inv")
                desc = simdnorm.MeanVarianceNormalizationGradDesc(
                    td(x), kw["axes"], td(mean), td(inv), td(s), td(b), normalize_mean=kw["normalize_mean"],
                    normalize_variance=kw["normalize_variance"], epsilon_mode=kw["epsilon_mode"], **com)
                res = simdnorm.compile(desc)(dy, x, mean, inv, s, b, out=o)
            elif op == "mvn":
                res = simdnorm.mean_variance_normalization_backward(
                    dy, x, kw["axes"], views.get("mean"), views.get("inv"), s, b,
                    normalize_mean=kw["normalize_mean"], normalize_variance=kw["normalize_variance"],
                    epsilon_mode=kw["epsilon_mode"], **com)
            elif op == "layer_norm":
                res = simdnorm.layer_norm_backward(dy, x, views["mean"], views["inv"], s, b, axis=kw["axis"], **com)
            elif op == "rms_norm":
                res = simdnorm.rms_norm_backward(dy, x, views["inv"], s, axis=kw["axis"], **com)
            elif op == "instance_norm":
                res = simdnorm.instance_norm_backward(dy, x, views["mean"], views["inv"], s, b,
                                                      channel_axis=kw["channel_axis"], **com)
            else:
                res = simdnorm.group_norm_backward(dy, x, kw["num_groups"], views["mean"], views["inv"], s, b,
                                                   channel_axis=kw["channel_axis"], **com)
    finally:
        simdnorm.set_num_threads(prev)
    # no byte outside out (and the running statistics) changed
    changed = arena.buf != before
    allowed = [n for n in ("out", "rm", "rv") if n in views] + (["x"] if out_kind == "in_place" else [])
    for n in allowed:
        changed &= ~arena.element_mask(n)
    if changed.any():
        where = np.flatnonzero(changed)
        owners = [n for n, r in arena.regions.items() if r.offset + r.lo <= where[0] < r.offset + r.hi]
        raise AssertionError(f"{int(changed.sum())} bytes outside out were written, first at arena byte "
                             f"{where[0]} (regions {owners or 'padding'}) {ctx}")
    first = res[0]
    if op == "bn_training":
        assert isinstance(res, tuple) and len(res) == 3, ctx
        y, m, v = res
        if out is None:
            assert_like_empty_like(y, x0)
        else:
            assert y is out, ctx
        with quiet():
            r = bn_training_ref(x0, prob.scale, prob.bias, epsilon=eps, channel_axis=kw["channel_axis"],
                                fused_add=prob.fused_add)
        assert m.shape == r.stat_shape and v.shape == r.stat_shape and m.dtype == ct and v.dtype == ct, \
            (m.shape, v.shape, m.dtype, r.stat_shape, ctx)
        if r.count == 0:
            assert y.size == 0 and np.isnan(m).all() and np.isnan(v).all(), ctx
            if run is not None:
                np.testing.assert_array_equal(np.array(views["rm"]), rm0, err_msg=f"untouched {ctx}")
                np.testing.assert_array_equal(np.array(views["rv"]), rv0, err_msg=f"untouched {ctx}")
            return
        with quiet():
            std = np.sqrt(r.var)
            rt = 1e-5 if ct == np.float32 else 1e-12
            ok_m = np.abs(f64(m) - r.mean) <= rt * (np.abs(r.mean) + std) + 1e-300
            ok_v = np.abs(f64(v) - r.var) <= 4 * rt * (r.var + rt * r.mean ** 2) + 1e-300
        assert ok_m.all(), f"mean off: got {m.ravel()[:4]} want {r.mean.ravel()[:4]} {ctx}"
        assert ok_v.all(), f"variance off: got {v.ravel()[:4]} want {r.var.ravel()[:4]} {ctx}"
        with quiet():
            check_close(y, r.pre, r.zscale, act, params, dtype=dtype, context=ctx)
        if run is not None:
            want_m, want_v = running_update_ref(rm0, rv0, r.mean, r.var, r.count, momentum=run["momentum"],
                                                momentum_convention=run["convention"],
                                                num_batches_tracked=run["nbt"])
            rdt = views["rm"].dtype
            ort = {np.dtype(np.float16): 1e-3, BF16: 8e-3}.get(np.dtype(rdt), 0.0)
            crt = 1e-12 if ct == np.float64 and rdt == np.float64 else 1e-5
            for name, got, want in (("running_mean", views["rm"], want_m), ("running_var", views["rv"], want_v)):
                tol = crt * (np.abs(want) + np.abs(f64(rm0 if name == "running_mean" else rv0)) + 1.0) \
                    + ort * np.abs(want)
                assert (np.abs(f64(got) - want) <= tol).all(), f"{name}: got {np.array(got).ravel()[:4]} " \
                    f"want {want.ravel()[:4]} {run} {ctx}"
        return
    # backward
    with quiet():
        if op == "batch_norm_eval" or op == "batch_norm":
            st = (f64(stats["mean"]), f64(stats["variance"]))
        elif op == "rms_norm":
            st = (f64(stats["inv"]),)
        elif op == "mvn":
            st = tuple(f64(stats[n]) if n in stats else None for n in ("mean", "inv"))
        else:
            st = (f64(stats["mean"]), f64(stats["inv"]))
        ref = prob.backward(f64(dy0), st)
    flags = c["flags"]
    want = []
    if flags["grad_input"]:
        want.append("input")
    for n in ("scale", "bias"):
        f = flags["grad_" + n]
        if n in c["params"] and (f is None or f) and not (n == "bias" and op == "rms_norm"):
            want.append(n)
    if "input" in want:
        if out is None:
            assert_like_empty_like(first, x0)
        else:
            assert first is out, f"a call with out= must return out {ctx}"
    with quiet():
        check_grads(res, ref, x=x0, scale=prob.scale, bias=prob.bias,
                    fused_add=prob.fused_add if op.startswith("batch_norm") else None, want=tuple(want), context=ctx)


# ----------------------------------------------------------------------------------------------
# the child and the parent
# ----------------------------------------------------------------------------------------------


def child_main(seed: int) -> int:
    import faulthandler
    import warnings

    faulthandler.enable()
    warnings.simplefilter("error")
    # the harness's self-test: SIMDNORM_TRAINING_FUZZ_INJECT="crash:I:J" aborts at cases I and J
    spec = os.environ.get("SIMDNORM_TRAINING_FUZZ_INJECT", "")
    crash_at = {int(i) for i in spec.split(":")[1:]} if spec.startswith("crash:") else set()
    out = sys.stdout
    for line in sys.stdin:
        index = int(line)
        out.write(f"{TAG}START {index}\n")
        out.flush()
        try:
            if index in crash_at:
                os.abort()
            execute(draw_case(seed, index))
        except BaseException as e:  # noqa: BLE001 - every failure is reported, the child goes on
            kind = "wrong" if isinstance(e, AssertionError) else "error"
            msg = "".join(traceback.format_exception_only(type(e), e)).strip()
            out.write(f"{TAG}FAIL {index} {kind} {json.dumps(msg[:3000])}\n")
        else:
            out.write(f"{TAG}OK {index}\n")
        out.flush()
    return 0


def run(seed: int, indices, *, jobs: int = 2, case_timeout: float = 120.0):
    """Run the cases in `jobs` children (each given an interleaved share); a child that dies is
    reported as a crash of the case it was running and the rest of its share goes to a new child.
    Returns (number of cases run, list of (index, kind, message))."""
    pending = [list(indices[j::jobs]) for j in range(jobs)]
    failures = []
    done = 0
    here = os.path.abspath(__file__)
    while any(pending):
        procs = []
        for share in pending:
            if not share:
                continue
            err = tempfile.TemporaryFile()
            pr = subprocess.Popen([sys.executable, here, "--child", str(seed)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=err, text=True)
            procs.append((pr, share, err))
        pending = []

        def talk(item):
            pr, share, _ = item
            try:
                return pr.communicate("".join(f"{i}\n" for i in share), timeout=case_timeout + 2.0 * len(share))[0]
            except subprocess.TimeoutExpired:  # a hang: reported like a crash of the case it was running
                pr.kill()
                return pr.communicate()[0]

        with concurrent.futures.ThreadPoolExecutor(len(procs)) as ex:
            outputs = list(ex.map(talk, procs))
        for (pr, share, err), stdout in zip(procs, outputs):
            started, finished = None, set()
            for line in stdout.splitlines():
                if not line.startswith(TAG):
                    continue
                what, rest = line[len(TAG):].split(" ", 1)
                if what == "START":
                    started = int(rest)
                    continue
                idx = int(rest.split(" ", 1)[0])
                finished.add(idx)
                done += 1
                if what == "FAIL":
                    _, kind, msg = rest.split(" ", 2)
                    failures.append((idx, kind, json.loads(msg)))
            if pr.returncode != 0 or len(finished) < len(share):
                err.seek(0)
                tail = err.read().decode(errors="replace")[-3000:]
                if started is not None and started not in finished:
                    done += 1
                    failures.append((started, "crash", f"the child died running it (exit status {pr.returncode}); "
                                                       f"its stderr ends:\n{tail}"))
                    finished.add(started)
                elif not finished:
                    raise RuntimeError(f"a training-fuzz child died before its first case:\n{tail}")
                rest = [i for i in share if i not in finished]
                pending.append(rest)
            err.close()
    return done, failures


def _failure_class(kind, msg):
    """The kind of a failure and the first line of its message with the numbers and shapes taken
    out, cut before its context: failures of one cause share it."""
    first = msg.splitlines()[0] if msg else ""
    first = first.split(" [", 1)[0]
    return kind + ": " + re.sub(r"\([^()]*\)|[-+]?\d[\d.e+-]*", "#", first)[:140]


def report(seed, failures, max_classes=8) -> str:
    """One example (the first) of each class of failure, the classes by size."""
    classes = {}
    for f in sorted(failures):
        classes.setdefault(_failure_class(f[1], f[2]), []).append(f)
    lines = []
    for key, fs in sorted(classes.items(), key=lambda kv: -len(kv[1]))[:max_classes]:
        idx, kind, msg = fs[0]
        c = draw_case(seed, idx)
        lines += ["", f"=== {len(fs)} case(s) of: {key}", f"    e.g. cases {[f[0] for f in fs[:10]]}",
                  f"--- case {seed}:{idx}: {kind}", f"drawn: {describe(c)}", msg.rstrip(),
                  f"replay: python tests/test_training_fuzz.py --seed {seed} --replay {idx}"]
    if len(classes) > max_classes:
        lines.append(f"... and {len(classes) - max_classes} more classes")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# pytest
# ----------------------------------------------------------------------------------------------


def _seed():
    env = os.environ.get("SIMDNORM_TRAINING_FUZZ_SEED", "").strip()
    return int(env) if env else secrets.randbits(32)


def _cases():
    env = os.environ.get("SIMDNORM_TRAINING_FUZZ_CASES", "").strip()
    return int(env) if env else CI_CASES


def test_training_fuzz():
    import pytest

    seed, n = _seed(), _cases()
    print(f"training fuzz: seed {seed}, {n} cases; rerun with SIMDNORM_TRAINING_FUZZ_SEED={seed}", flush=True)
    t0 = time.monotonic()
    done, failures = run(seed, list(range(n)))
    kinds = {k: sum(f[1] == k for f in failures) for k in ("crash", "wrong", "error")}
    print(f"{done} cases in {time.monotonic() - t0:.1f} s: {kinds}")
    if failures or done != n:
        pytest.fail(f"{len(failures)} failing cases ({kinds}) of {done}; rerun with SIMDNORM_TRAINING_FUZZ_SEED={seed}"
                    + report(seed, failures), pytrace=False)


def test_a_crash_in_a_child_is_a_reported_case(monkeypatch):
    monkeypatch.setenv("SIMDNORM_TRAINING_FUZZ_INJECT", "crash:3:4")
    done, failures = run(7, list(range(8)), jobs=2)
    assert done == 8, done
    crashes = sorted(f[0] for f in failures if f[1] == "crash")
    assert crashes == [3, 4], failures
    assert "SIGABRT" in failures[0][2] or "-6" in failures[0][2] or "exit status" in failures[0][2]


def test_draws_cover_the_space():
    # the generator reaches every op, rank, dtype and the interesting forms (numpy only)
    seen = {"op": set(), "nd": set(), "dtype": set(), "act": set(), "zero_size": 0, "zero_stride_x": 0,
            "running": 0, "same_rank": 0, "fused_add": 0, "big": 0, "extreme_spread": 0, "compiled": set()}
    for i in range(3000):
        c = draw_case(12345, i)
        seen["op"].add(c["op"])
        seen["nd"].add(len(c["shape"]))
        seen["dtype"].add(c["dtype"])
        seen["act"].add(c["act"])
        seen["zero_size"] += 0 in c["shape"]
        seen["zero_stride_x"] += c["x_layout"] is not None and any(c["x_layout"].zero)
        seen["running"] += "running" in c
        seen["same_rank"] += len(c.get("stat_shape", ())) > 1
        seen["fused_add"] += "fused_add" in c["params"]
        seen["big"] += int(np.prod(c["shape"])) >= 1 << 16
        seen["extreme_spread"] += c["data"][1] >= 1e25
        if c["compiled"]:
            seen["compiled"].add(c["op"])
    assert seen["op"] == set(OPS)
    assert seen["compiled"] == set(COMPILED)
    assert seen["nd"] == set(range(1, 9))
    assert seen["dtype"] == {"float32", "float16", "bfloat16", "float64"}
    assert {None, "relu", "leaky_relu", "leaky_relu0.3", "silu", "gelu"} <= seen["act"]
    for k in ("zero_size", "zero_stride_x", "running", "same_rank", "fused_add", "big", "extreme_spread"):
        assert seen[k] >= 20, (k, seen[k])


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--replay", type=int, metavar="INDEX")
    ap.add_argument("--child", type=int, metavar="SEED", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        return child_main(a.child)
    seed = a.seed if a.seed is not None else secrets.randbits(32)
    if a.replay is not None:
        c = draw_case(seed, a.replay)
        print(f"# drawn: {describe(c)}", flush=True)
        execute(c)
        print(f"case {seed}:{a.replay} passed")
        return 0
    t0 = time.monotonic()
    done, failures = run(seed, list(range(a.start, a.start + a.cases)), jobs=a.jobs)
    print(f"seed {seed}: {done} cases, {len(failures)} failures in {time.monotonic() - t0:.1f} s")
    print(report(seed, failures, 30))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
