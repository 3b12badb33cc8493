"""simdnorm.dask next to Dask's own standardization: the benchmark and the accuracy table of
docs/dask.rst (not a timed test).

    python bench/dask_bench.py [--gib 4] [--chunk-mib 64] [--schedulers threads,distributed]
    python bench/dask_bench.py --accuracy

Benchmark: a float32 array of --gib GiB, --cols columns, in chunks of about --chunk-mib MiB of rows,
generated and persisted in memory first (on the LocalCluster's workers for "distributed"), then
standardized over axis 0 and over all axes by

  dask       (x - x.mean(axis)) / x.std(axis)                  Dask's own expression
  simdnorm   simdnorm.dask.mean_variance_normalization(x, axes, epsilon=0)
  copy       x.map_blocks(np.copy)                              one read and one write an element

each reduced with .sum() and computed (so that no result is kept: what is timed is the op, for
every one the same way). GB/s counts one read and one write of the array. Statistics and normalize
read the input twice, so 1.5x the copy's time is the floor; simdnorm's goal is 2x at most, and 3x
faster than Dask's expression.

Accuracy (--accuracy): the issue's data, (8192, 1024) float32 of mean 1000 and std 0.01 in 64
chunks, its variance over all elements and over axis 0 by each method, against extended precision.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import numpy as np


def _simdnorm() -> Any:
    import simdnorm
    import simdnorm.dask as sd
    return simdnorm, sd


def _cases(sd: Any) -> Dict[str, Dict[str, Callable[[Any], Any]]]:
    return {
        "axis 0": {
            "dask": lambda x: (x - x.mean(axis=0)) / x.std(axis=0),
            "simdnorm": lambda x: sd.mean_variance_normalization(x, 0, epsilon=0.0),
            "copy": lambda x: x.map_blocks(np.copy),
        },
        "all axes": {
            "dask": lambda x: (x - x.mean()) / x.std(),
            "simdnorm": lambda x: sd.mean_variance_normalization(x, (0, 1), epsilon=0.0),
            "copy": lambda x: x.map_blocks(np.copy),
        },
    }


def _run(scheduler: str, args: argparse.Namespace) -> List[Dict[str, Any]]:
    import dask
    import dask.array as da
    _, sd = _simdnorm()
    cols = args.cols
    rows = int(args.gib * 2**30) // (4 * cols)
    chunk_rows = max(1, int(args.chunk_mib * 2**20) // (4 * cols))
    nbytes = rows * cols * 4
    client = cluster = None
    if scheduler == "distributed":
        import distributed
        cluster = distributed.LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                                           dashboard_address=None, memory_limit=args.worker_memory)
        client = distributed.Client(cluster)
        compute = lambda a: client.compute(a, sync=True)  # noqa: E731
    else:
        compute = lambda a: a.compute(scheduler="threads")  # noqa: E731
    try:
        rng = da.random.default_rng(args.seed)
        x = (rng.standard_normal((rows, cols), chunks=(chunk_rows, cols), dtype=np.float32) * 2.0 + 5.0)
        t0 = time.perf_counter()
        if client is not None:
            x = client.persist(x)
            distributed.wait(x)
        else:
            x = x.persist(scheduler="threads")
        print(f"[{scheduler}] x {x.shape} float32, {nbytes / 2**30:.2f} GiB in {x.numblocks[0]} chunks of "
              f"{chunk_rows * cols * 4 / 2**20:.0f} MiB, generated in {time.perf_counter() - t0:.1f} s", flush=True)
        results = []
        for case, impls in _cases(sd).items():
            times: Dict[str, List[float]] = {name: [] for name in impls}
            for r in range(args.rounds):
                order = list(impls) if r % 2 == 0 else list(reversed(impls))
                for name in order:
                    graph = impls[name](x).sum()
                    t = time.perf_counter()
                    compute(graph)
                    times[name].append(time.perf_counter() - t)
            best = {n: min(ts) for n, ts in times.items()}
            for name, ts in times.items():
                results.append(dict(scheduler=scheduler, case=case, impl=name, times=ts, best=best[name],
                                    median=statistics.median(ts), gbps=2 * nbytes / best[name] / 1e9,
                                    speedup_vs_dask=best["dask"] / best[name], vs_copy=best[name] / best["copy"]))
                print(f"  {case:8s} {name:9s} best {best[name]:7.3f} s  median {statistics.median(ts):7.3f} s  "
                      f"{2 * nbytes / best[name] / 1e9:6.2f} GB/s  {best['dask'] / best[name]:5.2f}x vs dask  "
                      f"{best[name] / best['copy']:5.2f}x copy", flush=True)
        del x
        return results
    finally:
        if client is not None:
            client.close()
            cluster.close()


def _table(results: List[Dict[str, Any]]) -> str:
    lines = ["| scheduler | normalized over | method | time (s) | GB/s | speedup vs dask | time / copy |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['scheduler']} | {r['case']} | {r['impl']} | {r['best']:.2f} | {r['gbps']:.2f} | "
                     f"{r['speedup_vs_dask']:.2f}x | {r['vs_copy']:.2f} |")
    return "\n".join(lines)


def accuracy(seed: int = 0) -> str:
    """The variance of the issue's data by every method, as relative errors against extended precision."""
    import dask.array as da
    simdnorm, sd = _simdnorm()
    rng = np.random.default_rng(seed)
    x = (1000.0 + 0.01 * rng.standard_normal((8192, 1024))).astype(np.float32)
    X = da.from_array(x, chunks=(128, 1024))
    xl = x.astype(np.longdouble)
    rows = []
    for label, axes in (("all elements", (0, 1)), ("axis 0 (per column, worst)", (0,))):
        truth = ((xl - xl.mean(axis=axes, keepdims=True)) ** 2).mean(axis=axes, keepdims=True).astype(np.float64)
        one = np.ones((1, 1) if len(axes) == 2 else (1, 1024), np.float32)  # same-rank: statistics over axes
        ours_dask = sd.batch_normalization_training(X, one)[2].compute(scheduler="threads")
        methods = {
            "simdnorm.dask batch_normalization_training (float32 result)": ours_dask,
            "simdnorm.merge_moments of 64 chunks' moments (float64)": simdnorm.merge_moments(
                simdnorm.moments(x[i:i + 128], axes) for i in range(0, 8192, 128)).variance(),
            "simdnorm in memory (float32 result)": simdnorm.batch_normalization_training(x, one)[2],
            "dask x.var() (float32)": X.var(axis=axes, keepdims=True).compute(scheduler="threads"),
            "dask x.var(dtype=float64)": X.var(axis=axes, keepdims=True, dtype=np.float64).compute(scheduler="threads"),
            "numpy x.var() in memory (float32)": x.var(axis=axes, keepdims=True),
        }
        for name, v in methods.items():
            err = np.max(np.abs(np.asarray(v, np.float64).reshape(truth.shape) / truth - 1))
            rows.append(f"| {label} | {name} | {err:.1e} |")
    return "\n".join(["| variance over | method | relative error |", "|---|---|---:|"] + rows)


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="array size in GiB (float32)")
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--chunk-mib", type=float, default=64.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--schedulers", default="threads,distributed")
    p.add_argument("--workers", type=int, default=2, help="LocalCluster process workers (1 thread each)")
    p.add_argument("--worker-memory", default="6GiB", help="each LocalCluster worker's memory limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results (and the machine) here")
    p.add_argument("--accuracy", action="store_true", help="print the accuracy table only")
    args = p.parse_args(argv)
    if args.accuracy:
        print(accuracy(args.seed))
        return 0
    import dask
    simdnorm, _ = _simdnorm()
    print(f"simdnorm {simdnorm.__version__} ({simdnorm.isa()}), dask {dask.__version__}, numpy {np.__version__}, "
          f"{os.cpu_count()} CPUs, {platform.platform()}", flush=True)
    results = []
    for scheduler in args.schedulers.split(","):
        results += _run(scheduler.strip(), args)
    print(_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(argv=argv, simdnorm=simdnorm.__version__, isa=simdnorm.isa(), dask=dask.__version__,
                           numpy=np.__version__, cpus=os.cpu_count(), platform=platform.platform(),
                           results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
