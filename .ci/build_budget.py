"""Runs a command and prints what it cost: wall time and the peak memory of its largest process
(for a build, the compiler of the largest unit). Exits with the command's status, or 1 when it took
longer than --max-seconds. --module also prints the size of the installed extension module.

    python .ci/build_budget.py --label "plain install" --module -- pip install .
"""
import argparse
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
    parser.add_argument("--module", action="store_true")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    start = time.perf_counter()
    status = subprocess.call(command)
    seconds = time.perf_counter() - start
    # ru_maxrss of the reaped descendants: the largest one's peak, in KiB on Linux
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    line = f"[budget] {args.label}: {seconds:.0f} s wall, largest process {peak_mib:.0f} MiB"
    if args.module and status == 0:
        line += f", module {installed_module_bytes() / 2**20:.1f} MiB"
    if args.max_seconds is not None:
        line += f" (limit {args.max_seconds:.0f} s)"
    print(line, flush=True)
    if status != 0:
        return status
    if args.max_seconds is not None and seconds > args.max_seconds:
        print(f"[budget] {args.label} took longer than {args.max_seconds:.0f} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
