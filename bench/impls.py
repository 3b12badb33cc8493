"""The implementations timed side by side: the copy roofline, numpy, simdnorm, and the peers.

Each implementation turns a :class:`CaseData` into a :class:`Prepared`: a timed callable that does
exactly the case's op (all setup, allocation and model building done before), and a way to run it
once and get its output for verification. An implementation that cannot do a case raises
:class:`NotAvailable` with the reason, and is shown as n/a.
"""
from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .cases import CaseData, NotAvailable
from .impl_base import Impl, LazyPeerImpl, Prepared, prepared_out
from .shapes import MOMENTUM, RUNNING_MEAN_INIT, RUNNING_VAR_INIT

__all__ = ["Prepared", "Impl", "LazyPeerImpl", "CopyImpl", "AddImpl", "NumpyImpl", "SimdnormImpl",
           "NotAvailable", "all_impls", "IMPL_NAMES"]


# --------------------------------------------------------------------------------------------- copy
class CopyImpl(Impl):
    """np.copyto(out, x): the same input into a same-layout output; the one-read one-write roofline.

    At N > 1 threads, on an array of >= SPLIT_MIN_BYTES that has an axis of >= N entries, two copies
    are timed in the same interleaved rounds and the faster by median is the roofline (both are in
    the JSON under "variants", the note says which won):
      - one np.copyto on the calling thread;
      - the copy split into N slices along the outermost axis that has at least N entries, copied
        by a small pool of Python threads (np.copyto releases the GIL on large arrays).
    The split alone is not an honest roofline: the pool's per-call overhead (submit, wake a worker,
    wait on a future: tens of us) made it slower than one thread up to ~12 MB. Measured here
    (2 vCPUs, threads=2, medians of 7 interleaved samples): 1.5 MB one thread 37.6 us vs split
    73.5 us, 3 MB 88 vs 147 us, 6 MB 254 vs 277 us, 12 MB 1086 vs 1368 us, 24.5 MB 2863 vs
    2629 us. Timing only the split made every t/copy ratio there look up to ~2x better than it was.
    Under SPLIT_MIN_BYTES only the one-thread copy is timed. At one thread nothing is split.
    """

    name = "copy"
    kind = "roofline"
    footnote = ("copy: np.copyto(out, x) of the same input into a same-layout output (the roofline of "
                "a one-read one-write op); at N threads on >= 1 MiB, the faster by median of one "
                "np.copyto and N slices copied by a small Python thread pool (the pool's per-call "
                "overhead makes the split slower on small and medium arrays); the note says which")
    SPLIT_MIN_BYTES = 1 << 20

    def __init__(self) -> None:
        self.threads = 1
        self._pool: Optional[ThreadPoolExecutor] = None

    def version(self) -> Optional[str]:
        return f"numpy {np.__version__}"

    def set_threads(self, n: int) -> None:
        if n != self.threads and self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self.threads = n

    def _get_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(1, self.threads - 1),
                                            thread_name_prefix="bench-copy")
        return self._pool

    @staticmethod
    def split_all(arrays: Sequence[np.ndarray], n: int) -> list[tuple[np.ndarray, ...]]:
        """The arrays (same shape and strides) cut into n slices along the outermost (largest-stride)
        axis of size >= n: one tuple of slices per part ([tuple(arrays)] when no axis has n)."""
        a0 = arrays[0]
        for ax in sorted(range(a0.ndim), key=lambda a: -abs(a0.strides[a])):
            size = a0.shape[ax]
            if size >= n:
                bounds = [size * i // n for i in range(n + 1)]
                idx = [slice(None)] * a0.ndim
                parts = []
                for lo, hi in zip(bounds[:-1], bounds[1:]):
                    idx[ax] = slice(lo, hi)
                    parts.append(tuple(a[tuple(idx)] for a in arrays))
                return parts
        return [tuple(arrays)]

    @classmethod
    def split(cls, x: np.ndarray, out: np.ndarray, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(out slice, x slice) pairs along the outermost (largest-stride) axis of size >= n."""
        return cls.split_all((out, x), n)

    # What the floor does: kernel(*operands) writes out (an operand); subclasses change these.
    kernel = staticmethod(np.copyto)

    def operands(self, data: CaseData) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray, str]:
        """(kernel arguments, the output among them, the bits it must hold, what those are)."""
        out = data.new_output()
        return (out, data.x), out, data.x, "its input"

    def bytes_moved(self, data: CaseData) -> int:
        return 2 * data.x.nbytes

    def prepare(self, data: CaseData) -> Prepared:
        args, out, exact, exact_of = self.operands(data)
        prep = self._prepare(args, out)
        prep.exact, prep.exact_of, prep.bytes_moved = exact, exact_of, self.bytes_moved(data)
        return prep

    def _prepare(self, args: tuple[np.ndarray, ...], out: np.ndarray) -> Prepared:
        kernel = self.kernel
        n = self.threads
        if n <= 1 or out.nbytes < self.SPLIT_MIN_BYTES:
            fn = functools.partial(kernel, *args)
            note = "" if n <= 1 else "one thread (small array)"
            return prepared_out(fn, out, note)
        parts = self.split_all(args, n)
        if len(parts) == 1:
            fn = functools.partial(kernel, *args)
            return prepared_out(fn, out, "one thread (no axis to split)")
        one_thread = functools.partial(kernel, *args)
        pool = self._get_pool()
        first, rest = parts[0], parts[1:]
        submit = pool.submit

        def threaded() -> None:
            futs = [submit(kernel, *p) for p in rest]
            kernel(*first)
            for f in futs:
                f.result()

        prep = prepared_out(threaded, out, f"1 thread or {len(parts)} threads, the faster")
        prep.variants = {"1 thread": one_thread, f"{len(parts)} threads": threaded}
        return prep

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


# ----------------------------------------------------------------------------------- two-read floor
class AddImpl(CopyImpl):
    """np.add(x, dy, out=dx) on the backward case's input and grad_output into a like-laid-out
    output: read two arrays, write one, the least any backward op can move (3 x input bytes). Only
    in the backward cases. Split across threads as the copy is (see CopyImpl).

    float16 and bfloat16 through uint16 views (an integer add, the same bytes): numpy's float16
    and ml_dtypes' bfloat16 add convert element by element and are compute-bound (8x512x768 here:
    float16 21 ms, bfloat16 7.5 ms, against 0.47 ms for the uint16 add and 1.4 ms for float32)."""

    name = "add"
    footnote = ("add: np.add(x, dy, out=dx) of the input and grad_output into a like-laid-out array "
                "(read two, write one: the floor of a backward op; backward cases only; float16 and "
                "bfloat16 as uint16 views, whose add moves the same bytes without numpy's per-element "
                "16-bit float conversions); threads as the copy")
    kernel = staticmethod(np.add)  # np.add(x, dy, dx): out= given positionally, the same call

    def applies(self, case) -> bool:
        return case.is_backward

    def operands(self, data: CaseData):
        if data.dy is None:
            raise NotAvailable("not a backward case (no grad_output)")
        out = data.new_output()
        x, dy, o = data.x, data.dy, out
        if x.dtype.itemsize == 2:  # float16 / bfloat16: same itemsize, so views of any strides
            x, dy, o = (a.view(np.uint16) for a in (x, dy, out))
        exact = np.empty_like(data.x)
        view = exact.view(o.dtype)
        np.add(x, dy, out=view)
        return (x, dy, o), out, exact, "np.add(x, dy)"

    def bytes_moved(self, data: CaseData) -> int:
        return 3 * data.x.nbytes


# -------------------------------------------------------------------------------------------- numpy
def numpy_activation(name: str, work: np.ndarray) -> Callable[[np.ndarray, np.ndarray], Any]:
    """act(src, dst): the activation `name` of `src` (an array like `work`: the work type, float32
    or float64) into `dst`, rounded once to dst's dtype; `dst` may be `src`. Silu's temporary is
    allocated here, before the timing."""
    wt = work.dtype.type
    if name == "relu":
        zero = wt(0.0)
        return lambda src, dst: np.maximum(src, zero, out=dst, dtype=wt)
    if name == "silu":  # x / (1 + exp(-x))
        t = np.empty_like(work)
        one = wt(1.0)

        def silu(src: np.ndarray, dst: np.ndarray) -> None:
            np.negative(src, out=t)
            np.exp(t, out=t)
            np.add(t, one, out=t)
            np.divide(src, t, out=dst, dtype=wt)

        return silu
    raise NotAvailable(f"no numpy version of activation {name!r}")


class NumpyImpl(Impl):
    """numpy written the obvious way: float32 work (float64 for float64 data), preallocated
    temporaries, rounded once."""

    name = "numpy"
    kind = "numpy"
    footnote = ("numpy: the obvious ufunc code, float32 work (float64 work and parameters for "
                "float64 data) with preallocated temporaries, rounded once (after the activation, "
                "if any: maximum, or negative/exp/add/divide for silu); always one thread")

    def __init__(self) -> None:
        self.threads = 1

    def version(self) -> Optional[str]:
        return np.__version__

    def prepare(self, data: CaseData) -> Prepared:
        case = data.case
        if case.is_training:
            raise NotAvailable("no numpy version of the training ops (PyTorch's is the baseline)")
        x = data.x
        out = data.new_output()
        # the work type: float32, or float64 for float64 data (a float64 user's obvious code)
        wt = data.param_dtype.type
        params = data.user_params()
        eps = case.epsilon
        in_wt = x.dtype == wt  # no separate temporaries: work in the output
        nd = x.ndim
        note = "single-threaded" if self.threads > 1 else ""
        if case.op == "batch_norm":
            bshape = (1, -1) + (1,) * (nd - 2)
            mean, var, scale, bias = (params[k].reshape(bshape)
                                      for k in ("mean", "var", "scale", "bias"))
            tmp = out if in_wt else np.empty_like(x, dtype=wt)
            # with an activation the norm stays in the work type (tmp) until the activation rounds it
            act = numpy_activation(case.activation, tmp) if case.activation else None
            norm_out = tmp if act else out

            def fn() -> None:
                a = scale / np.sqrt(var + eps)
                b = bias - mean * a
                np.multiply(x, a, out=tmp, dtype=wt)
                np.add(tmp, b, out=norm_out, dtype=wt)
                if act:
                    act(tmp, out)

            return prepared_out(fn, out, note)

        # the mean-variance family
        xv, ov_ = x, out
        scale = params.get("scale")
        bias = params.get("bias")
        if case.op == "group_norm":
            n, c = x.shape[:2]
            g = case.groups
            gshape = (n, g, c // g) + x.shape[2:]
            xv, ov_ = x.reshape(gshape), out.reshape(gshape)  # views: NCHW is contiguous
            axes = tuple(range(2, xv.ndim))
            pshape = (1, g, c // g) + (1,) * (nd - 2)
        elif case.op in ("layer_norm", "rms_norm"):
            axes = (nd - 1,)
            pshape = (-1,)
        else:  # instance_norm, mvn
            axes = tuple(case.axes)
            pshape = (1, -1) + (1,) * (nd - 2)
        if scale is not None:
            scale = scale.reshape(pshape)
        if bias is not None:
            bias = bias.reshape(pshape)
        d = ov_ if in_wt else np.empty_like(xv, dtype=wt)
        sq = np.empty_like(xv, dtype=wt)
        center = case.op != "rms_norm"
        one = wt(1.0)
        # with an activation the norm stays in the work type (d) until the activation rounds it
        act = numpy_activation(case.activation, d) if case.activation else None
        norm_out = d if act else ov_

        def normalize() -> None:
            if center:
                mean = np.mean(xv, axis=axes, keepdims=True, dtype=wt)
                np.subtract(xv, mean, out=d, dtype=wt)
                src = d
            else:
                src = xv
            np.multiply(src, src, out=sq, dtype=wt)
            var = np.mean(sq, axis=axes, keepdims=True)
            inv = one / np.sqrt(var + eps)
            if scale is None and bias is None:
                np.multiply(src, inv, out=norm_out, dtype=wt)
                return
            np.multiply(src, inv, out=d, dtype=wt)
            if bias is None:
                np.multiply(d, scale, out=norm_out, dtype=wt)
            else:
                np.multiply(d, scale, out=d)
                np.add(d, bias, out=norm_out, dtype=wt)

        if not act:
            return prepared_out(normalize, out, note)

        def normalize_then_activate() -> None:
            normalize()
            act(d, ov_)

        return prepared_out(normalize_then_activate, out, note)


# ----------------------------------------------------------------------------------------- simdnorm
_SIMDNORM_LOCK = threading.Lock()
_SIMDNORM: dict[str, Any] = {}


def load_simdnorm():
    """(module, None) or (None, reason). Imported lazily, once."""
    with _SIMDNORM_LOCK:
        if "mod" not in _SIMDNORM:
            try:
                import simdnorm  # the package under test (this suite's parent when installed)
                _SIMDNORM["mod"], _SIMDNORM["err"] = simdnorm, None
            except Exception as e:  # noqa: BLE001 - any import failure means "not available"
                _SIMDNORM["mod"], _SIMDNORM["err"] = None, f"import simdnorm failed: {type(e).__name__}: {e}"
        return _SIMDNORM["mod"], _SIMDNORM["err"]


class SimdnormImpl(Impl):
    name = "simdnorm"
    kind = "simdnorm"
    footnote = ("simdnorm: the functional call with out= (tiny/bn-compiled: simdnorm.compile(desc)), "
                "float32 (C,) parameters (float64 ones for float64 data), a +activation case's "
                "activation fused (activation=\"relu\"/\"silu\"; a -bwd+ case's backward takes it too); training: "
                "batch_normalization_training with running statistics, and the backward ops with "
                "out= for grad_input, given the statistics of the forward run with return_stats "
                "before the timing")

    def __init__(self) -> None:
        self.threads = 1

    def _mod(self):
        mod, err = load_simdnorm()
        if mod is None:
            raise NotAvailable(err)
        return mod

    def unavailable(self) -> Optional[str]:
        return load_simdnorm()[1]

    def version(self) -> Optional[str]:
        mod = load_simdnorm()[0]
        return None if mod is None else str(getattr(mod, "__version__", "?"))

    def set_threads(self, n: int) -> None:
        self.threads = n
        mod = load_simdnorm()[0]
        if mod is not None and hasattr(mod, "set_num_threads"):
            mod.set_num_threads(n)

    @staticmethod
    def _need(mod, name: str):
        f = getattr(mod, name, None)
        if f is None:
            raise NotAvailable(f"simdnorm has no {name}")
        return f

    def prepare(self, data: CaseData) -> Prepared:
        if data.case.is_training:
            return self._prepare_training(data)
        sn = self._mod()
        case = data.case
        x = data.x
        out = data.new_output()
        # 1-D, float32 (mixed precision for float16/bfloat16 inputs) or float64 for float64 data
        p = data.user_params()
        eps = case.epsilon
        # activation= only where the case fuses one: the other cases' calls stay as they were
        # (the tiny ones time the per-call cost)
        act = {"activation": case.activation} if case.activation else {}
        partial = functools.partial
        if case.op == "batch_norm" and case.compiled:
            TensorDesc = self._need(sn, "TensorDesc")
            BND = self._need(sn, "BatchNormalizationDesc")
            compile_ = self._need(sn, "compile")
            item = x.dtype.itemsize
            strides = None if x.flags.c_contiguous else tuple(s // item for s in x.strides)
            xdesc = TensorDesc(x.dtype, tuple(x.shape), strides)
            pdesc = [TensorDesc(data.param_dtype, (case.param_len,)) for _ in range(4)]
            desc = BND(xdesc, *pdesc, epsilon=eps, **act)
            op = compile_(desc)
            fn = partial(op, x, p["mean"], p["var"], p["scale"], p["bias"], out=out)
            return prepared_out(fn, out, "compile(desc)")
        if case.op == "batch_norm":
            f = self._need(sn, "batch_normalization")
            fn = partial(f, x, p["mean"], p["var"], p["scale"], p["bias"], epsilon=eps, out=out, **act)
        elif case.op == "instance_norm":
            f = self._need(sn, "instance_norm")
            fn = partial(f, x, p["scale"], p["bias"], epsilon=eps, out=out, **act)
        elif case.op == "group_norm":
            f = self._need(sn, "group_norm")
            fn = partial(f, x, case.groups, p["scale"], p["bias"], epsilon=eps, out=out, **act)
        elif case.op == "mvn":
            f = self._need(sn, "mean_variance_normalization")
            fn = partial(f, x, tuple(case.axes), epsilon=eps, out=out, **act)
        elif case.op == "layer_norm":
            f = self._need(sn, "layer_norm")
            fn = partial(f, x, p["scale"], p["bias"], epsilon=eps, out=out, **act)
        elif case.op == "rms_norm":
            f = self._need(sn, "rms_norm")
            fn = partial(f, x, p["scale"], epsilon=eps, out=out, **act)
        else:
            raise NotAvailable(f"unknown op {case.op}")
        return prepared_out(fn, out)

    def _prepare_training(self, data: CaseData) -> Prepared:
        """Forward-training batch norm: the call with running statistics (PyTorch's momentum), which
        it updates in place on every timed call. Backward: the statistics from the forward op with
        return_stats=True (batch_normalization_training for batch norm), then only the backward
        call is timed: grad_input into a preallocated array, grad_scale and grad_bias returned."""
        sn = self._mod()
        case = data.case
        x, dy = data.x, data.dy
        out = data.new_output()
        p = data.user_params()
        scale, bias = p.get("scale"), p.get("bias")
        eps = case.epsilon
        partial = functools.partial
        op = case.op
        if op == "batch_norm_training":
            rm = np.empty(case.param_len, data.param_dtype)
            rv = np.empty_like(rm)
            fn = partial(sn.batch_normalization_training, x, scale, bias, epsilon=eps, running_mean=rm,
                         running_var=rv, momentum=MOMENTUM, momentum_convention="pytorch", out=out)

            def run_training() -> dict:
                rm.fill(RUNNING_MEAN_INIT)
                rv.fill(RUNNING_VAR_INIT)
                _, mean, var = fn()
                return {"out": out, "mean": mean, "variance": var, "running_mean": rm.copy(),
                        "running_var": rv.copy()}

            return Prepared(fn, run_training, out=out)
        # a -bwd+<activation> case's gradient through its forward's activation (activation= only
        # there: the other calls stay as they were)
        act = {"activation": case.activation} if case.activation else {}
        if op == "batch_norm_backward":
            _, mean, var = sn.batch_normalization_training(x, scale, bias, epsilon=eps)
            fn = partial(sn.batch_normalization_backward, dy, x, mean, var, scale, bias, epsilon=eps,
                         training=True, out=out, **act)
        elif op == "batch_norm_eval_backward":  # the given statistics, as an eval-mode model's
            fn = partial(sn.batch_normalization_backward, dy, x, p["mean"], p["var"], scale, bias, epsilon=eps,
                         training=False, out=out, **act)
        elif op == "layer_norm_backward":
            _, mean, inv = sn.layer_norm(x, scale, bias, epsilon=eps, return_stats=True)
            fn = partial(sn.layer_norm_backward, dy, x, mean, inv, scale, bias, epsilon=eps, out=out, **act)
        elif op == "rms_norm_backward":
            _, _, inv = sn.rms_norm(x, scale, epsilon=eps, return_stats=True)
            fn = partial(sn.rms_norm_backward, dy, x, inv, scale, epsilon=eps, out=out, **act)
        elif op == "group_norm_backward":
            g = case.groups
            _, mean, inv = sn.group_norm(x, g, scale, bias, epsilon=eps, return_stats=True)
            fn = partial(sn.group_norm_backward, dy, x, g, mean, inv, scale, bias, epsilon=eps, out=out, **act)
        elif op == "instance_norm_backward":
            _, mean, inv = sn.instance_norm(x, scale, bias, epsilon=eps, return_stats=True)
            fn = partial(sn.instance_norm_backward, dy, x, mean, inv, scale, bias, epsilon=eps, out=out, **act)
        elif op == "mvn_backward":
            axes = tuple(case.axes)
            _, mean, inv = sn.mean_variance_normalization(x, axes, epsilon=eps, return_stats=True)
            fn = partial(sn.mean_variance_normalization_backward, dy, x, axes, mean, inv, epsilon=eps,
                         out=out, **act)
        else:
            raise NotAvailable(f"unknown op {op}")

        def run_backward() -> dict:
            _, gs, gb = fn()
            res = {"grad_input": out, "grad_scale": gs, "grad_bias": gb}
            return {k: v for k, v in res.items() if v is not None}

        return Prepared(fn, run_backward, out=out)


# -------------------------------------------------------------------------------------- registry
def all_impls() -> list[Impl]:
    """Every implementation, in display order: the floors, simdnorm, numpy, then the peers."""
    from .peer_onnxruntime import OnnxRuntimeImpl
    from .peer_openvino import OpenVinoImpl
    from .peer_torch import TorchImpl
    return [CopyImpl(), AddImpl(), SimdnormImpl(), NumpyImpl(), TorchImpl(), OnnxRuntimeImpl(),
            OpenVinoImpl()]


IMPL_NAMES = ("copy", "add", "simdnorm", "numpy", "torch", "onnxruntime", "openvino")
