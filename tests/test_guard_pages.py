"""Every array flush against an inaccessible page: no kernel reads or writes a byte outside its
arrays, and the results are the bits the same values give in ordinary memory.

A row's or plane's first and last vectors are partial (masked loads and stores, or element copies);
a kernel that loaded a whole vector there would read past an array that ends at the end of its
mapping, and die. Each array (input, out, parameters, gradients, saved statistics) is copied into
its own mmap'd region, either ending exactly where an inaccessible page begins or starting exactly
where one ends, for every ISA this machine runs, the four dtypes, and row and plane lengths that
leave every partial width. The cases run in a child process, which names each case before it runs
it: a fault is a failed test naming its case, not a dead pytest.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    r"""
    import ctypes, json, mmap, sys
    import ml_dtypes
    import numpy as np
    import simdnorm as sn

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    PAGE = mmap.PAGESIZE
    keep = []  # the mappings stay alive as long as the arrays in them

    def guarded(a, at_end):
        # a copy of a in a fresh mapping between two PROT_NONE pages, its last byte the last before
        # the second (at_end) or its first byte the first after the first
        a = np.ascontiguousarray(a)
        pages = max(1, -(-a.nbytes // PAGE))
        mm = mmap.mmap(-1, (pages + 2) * PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        for at in (base, base + (pages + 1) * PAGE):
            if libc.mprotect(at, PAGE, 0) != 0:
                raise OSError(ctypes.get_errno(), "mprotect")
        start = (pages + 1) * PAGE - a.nbytes if at_end else PAGE
        keep.append(mm)
        g = np.frombuffer(mm, np.uint8)[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
        g[...] = a
        return g

    def channels_last(a):  # (N, C, ...) values in (N, ..., C) memory
        return np.moveaxis(np.ascontiguousarray(np.moveaxis(a, 1, -1)), -1, 1)

    def guarded_like(a, at_end):
        # the same values and strides as a (C-order, or channels-last when a is), in guarded memory
        if a.ndim >= 3 and not a.flags.c_contiguous:
            g = guarded(np.moveaxis(a, 1, -1), at_end)
            return np.moveaxis(g, -1, 1)
        return guarded(a, at_end)

    DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
              "bfloat16": ml_dtypes.bfloat16}
    rng = np.random.default_rng(int(sys.argv[1]))

    def cases(dt):
        pdt = np.float32 if np.dtype(dt).itemsize == 2 else dt
        def r(*shape, dtype=dt):
            return (rng.standard_normal(shape) * 1.5 + 0.25).astype(dtype)
        def pos(*shape):
            return (rng.random(shape) + 0.5).astype(pdt)
        for L in (1, 3, 7, 12, 17, 33, 100):
            x, dy = r(5, L), r(5, L)
            w, b = r(L, dtype=pdt), r(L, dtype=pdt)
            _, m, s = sn.layer_norm(x, w, b, return_stats=True)
            _, _, q = sn.rms_norm(x, w, return_stats=True)
            yield f"layer L={L}", sn.layer_norm, (x, w, b), {}
            yield f"rms L={L}", sn.rms_norm, (x, w), {}
            yield f"layer_backward L={L}", sn.layer_norm_backward, (dy, x, m, s, w, b), {}
            yield f"rms_backward L={L}", sn.rms_norm_backward, (dy, x, q, w), {}
        for hw in ((1, 1), (3, 5), (7, 7), (2, 13)):
            for layout in ("nchw", "nhwc"):
                C = 8
                x, dy = r(3, C, *hw), r(3, C, *hw)
                if layout == "nhwc":
                    x, dy = channels_last(x), channels_last(dy)
                w, b, mean, var = r(C, dtype=pdt), r(C, dtype=pdt), r(C, dtype=pdt), pos(C)
                _, bm, bv = sn.batch_normalization_training(x, w, b)
                _, im, iv = sn.instance_norm(x, w, b, return_stats=True)
                _, gm, gv = sn.group_norm(x, 4, w, b, return_stats=True)
                _, mm_, ms = sn.mean_variance_normalization(x, (0, 2, 3), return_stats=True)
                tag = f"{hw[0]}x{hw[1]} {layout}"
                yield f"bn {tag}", sn.batch_normalization, (x, mean, var, w, b), {}
                yield f"bn_training {tag}", sn.batch_normalization_training, (x, w, b), {}
                yield f"instance {tag}", sn.instance_norm, (x, w, b), {}
                yield f"group {tag}", sn.group_norm, (x, 4, w, b), {}
                yield f"mvn023 {tag}", sn.mean_variance_normalization, (x, (0, 2, 3)), {}
                yield f"bn_backward {tag}", sn.batch_normalization_backward, (dy, x, bm, bv, w, b), {}
                yield f"instance_backward {tag}", sn.instance_norm_backward, (dy, x, im, iv, w, b), {}
                yield f"group_backward {tag}", sn.group_norm_backward, (dy, x, 4, gm, gv, w, b), {}
                yield f"mvn023_backward {tag}", sn.mean_variance_normalization_backward, (dy, x, (0, 2, 3), mm_, ms), {}

    def as_bytes(res):
        res = res if isinstance(res, tuple) else (res,)
        return [None if a is None else np.ascontiguousarray(a).view(np.uint8).tobytes() for a in res]

    failures, count = [], 0
    for isa in sn.available_isas():
        sn.set_isa(isa)
        for dname, dt in DTYPES.items():
            for name, fn, args, kw in cases(dt):
                expected = as_bytes(fn(*args, **kw))
                x = args[0] if not name.endswith("backward") else args[1]
                for at_end in (True, False):
                    label = f"{isa} {dname} {name} {'ending at' if at_end else 'starting at'} a guard page"
                    print("CASE", label, flush=True)
                    g = tuple(guarded_like(a, at_end) if isinstance(a, np.ndarray) else a for a in args)
                    out = guarded_like(np.empty_like(x), at_end)
                    out[...] = np.nan
                    got = as_bytes(fn(*g, **kw, out=out))
                    count += 1
                    if got != expected:
                        failures.append(label)
    print("RESULT", json.dumps({"count": count, "failures": failures}), flush=True)
    """
)


def test_no_access_past_any_array(rng):
    seed = int(rng.integers(2**31))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(seed)], capture_output=True, text=True, timeout=600)
    started = [ln[5:] for ln in proc.stdout.splitlines() if ln.startswith("CASE ")]
    if proc.returncode != 0:
        pytest.fail(f"the child died (status {proc.returncode}) in case {started[-1] if started else '(none)'!r} "
                    f"(seed {seed}):\n{proc.stderr[-3000:]}")
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[7:])
    assert result["count"] == len(started) > 0
    assert result["failures"] == [], f"seed {seed}: different bits in guarded memory: {result['failures'][:10]}"
