"""Runs one case: prepare every implementation, verify each once against the float64 reference
(the floors bit for bit: the copy against its input, the add against np.add(x, dy)), then time the
verified ones side by side."""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .cases import TOLERANCE, CaseData, Expected, NotAvailable, check, check_each, make_data, reference
from .impl_base import FLOORS, Impl, Prepared
from .shapes import ACTIVATION_DESCRIPTIONS, OP_DESCRIPTIONS, Case
from .timing import measure

OK, NA, ERROR, WRONG = "ok", "n/a", "error", "WRONG"


@dataclass
class ImplResult:
    status: str
    reason: str = ""
    note: str = ""
    max_abs_err: Optional[float] = None
    reps: int = 0
    samples_ns: list[float] = field(default_factory=list)
    median_ns: Optional[float] = None
    q1_ns: Optional[float] = None
    q3_ns: Optional[float] = None
    min_ns: Optional[float] = None
    max_ns: Optional[float] = None
    gbps: Optional[float] = None
    vs_copy: Optional[float] = None  # time / copy time
    vs_add: Optional[float] = None  # time / the two-read floor's time (backward cases)
    # training cases: the primary output is right, but these secondary outputs (statistics,
    # parameter gradients) are beyond the tolerance; timed all the same (the same work), flagged
    inaccurate: Optional[str] = None
    vs_best_other: Optional[float] = None  # time / fastest other implementation, floors excluded
    best_other: Optional[str] = None
    # several ways of doing the op timed side by side (Prepared.variants): {name: {reps, samples_ns,
    # median_ns, chosen}}; the figures above are the chosen one's (the lowest median)
    variants: Optional[dict[str, dict[str, Any]]] = None

    def to_json(self) -> dict[str, Any]:
        d = dict(vars(self))
        for k in ("variants", "vs_add", "inaccurate"):
            if d[k] is None:
                del d[k]
        return d


@dataclass
class CaseResult:
    case: Case
    results: dict[str, ImplResult]

    def to_json(self) -> dict[str, Any]:
        c = self.case
        return {
            "name": c.name,
            "op": c.op,
            "description": c.describe(),
            "definition": OP_DESCRIPTIONS[c.op] + (
                f"; then {c.activation}: {ACTIVATION_DESCRIPTIONS[c.activation]}" if c.activation else ""),
            "activation": c.activation,
            "shape": list(c.shape),
            "dtype": c.dtype,
            "layout": c.layout,
            "axes": list(c.axes),
            "groups": c.groups,
            "epsilon": c.epsilon,
            "compiled": c.compiled,
            "input_bytes": c.nbytes,
            "bytes_moved": c.bytes_moved,
            "tolerance": {"atol": TOLERANCE[c.dtype][0], "rtol": TOLERANCE[c.dtype][1]},
            "results": {k: v.to_json() for k, v in self.results.items()},
            "summary": summary(self),
        }


def summary(cr: CaseResult) -> dict[str, Any]:
    r = cr.results
    s = r.get("simdnorm")
    others = {k: v for k, v in r.items()
              if k not in FLOORS + ("simdnorm",) and v.status == OK and v.median_ns}
    best = min(others, key=lambda k: others[k].median_ns) if others else None
    out: dict[str, Any] = {"best_other": best}
    out["best_other_gbps"] = others[best].gbps if best else None
    out["copy_gbps"] = r["copy"].gbps if "copy" in r and r["copy"].status == OK else None
    if "add" in r:
        out["add_gbps"] = r["add"].gbps if r["add"].status == OK else None
    if s is not None and s.status == OK:
        out["simdnorm_gbps"] = s.gbps
        out["simdnorm_vs_copy"] = s.vs_copy
        if "add" in r:
            out["simdnorm_vs_add"] = s.vs_add
        out["simdnorm_speedup_over_best_other"] = (others[best].median_ns / s.median_ns) if best else None
    return out


def copied_exactly(out: np.ndarray, x: np.ndarray) -> bool:
    """out holds exactly x's bits, element by element."""
    if out.shape != x.shape or out.dtype != x.dtype:
        return False
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
    return bool(np.array_equal(out.view(uint), x.view(uint)))


def _verify(case: Case, name: str, prep: Prepared, data: CaseData, ref: np.ndarray) -> ImplResult:
    # Every output is NaN before each checked call, so that an element the call does not write shows.
    if prep.out is not None:
        prep.out.fill(np.nan)
    try:
        out = prep.run_once()
    except Exception as e:  # noqa: BLE001
        return ImplResult(ERROR, reason=f"{type(e).__name__}: {e}"[:200], note=prep.note)
    if prep.exact is not None:  # a floor: its output bit for bit
        what = prep.exact_of or "the expected bits"
        if not copied_exactly(np.asarray(out), prep.exact):
            return ImplResult(WRONG, reason=f"{name} output differs from {what}", note=prep.note)
        for vname, fn in (prep.variants or {}).items():
            if prep.out is None:
                break
            if fn is prep.fn:  # run_once has just checked it
                continue
            prep.out.fill(np.nan)
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                return ImplResult(ERROR, reason=f"{vname}: {type(e).__name__}: {e}"[:200], note=prep.note)
            if not copied_exactly(prep.out, prep.exact):
                return ImplResult(WRONG, reason=f"{name} ({vname}) output differs from {what}",
                                  note=prep.note)
        return ImplResult(OK, note=prep.note, max_abs_err=0.0)
    atol, rtol = TOLERANCE[case.dtype]
    tol = f"(tolerance {atol:g} + {rtol:g}*|ref|)"
    if isinstance(ref, Expected):
        # The primary output (out, grad_input) must be right, and every output known and shaped
        # right (err inf otherwise); a secondary one that is merely off is reported, and timed.
        each = check_each(case, out, ref)
        bad = {k: e for k, (good, e) in each.items() if not good}
        if bad and (ref.primary in bad or any(not np.isfinite(e) for e in bad.values())):
            err = max(bad.values(), key=lambda e: -1.0 if np.isnan(e) else e)
            return ImplResult(WRONG, note=prep.note, max_abs_err=err,
                              reason=f"{', '.join(bad)} differs from the float64 reference: "
                                     f"max |err| {err:.3g} {tol}")
        res = ImplResult(OK, note=prep.note, max_abs_err=each[ref.primary][1])
        if bad:
            res.inaccurate = (", ".join(f"{k} max |err| {e:.3g}" for k, e in bad.items())
                              + f" {tol}, |ref| + the terms' norm for sums")
        return res
    ok, err = check(case, out, ref)
    if not ok:
        return ImplResult(WRONG, note=prep.note, max_abs_err=err,
                          reason=f"output differs from the float64 reference: max |err| {err:.3g} {tol}")
    return ImplResult(OK, note=prep.note, max_abs_err=err)


def run_case(case: Case, impls: Sequence[Impl], rounds: int, min_sample_ns: float, warmup_ns: float,
             seed: int = 0, progress: Optional[Callable[[str], None]] = None,
             pause_ns: float = 0.0) -> CaseResult:
    say = progress or (lambda s: None)
    say("preparing data")
    results: dict[str, ImplResult] = {}
    prepared: dict[str, Prepared] = {}
    try:
        data = make_data(case, seed)
    except NotAvailable as e:
        return CaseResult(case, {i.name: ImplResult(NA, reason=str(e)) for i in impls if i.applies(case)})
    ref = reference(data)
    for impl in impls:
        if not impl.applies(case):
            continue
        say(f"setting up {impl.name}")
        reason = impl.unavailable()
        if reason:
            results[impl.name] = ImplResult(NA, reason=reason)
            continue
        try:
            prep = impl.prepare(data)
        except NotAvailable as e:
            results[impl.name] = ImplResult(NA, reason=str(e))
            continue
        except Exception as e:  # noqa: BLE001
            results[impl.name] = ImplResult(ERROR, reason=f"{type(e).__name__}: {e}"[:200])
            continue
        say(f"verifying {impl.name}")
        res = _verify(case, impl.name, prep, data, ref)
        results[impl.name] = res
        if res.status == OK:
            prepared[impl.name] = prep
    del ref
    gc.collect()
    fns: dict[str, Callable[[], Any]] = {}
    for k, p in prepared.items():
        if p.variants:
            fns.update({f"{k} [{v}]": f for v, f in p.variants.items()})
        else:
            fns[k] = p.fn
    raw = measure(fns, rounds, min_sample_ns, warmup_ns, progress=say, pause_ns=pause_ns)
    timings = {}
    for k, p in prepared.items():
        if not p.variants:
            timings[k] = raw[k]
            continue
        vt = {v: raw[f"{k} [{v}]"] for v in p.variants}
        best = min(vt, key=lambda v: vt[v].median_ns)
        timings[k] = vt[best]
        results[k].variants = {v: {"reps": t.reps, "samples_ns": [round(s, 1) for s in t.samples_ns],
                                   "median_ns": t.median_ns, "chosen": v == best}
                               for v, t in vt.items()}
        results[k].note = f"{best}; faster than " + ", ".join(
            f"{v} ({vt[v].median_ns / 1e3:.4g} us)" for v in vt if v != best)
    for name, t in timings.items():
        r = results[name]
        r.reps = t.reps
        r.samples_ns = [round(s, 1) for s in t.samples_ns]
        r.median_ns, r.q1_ns, r.q3_ns = t.median_ns, t.q1_ns, t.q3_ns
        r.min_ns, r.max_ns = t.min_ns, t.max_ns
        moved = prepared[name].bytes_moved or case.bytes_moved  # a floor counts its own bytes
        r.gbps = moved / r.median_ns  # bytes per ns == GB/s
    copy_t = timings["copy"].median_ns if "copy" in timings else None
    add_t = timings["add"].median_ns if "add" in timings else None
    for name, t in timings.items():
        r = results[name]
        if copy_t:
            r.vs_copy = t.median_ns / copy_t
        if add_t:
            r.vs_add = t.median_ns / add_t
        if name in FLOORS:
            continue
        others = {k: v.median_ns for k, v in timings.items() if k not in FLOORS + (name,)}
        if others:
            best = min(others, key=others.get)
            r.best_other = best
            r.vs_best_other = t.median_ns / others[best]
    for p in prepared.values():
        if p.close:
            p.close()
    return CaseResult(case, results)
