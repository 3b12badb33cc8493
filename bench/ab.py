"""A/B of two builds of simdnorm on the same calls: ``python -m simdnorm.bench.ab A B CASES``.

A and B are directories that each hold a ``simdnorm`` package (say, copies of an installed one
before and after a change); CASES is a Python file defining ``cases(simdnorm) -> {name: callable}``
(its arrays made there, once). Each build runs in a child process of its own (this file run as a
script, so that a build without it can be compared too), because two builds
imported into one process share the first one's compiled module (the second import of
``simdnorm._core`` returns the module already loaded): an in-process A/B compares a build with
itself. Every round starts both anew (their arrays made again), and the parent alternates the
builds, call batch by call batch (the order flipped every round, so that drift on a shared machine
falls on both), and prints each case's medians and B/A.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List


def _child(package_dir: str, cases_file: str, threads: int) -> None:
    sys.path.insert(0, package_dir)
    import simdnorm

    simdnorm.set_num_threads(threads)
    namespace: dict = {}
    with open(cases_file) as f:
        exec(compile(f.read(), cases_file, "exec"), namespace)
    calls = namespace["cases"](simdnorm)
    print(json.dumps({"names": list(calls), "module": simdnorm._core.__file__}), flush=True)
    for line in sys.stdin:  # "name reps": run the call reps times, answer the seconds per call
        name, reps = line.split()
        fn, n = calls[name], int(reps)
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        print((time.perf_counter() - t0) / n, flush=True)


class _Build:
    def __init__(self, package_dir: str, cases_file: str, threads: int):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", package_dir, cases_file, "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join([package_dir, os.environ.get("PYTHONPATH", "")])))
        assert self.proc.stdin is not None and self.proc.stdout is not None
        hello = self.proc.stdout.readline()
        if not hello:
            raise SystemExit(f"ab: the build in {package_dir} did not start (see its error above)")
        info = json.loads(hello)
        self.names: List[str] = info["names"]
        self.module: str = info["module"]

    def time(self, name: str, reps: int) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{name} {reps}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait()
        self.proc.stdout.close()


def compare(a_dir: str, b_dir: str, cases_file: str, rounds: int = 11, threads: int = 1,
            batch_seconds: float = 0.05) -> Dict[str, Dict[str, float]]:
    """{case: {"A": median seconds, "B": median seconds, "ratio": B / A}}."""
    samples: Dict[str, Dict[str, List[float]]] = {}
    reps: Dict[str, int] = {}
    for r in range(rounds):
        # Both builds in fresh processes every round: where a process's arrays land in memory moved
        # a memory-bound case by 30% between two processes of the same build on a virtual machine,
        # which two processes kept for the whole run gave to one side.
        builds = {"A": _Build(a_dir, cases_file, threads), "B": _Build(b_dir, cases_file, threads)}
        try:
            if r == 0 and builds["A"].module == builds["B"].module:
                print(f"ab: note: both sides load {builds['A'].module}", file=sys.stderr)
            for name in builds["A"].names:
                if name not in reps:
                    reps[name] = max(1, int(batch_seconds / max(builds["A"].time(name, 1), 1e-7)))
                got = samples.setdefault(name, {"A": [], "B": []})
                for tag in ("A", "B") if r % 2 else ("B", "A"):
                    got[tag].append(builds[tag].time(name, reps[name]))
        finally:
            for b in builds.values():
                b.close()
    out = {}
    for name, got in samples.items():
        a, b = statistics.median(got["A"]), statistics.median(got["B"])
        out[name] = {"A": a, "B": b, "ratio": b / a}
        print(f"{name:32s} A {a * 1e3:9.3f} ms  B {b * 1e3:9.3f} ms  B/A {b / a:.3f}", flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m simdnorm.bench.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("a", help="a directory holding the A build's simdnorm package")
    p.add_argument("b", nargs="?", help="a directory holding the B build's simdnorm package")
    p.add_argument("cases", nargs="?", help="a Python file defining cases(simdnorm) -> {name: callable}")
    p.add_argument("--rounds", type=int, default=11, help="timed batches of each build per case (default 11)")
    p.add_argument("--threads", type=int, default=1, help="simdnorm's threads in both builds (default 1)")
    args = p.parse_args(argv)
    # (this file runs as a script in the children: no import of the package's cli for these)
    if args.rounds < 1:
        p.error(f"--rounds: expected an integer >= 1, got {args.rounds}")
    if not 1 <= args.threads <= max(1024, os.cpu_count() or 1):
        p.error(f"--threads: expected an integer >= 1 and <= simdnorm's maximum, got {args.threads}")
    if args.child:  # (a: the package directory, b: the cases file)
        return _child(args.a, args.b, args.threads)
    if args.b is None or args.cases is None:
        p.error("give A, B and CASES")
    compare(args.a, args.b, args.cases, args.rounds, args.threads)


if __name__ == "__main__":
    main()
