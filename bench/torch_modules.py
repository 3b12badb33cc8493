"""`python -m simdnorm bench --torch-modules`: simdnorm's torch path against torch.nn's own modules.

Each case builds a torch.nn module (parameters and running statistics drawn from a seeded generator,
not the defaults) and its simdnorm twin, ``simdnorm.torch.convert(copy.deepcopy(module))``: the same
parameter values, called on the same input tensor. Four measures per case, each timed for both
implementations in the same interleaved rounds (bench.timing.measure: warm-up, Williams order, the
median of the rounds' samples, the garbage collector off), the ratio = torch.nn's median / simdnorm's:

* ``fwd``: ``m(x)`` under ``torch.no_grad()``; BatchNorm2d in train mode (batch statistics and the
  running statistics' update), the others have no modes;
* ``fwd+bwd``: ``x`` requires grad; ``y = m(x)`` then ``torch.autograd.grad(y, (x, *params), dy)``,
  a new graph each call (autograd.grad: no gradient accumulated into ``.grad`` across calls);
* ``model fwd`` / ``model fwd+bwd``: the same inside a step ``h = torch.relu(x); y = m(h);
  z = torch.add(y, 1)`` (and its backward), so that torch's OpenMP workers, which spin for
  milliseconds after each parallel op, are awake around the norm. The whole step is timed; the
  norm's own share is clocked inside it too (perf_counter_ns around ``m(h)``, and for the backward
  the span between a hook on ``y``'s gradient and one on ``h``'s, i.e. every autograd node of the
  norm): "norm inside" is the median over the rounds of that per-call time.

The ``.../eval/...`` rows: BatchNorm2d in eval mode under autograd (fine-tuning with frozen
statistics: the running statistics normalize, and the backward treats them as constants), the two
backward measures only.

The per-call rows (``tiny/...``, (1, 16, 8, 8)-sized tensors, times in us): eval-mode module forward
under ``torch.no_grad()``, and ``torch.ops.simdnorm.*`` called raw against ``torch.nn.functional.*``.

Before any timing, each measure runs once on fresh copies of both modules and once in float64
(torch.nn's module and the tensors converted, the same values). simdnorm's outputs, gradients and
buffers (running statistics) must have torch.nn's shapes and dtypes and agree with the float64
result within the array cases' tolerance of the dtype (parameter gradients, sums over the batch,
relative to |ref| + their largest element); else the row prints MISMATCH with the worst error
instead of a time, and the run exits with status 1. torch.nn's own results are held to the same
reference: where they miss it (its bfloat16 LayerNorm's weight and bias gradients, ~8% off here)
the row is timed all the same and a note says so. (Against torch.nn's result directly, simdnorm's
correct bfloat16 gradients would read as a mismatch.)

The speed goal (issue 42) is printed beside each ratio: at least GOAL (1.5x) on every case of 1 MB
or more, for fwd and fwd+bwd, alone and in a model (there: the norm inside the step); a per-call
row meets it when simdnorm's time is within 1.5x of torch.nn's (ratio >= 1/1.5).

Beside it, the ceiling: torch.nn's time over the memory floor of the measure, the least traffic any
implementation has (fwd: read x, write y; fwd+bwd: that, then read x and dy, write dx: two and five
passes over a tensor of the input's size), each pass half the faster of two copies of x timed in
the same rounds as the plain measures (torch's ``copy_``, and a copy with non-temporal stores,
simdnorm's batch norm with mean 0, variance 1 and epsilon 0). The model rows take their plain
measure's floor, against the norm inside. No implementation that reads and writes at that speed
gets past the ceiling: a row whose ceiling is under the goal cannot meet it on this machine, and
the summary says so.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from statistics import median
from time import perf_counter_ns
from typing import Any, Callable, Optional, Sequence

from .cases import TOLERANCE
from .report import json_safe
from .timing import Timing, loop_overhead_ns, measure, quartiles

GOAL = 1.5  # torch.nn's time / simdnorm's, on every case of >= 1 MB
TINY_GOAL = 1 / 1.5  # per call: simdnorm within 1.5x of torch.nn
BIG_BYTES = 10 ** 6
DEFAULT_ROUNDS = 9
QUICK_ROUNDS = 5
JSON_SCHEMA = 1
IMPLS = ("torch.nn", "simdnorm")
MEASURES = ("fwd", "fwd+bwd", "model fwd", "model fwd+bwd")
MEASURE_TITLES = {
    "fwd": "Module forward: m(x) under torch.no_grad() (BatchNorm2d in train mode: batch statistics "
           "and the running statistics' update)",
    "fwd+bwd": "Forward + backward: x requires grad, y = m(x), torch.autograd.grad(y, (x, *params), "
               "dy), a new graph each call",
    "model fwd": "In a model, forward: h = torch.relu(x); y = m(h); z = torch.add(y, 1) under "
                 "torch.no_grad(), the whole step timed; 'norm inside' is m(h)'s own time in it",
    "model fwd+bwd": "In a model, forward + backward: the step above with x requiring grad, then "
                     "torch.autograd.grad(z, (x, *params), dy); 'norm inside': m(h) and its "
                     "backward nodes",
}
KIND_MODULE = {"bn": "BatchNorm2d", "layer": "LayerNorm", "rms": "RMSNorm", "group": "GroupNorm",
               "instance": "InstanceNorm2d"}
OP_NAMES = {  # torch.ops.simdnorm.<op> against torch.nn.functional.<fn>
    "bn": ("batch_normalization", "batch_norm"), "layer": ("layer_norm", "layer_norm"),
    "rms": ("rms_norm", "rms_norm"), "group": ("group_norm", "group_norm"),
    "instance": ("instance_norm", "instance_norm"),
}
_SHORT = {"float32": "f32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class ModuleCase:
    kind: str  # a key of KIND_MODULE
    shape: tuple[int, ...]
    dtype: str = "float32"  # the input's and the module's (module.to(dtype)): float32, bfloat16
    channels_last: bool = False
    groups: int = 0  # GroupNorm's
    tiny: bool = False  # a per-call row: eval mode, forward under no_grad only, times in us
    frozen: bool = False  # (bn) eval mode under autograd: fine-tuning with frozen statistics
    raw_op: bool = False  # (tiny) torch.ops.simdnorm.<op> against F.<fn>, not the modules
    quick: bool = False  # in --quick

    @property
    def name(self) -> str:
        kind = f"{self.kind}{self.groups}" if self.kind == "group" else self.kind
        parts = (["tiny"] if self.tiny else []) + (["op"] if self.raw_op else []) + [kind]
        parts.append("x".join(map(str, self.shape)))
        if self.kind == "bn" and not self.tiny:
            parts.append("nhwc" if self.channels_last else "nchw")
        if self.frozen:
            parts.append("eval")
        parts.append(_SHORT[self.dtype])
        return "/".join(parts)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * {"float32": 4, "bfloat16": 2}[self.dtype]

    def module_text(self) -> str:
        c, d = self.shape[1], self.shape[-1]
        arg = {"bn": f"{c}", "layer": f"{d}", "rms": f"{d}", "group": f"{self.groups}, {c}",
               "instance": f"{c}, affine=True"}[self.kind]
        s = f"{KIND_MODULE[self.kind]}({arg})"
        if self.dtype != "float32":
            s += f".to({self.dtype})"
        if self.kind == "bn":
            s += ".eval()" if self.tiny or self.frozen else ".train()"
        if self.channels_last:
            s += ", channels_last input"
        return s

    def describe(self) -> str:
        if self.raw_op:
            sn, f = OP_NAMES[self.kind]
            return f"torch.ops.simdnorm.{sn} vs F.{f}"
        return self.module_text()

    def measures(self) -> tuple[str, ...]:
        if self.frozen:  # (its forward alone is the inference the other benchmark times)
            return tuple(m for m in MEASURES if m.endswith("bwd"))
        return ("call",) if self.tiny else MEASURES


BN_SHAPE = (8, 256, 56, 56)
SEQ_SHAPE = (8, 512, 768)
TINY_4D = (1, 16, 8, 8)
TINY_SEQ = (1, 16, 64)  # the same 1024 elements, normalized over 64
CASES: list[ModuleCase] = [
    ModuleCase("bn", BN_SHAPE, quick=True),
    ModuleCase("bn", BN_SHAPE, channels_last=True),
    ModuleCase("bn", BN_SHAPE, frozen=True),
    ModuleCase("bn", BN_SHAPE, channels_last=True, frozen=True),
    ModuleCase("layer", SEQ_SHAPE, quick=True),
    ModuleCase("layer", SEQ_SHAPE, "bfloat16"),
    ModuleCase("rms", SEQ_SHAPE),
    ModuleCase("group", BN_SHAPE, groups=32),
    ModuleCase("instance", BN_SHAPE),
    ModuleCase("bn", TINY_4D, tiny=True, quick=True),
    ModuleCase("layer", TINY_SEQ, tiny=True, quick=True),
    ModuleCase("rms", TINY_SEQ, tiny=True),
    ModuleCase("group", TINY_4D, groups=4, tiny=True),
    ModuleCase("instance", TINY_4D, tiny=True),
    ModuleCase("bn", TINY_4D, tiny=True, raw_op=True, quick=True),
    ModuleCase("layer", TINY_SEQ, tiny=True, raw_op=True, quick=True),
    ModuleCase("rms", TINY_SEQ, tiny=True, raw_op=True),
    ModuleCase("group", TINY_4D, groups=4, tiny=True, raw_op=True),
    ModuleCase("instance", TINY_4D, tiny=True, raw_op=True),
]


def select(quick: bool = False, filters: Sequence[str] = ()) -> list[ModuleCase]:
    return [c for c in CASES if (c.quick or not quick) and (not filters or any(f in c.name for f in filters))]


# ------------------------------------------------------------------------------------ the cases
MMAP_THRESHOLD = 32 << 20  # glibc's largest
TRIM_THRESHOLD = 1 << 30


def steady_malloc() -> Optional[str]:
    """Keep the C heap's freed pages in the process (glibc mallopt: tensors up to 32 MiB from the
    heap, not from a fresh mmap; no trim below 1 GiB), and say so (None where not glibc).

    Inside the model step three input-sized tensors are alive at once, and with glibc's default
    thresholds some steps' output came from a fresh mapping: 6272 page faults for a 25.7 MB tensor,
    ~10 ms here, landing at random on whichever norm wrote it first (bimodal samples, either
    implementation). simdnorm.torch's large outputs come from blocks it keeps itself (docs/torch.rst,
    "Output memory"), which fault only when first mapped; torch.nn's from this heap: this spares
    torch.nn's samples the faults, and keeps the heap's state out of the ratio."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    m_trim_threshold, m_mmap_threshold = -1, -3
    if mallopt(m_mmap_threshold, MMAP_THRESHOLD) != 1 or mallopt(m_trim_threshold, TRIM_THRESHOLD) != 1:
        return None
    return f"mallopt: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"


class Unavailable(Exception):
    pass


def load_torch():
    """(torch, simdnorm, simdnorm.torch); Unavailable with the reason when one does not import."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"torch does not import: {type(e).__name__}: {e}") from None
    try:
        import simdnorm
        import simdnorm.torch as sntorch
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"simdnorm.torch does not import: {type(e).__name__}: {e}") from None
    return torch, simdnorm, sntorch


def make_module(torch, case: ModuleCase, gen):
    """The torch.nn module of the case, its parameters and running statistics drawn from gen."""
    nn = torch.nn
    c, d = case.shape[1], case.shape[-1]
    m = {"bn": lambda: nn.BatchNorm2d(c), "layer": lambda: nn.LayerNorm(d), "rms": lambda: nn.RMSNorm(d),
         "group": lambda: nn.GroupNorm(case.groups, c),
         "instance": lambda: nn.InstanceNorm2d(c, affine=True)}[case.kind]()
    with torch.no_grad():
        for name, p in m.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.25 * r if name == "weight" else 0.5 * r)
        if getattr(m, "running_mean", None) is not None:
            m.running_mean.copy_(0.2 * torch.randn(m.running_mean.shape, generator=gen))
            m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
    m = m.to(getattr(torch, case.dtype))
    return m.eval() if case.tiny or case.frozen else m.train()


def make_twin(sntorch, module):
    """simdnorm's twin of a torch.nn module: a deep copy converted by simdnorm.torch.convert."""
    twin = sntorch.convert(copy.deepcopy(module))
    if type(twin) is type(module):
        raise TypeError(f"simdnorm.torch.convert left {type(module).__name__} as it was")
    return twin


@dataclass
class Data:
    x: Any  # the input
    xg: Any  # a leaf sharing x's memory that requires grad
    dy: Any  # grad_output, laid out like the output


def make_data(torch, case: ModuleCase, gen) -> Data:
    dt = getattr(torch, case.dtype)
    x = (1.5 * torch.randn(case.shape, generator=gen) + 0.3).to(dt)
    dy = torch.randn(case.shape, generator=gen).to(dt)
    if case.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        dy = dy.contiguous(memory_format=torch.channels_last)
    return Data(x, x.detach().requires_grad_(), dy)


def _raw_op(torch, case: ModuleCase, m, x, simdnorm_side: bool):
    """The tiny raw-op row's callable: torch.ops.simdnorm.<op> or F.<fn> with the module's
    parameters (eval-mode batch norm: its running statistics)."""
    F = torch.nn.functional
    ops = torch.ops.simdnorm
    p = functools.partial
    eps = m.eps
    if case.kind == "bn":
        if simdnorm_side:
            return p(ops.batch_normalization, x, m.running_mean, m.running_var, m.weight, m.bias, epsilon=eps)
        return p(F.batch_norm, x, m.running_mean, m.running_var, m.weight, m.bias, False, 0.1, eps)
    if case.kind == "layer":
        if simdnorm_side:
            return p(ops.layer_norm, x, m.weight, m.bias, axis=-1, epsilon=eps)
        return p(F.layer_norm, x, m.normalized_shape, m.weight, m.bias, eps)
    if case.kind == "rms":
        if eps is None:
            eps = torch.finfo(torch.float32).eps
        if simdnorm_side:
            return p(ops.rms_norm, x, m.weight, axis=-1, epsilon=eps)
        return p(F.rms_norm, x, m.normalized_shape, m.weight, eps)
    if case.kind == "group":
        if simdnorm_side:
            return p(ops.group_norm, x, case.groups, m.weight, m.bias, epsilon=eps)
        return p(F.group_norm, x, case.groups, m.weight, m.bias, eps)
    if case.kind == "instance":
        if simdnorm_side:
            return p(ops.instance_norm, x, m.weight, m.bias, epsilon=eps)
        return p(F.instance_norm, x, None, None, m.weight, m.bias, True, 0.1, eps)
    raise ValueError(case.kind)


def make_step(torch, case: ModuleCase, measure_name: str, m, data: Data, simdnorm_side: bool,
              inner: Optional[list] = None) -> Callable[[], Any]:
    """The timed callable of one measure for module m. Returns what verification compares: the
    output (fwd, call), the step's output (model fwd), or (output, *gradients) (the fwd+bwd ones).
    The model steps append the norm's own time in ns to `inner` (one entry per call)."""
    x, xg, dy = data.x, data.xg, data.dy
    if measure_name == "call":
        if case.raw_op:
            return _raw_op(torch, case, m, x, simdnorm_side)
        return functools.partial(m, x)
    if measure_name == "fwd":
        return functools.partial(m, x)
    grad, relu, add = torch.autograd.grad, torch.relu, torch.add
    inputs = (xg,) + tuple(p for p in m.parameters() if p.requires_grad)
    if measure_name == "fwd+bwd":
        def fwd_bwd():
            y = m(xg)
            return (y,) + grad(y, inputs, dy)
        return fwd_bwd
    assert inner is not None
    if measure_name == "model fwd":
        def model_fwd():
            h = relu(x)
            t0 = perf_counter_ns()
            y = m(h)
            t1 = perf_counter_ns()
            z = add(y, 1)
            inner.append(t1 - t0)
            return z
        return model_fwd
    if measure_name == "model fwd+bwd":
        def model_fwd_bwd():
            marks = [0, 0]

            def at_y(_g):  # y's gradient is there: the norm's backward starts
                marks[0] = perf_counter_ns()

            def at_h(_g):  # h's gradient is complete: every autograd node of the norm has run
                marks[1] = perf_counter_ns()

            h = relu(xg)
            h.register_hook(at_h)
            t0 = perf_counter_ns()
            y = m(h)
            t1 = perf_counter_ns()
            y.register_hook(at_y)
            z = add(y, 1)
            gs = grad(z, inputs, dy)
            if not 0 < marks[0] <= marks[1]:
                raise RuntimeError(f"the gradient hooks around the norm ran out of order: {marks}")
            inner.append(t1 - t0 + marks[1] - marks[0])
            return (z,) + gs
        return model_fwd_bwd
    raise ValueError(measure_name)


# ---------------------------------------------------------------------------------- verification
def _names(measure_name: str, m) -> list[str]:
    if measure_name in ("fwd+bwd", "model fwd+bwd"):
        return ["out", "grad_input"] + [f"grad_{n}" for n, p in m.named_parameters() if p.requires_grad]
    return ["out"]


def compare(torch, who: str, name: str, got, ref64, dtype: str) -> Optional[str]:
    """None if `got` agrees with the float64 reference within the tolerance of `dtype` (the array
    cases': bench.cases.TOLERANCE), else what differs. Parameter gradients (sums over the batch) are
    held to |ref| + their largest |element|; num_batches_tracked must be equal."""
    if got.shape != ref64.shape:
        return f"{name}: shape {tuple(got.shape)}, the reference's {tuple(ref64.shape)}"
    if not got.is_floating_point():
        return None if torch.equal(got, ref64) else f"{name}: {got.tolist()} against {ref64.tolist()}"
    g = got.detach().double()
    r = ref64.detach().double()
    if r.numel() == 0:
        return None
    if not bool(torch.isfinite(g).all()):
        return f"{name}: not finite"
    atol, rtol = TOLERANCE[dtype]
    err = (g - r).abs()
    bound = r.abs()
    if name.startswith("grad_") and name != "grad_input":
        bound = bound + r.abs().max()
    if bool((err <= atol + rtol * bound).all()):
        return None
    i = int(err.argmax())
    return (f"{name}: max |err| {float(err.max()):.3g} ({who} {float(g.flatten()[i]):.6g}, float64 "
            f"{float(r.flatten()[i]):.6g}; tolerance {atol:g} + {rtol:g}*|ref|)")


def _reference(torch, case: ModuleCase, m, data: Data):
    """torch.nn's module and the data in float64 (the same values): the reference computation."""
    ref = copy.deepcopy(m).double()
    if case.kind == "rms" and ref.eps is None:  # torch.nn's None: the machine epsilon of the data's type
        ref.eps = torch.finfo(torch.float32).eps
    x64 = data.x.double()  # (keeps channels_last)
    return ref, Data(x64, x64.detach().requires_grad_(), data.dy.double())


def verify(torch, case: ModuleCase, measure_name: str, m, twin, data: Data
           ) -> tuple[Optional[str], Optional[str], float]:
    """Run the measure once on fresh copies of both modules and once in float64 (torch.nn's module
    and the data converted): (what of simdnorm's is off the float64 reference or differs from
    torch.nn's in shape or dtype, what of torch.nn's own is off the reference, the largest error of
    simdnorm's relative to the reference tensor's largest |element|)."""
    ref_mod, d64 = _reference(torch, case, m, data)
    mods = (copy.deepcopy(m), copy.deepcopy(twin), ref_mod)
    outs = []
    ctx = torch.no_grad() if measure_name in ("fwd", "model fwd", "call") else nullcontext()
    for mod, sn_side, d in zip(mods, (False, True, False), (data, data, d64)):
        fn = make_step(torch, case, measure_name, mod, d, sn_side, inner=[])
        with ctx:
            o = fn()
        if case.raw_op and sn_side and isinstance(o, tuple):  # (out, *statistics) but batch_normalization
            o = o[0]
        outs.append(o if isinstance(o, tuple) else (o,))
    names = _names(measure_name, mods[0])
    tn, sn, ref = outs
    if not len(tn) == len(sn) == len(ref) == len(names):
        return f"{len(sn)} outputs against torch.nn's {len(tn)}", None, math.inf
    triples = list(zip(names, tn, sn, ref))
    bufs = [dict(mod.named_buffers()) for mod in mods]
    triples += [(k, bufs[0][k], bufs[1].get(k), bufs[2][k]) for k in bufs[0]]
    problems, torch_off = [], []
    worst = 0.0
    for name, t, g, r in triples:
        if g is None or g.shape != t.shape or g.dtype != t.dtype:
            problems.append(f"{name}: " + ("missing" if g is None else f"{tuple(g.shape)} {g.dtype}")
                            + f" against torch.nn's {tuple(t.shape)} {t.dtype}")
            continue
        why = compare(torch, "simdnorm", name, g, r, case.dtype)
        if why:
            problems.append(why)
        elif g.numel() and g.is_floating_point():
            r64 = r.detach().double()
            d = float((g.detach().double() - r64).abs().max())
            worst = max(worst, d / max(float(r64.abs().max()), 1e-30))
        off = compare(torch, "torch.nn", name, t, r, case.dtype)
        if off:
            torch_off.append(off)
    return ("; ".join(problems) or None), ("; ".join(torch_off) or None), worst


# ------------------------------------------------------------------------------------------- rows
@dataclass
class Row:
    case: ModuleCase
    measure: str
    threads: int
    status: str = "ok"  # ok, MISMATCH, error
    reason: str = ""
    timings: Optional[dict[str, Timing]] = None
    inner_samples: Optional[dict[str, list[float]]] = None  # the norm's own time per call, per round
    max_rel_err: Optional[float] = None  # simdnorm's, against the float64 reference
    torch_off: Optional[str] = None  # what of torch.nn's own result is off the float64 reference
    floor_ns: Optional[float] = None  # the measure's memory floor (see the module's doc)

    def median(self, impl: str) -> Optional[float]:
        return self.timings[impl].median_ns if self.timings else None

    @property
    def ratio(self) -> Optional[float]:
        if not self.timings:
            return None
        return self.timings["torch.nn"].median_ns / self.timings["simdnorm"].median_ns

    def inner_median(self, impl: str) -> Optional[float]:
        return median(self.inner_samples[impl]) if self.inner_samples else None

    @property
    def inner_ratio(self) -> Optional[float]:
        if not self.inner_samples:
            return None
        return median(self.inner_samples["torch.nn"]) / median(self.inner_samples["simdnorm"])

    @property
    def ceiling(self) -> Optional[float]:
        """torch.nn's time (the norm inside, in a model) over the measure's memory floor."""
        tn = self.inner_median("torch.nn") if self.measure.startswith("model") else self.median("torch.nn")
        return None if tn is None or not self.floor_ns else tn / self.floor_ns

    @property
    def goal_ratio(self) -> Optional[float]:
        """The ratio the goal is judged on: the norm inside the step in a model, else the ratio."""
        return self.inner_ratio if self.measure.startswith("model") else self.ratio

    @property
    def goal(self) -> Optional[float]:
        if self.case.tiny:
            return TINY_GOAL
        return GOAL if self.case.nbytes >= BIG_BYTES else None

    @property
    def goal_met(self) -> Optional[bool]:
        if self.status != "ok":
            return False
        g, r = self.goal, self.goal_ratio
        return None if g is None or r is None else r >= g

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"case": self.case.name, "module": self.case.describe(),
                             "size_bytes": self.case.nbytes, "dtype": self.case.dtype,
                             "measure": self.measure, "threads": self.threads, "status": self.status}
        if self.reason:
            d["reason"] = self.reason
        if self.max_rel_err is not None:
            d["max_rel_err"] = self.max_rel_err
        if self.torch_off:
            d["torch_nn_off_reference"] = self.torch_off
        if self.timings:
            for k, t in self.timings.items():
                q1, _, q3 = quartiles(t.samples_ns)
                d[k] = {"median_ns": t.median_ns, "q1_ns": q1, "q3_ns": q3, "min_ns": t.min_ns,
                        "max_ns": t.max_ns, "reps": t.reps, "samples_ns": [round(s, 1) for s in t.samples_ns]}
            d["ratio"] = self.ratio
        if self.inner_samples:
            d["norm_inside"] = {k: {"median_ns": median(v), "samples_ns": [round(s, 1) for s in v]}
                                for k, v in self.inner_samples.items()}
            d["norm_inside"]["ratio"] = self.inner_ratio
        if self.floor_ns:
            d["floor_ns"] = self.floor_ns
            d["ceiling"] = self.ceiling
        d["goal"] = self.goal
        d["goal_met"] = self.goal_met
        return d


def _inner_samples(inner: list, t: Timing, rounds: int) -> list[float]:
    """Per round, the mean of the norm's own times over that round's sample: measure() called the
    step during the warm-up, then exactly t.reps times per round, so the last rounds * reps
    entries are the samples', in order."""
    n = rounds * t.reps
    if len(inner) < n:
        raise RuntimeError(f"{len(inner)} inner times for {rounds} rounds of {t.reps} calls")
    tail = inner[-n:]
    return [sum(tail[i * t.reps:(i + 1) * t.reps]) / t.reps for i in range(rounds)]


def run_case(torch, sntorch, case: ModuleCase, threads: int, rounds: int, min_sample_ns: float,
             warmup_ns: float, seed: int, say: Callable[[str], None]) -> list[Row]:
    gen = torch.Generator().manual_seed(seed)
    say("setting up")
    rows = []
    try:
        m = make_module(torch, case, gen)
        twin = make_twin(sntorch, m)
        data = make_data(torch, case, gen)
        pristine = (copy.deepcopy(m), copy.deepcopy(twin))  # the timing moves running statistics
    except Exception as e:  # noqa: BLE001
        return [Row(case, mname, threads, "error", f"setup: {type(e).__name__}: {e}"[:300])
                for mname in case.measures()]
    pause = 1e6 if threads > 1 else 0.0
    for mname in case.measures():
        row = Row(case, mname, threads)
        rows.append(row)
        say(f"{mname}: verifying")
        try:
            why, row.torch_off, worst = verify(torch, case, mname, *pristine, data)
        except Exception as e:  # noqa: BLE001
            row.status, row.reason = "error", f"{type(e).__name__}: {e}"[:300]
            continue
        row.max_rel_err = worst
        if why:
            row.status, row.reason = "MISMATCH", why
            continue
        inner: dict[str, list] = {k: [] for k in IMPLS}
        fns = {k: make_step(torch, case, mname, mod, data, k == "simdnorm", inner[k])
               for k, mod in zip(IMPLS, (m, twin))}
        if mname in FLOOR_PASSES:
            fns.update(copies(torch, data))
        ctx = torch.no_grad() if mname in ("fwd", "model fwd", "call") else nullcontext()
        prefix = f"{mname}: "
        try:
            with ctx:
                row.timings = measure(fns, rounds, min_sample_ns, warmup_ns,
                                      progress=lambda s: say(prefix + s), pause_ns=pause)
            if mname.startswith("model"):
                row.inner_samples = {k: _inner_samples(inner[k], row.timings[k], rounds) for k in IMPLS}
        except Exception as e:  # noqa: BLE001
            row.status, row.reason, row.timings = "error", f"{type(e).__name__}: {e}"[:300], None
        del fns, inner
    for r in rows:  # (a model row: its plain measure's floor)
        plain = next((p for p in rows if p.measure == r.measure.removeprefix("model ") and p.timings
                      and COPIES[0] in p.timings), None)
        if plain is not None:
            per_pass = min(plain.timings[k].median_ns for k in COPIES) / 2
            r.floor_ns = FLOOR_PASSES[plain.measure] * per_pass
    return rows


# The passes over a tensor of the input's size each measure makes at least: fwd reads x and writes
# y; fwd+bwd also reads x and dy and writes dx.
FLOOR_PASSES = {"fwd": 2, "fwd+bwd": 5}
COPIES = ("copy: torch", "copy: streaming")


def copies(torch, data: Data) -> dict[str, Callable[[], Any]]:
    """Two copies of x into a tensor of its layout, timed with the plain measures: torch's copy_,
    and one that writes with non-temporal stores past the caches, as simdnorm's kernels do there
    (simdnorm's batch norm with mean 0, variance 1 and epsilon 0: y = (x - 0) * 1). The faster
    one's time is two passes of the floor."""
    import simdnorm

    x = data.x
    y, streamed = torch.empty_like(x), torch.empty_like(x)
    zero = torch.zeros(x.shape[1], dtype=torch.float32)
    one = torch.ones(x.shape[1], dtype=torch.float32)
    return {COPIES[0]: lambda: y.copy_(x),
            COPIES[1]: lambda: simdnorm.batch_normalization(x, zero, one, epsilon=0.0, out=streamed)}


# ------------------------------------------------------------------------------------------ report
def _ms(ns: Optional[float]) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f}"


def _us(ns: Optional[float]) -> str:
    return "-" if ns is None else f"{ns / 1e3:.2f}"


def _x(r: Optional[float], goal: Optional[float] = None) -> str:
    """A ratio to 2 decimals; one under the goal cut, not rounded (1.4962 is not 1.50x)."""
    if r is None:
        return "-"
    return f"{math.floor(r * 100) / 100:.2f}x" if goal is not None and r < goal else f"{r:.2f}x"


def _goal(row: Row) -> str:
    met = row.goal_met
    return "-" if met is None else ("yes" if met else "NO")


def _failed(row: Row, w: int) -> Optional[str]:
    if row.status == "ok":
        return None
    return f"{row.case.name:<{w}}  {row.status}: {row.reason}"


def format_tables(rows: Sequence[Row], threads: int) -> str:
    out = []
    big = [r for r in rows if not r.case.tiny]
    w = max([len(r.case.name) for r in rows] + [4])
    for mname in MEASURES:
        mrows = [r for r in big if r.measure == mname]
        if not mrows:
            continue
        out.append(f"{MEASURE_TITLES[mname]}  [threads={threads}]")
        model = mname.startswith("model")
        if model:
            out.append(f"{'':<{w}}  {'':>6}  {'------------ the step ------------':^43}  "
                       f"{'------- the norm inside -------':^34}")
            out.append(f"{'case':<{w}}  {'MB':>6}  {'torch.nn ms':>11} {'simdnorm ms':>11} {'ratio':>7} "
                       f"{'diff ms':>9}  {'torch.nn ms':>11} {'simdnorm ms':>11} {'ratio':>7}  {'ceiling':>7}  "
                       f"goal>={GOAL:g}x")
        else:
            out.append(f"{'case':<{w}}  {'MB':>6}  {'torch.nn ms':>11} {'simdnorm ms':>11} {'ratio':>7}  "
                       f"{'floor ms':>8} {'ceiling':>7}  goal>={GOAL:g}x")
        for r in mrows:
            bad = _failed(r, w)
            if bad:
                out.append(bad)
                continue
            tn, sn = r.median("torch.nn"), r.median("simdnorm")
            line = (f"{r.case.name:<{w}}  {r.case.nbytes / 1e6:>6.1f}  {_ms(tn):>11} {_ms(sn):>11} "
                    f"{_x(r.ratio, None if model else r.goal):>7}")
            if model:
                line += (f" {_ms(None if tn is None or sn is None else tn - sn):>9}  {_ms(r.inner_median('torch.nn')):>11} "
                         f"{_ms(r.inner_median('simdnorm')):>11} {_x(r.inner_ratio, r.goal):>7}  "
                         f"{_x(r.ceiling, r.goal):>7}")
            else:
                line += f"  {_ms(r.floor_ns):>8} {_x(r.ceiling, r.goal):>7}"
            out.append(line + f"  {_goal(r)}" + (" *" if r.torch_off else ""))
        out.append("")
    tiny = [r for r in rows if r.case.tiny]
    if tiny:
        dw = max(len(r.case.describe()) for r in tiny)
        out.append(f"Per call, {tiny[0].case.nbytes / 1e3:g} kB tensors, torch.no_grad(), eval mode "
                   f"(goal: simdnorm's time within {1 / TINY_GOAL:g}x torch.nn's, ratio >= {TINY_GOAL:.2f})"
                   f"  [threads={threads}]")
        out.append(f"{'case':<{w}}  {'what':<{dw}}  {'torch.nn us':>11} {'simdnorm us':>11} {'ratio':>7}  goal")
        for r in tiny:
            bad = _failed(r, w)
            if bad:
                out.append(bad)
                continue
            out.append(f"{r.case.name:<{w}}  {r.case.describe():<{dw}}  {_us(r.median('torch.nn')):>11} "
                       f"{_us(r.median('simdnorm')):>11} {_x(r.ratio, r.goal):>7}  {_goal(r)}"
                       + (" *" if r.torch_off else ""))
        out.append("")
    if any(r.torch_off for r in rows):
        out.append("* torch.nn's own result is off the float64 reference there (simdnorm's is within the "
                   "tolerance; timed all the same): see the notes above the tables")
        out.append("")
    return "\n".join(out)


def format_goal_summary(rows: Sequence[Row], threads: int) -> str:
    judged = [r for r in rows if r.goal is not None]
    missed = [r for r in judged if not r.goal_met]
    s = (f"Goal at threads={threads}: met on {len(judged) - len(missed)} of {len(judged)} rows "
         f"(>= {GOAL:g}x on cases of >= 1 MB, in a model the norm inside the step; per call within "
         f"{1 / TINY_GOAL:g}x)")
    if missed:
        s += "; missed: " + ", ".join(
            f"{r.case.name} {r.measure}" + (f" ({_x(r.goal_ratio, r.goal)}"
                                            + (f", ceiling {_x(r.ceiling, r.goal)}" if r.ceiling else "")
                                            + ")" if r.goal_ratio else f" ({r.status})")
            for r in missed)
        beyond = [r for r in missed if r.ceiling is not None and r.ceiling < r.goal]
        if beyond:
            s += (f". {len(beyond)} of the missed rows {'has' if len(beyond) == 1 else 'have'} a ceiling "
                  f"under the goal: torch.nn runs within {GOAL:g}x of the memory floor there, so no "
                  "implementation can meet it on this machine")
    return s


# --------------------------------------------------------------------------------------------- main
def main(args, parser) -> int:
    """Run the torch-path benchmark with the parsed options of bench.cli (args.threads: a tuple)."""
    from .cli import Progress, _writable_file
    from .report import _loadavg, machine_info, versions

    if args.impl:
        parser.error("--impl is for the array cases; --torch-modules times torch.nn against simdnorm.torch")
    if args.plot:
        parser.error("--plot is for the array cases, not --torch-modules")
    cases = select(quick=args.quick, filters=args.filter)
    if not cases:
        parser.error(f"no --torch-modules case{' of --quick' if args.quick else ''} matches --filter "
                     f"{' / '.join(map(repr, args.filter))}; --torch-modules --list lists them")
    if args.json and not args.list:
        why = _writable_file("--json", args.json)
        if why:
            parser.error(why)
    if args.list:
        for c in cases:
            print(f"{c.name:<28} {c.describe()}  ({c.nbytes / 1e6:.3g} MB; {', '.join(c.measures())})")
        return 0
    try:
        torch, simdnorm, sntorch = load_torch()
    except Unavailable as e:
        print(f"--torch-modules: {e}", file=sys.stderr)
        return 2
    threads = list(args.threads)
    rounds = args.rounds if args.rounds is not None else (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    warmup_ms = args.warmup_ms if args.warmup_ms is not None else (5.0 if args.quick else 20.0)
    malloc = steady_malloc()
    load = _loadavg()
    print(f"simdnorm bench --torch-modules: {len(cases)} case(s), {rounds} interleaved rounds, samples >= "
          f"{args.min_sample_ms:g} ms, threads={','.join(map(str, threads))}; torch {torch.__version__}, "
          f"simdnorm {getattr(simdnorm, '__version__', '?')} ({simdnorm.isa()})"
          + (f", load average {load[0]:.2f} on {os.cpu_count()} CPUs" if load else ""))
    print("ratio = torch.nn's median / simdnorm's (over 1: simdnorm is faster); medians of the rounds' "
          "samples, in ms (per call: us); C heap: " + (malloc or "glibc's defaults (mallopt not available)")
          # (share_threads() keeps the default simdnorm.torch's import chose, and says what it is)
          + "; simdnorm's threads: " + ("torch's OpenMP team (simdnorm.torch.share_threads)"
                                        if sntorch.share_threads() else "its own pool") + "\n")
    saved = (torch.get_num_threads(), simdnorm.get_num_threads())
    all_rows: list[Row] = []
    t0 = time.monotonic()
    try:
        for n in threads:
            torch.set_num_threads(n)
            simdnorm.set_num_threads(n)
            progress = Progress(not args.no_progress, len(cases))
            rows: list[Row] = []
            try:
                for i, case in enumerate(cases, 1):
                    progress.start(i, f"threads={n} {case.name}")
                    rows += run_case(torch, sntorch, case, n, rounds, args.min_sample_ms * 1e6,
                                     warmup_ms * 1e6, args.seed, progress.update)
                    progress.done()
            finally:
                progress.done()
            for r in rows:
                if r.status == "MISMATCH":
                    print(f"!!! MISMATCH threads={n} {r.case.name} {r.measure}: {r.reason}", flush=True)
                if r.torch_off:
                    print(f"note threads={n} {r.case.name} {r.measure}: torch.nn's own result is off the "
                          f"float64 reference (simdnorm's is within the tolerance): {r.torch_off}")
            if any(r.status == "MISMATCH" or r.torch_off for r in rows):
                print()
            print(format_tables(rows, n))
            print(format_goal_summary(rows, n) + "\n", flush=True)
            all_rows += rows
    finally:
        torch.set_num_threads(saved[0])
        simdnorm.set_num_threads(saved[1])
    bad = [r for r in all_rows if r.status != "ok"]
    print(f"{len(all_rows)} row(s) in {time.monotonic() - t0:.1f} s"
          + (f"; {len(bad)} not timed (MISMATCH or error: see above)" if bad else ""))
    rc = 0
    if args.json:
        doc = {
            "suite": "simdnorm.bench.torch_modules",
            "schema": JSON_SCHEMA,
            "machine": machine_info(threads[0], []),
            "versions": versions([]),
            "config": {
                "threads": threads, "quick": args.quick, "filters": args.filter, "rounds": rounds,
                "min_sample_ms": args.min_sample_ms, "warmup_ms": warmup_ms, "seed": args.seed,
                "pause_between_samples_ms": {str(n): 1.0 if n > 1 else 0.0 for n in threads},
                "loop_overhead_ns": round(loop_overhead_ns(), 1), "goal": GOAL, "tiny_goal": TINY_GOAL,
                "ratio_definition": "torch.nn median time / simdnorm median time",
                "measures": {**MEASURE_TITLES, "call": "tiny rows: eval-mode module forward or the raw op, "
                                                       "under torch.no_grad()"},
                "argv": list(getattr(args, "argv", []) or []),
                "loadavg_at_start": load,
                "malloc": malloc,
            },
            "rows": [r.to_json() for r in all_rows],
        }
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(json_safe(doc), f, indent=1, allow_nan=False)
                f.write("\n")
            print(f"wrote {args.json}")
        except OSError as e:
            print(f"--json: cannot write {args.json}: {e}", file=sys.stderr)
            rc = 2
    if any(r.status == "MISMATCH" for r in all_rows):
        print("simdnorm.torch disagrees with torch.nn on some row (MISMATCH above)", file=sys.stderr)
        return 1
    if bad:
        return 1
    return rc

