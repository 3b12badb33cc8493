"""Pinned repros of three defects the whole-space fuzzer (tests/fuzz_space.py) is built to find,
each run in a child process, so that a crash is a reported failure and not a dead pytest:

  (a) 8 dims that do not merge, normalized over all (or all but the first) of them: the planner's
      fixed 8-entry dim list overflowed (segfault): layer_norm / rms_norm axis=0, MVN over
      range(8) and range(1, 8), full-shape scale in C or F order, with and without out=;
  (b) group_norm of 8-dim inputs in every layout (1-8 dims with any strides are promised): every
      non-C layout was refused with DescriptorError;
  (c) results independent of the address: the same values at every byte offset (a multiple of
      the item size) mod 64, as input or as out=, give bitwise identical outputs and statistics.

Every result is also checked against the float64 reference (tests/reference.py) on fresh random,
non-zero data, with out= poisoned (NaN) before the call.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from reference import DTYPES, dtype_id

TESTS = os.path.dirname(os.path.abspath(__file__))

_PRELUDE = f"""
import faulthandler, sys
faulthandler.enable()  # a crash prints the Python stack
sys.path.insert(0, {TESTS!r})
import numpy as np, ml_dtypes, simdnorm
from cases import bits, empty_past_line, make_input, make_out, rand_values, scale_bias_values
from fuzz_harness import check_stats_nan_aware, group_reference
from reference import BF16, F16, F32, F64, check_bn, check_close, check_mvn
rng = np.random.default_rng(20240611)
"""


def run_child(body: str, timeout: float = 600.0):
    """Run the prelude + body in a fresh interpreter; fail with its output (and the code, a repro)
    unless it exits 0. A crash (a signal) is named as such."""
    code = _PRELUDE + textwrap.dedent(body)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # pragma: no cover - reported as a failure
        pytest.fail(f"the child did not finish within {timeout} s; code:\n{code}")
    if r.returncode != 0:
        how = (f"CRASHED: killed by {signal.Signals(-r.returncode).name}" if r.returncode < 0
               else f"failed (exit status {r.returncode})")
        pytest.fail(f"the child {how}\n--- stdout ---\n{r.stdout[-3000:]}\n--- stderr ---\n{r.stderr[-3000:]}"
                    f"\n--- repro (python -c) ---\n{code}", pytrace=False)
    return r.stdout


DTYPE_SRC = {"f32": "F32", "f16": "F16", "bf16": "BF16", "f64": "F64"}

# ----------------------------------------------------------------------------------------------
# (a) 8 dims that do not merge
# ----------------------------------------------------------------------------------------------

# (function call source, reduced axes, normalize_mean); s is a full-shape scale
EIGHT_DIM_CALLS = {
    "layer_norm_axis0": ("simdnorm.layer_norm(x, s, axis=0, out=out)", tuple(range(8)), True),
    "rms_norm_axis0": ("simdnorm.rms_norm(x, s, axis=0, out=out)", tuple(range(8)), False),
    "mvn_axes_range8": ("simdnorm.mean_variance_normalization(x, range(8), scale=s, out=out)", tuple(range(8)), True),
    "mvn_axes_range1_8": ("simdnorm.mean_variance_normalization(x, range(1, 8), scale=s, out=out)",
                          tuple(range(1, 8)), True),
}


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("call", list(EIGHT_DIM_CALLS))
def test_eight_unmergeable_dims(call, dtype):
    """The input in Fortran order (8 dims of size 2), a full-shape scale in C or F order, with and
    without a poisoned out=. The child prints each variant before running it: a crash names it."""
    src, axes, nm = EIGHT_DIM_CALLS[call]
    run_child(f"""
        dt = {DTYPE_SRC[dtype]}
        for scale_order in ("C", "F"):
            for with_out in (False, True):
                print(f"variant: scale in {{scale_order}} order, out={{'poisoned' if with_out else None}}", flush=True)
                x = np.asfortranarray(rand_values(rng, (2,) * 8, dt, loc=1.5))
                s = np.asarray(scale_bias_values(rng, (2,) * 8, dt), order=scale_order)
                out = np.full((2,) * 8, np.nan, dt) if with_out else None
                y = {src}
                assert out is None or y is out
                check_mvn(y, x, {axes}, s, normalize_mean={nm}, context=f"{call} scale {{scale_order}} out={{with_out}}")
    """)


def test_eight_dims_strided_without_parameters():
    """The same overflow without any parameter: every dim of the input stepped by 2."""
    run_child("""
        base = rand_values(rng, (4,) * 8, F32)
        x = base[(slice(None, None, 2),) * 8]
        check_mvn(simdnorm.layer_norm(x, axis=0), x, tuple(range(8)))
        out = make_out(x.shape, F32, "transposed")
        y, mean, inv = simdnorm.mean_variance_normalization(x, tuple(range(8)), out=out, return_stats=True)
        check_mvn(y, x, tuple(range(8)), stats=(mean, inv))
    """)


# ----------------------------------------------------------------------------------------------
# (b) group_norm, 8 dims, every layout
# ----------------------------------------------------------------------------------------------

GN_LAYOUTS = ("contiguous", "transposed", "permuted", "negative", "strided", "unaligned", "unaligned_strided",
              "channels_last", "zero_stride")


@pytest.mark.parametrize("channel_axis", [1, -1])
@pytest.mark.parametrize("layout", GN_LAYOUTS)
def test_group_norm_eight_dims(layout, channel_axis):
    """Every out kind (new, C order, a non-contiguous one) and return_stats, float32 and bfloat16,
    against the float64 reference (output and (N, G) statistics)."""
    run_child(f"""
        ca = {channel_axis}
        shape = [2, 3, 2, 3, 2, 2, 3, 2]
        shape[ca] = 8  # C = 8 channels in G = 4 groups
        shape = tuple(shape)
        failures = []
        for dt in (F32, BF16):
            x = make_input(rng, shape, dt, {layout!r}, loc=1.5)
            scale = scale_bias_values(rng, (8,), dt)
            bias = scale_bias_values(rng, (8,), F32, "bias")
            for out_layout in (None, "contiguous", "strided"):
                for return_stats in (False, True):
                    out = None if out_layout is None else make_out(shape, dt, out_layout)
                    ctx = f"{{dt}} x.strides={{x.strides}} out={{out_layout}} return_stats={{return_stats}}"
                    try:
                        res = simdnorm.group_norm(x, 4, scale, bias, channel_axis=ca, out=out,
                                                  return_stats=return_stats)
                        y = res[0] if return_stats else res
                        assert out is None or y is out, ctx
                        z, zs, mean, inv, xg = group_reference(x, 4, scale, bias, ca % len(shape), 1e-5)
                        check_close(y, z, zs, dtype=dt, context=ctx)
                        if return_stats:
                            assert res[1].shape == res[2].shape == (shape[0], 4), ctx
                            ones = (1,) * (xg.ndim - 2)
                            stats = tuple(s.reshape(s.shape + ones) for s in res[1:])
                            check_stats_nan_aware(stats, xg, tuple(range(2, xg.ndim)), mean.reshape(mean.shape + ones),
                                                  inv.reshape(inv.shape + ones), ctx, dtype=dt)
                    except Exception as e:  # every combination is tried; all failures are listed
                        failures.append(f"{{ctx}}: {{type(e).__name__}}: {{str(e)[:300]}}")
        assert not failures, f"{{len(failures)}} of 12 calls failed:\\n" + "\\n".join(failures)
        print("ok")
    """)


# ----------------------------------------------------------------------------------------------
# (c) the same values at every address give the same bits
# ----------------------------------------------------------------------------------------------

# op -> (shapes: a realistic one where the fast paths run, then small ones; call source taking
# x, p (parameters) and out, returning (y, mean or None, inv_std or None); reference check source)
ALIGN_OPS = {
    "layer_norm": (
        [(4, 128, 768), (3, 37), (5, 1, 19)],
        "p = dict(scale=scale_bias_values(rng, shape[-1:], dt), bias=scale_bias_values(rng, shape[-1:], dt, 'bias'))",
        "simdnorm.layer_norm(x, p['scale'], p['bias'], out=out, return_stats=True)",
        "check_mvn(r[0], x, (nd - 1,), p['scale'], p['bias'], stats=r[1:], context=ctx)",
    ),
    "rms_norm": (
        [(4, 128, 768), (3, 37), (5, 1, 19)],
        "p = dict(scale=scale_bias_values(rng, shape[-1:], dt))",
        "simdnorm.rms_norm(x, p['scale'], out=out, return_stats=True)",
        "check_mvn(r[0], x, (nd - 1,), p['scale'], normalize_mean=False, stats=r[1:], context=ctx)",
    ),
    "instance_norm": (
        [(8, 64, 28, 28), (2, 5, 7, 3), (3, 4, 9)],
        "p = dict(scale=scale_bias_values(rng, shape[1:2], dt), bias=scale_bias_values(rng, shape[1:2], dt, 'bias'))",
        "simdnorm.instance_norm(x, p['scale'], p['bias'], out=out, return_stats=True)",
        "chan = lambda a: a.reshape((1, -1) + (1,) * (nd - 2)); "
        "check_mvn(r[0], x, tuple(range(2, nd)), chan(p['scale']), chan(p['bias']), stats=r[1:], context=ctx)",
    ),
    "group_norm": (
        [(4, 256, 16, 16), (2, 64, 5, 3), (3, 32, 7)],
        "p = dict(scale=scale_bias_values(rng, shape[1:2], dt), bias=scale_bias_values(rng, shape[1:2], dt, 'bias'))",
        "simdnorm.group_norm(x, 32, p['scale'], p['bias'], out=out, return_stats=True)",
        "z, zs, mean, inv, xg = group_reference(x, 32, p['scale'], p['bias'], 1, 1e-5); "
        "check_close(r[0], z, zs, dtype=dt, context=ctx)",
    ),
    "mvn_0_2_3": (
        [(8, 64, 28, 28), (3, 5, 4, 7), (2, 3, 1, 33)],
        "p = {}",
        "simdnorm.mean_variance_normalization(x, (0, 2, 3), out=out, return_stats=True)",
        "check_mvn(r[0], x, (0, 2, 3), stats=r[1:], context=ctx)",
    ),
    "mvn_last_axis": (
        [(4, 128, 768), (7, 45), (2, 3, 17)],
        "p = dict(scale=scale_bias_values(rng, shape[-1:], F32))",
        "simdnorm.mean_variance_normalization(x, -1, p['scale'], out=out, return_stats=True)",
        "check_mvn(r[0], x, (nd - 1,), p['scale'], stats=r[1:], context=ctx)",
    ),
    "batch_normalization": (
        [(8, 64, 28, 28), (2, 5, 7, 3), (3, 37)],
        "c = shape[1]; p = dict(mean=scale_bias_values(rng, (c,), dt, 'bias'), "
        "var=np.abs(scale_bias_values(rng, (c,), dt)), scale=scale_bias_values(rng, (c,), dt), "
        "bias=scale_bias_values(rng, (c,), dt, 'bias'))",
        "(simdnorm.batch_normalization(x, p['mean'], p['var'], p['scale'], p['bias'], out=out), None, None)",
        "check_bn(r[0], x, p['mean'], p['var'], p['scale'], p['bias'], context=ctx)",
    ),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", list(ALIGN_OPS))
def test_results_do_not_depend_on_the_address(op, dtype):
    shapes, params_src, call_src, check_src = ALIGN_OPS[op]
    run_child(f"""
        dt = np.dtype({DTYPE_SRC[dtype_id(dtype)]})
        isz = dt.itemsize

        def call(x, p, out):
            r = {call_src}
            if not isinstance(r, tuple):
                r = (r, None, None)
            return r

        def placed(values, offset):
            a = empty_past_line(values.shape, dt, offset)
            a[...] = values
            return a

        def poisoned(shape, offset):
            a = empty_past_line(shape, dt, offset)
            a[...] = np.nan
            return a

        def same(r, r0, what):
            for name, a, b in zip(("out", "mean", "inv_std"), r, r0):
                if b is None:
                    assert a is None, what
                    continue
                diff = bits(a) != bits(b)
                assert not diff.any(), (
                    f"{{what}}: {{name}} differs from the aligned call's in {{diff.sum()}} of {{diff.size}} elements "
                    f"(first at {{np.argwhere(diff)[0].tolist()}}: {{a[tuple(np.argwhere(diff)[0])]!r}} vs "
                    f"{{b[tuple(np.argwhere(diff)[0])]!r}})")

        failures = []
        for shape in {shapes!r}:
            nd = len(shape)
            xv = rand_values(rng, shape, dt, loc=1.5)
            {params_src}
            x = placed(xv, 0)
            r0 = call(x, p, poisoned(shape, 0))
            r = r0
            ctx = f"{op} {{dt}} shape={{shape}}"
            {check_src}
            for k in range(isz, 64, isz):
                try:  # the input at byte offset k (out aligned), then out at k (input aligned)
                    same(call(placed(xv, k), p, poisoned(shape, 0)), r0, f"{{ctx}}: input at offset {{k}} mod 64")
                    same(call(x, p, poisoned(shape, k)), r0, f"{{ctx}}: out at offset {{k}} mod 64")
                except AssertionError as e:
                    failures.append(str(e))
        assert not failures, f"{{len(failures)}} offsets gave other bits:\\n" + "\\n".join(failures[:12])
        print("ok")
    """)
