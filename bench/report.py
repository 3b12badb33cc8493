"""Terminal table, JSON document, machine information and the roofline plot."""
from __future__ import annotations

import math
import os
import platform
import sys
from typing import Any, Optional, Sequence

from .impl_base import FLOORS
from .runner import OK, CaseResult, summary
from .shapes import ACTIVATION_DESCRIPTIONS, OP_DESCRIPTIONS

JSON_SCHEMA = 1


_UNITS = (("ns", 1.0), ("us", 1e3), ("ms", 1e6), ("s", 1e9))


def _unit(ns: float) -> tuple[str, float]:
    for name, div in reversed(_UNITS):
        if ns >= div:
            return name, div
    return "ns", 1.0


def fmt_time(ns: Optional[float], unit_of: Optional[float] = None, suffix: bool = True) -> str:
    """ns in a readable unit (that of `unit_of` if given)."""
    if ns is None:
        return "-"
    name, div = _unit(ns if unit_of is None else unit_of)
    v = ns / div
    s = f"{v:.0f}" if div == 1.0 or v >= 100 else f"{v:.2f}"
    return f"{s} {name}" if suffix else s


def fmt_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def _has_add(cr: CaseResult) -> bool:
    return "add" in cr.results


def format_case(cr: CaseResult) -> str:
    c = cr.case
    add = _has_add(cr)  # a backward case: t/add, the time over the two-read floor's, beside t/copy
    lines = [f"{c.name}  ({c.describe()}; {fmt_bytes(c.bytes_moved)} moved)"]
    hdr = (f"  {'impl':<12}{'median':>11}{'IQR':>8}{'min..max':>19}{'GB/s':>8}{'t/copy':>8}"
           + (f"{'t/add':>7}" if add else "") + f"  {'t/best other':<22}note")
    lines.append(hdr)
    for name, r in cr.results.items():
        if r.status == OK and r.median_ns is not None:
            iqr = (r.q3_ns - r.q1_ns) / r.median_ns * 100 if r.median_ns else 0.0
            unit = _unit(r.median_ns)[0]
            mm = (f"{fmt_time(r.min_ns, r.median_ns, False)}.."
                  f"{fmt_time(r.max_ns, r.median_ns, False)} {unit}")
            best = "-" if r.vs_best_other is None else f"{r.vs_best_other:.2f} ({r.best_other})"
            note = f"INACCURATE {r.inaccurate}; {r.note}" if r.inaccurate else r.note
            lines.append(f"  {name:<12}{fmt_time(r.median_ns):>11}{iqr:>7.1f}%{mm:>19}"
                         f" {r.gbps:>7.2f} {_ratio(r.vs_copy):>7}"  # (a space apart however wide)
                         + (f" {_ratio(r.vs_add):>6}" if add else "") + f"  {best:<22}{note}".rstrip())
        else:
            why = r.reason + (f"  [{r.note}]" if r.note else "")
            lines.append(f"  {name:<12}{r.status:>11}  {why}")
    return "\n".join(lines)


def format_summary(results: Sequence[CaseResult]) -> str:
    w = max([len(cr.case.name) for cr in results] + [4])
    add = any(_has_add(cr) for cr in results)
    lines = ["Summary (GB/s = bytes moved / median time: 2 x input bytes, 3 x for a backward op; "
             "speedup = best other's time / simdnorm's"
             + ("; t/add = time / np.add(x, dy, out=dx)'s, backward cases)" if add else ")"),
             f"{'case':<{w}}  {'simdnorm':>10} {'GB/s':>7}  {'copy GB/s':>9}  {'t/copy':>6}  "
             + (f"{'t/add':>6}  " if add else "")
             + f"{'best other':<12} {'GB/s':>7}  {'speedup':>7}"]
    starred = False
    for cr in results:
        s = summary(cr)
        sn = cr.results.get("simdnorm")
        if sn is not None and sn.status == OK:
            sn_t, sn_g, sn_r = fmt_time(sn.median_ns), f"{sn.gbps:7.2f}", _ratio(sn.vs_copy)
            sn_a = _ratio(sn.vs_add)
        else:
            sn_t, sn_g, sn_r, sn_a = (sn.status if sn else "-"), f"{'-':>7}", "-", "-"
        copy = s.get("copy_gbps")
        bg = s.get("best_other_gbps")
        sp = s.get("simdnorm_speedup_over_best_other")
        copy_s = f"{copy:9.2f}" if copy else f"{'-':>9}"
        bg_s = f"{bg:7.2f}" if bg else f"{'-':>7}"
        sp_s = f"{sp:6.2f}x" if sp else f"{'-':>7}"
        if sn is not None and sn.inaccurate:
            sn_t, starred = sn_t + "*", True
        best = s.get("best_other") or "-"
        if best in cr.results and cr.results[best].inaccurate:
            best, starred = best + "*", True
        lines.append(f"{cr.case.name:<{w}}  {sn_t:>10} {sn_g}  {copy_s}  {sn_r:>6}  "
                     + (f"{sn_a:>6}  " if add else "")
                     + f"{best:<12} {bg_s}  {sp_s}")
    if starred:
        lines.append("* timed, but a statistic or parameter gradient it returns is beyond the "
                     "tolerance (INACCURATE in the case's table)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- machine
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    wanted = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
              "avx512_bf16", "avx512_fp16", "amx_bf16", "asimd", "sve")
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


def _loadavg() -> Optional[list[float]]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info(threads: int, impls) -> dict[str, Any]:
    from .impls import load_simdnorm

    sn, err = load_simdnorm()
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count()
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "logical_cpus": os.cpu_count(),
        "cpus_available": affinity,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "threads": threads,
        "simdnorm_isa": None,
        "simdnorm_available_isas": None,
        "simdnorm_num_threads": None,
        "loadavg": _loadavg(),
    }
    if sn is not None:
        for key, attr in (("simdnorm_isa", "isa"), ("simdnorm_available_isas", "available_isas"),
                          ("simdnorm_num_threads", "get_num_threads")):
            f = getattr(sn, attr, None)
            if callable(f):
                try:
                    v = f()
                    info[key] = list(v) if isinstance(v, (list, tuple)) else v
                except Exception as e:  # noqa: BLE001
                    info[key] = f"error: {e}"
    else:
        info["simdnorm_error"] = err
    return info


def versions(impls) -> dict[str, Optional[str]]:
    """Installed versions of numpy, ml_dtypes, simdnorm and the peers (None: not installed)."""
    from importlib import metadata

    from .impls import load_simdnorm

    v: dict[str, Optional[str]] = {}
    for pkg in ("numpy", "ml_dtypes", "torch", "onnxruntime", "onnx", "openvino", "matplotlib"):
        try:
            v[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            v[pkg] = None
    sn = load_simdnorm()[0]
    v["simdnorm"] = None if sn is None else str(getattr(sn, "__version__", "?"))
    return v


def json_document(results: Sequence[CaseResult], impls, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "suite": "simdnorm.bench",
        "schema": JSON_SCHEMA,
        "machine": machine_info(config.get("threads", 1), impls),
        "versions": versions(impls),
        "config": config,
        "ops": OP_DESCRIPTIONS,
        "activations": ACTIVATION_DESCRIPTIONS,
        "notes": [getattr(i, "footnote") for i in impls if getattr(i, "footnote", None)],
        "cases": [cr.to_json() for cr in results],
    }


# ---------------------------------------------------------------------------------------- plot
def plot(results: Sequence[CaseResult], path: str, title: str = "", per_panel: int = 12) -> None:
    """Grouped bars: GB/s of each implementation per case, the copy (roofline) as a black line over
    each group (and the two-read floor of a backward case as a dashed one); panels of `per_panel`
    cases stacked vertically."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    impl_names: list[str] = []
    for cr in results:
        for k in cr.results:
            if k not in FLOORS and k not in impl_names:
                impl_names.append(k)
    k = max(1, len(impl_names))
    chunks = [list(results[i:i + per_panel]) for i in range(0, len(results), per_panel)] or [[]]
    fig_h = 3.6 * len(chunks) + 0.8
    fig, axes = plt.subplots(len(chunks), 1, figsize=(14, fig_h), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.8 / k
    for ax, chunk in zip(axes[:, 0], chunks):
        for j, name in enumerate(impl_names):
            xs, hs = [], []
            for i, cr in enumerate(chunk):
                r = cr.results.get(name)
                if r is not None and r.status == OK and r.gbps:
                    xs.append(i + (j - (k - 1) / 2) * width)
                    hs.append(r.gbps)
            ax.bar(xs, hs, width=width * 0.95, color=colors[j % len(colors)])
        for i, cr in enumerate(chunk):
            for floor, style in (("copy", "-"), ("add", "--")):
                r = cr.results.get(floor)
                if r is not None and r.status == OK and r.gbps:
                    ax.plot([i - 0.45, i + 0.45], [r.gbps, r.gbps], color="black", lw=2.0, ls=style)
            for j, name in enumerate(impl_names):  # mark what could not be timed
                r = cr.results.get(name)
                if r is not None and r.status != OK:
                    ax.text(i + (j - (k - 1) / 2) * width, 0, r.status, rotation=90, fontsize=6,
                            ha="center", va="bottom", color=colors[j % len(colors)])
        ax.set_xticks(range(len(chunk)))
        ax.set_xticklabels([cr.case.name for cr in chunk], rotation=20, ha="right", fontsize=7)
        ax.set_xlim(-0.6, max(len(chunk), 1) - 0.4)
        ax.set_ylabel("GB/s")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle((title or "simdnorm benchmark") +
                 ": GB/s (bytes moved / median time) vs the copy roofline",
                 y=1 - 0.12 / fig_h, fontsize=11)
    # Proxies in each implementation's colour: an implementation with no bar at all (a peer that
    # is not installed) would otherwise get the legend's default colour, the first one's.
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=colors[j % len(colors)], label=name) for j, name in enumerate(impl_names)]
    handles.append(Line2D([], [], color="black", lw=2.0, label="copy (roofline)"))
    if any("add" in cr.results for cr in results):
        handles.append(Line2D([], [], color="black", lw=2.0, ls="--", label="add (backward floor)"))
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.38 / fig_h), fontsize=8,
               ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig_h))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def json_safe(o):
    """NaN/inf floats (e.g. the error of a NaN output) become strings: the JSON stays strict."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {k: json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    return o
