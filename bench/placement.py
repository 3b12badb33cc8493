"""Where the output sits: ``python -m simdnorm.bench.placement [--offsets ...] [CASE ...]``.

Times each case with its output at several offsets from the input's phase to a 4 KB page (the
input at a page boundary, the output carved from one buffer so that its address mod 4096 is the
offset), and prints, per offset, the median over rounds of its time over offset 0's in the same
round. Each round times every offset (the best of 3 calls), in an order flipped every round, so
that drift on a shared machine falls on all offsets alike.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Tuple

import numpy as np

import simdnorm

from .cli import int_in, threads_arg

IMAGE, ROWS = (8, 256, 56, 56), (8, 512, 768)
DEFAULT_OFFSETS = (0, 16, 48, 80, 112, 256, 1040, 2048, 2064, 4048)


def at_page_phase(buffer: np.ndarray, phase: int, shape) -> np.ndarray:
    """A view of `buffer` (room for a page more than `shape`) starting `phase` bytes past a page."""
    start = ((phase - buffer.ctypes.data) % 4096) // buffer.itemsize
    return buffer[start:start + int(np.prod(shape))].reshape(shape)


def _pair(rng, shape, dtype) -> Tuple[np.ndarray, Callable[[int], np.ndarray]]:
    """An input at a page boundary, and the output at a given offset from it."""
    n = int(np.prod(shape))
    x = at_page_phase(np.empty(n + 4096, dtype), 0, shape)
    x[...] = rng.standard_normal(shape).astype(dtype)
    out = np.ones(n + 4096, dtype)
    return x, lambda offset: at_page_phase(out, offset, shape)


def make_case(name: str, rng) -> Tuple[Callable[[np.ndarray], object], Callable[[int], np.ndarray]]:
    """The call (of the output) and the output at an offset, for one of CASES."""
    channels = rng.standard_normal(IMAGE[1]).astype(np.float32)
    positive = np.abs(channels) + 1
    if name == "bn-nhwc":
        x, out = _pair(rng, (IMAGE[0], *IMAGE[2:], IMAGE[1]), np.float32)
        return (lambda y: simdnorm.batch_normalization(np.moveaxis(x, 3, 1), channels, positive,
                                                       out=np.moveaxis(y, 3, 1))), out
    if name in ("layer", "rms"):
        x, out = _pair(rng, ROWS, np.float32)
        w = rng.standard_normal(ROWS[-1]).astype(np.float32)
        if name == "layer":
            return (lambda y: simdnorm.layer_norm(x, w, w, out=y)), out
        return (lambda y: simdnorm.rms_norm(x, w, out=y)), out
    dtype = np.float16 if name == "bn-f16" else np.float32
    x, out = _pair(rng, IMAGE, dtype)
    calls: Dict[str, Callable[[np.ndarray], object]] = {
        "bn": lambda y: simdnorm.batch_normalization(x, channels, positive, out=y),
        "bn-f16": lambda y: simdnorm.batch_normalization(x, channels.astype(dtype), positive.astype(dtype), out=y),
        "bn-train": lambda y: simdnorm.batch_normalization_training(x, channels, channels, out=y),
        "instance": lambda y: simdnorm.instance_norm(x, channels, channels, out=y),
        "group": lambda y: simdnorm.group_norm(x, 32, channels, channels, out=y),
        "mvn023": lambda y: simdnorm.mean_variance_normalization(x, (0, 2, 3), out=y),
    }
    return calls[name], out


CASES = ("layer", "rms", "instance", "group", "mvn023", "bn-train", "bn", "bn-f16", "bn-nhwc")


def sweep(name: str, offsets, rounds: int, rng) -> Tuple[float, Dict[int, float]]:
    """(offset 0's median seconds, {offset: median of its time over offset 0's, round by round})."""
    call, out_at = make_case(name, rng)
    outs = {o: out_at(o) for o in offsets}
    ratios: Dict[int, List[float]] = {o: [] for o in offsets}
    base: List[float] = []
    for r in range(rounds):
        t = {}
        for o in offsets if r % 2 == 0 else offsets[::-1]:
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                call(outs[o])
                best = min(best, time.perf_counter() - t0)
            t[o] = best
        base.append(t[offsets[0]])
        for o in offsets:
            ratios[o].append(t[o] / t[offsets[0]])
    return statistics.median(base), {o: statistics.median(v) for o, v in ratios.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m simdnorm.bench.placement", description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="*", help=f"of {', '.join(CASES)} (default: all)")
    p.add_argument("--offsets", default=",".join(map(str, DEFAULT_OFFSETS)),
                   help="bytes past the input's phase to a page, the first the reference (default %(default)s)")
    p.add_argument("--rounds", type=int_in(1), default=7, help="rounds (default 7)")
    p.add_argument("--threads", type=threads_arg, default=1, help="simdnorm's threads (default 1)")
    args = p.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown case {unknown[0]!r}: give some of {', '.join(CASES)}")
    try:
        offsets = [int(o) for o in args.offsets.split(",")]
    except ValueError:
        p.error(f"--offsets: expected integers separated by commas, got {args.offsets!r}")
    if any(o < 0 or o >= 4096 for o in offsets):
        p.error("offsets are bytes in [0, 4096)")
    simdnorm.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    for name in args.cases or CASES:
        base, ratios = sweep(name, offsets, args.rounds, rng)
        cells = "  ".join(f"{o}:{ratios[o]:.2f}" for o in offsets)
        print(f"{name:9s} {base * 1e3:7.3f} ms  {cells}", flush=True)


if __name__ == "__main__":
    main()
