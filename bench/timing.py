"""Interleaved timing: warm up, size each sample to >= min_sample_ns, then round-robin over the
implementations for several rounds (each round in another order, see round_order), one sample per
implementation per round. A sample is the mean time per call over `reps` back-to-back calls; the
reported figure is the median of the samples, with quartiles and min/max as the spread.
"""
from __future__ import annotations

import gc
import math
import os
import threading
import time
from dataclasses import dataclass, field
from statistics import median
from time import perf_counter_ns
from typing import Callable, Optional, Sequence

MAX_REPS = 1_000_000
QUIET_MAX_NS = 50e6  # the longest wait for other threads to stop spinning before a sample


def run_reps(fn: Callable[[], object], reps: int) -> int:
    """Wall time in ns of `reps` calls of fn."""
    t0 = perf_counter_ns()
    for _ in range(reps):
        fn()
    return perf_counter_ns() - t0


def _others_running() -> Optional[bool]:
    """Whether a thread of this process other than the calling one is running or runnable (state R
    in /proc/self/task/*/stat: a worker spinning for its next job is); None where /proc is not
    available."""
    me = str(threading.get_native_id())
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        if stat[stat.rindex(")") + 2] == "R":
            return True
    return False


def wait_until_quiet(min_ns: float, max_ns: float, still_ns: float = 1e6) -> float:
    """Sleep at least min_ns, then until no other thread of the process has been running for
    still_ns (at most max_ns in all). Libraries keep their worker threads spinning after a parallel
    call (PyTorch's OpenMP workers for ~8 ms here; ORT and TBB pools too): the next
    implementation's sample would share the cores with them. Returns the time waited (ns)."""
    t0 = perf_counter_ns()
    time.sleep(min_ns / 1e9)
    quiet_since = perf_counter_ns()
    while perf_counter_ns() - t0 < max_ns:
        running = _others_running()
        if running is None:
            break
        now = perf_counter_ns()
        if running:
            quiet_since = now
        elif now - quiet_since >= still_ns:
            break
        time.sleep(still_ns / 8e9)
    return perf_counter_ns() - t0


def calibrate(fn: Callable[[], object], min_sample_ns: float, warmup_ns: float) -> int:
    """Warm fn up (>= warmup_ns and >= 3 calls), return the repetitions that make a sample
    last >= min_sample_ns."""
    fn()  # first call: lazy initialization, page faults of the output
    spent = 0
    reps = 1
    best = math.inf
    calls = 0
    while spent < warmup_ns or calls < 3:
        t = run_reps(fn, reps)
        spent += t
        calls += reps
        best = min(best, t / reps)
        if t < min_sample_ns / 4:
            reps = min(MAX_REPS, reps * 4)
    per_call = max(best, 1.0)
    return int(min(MAX_REPS, max(1, math.ceil(min_sample_ns / per_call))))


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    s = sorted(xs)
    n = len(s)
    if n == 1:
        return s[0], s[0], s[0]

    def q(p: float) -> float:  # linear interpolation, as numpy's default
        pos = p * (n - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, n - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return q(0.25), q(0.5), q(0.75)


@dataclass
class Timing:
    reps: int
    samples_ns: list[float] = field(default_factory=list)  # time per call, one per round

    @property
    def median_ns(self) -> float:
        return median(self.samples_ns)

    @property
    def q1_ns(self) -> float:
        return quartiles(self.samples_ns)[0]

    @property
    def q3_ns(self) -> float:
        return quartiles(self.samples_ns)[2]

    @property
    def min_ns(self) -> float:
        return min(self.samples_ns)

    @property
    def max_ns(self) -> float:
        return max(self.samples_ns)


def round_order(k: int, r: int) -> list[int]:
    """The order of the k implementations in round r: row r % k of a Williams design, in which
    every implementation follows every other one equally often over k rounds (once for an even k,
    twice over 2k rounds for an odd one).

    The implementation before a sample decides what its first calls find in the caches. Rounds
    that rotated one order (and reversed every other one) kept who sits beside whom: each
    implementation only ever followed one of its two neighbours in the list. In a full 1-thread
    run, 6 implementations, 9 rounds, simdnorm's samples in odd rounds (after numpy, whose
    temporaries fill the L3) against even ones (after the copy, which leaves the input cached):
    a median 1.03x over all cases, 1.21x at the 95th percentile; the copy's, after simdnorm or
    OpenVINO: 0.98x, 0.77x at the 5th."""
    if k <= 0:
        return []
    base, lo, hi = [0], 1, k - 1
    while len(base) < k:  # 0, 1, k-1, 2, k-2, ...
        base.append(lo)
        lo += 1
        if len(base) < k:
            base.append(hi)
            hi -= 1
    shift = r % k
    order = [(i + shift) % k for i in base]
    if k % 2 and (r // k) % 2:  # odd k: the mirror rounds complete the balance
        order.reverse()
    return order


def measure(fns: dict[str, Callable[[], object]], rounds: int, min_sample_ns: float = 2e6,
            warmup_ns: float = 2e7,
            progress: Optional[Callable[[str], None]] = None,
            pause_ns: float = 0.0) -> dict[str, Timing]:
    """Time every callable, interleaved. Returns {name: Timing}.

    pause_ns: idle time before each sample, and then until the worker threads a library left
    spinning (OpenMP, ORT and TBB pools spin for milliseconds after a parallel call) have gone to
    sleep, so that they do not compete with the next implementation's sample (used when timing
    with several threads; see wait_until_quiet).
    """
    names = list(fns)
    timings: dict[str, Timing] = {}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for name in names:
            if progress:
                progress(f"warm-up {name}")
            timings[name] = Timing(calibrate(fns[name], min_sample_ns, warmup_ns))
        k = len(names)
        for r in range(rounds):
            if progress:
                progress(f"round {r + 1}/{rounds}")
            for name in (names[i] for i in round_order(k, r)):
                t = timings[name]
                if pause_ns:
                    wait_until_quiet(pause_ns, QUIET_MAX_NS)
                t.samples_ns.append(run_reps(fns[name], t.reps) / t.reps)
    finally:
        if gc_was_enabled:
            gc.enable()
    return timings


def loop_overhead_ns(samples: int = 5, reps: int = 200_000) -> float:
    """Harness cost per call of an empty callable (the floor under every per-call time)."""
    import functools

    fn = functools.partial(int)
    return min(run_reps(fn, reps) / reps for _ in range(samples))
