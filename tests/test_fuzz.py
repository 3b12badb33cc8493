"""Fuzzer (hypothesis, in process): hypothesis draws shapes, memory layouts (axis order, steps of either sign, zero
strides, byte offsets, strides that are not multiples of the item size), dtypes, axes, parameters,
activations and `out` kinds; every array of a call (input, parameters, out) is a strided view at
some byte offset inside ONE poisoned uint8 arena (tests/fuzz_harness.py, shared with
tests/fuzz_space.py). After each call:

  * every byte of the arena outside out's elements is unchanged (padding, gaps inside strided
    views, the input and the parameters: no stray write, whatever the layout or the thread split);
  * out's elements hold the float64 reference (tests/reference.py) within its tolerance (an
    element left unwritten still holds the poison, which the reference rejects);
  * out=None gives np.empty_like's dtype, shape and order; out=... returns out; statistics match.

out kinds: new, a separate view, the input itself (in place), a view overlapping the input's
memory, and a view whose memory holds one of the parameters (both must act as if there were no
overlap, SPEC §6). Covered: batch_normalization (both parameter rules, channel_axis, parameter
dtypes, activations, epsilon), mean_variance_normalization (any axes subset in any spelling,
normalize_mean/variance, epsilon_mode, scale/bias broadcast, return_stats), the compiled operators,
and layer_norm, rms_norm, instance_norm, group_norm. Rarely an input large enough to be split over
threads (1-3 threads drawn per example).

Examples per test: SIMDNORM_FUZZ_EXAMPLES (env) overrides the CI defaults below; see
docs/RELIABILITY.md for long runs and for replaying a failure.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import simdnorm
from cases import activation_draws
from fuzz_harness import DATA_KINDS, Case, Layout, build_bn, build_convenience, build_mvn
from reference import DTYPES, check_mvn

_ENV = os.environ.get("SIMDNORM_FUZZ_EXAMPLES", "").strip()


def _examples(ci_default: int) -> int:
    return int(_ENV) if _ENV else ci_default


def fuzz_settings(ci_default: int):
    # CI (no SIMDNORM_FUZZ_EXAMPLES): the same examples every run, and a failure is reported as found
    # (shrinking can take minutes on a busy 2-core machine); a long run searches afresh and shrinks
    phases = tuple(Phase) if _ENV else (Phase.explicit, Phase.reuse, Phase.generate)
    return settings(max_examples=_examples(ci_default), deadline=None, print_blob=True, derandomize=not _ENV,
                    phases=phases,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# ----------------------------------------------------------------------------------------------
# drawing layouts, values and shapes (the arena, the calls and the checks: tests/fuzz_harness.py)
# ----------------------------------------------------------------------------------------------

@st.composite
def layouts(draw, ndim, allow_zero=True):
    perm = tuple(draw(st.permutations(range(ndim))))
    steps = tuple(draw(st.lists(st.sampled_from([1, 1, 1, 2, 3]), min_size=ndim, max_size=ndim)))
    signs = tuple(draw(st.lists(st.sampled_from([1, 1, -1]), min_size=ndim, max_size=ndim)))
    if allow_zero and draw(st.integers(0, 4)) == 0:
        zero = tuple(draw(st.lists(st.booleans(), min_size=ndim, max_size=ndim)))
    else:
        zero = (False,) * ndim
    odd = draw(st.integers(0, 9)) == 0
    misalign = draw(st.sampled_from([0, 0, 0, 1, 2, 3, 4, 6, 8, 12, 16, 32]))
    return Layout(perm, steps, signs, zero, odd, misalign)


@st.composite
def shapes(draw, min_ndim=1, max_ndim=5, zero_ok=True):
    big = draw(st.integers(0, 24)) == 0  # now and then an input that the thread pool splits
    nd = draw(st.integers(min_ndim, max_ndim))
    if big:
        base = [2, 3, 131, 97][-nd:] if nd <= 4 else [2, 3, 5, 61, 47][:nd]
        shape = list(base) + [1] * (nd - len(base))
        shape = [max(1, s + draw(st.integers(-1, 1))) for s in shape]
    else:
        sizes = st.sampled_from([1, 1, 2, 2, 3, 4, 5, 7]) if nd > 3 else st.integers(1, 9)
        shape = list(draw(st.lists(sizes, min_size=nd, max_size=nd)))
        if draw(st.integers(0, 4)) == 0:  # one long dim: SIMD heads, bodies and tails
            shape[draw(st.integers(0, nd - 1))] = draw(st.integers(10, 70))
    if zero_ok and draw(st.integers(0, 19)) == 0:
        shape[draw(st.integers(0, nd - 1))] = 0
    return tuple(shape)


@st.composite
def activations(draw):
    name, params = draw(activation_draws(none_weight=4))
    as_object = draw(st.booleans())
    return name, params, as_object


@st.composite
def common(draw, ndim):
    """What every case draws: dtype, input layout, data kind, out kind and layout, threads, seed."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    return dict(
        dtype=dtype,
        x_layout=draw(st.one_of(st.none(), layouts(ndim))),
        x_readonly=draw(st.booleans()),
        data=draw(st.sampled_from(DATA_KINDS)),
        out_kind=draw(st.sampled_from(["new", "new", "separate", "separate", "in_place", "overlap_input",
                                       "overlap_param"])),
        out_layout=draw(st.one_of(st.none(), layouts(ndim, allow_zero=False))),
        overlap_shift=draw(st.integers(-24, 24)),
        threads=draw(st.sampled_from([1, 2, 2, 3])),
        seed=draw(st.integers(0, 2 ** 32 - 1)),
        gap=draw(st.sampled_from([0, 1, 7, 16, 64])),
        # now and then a few NaN (and for batch norm +-inf) input elements: they must stay in their
        # element (batch norm) or normalization group (MVN), SPEC §2-§3
        specials=draw(st.integers(1, 3)) if draw(st.integers(0, 7)) == 0 else 0,
    )


# ----------------------------------------------------------------------------------------------
# batch normalization
# ----------------------------------------------------------------------------------------------

@st.composite
def bn_cases(draw):
    shape = draw(shapes())
    nd = len(shape)
    c = draw(common(nd))
    c["channel_axis"] = draw(st.integers(-nd, nd - 1)) if nd > 1 else draw(st.sampled_from([1, 0, -1]))
    c["params"] = {}
    for name in ("mean", "variance", "scale", "bias"):
        rules = ["same_rank"] if nd == 1 else ["1d", "1d", "same_rank"]
        if name in ("scale", "bias"):
            rules.append("none")
        rule = draw(st.sampled_from(rules))
        keep = tuple(draw(st.lists(st.booleans(), min_size=nd, max_size=nd)))
        pdt = draw(st.sampled_from(["input", "input", "float32"]))
        c["params"][name] = (rule, keep, pdt, draw(st.one_of(st.none(), layouts(1 if rule == "1d" else nd))))
    c["epsilon"] = draw(st.sampled_from([0.0, 1e-5, 1e-3, 0.5, 2.0]))
    c["act"] = draw(activations())
    c["compiled"] = draw(st.integers(0, 4)) == 0
    return shape, c


@fuzz_settings(150)
@given(bn_cases())
def test_fuzz_batch_normalization(case):
    shape, c = case
    build_bn(shape, c).execute()


# ----------------------------------------------------------------------------------------------
# mean-variance normalization
# ----------------------------------------------------------------------------------------------

@st.composite
def sb_shape(draw, shape):
    """A scale/bias shape broadcastable to `shape` without enlarging it: fewer leading dims, any 1s."""
    nd = len(shape)
    lead = draw(st.integers(0, nd - 1))
    keep = draw(st.lists(st.booleans(), min_size=nd - lead, max_size=nd - lead))
    return tuple(s if k else 1 for s, k in zip(shape[lead:], keep))


@st.composite
def mvn_cases(draw):
    shape = draw(shapes(max_ndim=6))
    nd = len(shape)
    c = draw(common(nd))
    axes = draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True))
    spelled = [a - nd if draw(st.booleans()) else a for a in axes]
    form = draw(st.sampled_from(["tuple", "list", "int", "array", "numpy_ints"]))
    if form == "int" and len(spelled) == 1:
        c["axes"] = spelled[0]
    elif form == "list":
        c["axes"] = list(spelled)
    elif form == "array":
        c["axes"] = np.array(spelled, np.int64)
    elif form == "numpy_ints":
        c["axes"] = tuple(np.int32(a) for a in spelled)
    else:
        c["axes"] = tuple(spelled)
    c["norm_axes"] = tuple(sorted(a % nd for a in axes))
    c["params"] = {}
    for name in ("scale", "bias"):
        if draw(st.booleans()):
            pshape = draw(sb_shape(shape))
            pdt = draw(st.sampled_from(["input", "float32"]))
            c["params"][name] = (pshape, pdt, draw(st.one_of(st.none(), layouts(len(pshape)))))
    c["normalize_mean"] = draw(st.booleans())
    c["normalize_variance"] = draw(st.sampled_from([True, True, False]))
    c["epsilon"] = draw(st.sampled_from([1e-5, 1e-3, 0.5]))
    c["epsilon_mode"] = draw(st.sampled_from(["inside", "outside"]))
    c["act"] = draw(activations())
    c["return_stats"] = draw(st.booleans())
    c["compiled"] = draw(st.integers(0, 4)) == 0
    return shape, c


@fuzz_settings(150)
@given(mvn_cases())
def test_fuzz_mean_variance_normalization(case):
    shape, c = case
    build_mvn(shape, c).execute()


# ----------------------------------------------------------------------------------------------
# the conveniences
# ----------------------------------------------------------------------------------------------

@st.composite
def convenience_cases(draw):
    which = draw(st.sampled_from(["layer_norm", "rms_norm", "instance_norm", "group_norm"]))
    if which == "group_norm":
        g, k = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        base = draw(shapes(min_ndim=2, max_ndim=5))
        nd = len(base)
        ca = draw(st.sampled_from([1, -1] + list(range(2, nd))))
        shape = list(base)
        shape[ca % nd] = g * k
        shape = tuple(shape)
        extra = dict(num_groups=g, channel_axis=ca)
    elif which == "instance_norm":
        shape = draw(shapes(min_ndim=3, max_ndim=5))
        nd = len(shape)
        extra = dict(channel_axis=draw(st.sampled_from([1, -1] + list(range(2, nd)))))
    else:
        shape = draw(shapes(max_ndim=5))
        nd = len(shape)
        extra = dict(axis=draw(st.integers(-nd, nd - 1)))
    nd = len(shape)
    c = draw(common(nd))
    c["which"] = which
    c["extra"] = extra
    c["params"] = {}
    names = ("scale",) if which == "rms_norm" else ("scale", "bias")
    for name in names:
        if draw(st.booleans()):
            if which in ("layer_norm", "rms_norm"):
                a = extra["axis"] % nd
                pshape = draw(sb_shape(shape[a:])) if draw(st.booleans()) else shape[a:]
            else:
                pshape = (shape[extra["channel_axis"] % nd],)
            pdt = draw(st.sampled_from(["input", "float32"]))
            c["params"][name] = (pshape, pdt, draw(st.one_of(st.none(), layouts(len(pshape)))))
    c["epsilon"] = draw(st.sampled_from([1e-5, 1e-3, 0.5]))
    c["act"] = draw(activations())
    c["return_stats"] = draw(st.booleans())
    return shape, c


@fuzz_settings(120)
@given(convenience_cases())
def test_fuzz_conveniences(case):
    shape, c = case
    build_convenience(shape, c).execute()


# ----------------------------------------------------------------------------------------------
# the harness catches what it should (so that a green run means something)
# ----------------------------------------------------------------------------------------------

class _RawCall:
    """A Call stand-in for the harness's self-test: fn(x, out) on the arena's views."""

    def __init__(self, fn):
        self.fn = fn

    def invoke(self, views):
        return self.fn(views["x"], views["out"])


def test_arena_detects_stray_writes_and_unwritten_elements():
    c = dict(dtype=np.dtype(np.float32), x_layout=None, x_readonly=False, data=(0.0, 1.0), out_kind="separate",
             out_layout=None, overlap_shift=0, threads=1, seed=1, gap=7, specials=0)
    shape = (3, 5)

    def sloppy(x, out):  # writes one float just past the end of out
        simdnorm.layer_norm(x, out=out)
        r = run.arena.regions["out"]
        run.arena.buf[r.offset + r.hi:r.offset + r.hi + 4] = 0
        return out

    run = Case(dict(c), shape)
    with pytest.raises(AssertionError, match=r"bytes outside out were written"):
        run.run(_RawCall(sloppy), "sloppy")

    def lazy(x, out):  # leaves the last element unwritten (poisoned)
        y = simdnorm.layer_norm(x)
        out[:, :-1] = y[:, :-1]
        return out

    run = Case(dict(c), shape)
    y, x0, _, ctx = run.run(_RawCall(lazy), "lazy")
    with pytest.raises(AssertionError, match="out of tolerance"):
        check_mvn(y, x0, (1,), context=ctx)
