"""`python -m simdnorm bench [options]`: simdnorm side by side with the copy roofline, numpy and
the libraries a user would pick instead (PyTorch, ONNX Runtime, OpenVINO) when installed.
`--torch-modules`: simdnorm.torch's modules against torch.nn's instead (bench/torch_modules.py)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Optional, Sequence

from . import shapes
from .impl_base import FLOORS
from .impls import IMPL_NAMES, all_impls
from .report import _loadavg, fmt_bytes, format_case, format_summary, json_document, json_safe, plot
from .runner import ERROR, WRONG, run_case
from .timing import loop_overhead_ns

DEFAULT_ROUNDS = 9
QUICK_ROUNDS = 5
FALLBACK_MAX_THREADS = max(1024, os.cpu_count() or 1)  # simdnorm's limit (_runtime), when it does not import


# ------------------------------------------------------------------------ option validation
# argparse `type=` validators: a bad value is a one-line usage error (exit 2) before anything runs,
# not a traceback, a silent default (--rounds 0) or a hang (--warmup-ms inf).
def _shown(s: str) -> str:
    return repr(s) if len(s) <= 40 else repr(s[:37] + "...")


def int_in(lo: int, hi: Optional[int] = None):
    """An argparse type: an int in [lo, hi] (a usage error otherwise); also bench/placement.py's
    and bench/ab.py's."""
    def parse(s: str) -> int:
        top = f" and <= {hi}" if hi is not None else ""
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}{top}, got {_shown(s)}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}{top}, got {_shown(s)}")
        return v
    return parse


def _file_name(s: str) -> str:
    if not s:  # (an empty name was taken as no option at all: nothing written, nothing said)
        raise argparse.ArgumentTypeError("expected a file name, got an empty one")
    return s


def _nonnegative_ms(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of ms >= 0, got {_shown(s)}")
    return v


def max_threads() -> int:
    """simdnorm's own maximum for set_num_threads (every library gets --threads)."""
    from .impls import load_simdnorm

    if load_simdnorm()[0] is not None:
        try:
            import importlib

            return int(importlib.import_module("simdnorm._runtime").MAX_THREADS)
        except Exception:  # noqa: BLE001 - an older simdnorm: its documented limit
            pass
    return FALLBACK_MAX_THREADS


def threads_arg(s: str) -> int:
    """An argparse type: a thread count simdnorm takes."""
    return int_in(1, max_threads())(s)


def _thread_list(s: str) -> tuple[int, ...]:
    """N or N,N,... (the list for --torch-modules), each N as _threads takes it."""
    out: list[int] = []
    for part in s.split(","):
        n = threads_arg(part.strip())
        if n not in out:
            out.append(n)
    return tuple(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m simdnorm bench",
        description=__doc__,
        epilog="GB/s counts the input read once and the output written once (2 x input bytes; a "
               "backward op reads x and grad_output and writes grad_input: 3 x). t/copy = time / "
               "copy time; t/add = time / np.add(x, dy, out=dx)'s (the backward cases' floor); "
               "t/best other = time / the fastest other implementation (floors excluded). The "
               "training cases: --filter train --filter bwd.")
    p.add_argument("--threads", type=_thread_list, default=None, metavar="N",
                   help="threads for every library (default 1; at most simdnorm's maximum); with "
                        "--torch-modules a list, each run in turn (default 1,2)")
    p.add_argument("--torch-modules", action="store_true",
                   help="instead of the array cases: simdnorm.torch's drop-in modules against "
                        "torch.nn's on the same tensors (forward, forward + backward, both inside a "
                        "model), and the per-call cost of torch.ops.simdnorm (needs torch)")
    p.add_argument("--quick", action="store_true",
                   help="a few shapes and fewer rounds (under a minute)")
    p.add_argument("--filter", action="append", default=[], metavar="SUBSTR",
                   help="run the cases whose name contains SUBSTR (repeatable: any of them)")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--json", metavar="FILE", type=_file_name, help="write the results and machine info as JSON")
    p.add_argument("--plot", metavar="FILE", type=_file_name,
                   help="draw GB/s per implementation vs the copy (needs matplotlib; the format from "
                        "the extension: .png, .svg, .pdf...; no extension: FILE.png)")
    p.add_argument("--impl", metavar="NAMES",
                   help=f"comma-separated implementations to run (default all: {','.join(IMPL_NAMES)}); "
                        "the floors (copy; add in the backward cases) are always included")
    p.add_argument("--rounds", type=int_in(1), default=None,
                   help=f"interleaved rounds (default {DEFAULT_ROUNDS}, --quick {QUICK_ROUNDS})")
    p.add_argument("--min-sample-ms", type=_nonnegative_ms, default=2.0,
                   help="minimum duration of one timing sample (default 2 ms)")
    p.add_argument("--warmup-ms", type=_nonnegative_ms, default=None,
                   help="warm-up time per implementation and case (default 20 ms, --quick 5 ms)")
    p.add_argument("--seed", type=int_in(0), default=0, help="seed of the input data (>= 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    return p


class Progress:
    """One status line on stderr (rewritten in place on a terminal, a line per case otherwise)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.total = total
        self.i = 0
        self.name = ""
        self.t0 = time.monotonic()
        self._width = 0

    def start(self, i: int, name: str) -> None:
        self.i, self.name = i, name
        if self.enabled and not self.tty:
            print(f"[{i}/{self.total}] {name}", file=sys.stderr, flush=True)
        self.update("")

    def update(self, what: str) -> None:
        if not self.tty:
            return
        el = time.monotonic() - self.t0
        s = f"[{self.i}/{self.total} {el:5.0f}s] {self.name}: {what}"
        s = s[:shutil_cols() - 1]
        pad = max(0, self._width - len(s))
        sys.stderr.write("\r" + s + " " * pad)
        sys.stderr.flush()
        self._width = len(s)

    def done(self) -> None:
        if self.tty and self._width:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()
            self._width = 0


def shutil_cols() -> int:
    try:
        cols = os.get_terminal_size(sys.stderr.fileno()).columns
    except OSError:
        cols = 0
    return cols if cols >= 40 else 100


def _wanted_impls(spec: Optional[str]) -> Optional[set]:
    """The implementation names --impl asks for (the floors always added), None for all; ValueError
    for an unknown name."""
    if not spec:
        return None
    wanted = {s.strip() for s in spec.split(",") if s.strip()}
    unknown = wanted - set(IMPL_NAMES)
    if unknown:
        raise ValueError(f"--impl: unknown implementation(s): {', '.join(sorted(unknown))}; "
                         f"valid: {', '.join(IMPL_NAMES)}")
    return wanted | set(FLOORS)


def _select_impls(spec: Optional[str]):
    wanted = _wanted_impls(spec)
    return [i for i in all_impls() if wanted is None or i.name in wanted]


def _writable_file(opt: str, path: str) -> Optional[str]:
    """Why `path` cannot be written as a file (None if it can), checked before any timing."""
    if os.path.isdir(path):
        return f"{opt}: {path} is a directory"
    if path.endswith(("/", os.sep)):
        return f"{opt}: {path} names a directory (it ends with a slash), not a file"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"{opt}: directory {parent} does not exist"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{opt}: {path} is not writable"
    if not os.path.exists(path) and not os.access(parent, os.W_OK | os.X_OK):
        return f"{opt}: directory {parent} is not writable"
    return None


def plot_path(path: str) -> str:
    """The file --plot writes (matplotlib's choice for a name without an extension: FILE.png);
    ValueError if matplotlib is missing or cannot write that format."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError as e:
        raise ValueError(f"--plot needs matplotlib, which does not import: {e}") from None
    if path.endswith(("/", os.sep)):  # (before a name for matplotlib is made of it: dir/.png)
        raise ValueError(_writable_file("--plot", path))
    ext = os.path.splitext(path)[1].lower()
    if not ext or ext == ".":
        path, ext = path.rstrip(".") + ".png", ".png"
    formats = FigureCanvasAgg.get_supported_filetypes()
    if ext[1:] not in formats:
        raise ValueError(f"--plot: matplotlib cannot write {ext} files; use one of: "
                         f"{', '.join('.' + k for k in sorted(formats))}")
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        rc = _main(argv)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        # the reader of stdout went away (`... --list | head -1`): the standard handling, no
        # traceback (and none from the interpreter's own flush at exit)
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 1


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.torch_modules:
        from . import torch_modules

        args.threads = args.threads or (1, 2)
        args.argv = list(argv) if argv is not None else sys.argv[1:]
        return torch_modules.main(args, parser)
    if args.threads is not None and len(args.threads) > 1:
        parser.error(f"--threads: one N for the array cases (a list is for --torch-modules), got "
                     f"{','.join(map(str, args.threads))}")
    args.threads = args.threads[0] if args.threads else 1
    cases = shapes.select(quick=args.quick, filters=args.filter)
    if not cases:
        parser.error(f"no case{' of --quick' if args.quick else ''} matches --filter "
                     f"{' / '.join(map(repr, args.filter))}; --list without --filter lists them all")
    try:
        impls = _select_impls(args.impl)
        if args.plot and not args.list:  # the file it will write, and matplotlib can write it
            args.plot = plot_path(args.plot)
    except ValueError as e:
        parser.error(str(e))
    json_path = args.json
    for opt, path in (("--json", json_path), ("--plot", args.plot)):  # before any timing
        why = _writable_file(opt, path) if path and not args.list else None
        if why:
            parser.error(why)
    if json_path and args.plot and not args.list and os.path.realpath(json_path) == os.path.realpath(args.plot):
        parser.error(f"--json and --plot name the same file, {args.plot}")
    if args.list:
        for c in cases:
            print(f"{c.name:<34} {c.describe()}  ({fmt_bytes(c.bytes_moved)} moved)")
        return 0
    rounds = args.rounds if args.rounds is not None else (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    warmup_ms = args.warmup_ms if args.warmup_ms is not None else (5.0 if args.quick else 20.0)
    for impl in impls:
        if impl.unavailable() is None:
            impl.set_threads(args.threads)
        else:
            impl.threads = args.threads
    config = {
        "threads": args.threads,
        "quick": args.quick,
        "filters": args.filter,
        "rounds": rounds,
        "min_sample_ms": args.min_sample_ms,
        "warmup_ms": warmup_ms,
        "seed": args.seed,
        "implementations": [i.name for i in impls],
        "loop_overhead_ns": round(loop_overhead_ns(), 1),
        "pause_between_samples_ms": 1.0 if args.threads > 1 else 0.0,
        "then_until_other_threads_idle_ms": [1.0, 50.0] if args.threads > 1 else None,
        "gbps_definition": "bytes moved / median time per call: 2 * input nbytes (3 * for a "
                           "backward op: x, grad_output, grad_input; the copy its 2, the add its 3)",
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "loadavg_at_start": _loadavg(),
    }
    load = config["loadavg_at_start"]
    print(f"simdnorm bench: {len(cases)} case(s), {rounds} interleaved rounds, samples >= "
          f"{args.min_sample_ms:g} ms, threads={args.threads}"
          + (f", load average {load[0]:.2f} on {os.cpu_count()} CPUs" if load else ""))
    un = [(i.name, i.unavailable()) for i in impls]
    for name, why in un:
        if why:
            print(f"  {name}: n/a ({why})")
    print()
    progress = Progress(not args.no_progress, len(cases))
    results = []
    failed = False
    t0 = time.monotonic()
    try:
        for i, case in enumerate(cases, 1):
            progress.start(i, case.name)
            cr = run_case(case, impls, rounds, args.min_sample_ms * 1e6, warmup_ms * 1e6,
                          seed=args.seed, progress=progress.update,
                          pause_ns=1e6 if args.threads > 1 else 0.0)
            progress.done()
            results.append(cr)
            print(format_case(cr))
            print(flush=True)
            sn = cr.results.get("simdnorm")
            if sn is not None and (sn.status in (WRONG, ERROR) or sn.inaccurate):
                failed = True
    finally:
        progress.done()
        for impl in impls:
            impl.shutdown()
    print(format_summary(results))
    notes = [getattr(i, "footnote") for i in impls if getattr(i, "footnote", None)]
    if notes:
        print()
        for n in notes:
            print("  " + n)
    print(f"\n{len(results)} case(s) in {time.monotonic() - t0:.1f} s")
    rc = 0
    if json_path:
        doc = json_document(results, impls, config)
        try:
            with open(json_path, "w", encoding="utf-8") as f:
                json.dump(json_safe(doc), f, indent=1, allow_nan=False, default=_json_default)
                f.write("\n")
            print(f"wrote {json_path}")
        except OSError as e:
            print(f"--json: cannot write {json_path}: {e}", file=sys.stderr)
            rc = 2
    if args.plot:
        try:
            plot(results, args.plot, title=f"simdnorm bench, threads={args.threads}")
            print(f"wrote {args.plot}")
        except Exception as e:  # noqa: BLE001 - matplotlib's own (a backend's tool missing: RuntimeError)
            print(f"--plot: cannot write {args.plot}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                  file=sys.stderr)
            rc = 2
    if failed:
        print("simdnorm produced a wrong result or failed on some case (see above)", file=sys.stderr)
        return 1
    return rc



def _json_default(o):
    try:
        import numpy as np
        if isinstance(o, np.generic):
            return o.item()
    except ImportError:
        pass
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
