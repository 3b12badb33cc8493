"""Runs a command and prints what it cost: wall time and the peak memory of its largest process
(for a build, the compiler of the largest unit); with --module, the size of the installed extension
module. Exits with the command's status, or 1 when a cost passed its limit (--max-seconds,
--max-process-mib, --max-module-mib): a change that makes the build slower or larger than the
project allows fails CI. --unchanged GLOB: files (say, compiled objects) the command must leave as
they were (their modification times), at least one of them existing: an install that should reuse
a build's objects fails if it compiled any again.

    python .ci/build_budget.py --label "plain install" --module --max-seconds 240 -- pip install .
"""
import argparse
import glob
import os
import resource
import subprocess
import sys
import time


def installed_module_bytes():
    found = subprocess.run(
        [sys.executable, "-c", "import simdnorm._core as c; print(c.__file__)"],
        capture_output=True, text=True, check=True)
    return os.path.getsize(found.stdout.strip())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True)
    parser.add_argument("--max-seconds", type=float, default=None)
    parser.add_argument("--max-process-mib", type=float, default=None)
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--max-module-mib", type=float, default=None)
    parser.add_argument("--unchanged", metavar="GLOB", default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    kept = {f: os.stat(f).st_mtime_ns for f in glob.glob(args.unchanged)} if args.unchanged else {}
    if args.unchanged and not kept:
        print(f"[budget] {args.label}: nothing matches --unchanged {args.unchanged}", file=sys.stderr)
        return 1
    start = time.perf_counter()
    status = subprocess.call(command)
    seconds = time.perf_counter() - start
    # ru_maxrss of the reaped descendants: the largest one's peak, in KiB on Linux
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    module_mib = installed_module_bytes() / 2**20 if args.module and status == 0 else None
    costs = [("wall time", seconds, args.max_seconds, "s"), ("largest process", peak_mib, args.max_process_mib, "MiB")]
    if module_mib is not None:
        costs.append(("module", module_mib, args.max_module_mib, "MiB"))
    shown = ", ".join(f"{name} {value:.{1 if name == 'module' else 0}f} {unit}" for name, value, _, unit in costs)
    limits = ", ".join(f"{name} {limit:g} {unit}" for name, _, limit, unit in costs if limit is not None)
    print(f"[budget] {args.label}: {shown}" + (f" (limits: {limits})" if limits else ""), flush=True)
    if status != 0:
        return status
    over = [f"{name} {value:.1f} {unit} > {limit:g} {unit}" for name, value, limit, unit in costs
            if limit is not None and value > limit]
    changed = [f for f, mtime in kept.items() if not os.path.exists(f) or os.stat(f).st_mtime_ns != mtime]
    if kept:
        print(f"[budget] {args.label}: {len(kept) - len(changed)} of the {len(kept)} files {args.unchanged} "
              "left as they were", flush=True)
    over += [f"{f} was built again" for f in changed]
    for what in over:
        print(f"[budget] {args.label}: over budget: {what}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
