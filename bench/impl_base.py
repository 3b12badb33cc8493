"""What every timed implementation is: :class:`Impl`, the :class:`Prepared` op it hands the
runner, and :class:`LazyPeerImpl` for the peers that import their library on first use. The peers
(peer_*.py) and impls.py both import this module; neither imports the other's contents.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from .cases import CaseData, NotAvailable

__all__ = ["Prepared", "Impl", "LazyPeerImpl", "prepared_out", "FLOORS"]

# The floors, by name: always run where they apply (--impl or not), never anyone's "best other".
FLOORS = ("copy", "add")


@dataclass
class Prepared:
    fn: Callable[[], Any]  # the timed callable: the op and nothing else
    run_once: Callable[[], np.ndarray]  # runs the op once, returns its output (logical shape)
    note: str = ""
    close: Optional[Callable[[], None]] = None
    out: Optional[np.ndarray] = None  # the preallocated output fn writes, if it writes one
    # Ways of doing the same op into the same `out` (fn is one of them), by name: each is verified,
    # all are timed in the same interleaved rounds, and the fastest by median stands for the
    # implementation (the runner records every one; see CopyImpl).
    variants: Optional[dict[str, Callable[[], Any]]] = None
    # The floors (copy, add) do no normalization: `exact` holds the bits their output must hold
    # (checked bitwise for fn and every variant instead of against the reference), `exact_of` says
    # what that is ("its input"), and `bytes_moved` what they move (GB/s), when not the case's.
    exact: Optional[np.ndarray] = None
    exact_of: str = ""
    bytes_moved: Optional[int] = None


class Impl:
    name = "?"
    kind = "peer"  # "roofline" | "simdnorm" | "numpy" | "peer"

    def unavailable(self) -> Optional[str]:
        """Why this implementation cannot run at all (not installed...), or None."""
        return None

    def applies(self, case) -> bool:
        """Whether the implementation belongs in this case's table at all (the two-read floor is
        only there for the backward cases); one that applies but cannot run it is n/a instead."""
        return True

    def version(self) -> Optional[str]:
        return None

    def set_threads(self, n: int) -> None:
        self.threads = n

    def prepare(self, data: CaseData) -> Prepared:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class LazyPeerImpl(Impl):
    """A peer whose modules are imported on first use, once; if that fails, the peer is unavailable
    (with the reason) instead of the whole run failing.

    Subclasses name what they import in `requires` (for the message), import it in
    :meth:`_import` (anything that can fail with the import, too) and say in :meth:`_version` what
    version of it runs.
    """

    requires = "?"

    def __init__(self) -> None:
        self.threads = 1
        self._mods: Any = None
        self._err: Optional[str] = None

    def _import(self) -> Any:
        raise NotImplementedError

    def _version(self, mods: Any) -> str:
        raise NotImplementedError

    def _load(self) -> Any:
        if self._mods is None and self._err is None:
            try:
                self._mods = self._import()
            except Exception as e:  # noqa: BLE001 - any import failure means "not available"
                self._err = f"{self.requires} not importable: {type(e).__name__}: {e}"
        if self._mods is None:
            raise NotAvailable(self._err)
        return self._mods

    def unavailable(self) -> Optional[str]:
        try:
            self._load()
        except NotAvailable as e:
            return str(e)
        return None

    def version(self) -> Optional[str]:
        try:
            mods = self._load()
        except NotAvailable:
            return None
        return self._version(mods)


def prepared_out(fn: Callable[[], Any], out: np.ndarray, note: str = "") -> Prepared:
    """A Prepared whose timed callable writes into the preallocated `out`."""
    def run_once() -> np.ndarray:
        fn()
        return out
    return Prepared(fn, run_once, note, out=out)
