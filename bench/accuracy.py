"""`python -m simdnorm accuracy [--seed N] [--ops OP,...] [--json FILE]`: how far simdnorm's outputs
and returned statistics are from a float64 reference on ordinary data, with PyTorch's next to them.

Every case draws its data from a generator seeded by (--seed, op, dtype, data kind), so two runs
print the same numbers and --ops does not change the other cases' data. The reference is computed
from the input values as stored (after rounding to the case's dtype): statistics with long double
sums, the output in float64 from them. Errors:

- output: max |got - ref|; and |got - ref| / ulp, ulp = the spacing of the output dtype at
  dtype(ref) (max and mean), and at max(|ref|, 1) ("ulp1": near-zero outputs, where a mean that is
  off by one rounding is many ulps of the output, do not dominate it).
- statistics (mean, inv_std as returned; float32 for 16-bit and float32 inputs): a float64
  reference value r is compared as |got - r| / spacing(float32(r)), in float32 ulps whatever
  dtype a library returns them in.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

EPSILON = 1e-5
DEFAULT_SEED = 20240607

# (name, mean, standard deviation, dtypes it runs in)
DATA_KINDS = (
    ("N(0,1)", 0.0, 1.0, ("float32", "float16", "bfloat16")),
    ("N(3,1)", 3.0, 1.0, ("float32", "float16", "bfloat16")),
    # |mean| / std = 1e5: the pivot and the sums must absorb the mean (float32 only: 16-bit types
    # cannot hold a spread of 0.01 around 1000)
    ("N(1000,0.01)", 1000.0, 0.01, ("float32",)),
)
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class OpCase:
    op: str
    shape: tuple
    label: str
    has_mean: bool = True  # the op returns a mean (RMS norm does not)


OP_CASES = (
    OpCase("layer_norm", (4, 128, 768), "layer_norm"),
    OpCase("rms_norm", (4, 128, 768), "rms_norm", has_mean=False),
    OpCase("instance_norm", (8, 64, 28, 28), "instance_norm"),
    OpCase("group_norm", (4, 256, 32, 32), "group_norm G=32"),
    OpCase("mvn", (8, 64, 28, 28), "mvn (0,2,3)"),
    OpCase("batch_norm", (8, 64, 28, 28), "batch_norm"),  # given its statistics: the output only
)
OP_NAMES = tuple(c.op for c in OP_CASES)
GROUPS = 32
MVN_AXES = (0, 2, 3)

# float32, float16, bfloat16: (precision in bits including the implicit one, smallest normal exponent)
_FORMAT = {"float32": (24, -126), "float16": (11, -14), "bfloat16": (8, -126)}


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def spacing(ref: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of `dtype` at dtype(ref): ulp(v) = 2^(e - p + 1) for |v| in [2^e, 2^(e+1)), and
    the subnormal spacing below the smallest normal. ref: float64."""
    p, emin = _FORMAT[dtype]
    rounded = np.abs(np.asarray(ref, np.float64)).astype(np_dtype(dtype)).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        _, e = np.frexp(rounded)  # rounded = m 2^e with m in [0.5, 1): the exponent is e - 1
    return np.ldexp(1.0, np.maximum(e - 1, emin) - (p - 1))


def ulp_errors(got: np.ndarray, ref: np.ndarray, dtype: str, floor: float = 0.0) -> np.ndarray:
    """|got - ref| in ulps of dtype at max(|ref|, floor); a non-finite result is an infinite error."""
    g = np.asarray(got).astype(np.float64)
    at = np.maximum(np.abs(ref), floor) if floor else ref
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(g - ref) / spacing(at, dtype)
    return np.where(np.isfinite(g), err, np.inf)


# ------------------------------------------------------------------------------------ the data
@dataclass
class CaseData:
    x: np.ndarray  # the input, in the case's dtype
    scale: np.ndarray  # per normalized element (layer/RMS norm) or per channel
    bias: np.ndarray
    bn_mean: Optional[np.ndarray] = None  # batch norm's given statistics, (C,), the input's dtype
    bn_var: Optional[np.ndarray] = None


def case_seed(seed: int, op: str, dtype: str, kind: str) -> list:
    return [seed, zlib.crc32(f"{op}/{dtype}/{kind}".encode())]


def make_data(case: OpCase, dtype: str, mu: float, sd: float, rng: np.random.Generator) -> CaseData:
    dt = np_dtype(dtype)
    x = (mu + sd * rng.standard_normal(case.shape)).astype(dt)
    n_params = case.shape[-1] if case.op in ("layer_norm", "rms_norm") else case.shape[1]
    # scale near 1 and a small bias, as trained layers have; rounded to the input's dtype
    scale = (1.0 + 0.1 * rng.standard_normal(n_params)).astype(dt)
    bias = (0.1 * rng.standard_normal(n_params)).astype(dt)
    data = CaseData(x, scale, bias)
    if case.op == "batch_norm":  # given statistics: the data's own, per channel, in the input's dtype
        x64 = x.astype(np.float64)
        data.bn_mean = x64.mean(axis=(0, 2, 3)).astype(dt)
        data.bn_var = x64.var(axis=(0, 2, 3)).astype(dt)
    return data


# ---------------------------------------------------------------------------------- the reference
@dataclass
class Result:
    y: np.ndarray
    mean: Optional[np.ndarray]  # shaped as the reference's statistics, or None (not returned)
    inv_std: Optional[np.ndarray]
    stats_dtype: str = ""  # the dtype the library returned its statistics in


def _channel(p: np.ndarray, ndim: int) -> np.ndarray:
    return p.reshape((1, -1) + (1,) * (ndim - 2))


def reference(case: OpCase, d: CaseData) -> Result:
    """float64 output and statistics of the stored values; sums in long double (80-bit on x86-64),
    so that the reference's own rounding is far below a float32 ulp."""
    x = d.x.astype(np.float64)
    s = d.scale.astype(np.float64)
    b = d.bias.astype(np.float64)
    if case.op == "batch_norm":
        m = _channel(d.bn_mean.astype(np.float64), x.ndim)
        inv = 1.0 / np.sqrt(_channel(d.bn_var.astype(np.float64), x.ndim) + EPSILON)
        return Result((x - m) * inv * _channel(s, x.ndim) + _channel(b, x.ndim), None, None)
    if case.op == "group_norm":
        view = x.reshape(x.shape[0], GROUPS, -1)
        axes = (2,)
    else:
        view = x
        axes = {"layer_norm": (2,), "rms_norm": (2,), "instance_norm": (2, 3), "mvn": MVN_AXES}[case.op]
    xl = view.astype(np.longdouble)
    if case.has_mean:
        mean_l = xl.mean(axis=axes, keepdims=True)
        var_l = np.square(xl - mean_l).mean(axis=axes, keepdims=True)
    else:
        mean_l = None
        var_l = np.square(xl).mean(axis=axes, keepdims=True)
    inv = (1.0 / np.sqrt(var_l + EPSILON)).astype(np.float64)
    mean = None if mean_l is None else mean_l.astype(np.float64)
    z = (view - (0.0 if mean is None else mean)) * inv
    z = z.reshape(x.shape)
    if case.op in ("layer_norm", "rms_norm"):
        y = z * s + (0.0 if case.op == "rms_norm" else b)
    else:
        y = z * _channel(s, x.ndim) + _channel(b, x.ndim)
    return Result(y, mean, inv)


# ------------------------------------------------------------------------------------- simdnorm
def run_simdnorm(case: OpCase, d: CaseData, ref: Result) -> Result:
    import simdnorm

    x, s, b = d.x, d.scale, d.bias
    out = np.empty_like(x)
    if case.op == "batch_norm":
        y = simdnorm.batch_normalization(x, d.bn_mean, d.bn_var, s, b, epsilon=EPSILON, out=out)
        return Result(y, None, None)
    if case.op == "layer_norm":
        y, m, inv = simdnorm.layer_norm(x, s, b, epsilon=EPSILON, out=out, return_stats=True)
    elif case.op == "rms_norm":
        y, m, inv = simdnorm.rms_norm(x, s, epsilon=EPSILON, out=out, return_stats=True)
    elif case.op == "instance_norm":
        y, m, inv = simdnorm.instance_norm(x, s, b, epsilon=EPSILON, out=out, return_stats=True)
    elif case.op == "group_norm":
        y, m, inv = simdnorm.group_norm(x, GROUPS, s, b, epsilon=EPSILON, out=out, return_stats=True)
    else:
        y, m, inv = simdnorm.mean_variance_normalization(x, MVN_AXES, _channel(s, x.ndim), _channel(b, x.ndim),
                                                         epsilon=EPSILON, out=out, return_stats=True)
    shape = ref.inv_std.shape
    return Result(y, None if m is None else m.reshape(shape), inv.reshape(shape), inv.dtype.name)


# ---------------------------------------------------------------------------------------- torch
def load_torch():
    """(torch, None) or (None, why it is not used)."""
    try:
        import torch
        import torch.nn.functional  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or a broken install: say which
        return None, f"{type(e).__name__}: {e}"
    return torch, None


def _to_torch(torch, a: np.ndarray):
    if a.dtype.name == "bfloat16":  # numpy has no bfloat16: share the bits
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _to_numpy(torch, t) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np_dtype("bfloat16"))
    return t.numpy()


TORCH_CALLS = {
    "layer_norm": "F.layer_norm; statistics: aten.native_layer_norm",
    "rms_norm": "F.rms_norm; statistics: aten._fused_rms_norm's rstd (n/a when torch has none)",
    "instance_norm": "F.instance_norm; statistics: aten.native_batch_norm, training, of x viewed as (1, N*C, H, W) "
                     "(what F.instance_norm runs)",
    "group_norm": "F.group_norm; statistics: aten.native_group_norm",
    "mvn": "torch.var_mean(x, (0,2,3), correction=0), then (x - mean) * rsqrt(var + eps) * scale + bias",
    "batch_norm": "F.batch_norm, inference (statistics given)",
}


def run_torch(torch, case: OpCase, d: CaseData, ref: Result) -> Result:
    import torch.nn.functional as F

    xt = _to_torch(torch, d.x)
    st, bt = _to_torch(torch, d.scale), _to_torch(torch, d.bias)
    ndim = d.x.ndim
    m = inv = None
    if case.op == "layer_norm":
        shape = list(d.x.shape[-1:])
        y = F.layer_norm(xt, shape, st, bt, EPSILON)
        _, m, inv = torch.ops.aten.native_layer_norm(xt, shape, st, bt, EPSILON)
    elif case.op == "rms_norm":
        shape = list(d.x.shape[-1:])
        y = F.rms_norm(xt, shape, st, eps=EPSILON)  # eps given: its default is the dtype's epsilon
        fused = getattr(torch.ops.aten, "_fused_rms_norm", None)
        if fused is not None:
            try:
                _, inv = fused(xt, shape, st, EPSILON)
            except (RuntimeError, NotImplementedError):
                inv = None
    elif case.op == "instance_norm":
        n, c = d.x.shape[:2]
        y = F.instance_norm(xt, weight=st, bias=bt, eps=EPSILON)
        _, m, inv = torch.ops.aten.native_batch_norm(xt.reshape((1, n * c) + tuple(d.x.shape[2:])), None, None,
                                                     None, None, True, 0.0, EPSILON)
    elif case.op == "group_norm":
        n, c = d.x.shape[:2]
        hw = int(np.prod(d.x.shape[2:]))
        y = F.group_norm(xt, GROUPS, st, bt, EPSILON)
        _, m, inv = torch.ops.aten.native_group_norm(xt, st, bt, n, c, hw, GROUPS, EPSILON)
    elif case.op == "mvn":
        var, m = torch.var_mean(xt, dim=MVN_AXES, correction=0, keepdim=True)
        inv = torch.rsqrt(var + EPSILON)
        y = (xt - m) * inv * st.reshape(_channel(d.scale, ndim).shape) + bt.reshape(_channel(d.bias, ndim).shape)
    else:
        y = F.batch_norm(xt, _to_torch(torch, d.bn_mean), _to_torch(torch, d.bn_var), st, bt, False, 0.0, EPSILON)
    sdt = ""
    if inv is not None:
        sdt = str(inv.dtype).replace("torch.", "")
        shape = ref.inv_std.shape
        inv = _to_numpy(torch, inv).reshape(shape)
        m = None if m is None else _to_numpy(torch, m).reshape(shape)
    return Result(_to_numpy(torch, y), m, inv, sdt)


# -------------------------------------------------------------------------------------- metrics
def metrics(dtype: str, got: Result, ref: Result) -> dict[str, Any]:
    y = np.asarray(got.y).astype(np.float64)
    err = np.abs(y - ref.y)
    ulp = ulp_errors(got.y, ref.y, dtype)
    row: dict[str, Any] = {
        "out_abs_max": float(np.max(np.where(np.isfinite(y), err, np.inf))),
        "out_ulp_max": float(ulp.max()),
        "out_ulp_mean": float(ulp.mean()),
        "out_ulp1_max": float(ulp_errors(got.y, ref.y, dtype, floor=1.0).max()),
    }
    for name, g, r in (("mean", got.mean, ref.mean), ("inv_std", got.inv_std, ref.inv_std)):
        if g is None or r is None:
            row[f"{name}_ulp_max"] = row[f"{name}_ulp_mean"] = None  # n/a: not computed or not returned
        else:
            e = ulp_errors(g, r, "float32")
            row[f"{name}_ulp_max"] = float(e.max())
            row[f"{name}_ulp_mean"] = float(e.mean())
    row["stats_dtype"] = got.stats_dtype or None
    return row


def run_case(case: OpCase, dtype: str, kind: tuple, seed: int, torch) -> list[dict[str, Any]]:
    name, mu, sd, _ = kind
    rng = np.random.default_rng(case_seed(seed, case.op, dtype, name))
    data = make_data(case, dtype, mu, sd, rng)
    ref = reference(case, data)
    head = {"op": case.op, "shape": list(case.shape), "dtype": dtype, "data": name}
    rows = [dict(head, lib="simdnorm", **metrics(dtype, run_simdnorm(case, data, ref), ref))]
    if torch is not None:
        rows.append(dict(head, lib="torch", **metrics(dtype, run_torch(torch, case, data, ref), ref)))
    return rows


# ------------------------------------------------------------------------------------- the table
COLUMNS = (
    ("out_abs_max", "out max|err|"),
    ("out_ulp_max", "ulp max"),
    ("out_ulp_mean", "ulp mean"),
    ("out_ulp1_max", "ulp1 max"),
    ("mean_ulp_max", "mean max"),
    ("mean_ulp_mean", "mean avg"),
    ("inv_std_ulp_max", "inv_std max"),
    ("inv_std_ulp_mean", "inv_std avg"),
)


def _cell(key: str, v: Optional[float]) -> str:
    if v is None:
        return "n/a"
    if key == "out_abs_max":
        return f"{v:.2e}"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.2f}" if v < 1000 else f"{v:.3g}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (op, dtype, data, library), torch's under simdnorm's; a blank line between ops."""
    labels = {c.op: c.label for c in OP_CASES}
    head = ["op", "dtype", "data", "lib"] + [title for _, title in COLUMNS]
    body = []
    for r in rows:
        cells = [_cell(k, r[k]) for k, _ in COLUMNS]
        if r["lib"] == "torch" and r["stats_dtype"] not in (None, "float32"):  # 16-bit statistics
            cells[4:] = [c if c == "n/a" else c + "*" for c in cells[4:]]
        body.append([labels[r["op"]], r["dtype"], r["data"], r["lib"]] + cells)
    widths = [max(len(line[i]) for line in [head] + body) for i in range(len(head))]

    def text(line):
        return "  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))

    out = [text(head), "-" * len(text(head))]
    for k, (r, line) in enumerate(zip(rows, body)):
        if k and r["op"] != rows[k - 1]["op"]:
            out.append("")
        out.append(text(line).rstrip())
    return "\n".join(out)


def header_lines(seed: int, torch, torch_why: Optional[str]) -> list[str]:
    import simdnorm

    lines = [
        f"simdnorm {simdnorm.__version__} (isa {simdnorm.isa()}), numpy {np.__version__}, seed {seed}, "
        f"epsilon {EPSILON:g}, 1 thread",
    ]
    if torch is None:
        lines.append(f"torch: not used ({torch_why}); simdnorm's columns only")
    else:
        lines.append(f"torch {torch.__version__}, 1 thread, in the input's dtype (bfloat16 tensors for bfloat16)")
    lines += [
        "data: x ~ N(mean, std) rounded to the dtype; scale ~ 1 + 0.1 N(0,1), bias ~ 0.1 N(0,1) in the same "
        "dtype (rms_norm: no bias); batch_norm is given the data's per-channel mean and variance in the dtype",
        "reference: float64 (long double sums) from the stored input values",
        "out max|err|: max |got - ref|; ulp max / ulp mean: |got - ref| / spacing of the output dtype at "
        "dtype(ref); ulp1: at max(|ref|, 1)",
        "mean / inv_std: returned statistics, |got - r| / spacing(float32(r)) for the float64 value r "
        "(float32 ulps, whatever dtype they come in); n/a: not computed or not returned",
    ]
    if torch is not None:
        lines.append("* torch returned 16-bit statistics (they are compared in float32 ulps all the same)")
        lines += [f"torch {op}: {call}" for op, call in TORCH_CALLS.items()]
    return lines


# ------------------------------------------------------------------------------------------ cli
def _ops(s: str) -> tuple:
    names = tuple(dict.fromkeys(p.strip() for p in s.split(",") if p.strip()))
    bad = [n for n in names if n not in OP_NAMES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(OP_NAMES)}; got {s!r}")
    return names


def _seed(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {s!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(prog="python -m simdnorm accuracy",
                                description="How far simdnorm's outputs and returned statistics are from a float64 "
                                            "reference\non ordinary data, with PyTorch's next to them.",
                                epilog=doc[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=_seed, default=DEFAULT_SEED, help=f"data seed (default {DEFAULT_SEED})")
    p.add_argument("--ops", type=_ops, default=OP_NAMES, metavar="OP,...",
                   help=f"ops to run (default all: {','.join(OP_NAMES)})")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return p


def _writable(path: str) -> Optional[str]:
    if os.path.isdir(path):
        return f"--json: {path} is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"--json: directory {parent} does not exist"
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        return f"--json: {path} is not writable"
    return None


def collect(seed: int, ops: Sequence[str], torch) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for case in OP_CASES:
        if case.op not in ops:
            continue
        for dtype in DTYPES:
            for kind in DATA_KINDS:
                if dtype in kind[3]:
                    rows += run_case(case, dtype, kind, seed, torch)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.json:
        why = _writable(args.json)
        if why:
            parser.error(why)
    import simdnorm

    torch, torch_why = load_torch()
    threads = simdnorm.get_num_threads()
    simdnorm.set_num_threads(1)  # simdnorm's results do not depend on it; torch's reductions might
    torch_threads = None
    if torch is not None:
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
    try:
        rows = collect(args.seed, args.ops, torch)
    finally:
        simdnorm.set_num_threads(threads)
        if torch is not None:
            torch.set_num_threads(torch_threads)
    print("\n".join(header_lines(args.seed, torch, torch_why)))
    print()
    print(format_table(rows))
    sys.stdout.flush()
    if args.json:
        doc = {
            "suite": "simdnorm.accuracy",
            "seed": args.seed,
            "epsilon": EPSILON,
            "simdnorm": {"version": simdnorm.__version__, "isa": simdnorm.isa()},
            "numpy": np.__version__,
            "threads": 1,
            "torch": None if torch is None else torch.__version__,
            "torch_unavailable": torch_why,
            "torch_calls": TORCH_CALLS if torch is not None else None,
            "data_kinds": [{"name": k[0], "mean": k[1], "std": k[2], "dtypes": list(k[3])} for k in DATA_KINDS],
            "definitions": {
                "out_abs_max": "max |got - ref|, ref the float64 output of the stored input values",
                "out_ulp": "|got - ref| / spacing of the output dtype at dtype(ref)",
                "out_ulp1": "|got - ref| / spacing of the output dtype at max(|ref|, 1)",
                "stats_ulp": "|got - r| / spacing(float32(r)), r the float64 statistic",
            },
            "cases": rows,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
