"""Fuzzer over the whole documented input space, each case in a child process.

A case is drawn from numpy's Generator seeded with (seed, index) alone, so any process can rebuild
case `index` of run `seed`. Each axis of the space is drawn independently: rank 1..8 (uniform),
sizes, the input's layout, out= and its layout, every parameter's shape form, layout and dtype,
axes and their spelling, dtype, activation, op and attributes (draw_case below). Arrays are placed
and checked by tests/fuzz_harness.py: one poisoned arena, every byte outside out's elements
unchanged, out against the float64 reference.

Cases run in up to `jobs` worker children that print a line before each case and its result
after; a child that dies (segfault, abort, sanitizer report) costs the parent nothing: the case it
was running is reported as a crash with a self-contained repro, and a new child takes the rest.

    python tests/fuzz_space.py --cases 100000 --seed N --jobs 2     # a long run
    python tests/fuzz_space.py --seed N --repro I                   # print case I's repro snippet
    python tests/fuzz_space.py --seed N --replay I                  # run case I here, traceback and all

tests/test_fuzz_space.py runs the CI budget; docs/RELIABILITY.md describes both.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import List, Optional

if __name__ == "__main__":  # run as a script: the test helpers are modules beside this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np

from fuzz_harness import DATA_KINDS, OUT_KINDS, Layout, build_op
from reference import ACTIVATION_NAMES, DTYPES, NONDEFAULT_PARAMS

OPS = ("batch_normalization", "mean_variance_normalization", "layer_norm", "rms_norm", "instance_norm",
       "group_norm", "moments")
THREAD_SPLIT_ELEMENTS = 1 << 16   # the kernels give each thread at least 2**15 elements (cpp/ops/common.h)


# ----------------------------------------------------------------------------------------------
# drawing one case
# ----------------------------------------------------------------------------------------------

def _pick(rng, options, weights=None):
    if weights is None:
        return options[int(rng.integers(len(options)))]
    p = np.asarray(weights, float)
    return options[int(rng.choice(len(options), p=p / p.sum()))]


def draw_shape(rng, nd):
    """Mostly small sizes with 1s common; sometimes one long dim (SIMD heads and tails), now and then
    an input the thread pool splits, now and then a 0. High ranks take small sizes (and fewer 1s,
    which the planner would drop) to stay small and keep their dims."""
    if nd <= 3:
        sizes = [int(rng.integers(1, 10)) if rng.random() < 0.8 else 1 for _ in range(nd)]
    elif nd <= 5:
        sizes = [_pick(rng, [1, 1, 2, 2, 3, 4, 5, 7]) for _ in range(nd)]
    else:  # 1s rarer: 8 dims that stay 8 after the planner drops the 1s are what stresses its dim lists
        sizes = [1 if rng.random() < 0.05 else _pick(rng, [2, 2, 2, 3, 3, 4]) for _ in range(nd)]
    r = rng.random()
    if r < 0.04:  # big enough for 2+ threads
        sizes = [max(s, 2) for s in sizes]
        while np.prod(sizes) < THREAD_SPLIT_ELEMENTS:
            d = int(rng.integers(nd))
            sizes[d] = sizes[d] * 2 + int(rng.integers(0, 2))
        return tuple(sizes)
    if r < 0.24:
        sizes[int(rng.integers(nd))] = int(rng.integers(10, 71))
    while np.prod(sizes) > 20000:  # keep ordinary cases quick: shrink the largest dim
        d = int(np.argmax(sizes))
        sizes[d] = max(1, sizes[d] // 2)
    if rng.random() < 0.05:
        sizes[int(rng.integers(nd))] = 0
    return tuple(sizes)


def draw_layout(rng, nd, allow_zero=True) -> Optional[Layout]:
    """None (C order, aligned) or a Layout: C, F, any permutation or channels last; steps of 2-3,
    negative steps, zero strides (not for out), odd innermost stride, any byte offset mod 64."""
    if rng.random() < 0.2:
        return None
    order = _pick(rng, ["C", "F", "perm", "channels_last"], [0.2, 0.3, 0.3, 0.2])
    if order == "C":
        perm = tuple(range(nd))
    elif order == "F":
        perm = tuple(reversed(range(nd)))
    elif order == "perm":
        perm = tuple(int(p) for p in rng.permutation(nd))
    else:  # dim 1 (the channels of NCHW...) innermost
        perm = tuple(d for d in range(nd) if d != 1) + ((1,) if nd > 1 else ())
    steps = [_pick(rng, [1, 1, 2, 3]) for _ in range(nd)] if rng.random() < 0.3 else [1] * nd
    while np.prod(steps) > 9:  # the view's extent grows by the product of the steps: keep arenas small
        steps[int(rng.integers(nd))] = 1
    steps = tuple(steps)
    signs = tuple(_pick(rng, [1, 1, -1]) for _ in range(nd)) if rng.random() < 0.3 else (1,) * nd
    if allow_zero and rng.random() < 0.15:
        zero = tuple(bool(rng.random() < 0.5) for _ in range(nd))
    else:
        zero = (False,) * nd
    odd = bool(rng.random() < 0.1)
    r = rng.random()
    misalign = 0 if r < 0.4 else 4 * int(rng.integers(0, 16)) if r < 0.7 else int(rng.integers(0, 64))
    return Layout(perm, steps, signs, zero, odd, misalign)


def draw_activation(rng):
    """(name or None, non-default parameters or None, as an Activation object): None four times as
    likely as each activation, non-default parameters half of the time (cases.activation_draws)."""
    name = _pick(rng, (None,) * 4 + ACTIVATION_NAMES)
    params = NONDEFAULT_PARAMS.get(name) if name and rng.random() < 0.5 else None
    return name, params, bool(rng.random() < 0.5)


def draw_keep(rng, nd, channel=None):
    """Which dims of a same-rank parameter keep the input's size (the rest are 1)."""
    r = rng.random()
    if r < 0.3:
        return (True,) * nd
    if r < 0.45 and channel is not None:
        return tuple(d == channel for d in range(nd))
    return tuple(bool(rng.random() < 0.5) for _ in range(nd))


def draw_sb_shape(rng, shape):
    """A scale/bias shape broadcastable to `shape` without enlarging it: fewer leading dims, any 1s."""
    nd = len(shape)
    lead = int(rng.integers(0, nd)) if rng.random() < 0.5 else 0
    keep = draw_keep(rng, nd - lead)
    return tuple(s if k else 1 for s, k in zip(shape[lead:], keep))


def draw_axes(rng, nd):
    """(axes as spelled, sorted non-negative axes): any non-empty subset (all dims included), any
    order, each axis negative or not, as tuple, list, int, numpy array or tuple of numpy ints."""
    # all dims (a whole-tensor reduction, the planner's longest reduced list) a third of the time
    k = nd if rng.random() < 1 / 3 else int(rng.integers(1, nd + 1))
    axes = [int(a) for a in rng.permutation(nd)[:k]]
    spelled = [a - nd if rng.random() < 0.5 else a for a in axes]
    form = _pick(rng, ["tuple", "list", "int", "array", "numpy_ints"])
    if form == "int" and k == 1:
        value = spelled[0]
    elif form == "list":
        value = list(spelled)
    elif form == "array":
        value = np.array(spelled, np.int64)
    elif form == "numpy_ints":
        value = tuple(np.int32(a) for a in spelled)
    else:
        value = tuple(spelled)
    return value, tuple(sorted(axes))


def draw_case(seed: int, index: int):
    """(op, shape, c) of case `index` of run `seed`: a valid call by the documented rules."""
    rng = np.random.default_rng([seed, index])
    nd = int(rng.integers(1, 9))
    ops = [op for op in OPS if not (op == "instance_norm" and nd < 3 or op == "group_norm" and nd < 2)]
    op = _pick(rng, ops)
    shape = list(draw_shape(rng, nd))
    c = dict(dtype=np.dtype(_pick(rng, DTYPES)))
    c["act"] = draw_activation(rng)
    c["params"] = {}
    sb_dtype = lambda: _pick(rng, ["input", "float32"])
    if op == "batch_normalization":
        c["channel_axis"] = int(rng.integers(-nd, nd)) if nd > 1 else _pick(rng, [1, 0, -1])
        ca = c["channel_axis"] % nd
        for name in ("mean", "variance", "scale", "bias"):
            rules = ["same_rank"] if nd == 1 else ["1d", "same_rank"]
            if name in ("scale", "bias"):
                rules.append("none")
            rule = _pick(rng, rules)
            keep = draw_keep(rng, nd, ca)
            c["params"][name] = (rule, keep, sb_dtype(), draw_layout(rng, 1 if rule == "1d" else nd))
        c["epsilon"] = _pick(rng, [0.0, 1e-5, 1e-3, 0.5, 2.0])
        c["compiled"] = bool(rng.random() < 0.2)
    elif op == "mean_variance_normalization":
        c["axes"], c["norm_axes"] = draw_axes(rng, nd)
        for name in ("scale", "bias"):
            if rng.random() < 0.5:
                pshape = draw_sb_shape(rng, shape)
                c["params"][name] = (pshape, sb_dtype(), draw_layout(rng, len(pshape)))
        c["normalize_mean"] = bool(rng.random() < 0.5)
        c["normalize_variance"] = bool(rng.random() < 0.75)
        c["epsilon"] = _pick(rng, [1e-5, 1e-3, 0.5])
        c["epsilon_mode"] = _pick(rng, ["inside", "outside"])
        c["return_stats"] = bool(rng.random() < 0.5)
        c["compiled"] = bool(rng.random() < 0.2)
    elif op == "moments":
        c["axes"], c["norm_axes"] = draw_axes(rng, nd)
    else:
        c["which"] = op
        if op in ("layer_norm", "rms_norm"):
            # axis 0 (every dim normalized) a third of the time, spelled 0 or -ndim
            axis = _pick(rng, [0, -nd]) if rng.random() < 1 / 3 else int(rng.integers(-nd, nd))
            c["extra"] = dict(axis=axis)
            a = axis % nd
            for name in ("scale",) if op == "rms_norm" else ("scale", "bias"):
                if rng.random() < 0.6:
                    r = rng.random()  # ONNX's x.shape[axis:], or any shape that broadcasts
                    pshape = (tuple(shape[a:]) if r < 0.4 else draw_sb_shape(rng, shape[a:]) if r < 0.7
                              else draw_sb_shape(rng, shape))
                    c["params"][name] = (pshape, sb_dtype(), draw_layout(rng, len(pshape)))
        else:
            ca = _pick(rng, [1, -1] + list(range(2, nd)))
            if rng.random() < 0.5:  # spelled the other way
                ca = ca - nd if ca > 0 else ca + nd
            if op == "group_norm":
                g, k = int(rng.integers(1, 5)), int(rng.integers(1, 4))
                shape[ca % nd] = g * k
                c["extra"] = dict(num_groups=g, channel_axis=ca)
            else:
                c["extra"] = dict(channel_axis=ca)
            for name in ("scale", "bias"):
                if rng.random() < 0.6:
                    c["params"][name] = ((shape[ca % nd],), sb_dtype(), draw_layout(rng, 1))
        c["epsilon"] = _pick(rng, [1e-5, 1e-3, 0.5])
        c["return_stats"] = bool(rng.random() < 0.5)
    c.update(
        x_layout=draw_layout(rng, nd),
        x_readonly=bool(rng.random() < 0.3),
        data=_pick(rng, DATA_KINDS),
        out_kind=_pick(rng, OUT_KINDS, [0.3, 0.3, 0.15, 0.1, 0.15]),
        out_layout=draw_layout(rng, nd, allow_zero=False),
        overlap_shift=int(rng.integers(-24, 25)),
        threads=_pick(rng, [1, 2, 2, 3]),
        seed=int(rng.integers(0, 2 ** 32)),
        gap=_pick(rng, [0, 1, 7, 16, 64]),
        specials=int(rng.integers(1, 4)) if rng.random() < 0.125 else 0,
    )
    if op == "moments":
        c["out_kind"] = "new"  # (it writes nothing: no out=)
    return op, tuple(shape), c


def describe(op, shape, c) -> str:
    skip = {"seed", "gap", "overlap_shift"}
    items = ", ".join(f"{k}={v!r}" for k, v in c.items() if k not in skip)
    return f"{op} shape={shape} {items}"


def build_case(seed, index):
    op, shape, c = draw_case(seed, index)
    return build_op(op, shape, c), (op, shape, c)


def repro_text(seed, index) -> str:
    opcase, (op, shape, c) = build_case(seed, index)
    return (f"# case {seed}:{index}: {op} {c['dtype']} shape={shape}\n"
            f"# replay with every check: python tests/fuzz_space.py --seed {seed} --replay {index}\n"
            + opcase.repro())


# ----------------------------------------------------------------------------------------------
# the child: reads indices from stdin, runs each case, reports on stdout
# ----------------------------------------------------------------------------------------------

TAG = "@@fuzz "  # protocol lines; anything else on the child's stdout is ignored


def _injected(kind):
    """Indices at which a self-test wants the child to crash or fail (SIMDNORM_FUZZ_INJECT)."""
    spec = os.environ.get("SIMDNORM_FUZZ_INJECT", "")
    return {int(i) for part in spec.split(",") if part.startswith(kind + ":") for i in part.split(":")[1:]}


def child_main(seed: int) -> int:
    import faulthandler
    import warnings

    faulthandler.enable()  # a crash prints the Python stack to stderr, which the parent keeps
    warnings.simplefilter("error")  # as under pytest's filterwarnings = error
    crash_at, fail_at = _injected("crash"), _injected("fail")
    out = sys.stdout
    for line in sys.stdin:
        index = int(line)
        out.write(f"{TAG}START {index}\n")
        out.flush()
        try:
            if index in crash_at:  # the harness's self-test: abort() leaves no sanitizer report behind
                os.abort()
            if index in fail_at:
                raise AssertionError("injected failure")
            opcase, _ = build_case(seed, index)
            opcase.execute()
        except BaseException as e:  # noqa: BLE001 - every failure is reported, the child goes on
            kind = "wrong" if isinstance(e, AssertionError) else "error"
            msg = "".join(traceback.format_exception_only(type(e), e)).strip()
            out.write(f"{TAG}FAIL {index} {kind} {json.dumps(msg)}\n")
        else:
            out.write(f"{TAG}OK {index}\n")
        out.flush()
    return 0


# ----------------------------------------------------------------------------------------------
# the parent: up to `jobs` children, a new one after each crash
# ----------------------------------------------------------------------------------------------

@dataclass
class Failure:
    index: int
    kind: str          # crash, hang, wrong (an assertion: values, stray bytes, shape), error (it raised)
    message: str
    case: str = ""
    repro: str = ""


@dataclass
class Summary:
    seed: int
    cases: int = 0
    failures: List[Failure] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, *kinds):
        return sum(f.kind in kinds for f in self.failures)

    def headline(self):
        return (f"fuzz_space seed={self.seed}: {self.cases} cases, {self.count('crash', 'hang')} crashes/hangs, "
                f"{self.count('wrong')} wrong results, {self.count('error')} refused valid calls "
                f"in {self.seconds:.1f} s")

    def report(self, max_failures=10):
        lines = [self.headline()]
        for f in sorted(self.failures, key=lambda f: f.index)[:max_failures]:
            lines += ["", f"=== case {self.seed}:{f.index}: {f.kind}", f"drawn: {f.case}", f.message.rstrip(),
                      f"--- repro (python tests/fuzz_space.py --seed {self.seed} --replay {f.index} runs it with "
                      "every check) ---", f.repro.rstrip()]
        if len(self.failures) > max_failures:
            lines.append(f"... and {len(self.failures) - max_failures} more failures")
        return "\n".join(lines)


def _signal_name(rc):
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


class _Worker:
    def __init__(self, seed, env):
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", str(seed)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, env=env)
        self.pending = b""
        self.assigned = None    # index sent, result not yet read
        self.started = None     # time its START line came
        self.ever_started = False

    def send(self, index):
        self.assigned, self.started = index, None
        try:
            self.proc.stdin.write(f"{index}\n".encode())
            self.proc.stdin.flush()
        except BrokenPipeError:  # it died after its last result: its EOF is handled as a death
            pass

    def stderr_tail(self, n=4000):
        self.err.seek(0)
        data = self.err.read().decode(errors="replace")
        return data[-n:]

    def close(self, kill=False):
        """End the child (closing its stdin ends its loop; kill for a hang or an early stop) and
        release its pipes; returns its exit status."""
        if kill:
            self.proc.kill()
        try:
            self.proc.stdin.close()
        except OSError:  # the child is gone: its end of the pipe is closed
            pass
        rc = self.proc.wait()
        self.proc.stdout.close()
        self.err.close()
        return rc


class HarnessError(RuntimeError):
    pass


def run(seed: int, cases: int, *, jobs: int = 2, start: int = 0, indices=None, case_timeout: float = 300.0,
        stop_at_first_crash: bool = False, progress=None, progress_every: float = 10.0, env=None) -> Summary:
    """Run cases start .. start + cases - 1 of run `seed` (or the given indices, in order) in up to
    `jobs` children; progress(text) is called every progress_every seconds."""
    env = dict(os.environ if env is None else env)
    summary = Summary(seed)
    t0 = last = time.monotonic()
    todo = iter(range(start, start + cases) if indices is None else indices)
    sel = selectors.DefaultSelector()
    workers = []
    stopping = False

    def spawn():
        w = _Worker(seed, env)
        os.set_blocking(w.proc.stdout.fileno(), False)
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        workers.append(w)
        feed(w)

    def feed(w):
        nxt = None if stopping else next(todo, None)
        if nxt is None:
            w.assigned = None
            sel.unregister(w.proc.stdout)
            workers.remove(w)
            w.close()
        else:
            w.send(nxt)

    def fail(index, kind, message):
        op, shape, c = draw_case(seed, index)
        try:
            rep = repro_text(seed, index)
        except Exception as e:  # pragma: no cover - the report must still come out
            rep = f"(no repro: {e!r})"
        summary.failures.append(Failure(index, kind, message, describe(op, shape, c), rep))

    def died(w):
        nonlocal stopping
        sel.unregister(w.proc.stdout)
        workers.remove(w)
        tail = w.stderr_tail()
        rc = w.close()
        if w.assigned is not None and not w.ever_started:
            raise HarnessError(f"a fuzz child died before its first case ({_signal_name(rc)}):\n{tail}")
        if w.assigned is not None:
            summary.cases += 1
            fail(w.assigned, "crash", f"the child process died running it ({_signal_name(rc)}); its stderr ends:\n"
                 + tail)
            stopping = stopping or stop_at_first_crash
        spawn_if_needed()

    def spawn_if_needed():
        if not stopping:
            spawn()

    try:
        for _ in range(max(1, jobs)):
            spawn()
        while workers:
            for key, _ in sel.select(timeout=1.0):
                w = key.data
                try:
                    chunk = os.read(w.proc.stdout.fileno(), 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    died(w)
                    continue
                w.pending += chunk
                *lines, w.pending = w.pending.split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace")
                    if not line.startswith(TAG):
                        continue
                    what, rest = line[len(TAG):].split(" ", 1)
                    if what == "START":
                        w.started, w.ever_started = time.monotonic(), True
                        continue
                    summary.cases += 1
                    if what == "FAIL":
                        idx, kind, msg = rest.split(" ", 2)
                        fail(int(idx), kind, json.loads(msg))
                    feed(w)
            now = time.monotonic()
            for w in list(workers):  # a case that runs too long: a hang, reported like a crash
                if w.started is not None and now - w.started > case_timeout:
                    sel.unregister(w.proc.stdout)
                    workers.remove(w)
                    tail = w.stderr_tail()
                    w.close(kill=True)
                    summary.cases += 1
                    fail(w.assigned, "hang", f"no result after {case_timeout:.0f} s; the child was killed; its "
                         f"stderr ends:\n{tail}")
                    spawn_if_needed()
            if progress is not None and now - last >= progress_every:
                last = now
                summary.seconds = now - t0
                progress(summary.headline())
    finally:
        for w in list(workers):
            w.close(kill=True)
        sel.close()
    summary.seconds = time.monotonic() - t0
    return summary


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, help="run seed (default: a fresh random one, printed)")
    ap.add_argument("--cases", type=int, default=1000, help="number of cases (default 1000)")
    ap.add_argument("--start", type=int, default=0, help="first case index (default 0)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a case counts as a hang")
    ap.add_argument("--stop-at-first-crash", action="store_true",
                    help="stop handing out cases after the first crash (measures draws to a crash)")
    ap.add_argument("--max-reports", type=int, default=20, help="failures printed in full (default 20)")
    ap.add_argument("--repro", type=int, metavar="INDEX", help="print case INDEX's repro snippet and exit")
    ap.add_argument("--replay", type=int, metavar="INDEX", help="run case INDEX in this process, with a traceback")
    ap.add_argument("--child", type=int, metavar="SEED", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        return child_main(a.child)
    seed = a.seed if a.seed is not None else secrets.randbits(32)
    if a.repro is not None or a.replay is not None:
        index = a.repro if a.repro is not None else a.replay
        op, shape, c = draw_case(seed, index)
        print(f"# drawn: {describe(op, shape, c)}")
        print(repro_text(seed, index), flush=True)
        if a.replay is not None:
            build_case(seed, index)[0].execute()
            print(f"case {seed}:{index} passed")
        return 0
    print(f"fuzz_space: seed {seed}, cases {a.start}..{a.start + a.cases - 1}, {a.jobs} jobs", flush=True)
    s = run(seed, a.cases, jobs=a.jobs, start=a.start, case_timeout=a.timeout,
            stop_at_first_crash=a.stop_at_first_crash, progress=lambda t: print(t, flush=True))
    print(s.report(a.max_reports), flush=True)
    if a.stop_at_first_crash:
        crashes = [f.index for f in s.failures if f.kind == "crash"]
        print(f"first crash at case index {min(crashes) if crashes else None}")
    return 1 if s.failures else 0


if __name__ == "__main__":
    sys.exit(main())
