"""DLPack producers built with ctypes, so that every field of the capsule can be set, hostile ones
included, and the deleter's calls counted. The structs are DLPack 1.x's (dlpack/dlpack.h; the same
layout as cpp/bindings/dlpack.h, written out again here so that a mistake in one shows against the
other). The capsule's destructor behaves as a real producer's (numpy's, torch's): it calls the
deleter only if no consumer took the tensor (renamed the capsule "used_...").

Used by tests/test_dlpack_hostile.py, in child processes: a crash there is a failed test.
"""

from __future__ import annotations

import ctypes as C
from typing import Any, Optional, Sequence

import numpy as np


class DLDevice(C.Structure):
    _fields_ = [("device_type", C.c_int32), ("device_id", C.c_int32)]


class DLDataType(C.Structure):
    _fields_ = [("code", C.c_uint8), ("bits", C.c_uint8), ("lanes", C.c_uint16)]


class DLTensor(C.Structure):
    _fields_ = [("data", C.c_void_p), ("device", DLDevice), ("ndim", C.c_int32), ("dtype", DLDataType),
                ("shape", C.POINTER(C.c_int64)), ("strides", C.POINTER(C.c_int64)), ("byte_offset", C.c_uint64)]


DELETER = C.CFUNCTYPE(None, C.c_void_p)


class DLManagedTensor(C.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", C.c_void_p), ("deleter", DELETER)]


class DLPackVersion(C.Structure):
    _fields_ = [("major", C.c_uint32), ("minor", C.c_uint32)]


class DLManagedTensorVersioned(C.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", C.c_void_p), ("deleter", DELETER),
                ("flags", C.c_uint64), ("dl_tensor", DLTensor)]


READ_ONLY = 1
FLOAT, BFLOAT = 2, 4
CPU, CUDA, CUDA_HOST = 1, 2, 3
DTYPES = {np.dtype(np.float32): (FLOAT, 32), np.dtype(np.float64): (FLOAT, 64), np.dtype(np.float16): (FLOAT, 16)}

_api = C.pythonapi
_api.PyCapsule_New.restype = C.py_object
_api.PyCapsule_New.argtypes = [C.c_void_p, C.c_char_p, C.c_void_p]
_api.PyCapsule_GetName.restype = C.c_char_p
_api.PyCapsule_GetName.argtypes = [C.c_void_p]
_api.PyCapsule_GetPointer.restype = C.c_void_p
_api.PyCapsule_GetPointer.argtypes = [C.c_void_p, C.c_char_p]

# Capsule names must outlive their capsules: module-level buffers, never freed.
_NAMES = {n: C.create_string_buffer(n) for n in
          (b"dltensor", b"dltensor_versioned", b"used_dltensor", b"used_dltensor_versioned", b"not_a_tensor")}

# A managed tensor's address -> the struct (the capsule destructor finds the deleter there).
_LIVE: dict = {}


@C.CFUNCTYPE(None, C.c_void_p)
def _capsule_destructor(capsule: int) -> None:
    """A producer's capsule destructor: the deleter runs here only if no consumer renamed the
    capsule (took the tensor)."""
    name = _api.PyCapsule_GetName(capsule)
    if name not in (b"dltensor", b"dltensor_versioned"):
        return
    ptr = _api.PyCapsule_GetPointer(capsule, name)
    managed = _LIVE.get(ptr)
    if managed is not None and managed.deleter:
        managed.deleter(ptr)


class Producer:
    """An object with __dlpack__ over the memory of a numpy array (kept alive here), every field
    overridable: versioned (DLPack 1.x, else legacy), shape, strides (None: NULL), dtype (code,
    bits, lanes), device (type, id), data (an address; default the array's), byte_offset, flags,
    version, the capsule's name, whether __dlpack__ takes max_version, a null deleter.
    ``deleted`` counts the deleter's calls, ``exports`` the capsules returned (each a new managed
    tensor)."""

    def __init__(self, array: Optional[np.ndarray] = None, *, versioned: bool = True,
                 shape: Optional[Sequence[int]] = None, strides: Any = "array", dtype: Any = None,
                 device: Sequence[int] = (CPU, 0), data: Any = None, byte_offset: int = 0, flags: int = 0,
                 version: Sequence[int] = (1, 0), capsule_name: Optional[bytes] = None,
                 accepts_max_version: bool = True, null_deleter: bool = False, ndim: Optional[int] = None,
                 null_shape: bool = False) -> None:
        self.array = array
        self.versioned = versioned
        self.shape = list(array.shape if shape is None else shape)
        if isinstance(strides, str):
            strides = [s // array.itemsize for s in array.strides]
        self.strides = None if strides is None else list(strides)
        if dtype is None:
            dtype = DTYPES[array.dtype] + (1,) if array is not None and array.dtype in DTYPES else (BFLOAT, 16, 1)
        self.dtype = dtype
        self.device = device
        self.data = data if data is not None else (array.__array_interface__["data"][0] if array is not None else 0)
        self.byte_offset = byte_offset
        self.flags = flags
        self.version = version
        self.capsule_name = capsule_name or (b"dltensor_versioned" if versioned else b"dltensor")
        self.accepts_max_version = accepts_max_version
        self.null_deleter = null_deleter
        self.ndim = len(self.shape) if ndim is None else ndim
        self.null_shape = null_shape
        self.deleted = 0
        self.exports = 0  # capsules returned
        self.calls: list = []  # the keyword arguments of each __dlpack__ call
        self._keep: list = []  # every export's structs and arrays: alive as long as the producer

        def deleter(ptr: int) -> None:
            self.deleted += 1
            _LIVE.pop(ptr, None)

        self._deleter = DELETER(deleter)  # (kept: ctypes frees a callback with its last reference)

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        if kwargs and not self.accepts_max_version:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        self.exports += 1
        n = len(self.shape)
        shape = (C.c_int64 * max(n, 1))(*self.shape)
        strides = None if self.strides is None else (C.c_int64 * max(n, 1))(*self.strides)
        t = DLTensor()
        t.data = self.data or None
        t.device = DLDevice(*self.device)
        t.ndim = self.ndim
        t.dtype = DLDataType(*self.dtype)
        t.shape = C.cast(shape, C.POINTER(C.c_int64)) if not self.null_shape else None
        if strides is not None:
            t.strides = C.cast(strides, C.POINTER(C.c_int64))
        t.byte_offset = self.byte_offset
        if self.versioned:
            m = DLManagedTensorVersioned()
            m.version = DLPackVersion(*self.version)
            m.flags = self.flags
        else:
            m = DLManagedTensor()
        m.dl_tensor = t
        m.deleter = DELETER() if self.null_deleter else self._deleter
        self._keep.append((m, shape, strides))
        ptr = C.addressof(m)
        _LIVE[ptr] = m
        return _api.PyCapsule_New(ptr, _NAMES[self.capsule_name], C.cast(_capsule_destructor, C.c_void_p))


# ------------------------------------------------------------------------------------------------
# The hostile-producer catalogue: each case builds a producer and passes it to simdnorm in one
# role; run_case reports what was raised, whether memory was written, and the deleter's calls once
# every reference is gone. tests/test_dlpack_hostile.py runs them in child processes
# (``python dlpack_producers.py CASE...``) and holds the expectations.

class Raiser:
    """__dlpack__ raises exc (on every call, with or without max_version)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise self.exc


class Returns:
    """__dlpack__ returns value (not a capsule)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.value


class NotCallable:
    __dlpack__ = 5


POISON = np.float32(-7.25)
F32 = np.float32
H = 2 ** 62


def _data(shape=(3, 4), dtype=F32, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _ln_ref(a: np.ndarray) -> np.ndarray:
    """layer norm over the last axis, float64."""
    a = a.astype(np.float64)
    m = a.mean(axis=-1, keepdims=True)
    return (a - m) / np.sqrt(((a - m) ** 2).mean(axis=-1, keepdims=True) + 1e-5)


def _close(got: Any, want: np.ndarray, rtol: float) -> bool:
    got = np.asarray(got).astype(np.float64)
    return got.shape == want.shape and bool(np.all(np.abs(got - want) <= rtol * (1 + np.abs(want))))


def catalogue(a: np.ndarray) -> dict:
    """case -> (producer, role), the producers over a's memory (or their own)."""
    P = Producer
    return {
        "raises-runtime": (Raiser(RuntimeError("boom")), "input"),
        "raises-buffer": (Raiser(BufferError("no export")), "input"),
        "raises-type-always": (Raiser(TypeError("never")), "input"),
        "raises-as-out": (Raiser(RuntimeError("boom")), "out"),
        "not-callable": (NotCallable(), "input"),
        "returns-int": (Returns(42), "input"),
        "returns-ndarray": (Returns(np.ones(3, F32)), "input"),
        "used-capsule": (P(a, capsule_name=b"used_dltensor_versioned"), "input"),
        "used-legacy-capsule": (P(a, versioned=False, capsule_name=b"used_dltensor"), "input"),
        "other-capsule-name": (P(a, capsule_name=b"not_a_tensor"), "input"),
        "null-data": (P(a, data=0), "input"),
        "null-data-as-out": (P(a, data=0), "out"),
        "negative-shape": (P(a, shape=[-1, 4]), "input"),
        "negative-shape-as-param": (P(a[0], shape=[-4]), "param"),
        "count-overflow": (P(a, shape=[2 ** 40, 2 ** 40], strides=None), "input"),
        "stride-overflow": (P(a, strides=[H, 1]), "input"),
        "stride-overflow-negative": (P(a, strides=[-H - 1, 1]), "input"),
        "extent-overflow": (P(a, shape=[2, 2, 2], strides=[H // 4 - 1] * 3), "input"),
        "below-address-zero": (P(a, shape=[3], strides=[-8], data=16), "input"),
        "byte-offset-overflow": (P(a, byte_offset=2 ** 64 - 1), "input"),
        "device-cuda": (P(a, device=(CUDA, 1)), "input"),
        "device-unknown": (P(a, device=(99, 0)), "input"),
        "dtype-int32": (P(a, dtype=(0, 32, 1)), "input"),
        "dtype-float8": (P(a, dtype=(FLOAT, 8, 1)), "input"),
        "dtype-lanes": (P(a, dtype=(FLOAT, 32, 4)), "input"),
        "dtype-bfloat32": (P(a, dtype=(BFLOAT, 32, 1)), "input"),
        "dtype-code-200": (P(a, dtype=(200, 32, 1)), "input"),
        "dtype-bool": (P(a, dtype=(6, 8, 1)), "input"),
        "ndim-negative": (P(a, ndim=-1), "input"),
        "ndim-nine": (P(np.zeros((1,) * 9, F32)), "input"),
        "null-shape": (P(a, null_shape=True), "input"),
        "version-2": (P(a, version=(2, 0)), "input"),
        "read-only-as-out": (P(a, flags=READ_ONLY), "out"),
        "read-only-in-place": (P(a, flags=READ_ONLY), "in-place"),
        "read-only-as-running-mean": (P(a[0], flags=READ_ONLY), "running"),
        "zero-stride-as-out": (P(a, strides=[0, 1]), "out"),
        "rank-zero": (P(np.ones((), F32)), "input"),
        # accepted: the result is checked, and the deleter still runs once
        "ok-versioned": (P(a), "input"),
        "ok-legacy": (P(a, versioned=False), "input"),
        "ok-legacy-without-max-version": (P(a, versioned=False, accepts_max_version=False), "input"),
        "ok-null-strides": (P(a, strides=None), "input"),
        "ok-negative-stride": (P(a, shape=[3, 4], strides=[-4, 1], data=_address(a) + 32), "input"),
        "ok-byte-offset": (P(a, shape=[2, 4], byte_offset=16), "input"),
        "ok-cuda-host": (P(a, device=(CUDA_HOST, 0)), "input"),
        "ok-read-only-input": (P(a, flags=READ_ONLY), "input"),
        "ok-null-deleter": (P(a, null_deleter=True), "input"),
        "ok-as-out": (P(a), "out"),
        "ok-in-place": (P(a), "in-place"),
        "ok-as-param": (P(a[0]), "param"),
        "ok-as-running-mean": (P(np.zeros(4, F32)), "running"),
        "ok-float16": (P(a.astype(np.float16)), "input"),
        "ok-bfloat16": (P(_bf16_bits(a)), "input"),
        "ok-view-lifetime": (P(a), "view"),
        "ok-null-data-empty": (P(np.zeros((0, 4), F32), data=0), "input"),
    }


def build(case: str) -> dict:
    """{producer, role, memory (what the producer exports, checked for writes), want (the float64
    result of a call that should succeed, else None), rtol}."""
    a = _data()
    producer, role = catalogue(a)[case]
    want, rtol = None, 1e-5
    if case.startswith("ok-"):
        if case == "ok-negative-stride":
            src = a[::-1]
        elif case == "ok-byte-offset":
            src = a[1:3]
        elif case == "ok-float16":
            src, rtol = a.astype(np.float16).astype(np.float64), 2e-3
        elif case == "ok-bfloat16":
            src, rtol = _bf16_values(a), 1e-2
        elif case == "ok-null-data-empty":
            src = np.zeros((0, 4))
        else:
            src = a
        want = {"input": _ln_ref(src), "out": _ln_ref(_data(seed=1)),
                "in-place": _ln_ref(src), "param": None, "running": None, "view": src}[role]
    memory = getattr(producer, "array", None)
    return {"producer": producer, "role": role, "memory": memory, "want": want, "rtol": rtol}


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """a rounded to bfloat16, as the uint16 bits (exported with the bfloat16 DLPack code)."""
    import ml_dtypes

    return a.astype(ml_dtypes.bfloat16).view(np.uint16)


def _bf16_values(a: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def run_case(case: str) -> dict:
    import gc

    import simdnorm

    spec = build(case)
    p, role, memory = spec["producer"], spec["role"], spec["memory"]
    before = None if memory is None else memory.copy()
    x = _data(seed=1)
    out = np.full(x.shape, POISON, F32)
    raised = msg = None
    good = None
    try:
        if role == "input" and spec["want"] is None:  # refused: out stays poisoned
            simdnorm.layer_norm(p, out=out)
        elif role == "input":
            got = simdnorm.layer_norm(p)
            good = type(got) is np.ndarray and _close(got, spec["want"], spec["rtol"])
        elif role == "out":
            got = simdnorm.layer_norm(x, out=p)
            good = got is p and (spec["want"] is None or _close(memory, spec["want"], spec["rtol"]))
        elif role == "in-place":
            got = simdnorm.layer_norm(p, out=p)
            good = got is p and (spec["want"] is None or _close(memory, spec["want"], spec["rtol"]))
        elif role == "param":
            got = simdnorm.batch_normalization(x, p, np.ones(4, F32), channel_axis=-1, epsilon=0.0)
            good = _close(got, x.astype(np.float64) - memory.astype(np.float64), 1e-6)
        elif role == "running":
            simdnorm.batch_normalization_training(x, channel_axis=-1, running_mean=p, running_var=np.ones(4, F32),
                                                  momentum=0.5)
            good = _close(memory, 0.5 * x.astype(np.float64).mean(axis=0), 1e-5)
        elif role == "view":  # the deleter runs when the last view goes, not before
            arr = simdnorm._core.from_dlpack(p, "input", False)
            view = arr[1:]
            del arr
            gc.collect()
            alive = p.deleted
            good = alive == 0 and _close(view, spec["want"][1:], 0) and np.shares_memory(view, memory)
            del view
        got = None
    except Exception as e:  # noqa: BLE001 - the parent judges the type
        raised, msg = type(e).__name__, str(e)
        is_tv = isinstance(e, (TypeError, ValueError))
    else:
        is_tv = None
    gc.collect()
    spec.pop("producer")
    deleted = getattr(p, "deleted", None)
    exports = getattr(p, "exports", None)
    del p
    gc.collect()
    untouched = bool(np.all(out == POISON)) if raised else None
    memory_untouched = None if memory is None or role in ("out", "in-place", "running") and raised is None \
        else bool(np.array_equal(memory, before, equal_nan=True))
    return {"case": case, "raised": raised, "type_or_value_error": is_tv, "msg": msg, "deleted": deleted,
            "exports": exports,
            "out_untouched": untouched, "memory_untouched": memory_untouched, "good": good}


if __name__ == "__main__":
    import json
    import sys

    for name in sys.argv[1:]:
        print(json.dumps({"started": name}), flush=True)
        print(json.dumps(run_case(name)), flush=True)
