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
from typing import Any, Optional

import numpy as np

from .cases import CaseData, NotAvailable
from .impl_base import Impl, LazyPeerImpl, Prepared, prepared_out

__all__ = ["Prepared", "Impl", "LazyPeerImpl", "CopyImpl", "NumpyImpl", "SimdnormImpl", "NotAvailable",
           "all_impls", "IMPL_NAMES"]


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
    def split(x: np.ndarray, out: np.ndarray, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(out slice, x slice) pairs along the outermost (largest-stride) axis of size >= n."""
        axes = sorted(range(x.ndim), key=lambda a: -abs(x.strides[a]))
        for ax in axes:
            size = x.shape[ax]
            if size >= n:
                bounds = [size * i // n for i in range(n + 1)]
                idx = [slice(None)] * x.ndim
                pairs = []
                for lo, hi in zip(bounds[:-1], bounds[1:]):
                    idx[ax] = slice(lo, hi)
                    pairs.append((out[tuple(idx)], x[tuple(idx)]))
                return pairs
        return [(out, x)]

    def prepare(self, data: CaseData) -> Prepared:
        x = data.x
        out = data.new_output()
        n = self.threads
        if n <= 1 or x.nbytes < self.SPLIT_MIN_BYTES:
            fn = functools.partial(np.copyto, out, x)
            note = "" if n <= 1 else "one thread (small array)"
            return prepared_out(fn, out, note)
        pairs = self.split(x, out, n)
        if len(pairs) == 1:
            fn = functools.partial(np.copyto, out, x)
            return prepared_out(fn, out, "one thread (no axis to split)")
        one_thread = functools.partial(np.copyto, out, x)
        pool = self._get_pool()
        first, rest = pairs[0], pairs[1:]
        copyto = np.copyto
        submit = pool.submit

        def threaded_copy() -> None:
            futs = [submit(copyto, o, i) for o, i in rest]
            copyto(*first)
            for f in futs:
                f.result()

        prep = prepared_out(threaded_copy, out, f"1 thread or {len(pairs)} threads, the faster")
        prep.variants = {"1 thread": one_thread, f"{len(pairs)} threads": threaded_copy}
        return prep

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


# -------------------------------------------------------------------------------------------- numpy
class NumpyImpl(Impl):
    """numpy written the obvious way: float32 work (float64 for float64 data), preallocated
    temporaries, rounded once."""

    name = "numpy"
    kind = "numpy"
    footnote = ("numpy: the obvious ufunc code, float32 work (float64 work and parameters for "
                "float64 data) with preallocated temporaries, rounded once; always one thread")

    def __init__(self) -> None:
        self.threads = 1

    def version(self) -> Optional[str]:
        return np.__version__

    def prepare(self, data: CaseData) -> Prepared:
        case = data.case
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

            def fn() -> None:
                a = scale / np.sqrt(var + eps)
                b = bias - mean * a
                np.multiply(x, a, out=tmp, dtype=wt)
                np.add(tmp, b, out=out, dtype=wt)

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

        def fn() -> None:
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
                np.multiply(src, inv, out=ov_, dtype=wt)
                return
            np.multiply(src, inv, out=d, dtype=wt)
            if bias is None:
                np.multiply(d, scale, out=ov_, dtype=wt)
            else:
                np.multiply(d, scale, out=d)
                np.add(d, bias, out=ov_, dtype=wt)

        return prepared_out(fn, out, note)


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
                "float32 (C,) parameters (float64 ones for float64 data)")

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
        sn = self._mod()
        case = data.case
        x = data.x
        out = data.new_output()
        # 1-D, float32 (mixed precision for float16/bfloat16 inputs) or float64 for float64 data
        p = data.user_params()
        eps = case.epsilon
        partial = functools.partial
        if case.op == "batch_norm" and case.compiled:
            TensorDesc = self._need(sn, "TensorDesc")
            BND = self._need(sn, "BatchNormalizationDesc")
            compile_ = self._need(sn, "compile")
            item = x.dtype.itemsize
            strides = None if x.flags.c_contiguous else tuple(s // item for s in x.strides)
            xdesc = TensorDesc(x.dtype, tuple(x.shape), strides)
            pdesc = [TensorDesc(data.param_dtype, (case.param_len,)) for _ in range(4)]
            desc = BND(xdesc, *pdesc, epsilon=eps)
            op = compile_(desc)
            fn = partial(op, x, p["mean"], p["var"], p["scale"], p["bias"], out=out)
            return prepared_out(fn, out, "compile(desc)")
        if case.op == "batch_norm":
            f = self._need(sn, "batch_normalization")
            fn = partial(f, x, p["mean"], p["var"], p["scale"], p["bias"], epsilon=eps, out=out)
        elif case.op == "instance_norm":
            f = self._need(sn, "instance_norm")
            fn = partial(f, x, p["scale"], p["bias"], epsilon=eps, out=out)
        elif case.op == "group_norm":
            f = self._need(sn, "group_norm")
            fn = partial(f, x, case.groups, p["scale"], p["bias"], epsilon=eps, out=out)
        elif case.op == "mvn":
            f = self._need(sn, "mean_variance_normalization")
            fn = partial(f, x, tuple(case.axes), epsilon=eps, out=out)
        elif case.op == "layer_norm":
            f = self._need(sn, "layer_norm")
            fn = partial(f, x, p["scale"], p["bias"], epsilon=eps, out=out)
        elif case.op == "rms_norm":
            f = self._need(sn, "rms_norm")
            fn = partial(f, x, p["scale"], epsilon=eps, out=out)
        else:
            raise NotAvailable(f"unknown op {case.op}")
        return prepared_out(fn, out)


# -------------------------------------------------------------------------------------- registry
def all_impls() -> list[Impl]:
    """Every implementation, in display order: the roofline, simdnorm, numpy, then the peers."""
    from .peer_onnxruntime import OnnxRuntimeImpl
    from .peer_openvino import OpenVinoImpl
    from .peer_torch import TorchImpl
    return [CopyImpl(), SimdnormImpl(), NumpyImpl(), TorchImpl(), OnnxRuntimeImpl(), OpenVinoImpl()]


IMPL_NAMES = ("copy", "simdnorm", "numpy", "torch", "onnxruntime", "openvino")
