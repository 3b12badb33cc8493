"""Runtime controls (the user guide's "Threads and instruction sets"): threads, instruction set, environment, threadpoolctl.

At import: the thread count from ``SIMDNORM_NUM_THREADS``, else ``OMP_NUM_THREADS``, else the CPUs
available to the process; the instruction set from ``SIMDNORM_ISA`` (a bad value warns, naming the
valid ones, and the best available ISA stays). The C++ extension reads no environment variable.
"""
from __future__ import annotations

import contextlib
import operator
import os
import sys
import warnings
from typing import Iterator, List, Optional

from . import _core
from ._activation import value_text

__all__ = ["set_num_threads", "get_num_threads", "isa", "available_isas", "set_isa"]

#: Every instruction-set name the package knows (those this CPU runs: ``available_isas()``).
KNOWN_ISAS = ("avx512bf16", "avx512", "avx2", "baseline")

#: The most threads set_num_threads accepts: 1024, or the CPU count where it is larger. The pool
#: starts that many OS threads; tens of thousands (once accepted) exhaust the system's limits on
#: threads and memory maps, and other processes on the machine could then not start theirs.
MAX_THREADS = max(1024, os.cpu_count() or 1)


_OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")
_torch_threads_decided = False
_fork_handler_registered = False


def _loaded_openmp_runtimes() -> List[str]:
    """The OpenMP runtime libraries this process has loaded (Linux: /proc/self/maps), those in
    torch's own directory first."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    # (address, permissions, offset, device, inode, then the path of a file mapping)
    paths = {fields[5] for fields in (line.split(None, 5) for line in lines)
             if len(fields) == 6 and fields[5].startswith("/")}
    found = sorted(p for p in paths if os.path.basename(p).startswith(_OPENMP_RUNTIMES) and ".so" in p)
    torch = sys.modules.get("torch")
    torch_dir = os.path.dirname(os.path.realpath(getattr(torch, "__file__", None) or os.sep)) + os.sep
    return sorted(found, key=lambda p: not os.path.realpath(p).startswith(torch_dir))


def share_torch_threads(enabled: bool = True) -> bool:
    """Run simdnorm's parallel calls on the OpenMP threads that torch's parallel ops use, or, with
    ``enabled=False``, on simdnorm's own thread pool. Returns whether the calls now share torch's
    threads: False where the process runs no OpenMP runtime that simdnorm can use (then nothing
    changes). Done once by itself when ``simdnorm.torch`` is imported or a torch tensor first
    goes through a plain function, unless decided here before (``simdnorm.torch.share_threads``).

    Why: after each parallel op, an OpenMP runtime keeps its threads spinning for a while, waiting
    for the next one. simdnorm's own workers would then compete with them for the same cores and
    lose time slices; on torch's threads a simdnorm call takes the cores they hold. The number of
    threads stays simdnorm's (:func:`set_num_threads`); a call wanting more threads than torch's
    (``torch.set_num_threads``) runs on simdnorm's pool instead. Results are bitwise the same
    either way. A process forked after simdnorm was imported uses simdnorm's own pool (an OpenMP
    runtime the parent used waits there for threads that do not exist), and where simdnorm's calls
    ran on torch's threads before the fork, torch runs on one thread in the child
    (``torch.set_num_threads(1)``, as in its DataLoader's workers), whose parallel ops would
    otherwise wait for ever.
    """
    global _torch_threads_decided, _fork_handler_registered
    _torch_threads_decided = True
    if not enabled:
        _core.use_own_threads()
        return False
    if _core.sharing_openmp_team() or any(_core.share_openmp_team(p) for p in _loaded_openmp_runtimes()):
        if not _fork_handler_registered:
            os.register_at_fork(after_in_child=_one_torch_thread_after_fork)
            _fork_handler_registered = True
        return True
    return False


def _one_torch_thread_after_fork() -> None:
    """In a fork()ed child of a process where simdnorm's calls ran on torch's OpenMP threads: torch
    on one thread, as in its DataLoader's workers. The runtime's threads are not there, and torch's
    next parallel op would wait for them for ever."""
    torch = sys.modules.get("torch")
    if torch is not None and _core.openmp_team_entered():
        torch.set_num_threads(1)


def share_torch_threads_once() -> None:
    """share_torch_threads() unless it was called before (the user's choice stands)."""
    if not _torch_threads_decided:
        share_torch_threads()


def get_num_threads() -> int:
    """The number of threads simdnorm's kernels use (small inputs stay on one thread)."""
    return _core.get_num_threads()


def _check_threads(n: object, name: str = "n") -> int:
    if isinstance(n, bool):
        raise TypeError(f"set_num_threads: {name} must be an int >= 1, got bool")
    try:
        v = operator.index(n)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"set_num_threads: {name} must be an int >= 1, got {type(n).__name__}") from None
    if v < 1:
        raise ValueError(f"set_num_threads: {name} must be >= 1, got {value_text(v)}")
    if v > MAX_THREADS:
        raise ValueError(f"set_num_threads: {name} must be <= {MAX_THREADS}, got {value_text(v)}")
    return v


def set_num_threads(n: int) -> int:
    """Use ``n`` threads (1 to MAX_THREADS); return the previous number. ``ValueError`` for n < 1
    (or above MAX_THREADS), ``TypeError`` for a non-integer. Results are bitwise identical for any
    number of threads."""
    return _core.set_num_threads(_check_threads(n))


@contextlib.contextmanager
def caller_threads(n: int) -> Iterator[None]:
    """Within the block, calls made from this thread use ``n`` threads (1 to MAX_THREADS), whatever
    set_num_threads says; other threads are unaffected, and the previous count comes back after.
    simdnorm.dask runs each task in one (``num_threads=``): Dask's threads and the pool's then do
    not compete for the cores."""
    previous = _core.set_caller_threads(_check_threads(n, "num_threads"))
    try:
        yield
    finally:
        _core.set_caller_threads(previous)


def isa() -> str:
    """The active instruction set: one of :func:`available_isas`."""
    return _core.isa()


def available_isas() -> List[str]:
    """The instruction sets this CPU and OS run among those built into this install, best first
    (e.g. ``['avx512bf16', 'avx512', 'baseline']``). A default install builds the best this CPU runs
    and the baseline; one built with ``SIMDNORM_ISAS=all`` offers every unit the CPU runs."""
    return list(_core.available_isas())


def _valid_names() -> str:
    avail = available_isas()
    others = [n for n in KNOWN_ISAS if n not in avail]
    msg = "available on this CPU: " + ", ".join(avail)
    if others:
        msg += "; known but not available here: " + ", ".join(others)
    return msg


def set_isa(name: str) -> str:
    """Force the instruction set ``name`` (one of :func:`available_isas`); return the previous one.
    ``ValueError`` for an unknown or unavailable name."""
    if not isinstance(name, str):
        raise TypeError(f"set_isa: name must be a str, got {type(name).__name__}; {_valid_names()}")
    key = name.strip().lower()
    if key not in available_isas():
        if key in _core.cpu_isas():
            what = (f"not built into this install (SIMDNORM_ISAS={_core.isas_setting}; "
                    "SIMDNORM_ISAS=all builds every unit)")
        else:
            what = "not available on this CPU" if key in KNOWN_ISAS else "unknown"
        raise ValueError(f"set_isa: {name!r} is {what}; {_valid_names()}")
    previous = _core.isa()
    _core.set_isa(key)
    return previous


# ----------------------------------------------------------------------------------------------------
# environment, read once at import

def _env_threads(var: str, strict: bool) -> Optional[int]:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    if not strict:
        text = text.split(",")[0].strip()  # OMP_NUM_THREADS may list nested levels: "4,2"
    try:
        v = int(text)
    except ValueError:
        v = 0
    if not 1 <= v <= MAX_THREADS:
        if strict:
            warnings.warn(
                f"{var}={raw!r} is not a positive integer <= {MAX_THREADS}; ignoring it", RuntimeWarning,
                stacklevel=3,
            )
        return None
    return v


def default_num_threads() -> int:
    """SIMDNORM_NUM_THREADS, else OMP_NUM_THREADS, else the CPUs available to this process."""
    for var, strict in (("SIMDNORM_NUM_THREADS", True), ("OMP_NUM_THREADS", False)):
        v = _env_threads(var, strict)
        if v is not None:
            return v
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def apply_isa_env() -> None:
    raw = os.environ.get("SIMDNORM_ISA")
    if raw is None or not raw.strip():
        return
    key = raw.strip().lower()
    if key in available_isas():
        _core.set_isa(key)
        return
    best = available_isas()[0]
    _core.set_isa(best)
    why = (f"not built into this install (SIMDNORM_ISAS={_core.isas_setting})" if key in _core.cpu_isas()
           else "not valid on this machine")
    warnings.warn(
        f"SIMDNORM_ISA={raw!r} is {why}; valid values: {', '.join(available_isas())} "
        f"(known: {', '.join(KNOWN_ISAS)}); using the best available, {best!r}",
        RuntimeWarning,
        stacklevel=3,
    )


def init() -> None:
    _core.set_num_threads(min(default_num_threads(), MAX_THREADS))
    apply_isa_env()
    register_threadpoolctl()


# ----------------------------------------------------------------------------------------------------
# threadpoolctl

_REGISTERED = False


def register_threadpoolctl() -> None:
    """Make ``threadpoolctl.threadpool_info()`` list simdnorm and ``threadpool_limits`` limit it.

    threadpoolctl finds controllers by scanning the loaded shared libraries for a filename starting
    with a registered prefix: ours is the extension ``_core.<abi tag>.so``. Another package's
    ``_core`` extension would match the prefix too: such an entry reports no thread count and
    ignores limits, since only the file of this package's extension is delegated to."""
    global _REGISTERED
    if _REGISTERED:
        return
    try:
        import threadpoolctl
    except ImportError:  # pragma: no cover - a declared dependency, but optional at run time
        return
    if not hasattr(threadpoolctl, "register") or not hasattr(threadpoolctl, "LibController"):
        return  # pragma: no cover - threadpoolctl < 3.2 (register came in 3.2)

    core_file = getattr(_core, "__file__", None)
    ours = os.path.realpath(core_file) if core_file else None

    class SimdnormController(threadpoolctl.LibController):
        user_api = "simdnorm"
        internal_api = "simdnorm"
        filename_prefixes = ("_core",)
        check_symbols = ("PyInit__core",)

        def _is_ours(self) -> bool:
            return ours is not None and os.path.realpath(self.filepath) == ours

        def get_num_threads(self):
            return _core.get_num_threads() if self._is_ours() else None

        def set_num_threads(self, num_threads):
            if self._is_ours():
                return _core.set_num_threads(_check_threads(num_threads, "num_threads"))
            return None

        def get_version(self):
            return getattr(_core, "__version__", None) if self._is_ours() else None

    threadpoolctl.register(SimdnormController)
    _REGISTERED = True
