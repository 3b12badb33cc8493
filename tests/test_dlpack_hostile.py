"""Hostile DLPack producers (SPEC section 10): a __dlpack__ that raises, is not callable or returns
something other than a capsule; a capsule already used or of another name; a null data pointer with
elements; negative or int64-overflowing shapes, strides, byte offsets and byte extents; a non-CPU
device; unsupported dtype codes, bits and lanes; a DLPack major version from the future; read-only
exports as out= or running statistics; a self-overlapping out=. Each is a TypeError or ValueError
naming the argument, nothing is written (a poisoned out= and the producer's memory compared after),
and each exported capsule's deleter runs exactly once (none when the capsule was not the
producer's to give: "used_..." or another name). The accepted layouts (legacy capsules, a producer
without max_version, NULL strides, negative strides, byte offsets, pinned host memory, read-only
inputs, float16, bfloat16, empty tensors with a null pointer) are checked against float64
references, with the same deleter count; the deleter waits for the last view of the memory.

The producers are ctypes structs (tests/dlpack_producers.py, which also holds the cases). They run in
a child process, so that a crash is a failed case, not a dead pytest: one child runs the cases in
turn, and a child that dies fails the case it was running and hands the rest to a new child.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TE, VE = "TypeError", "ValueError"

# case -> (the error's class, a message regex, or (None, None) for an accepted call)
EXPECT = {
    "raises-runtime": (TE, r"^input: cannot read this Raiser through DLPack: its __dlpack__\(\) raised RuntimeError: boom$"),
    "raises-buffer": (TE, r"^input: .*raised BufferError: no export$"),
    "raises-type-always": (TE, r"^input: .*raised TypeError: never$"),
    "raises-as-out": (TE, r"^out: cannot read this Raiser through DLPack: .*RuntimeError: boom$"),
    "not-callable": (TE, r"^input: .*raised TypeError: 'int' object is not callable$"),
    "returns-int": (TE, r"^input: Returns.__dlpack__\(\) returned a int, not a DLPack capsule$"),
    "returns-ndarray": (TE, r"^input: Returns.__dlpack__\(\) returned a numpy.ndarray, not a DLPack capsule$"),
    "used-capsule": (VE, r"^input: .*already consumed \(named \"used_dltensor_versioned\"\)"),
    "used-legacy-capsule": (VE, r"^input: .*already consumed \(named \"used_dltensor\"\)"),
    "other-capsule-name": (TE, r"^input: .*a capsule named \"not_a_tensor\", not a DLPack tensor"),
    "null-data": (VE, r"^input: the DLPack tensor's data pointer is null and it has 12 elements$"),
    "null-data-as-out": (VE, r"^out: the DLPack tensor's data pointer is null"),
    "negative-shape": (VE, r"^input: DLPack shape\[0\] is -1; sizes must be >= 0$"),
    "negative-shape-as-param": (VE, r"^mean: DLPack shape\[0\] is -4"),
    "count-overflow": (VE, r"^input: the DLPack shape's element count times 4 bytes overflows 64-bit arithmetic$"),
    "stride-overflow": (VE, r"^input: DLPack strides\[0\] = 4611686018427387904 elements of 4 bytes overflows"),
    "stride-overflow-negative": (VE, r"^input: DLPack strides\[0\] = -4611686018427387905 elements"),
    "extent-overflow": (VE, r"^input: the byte extent of the DLPack tensor's shape, strides and byte_offset overflows"),
    "below-address-zero": (VE, r"^input: the byte extent .* or the address space$"),
    "byte-offset-overflow": (VE, r"^input: DLPack byte_offset 18446744073709551615 overflows 64-bit arithmetic$"),
    "device-cuda": (TE, r"^input: the DLPack tensor is on device CUDA \(type 2, id 1\), not in the CPU's memory"),
    "device-unknown": (TE, r"^input: the DLPack tensor is on device unknown \(type 99, id 0\)"),
    "dtype-int32": (TE, r"^input: dtype int32 \(DLPack code 0, 32 bits, 1 lane\) is not supported; accepted: "
                        r"float32, float16, bfloat16, float64$"),
    "dtype-float8": (TE, r"^input: dtype float8 \(DLPack code 2, 8 bits, 1 lane\) is not supported"),
    "dtype-lanes": (TE, r"^input: dtype float32 \(DLPack code 2, 32 bits, 4 lanes\) is not supported"),
    "dtype-bfloat32": (TE, r"^input: dtype bfloat32 \(DLPack code 4, 32 bits, 1 lane\) is not supported"),
    "dtype-code-200": (TE, r"^input: dtype .*\(DLPack code 200, 32 bits, 1 lane\) is not supported"),
    "dtype-bool": (TE, r"^input: dtype bool \(DLPack code 6, 8 bits, 1 lane\) is not supported"),
    "ndim-negative": (VE, r"^input: -1 dimensions \(DLPack ndim\); tensors must have 1 to 8 dimensions$"),
    "ndim-nine": (VE, r"^input: 9 dimensions \(DLPack ndim\)"),
    "null-shape": (VE, r"^input: the DLPack tensor has 2 dims and no shape$"),
    "version-2": (TE, r"^input: DLPack version 2.0 \(simdnorm reads major version 1\)$"),
    "read-only-as-out": (VE, r"^out: the Producer is read-only \(its DLPack export says so\); it cannot be written$"),
    "read-only-in-place": (VE, r"^out: the Producer is read-only"),
    "read-only-as-running-mean": (VE, r"^running_mean: the Producer is read-only"),
    "zero-stride-as-out": (VE, r"^out: DLPack strides\[0\] is 0 with size 3: more than one element of it is one "
                               r"memory location"),
    "rank-zero": (VE, r"^input: 0 dimensions \(shape \(\)\); tensors must have 1 to 8 dimensions$"),
}
ACCEPTED = ["ok-versioned", "ok-legacy", "ok-legacy-without-max-version", "ok-null-strides", "ok-negative-stride",
            "ok-byte-offset", "ok-cuda-host", "ok-read-only-input", "ok-null-deleter", "ok-as-out", "ok-in-place",
            "ok-as-param", "ok-as-running-mean", "ok-float16", "ok-bfloat16", "ok-view-lifetime",
            "ok-null-data-empty"]
# The capsules whose deleter is nobody's to run: not the producer's to give ("used_...", another
# name: its destructor declines too), or no deleter at all.
NOT_DELETED = {"used-capsule", "used-legacy-capsule", "other-capsule-name", "ok-null-deleter"}
CASES = list(EXPECT) + ACCEPTED


def _run_children(cases: list) -> dict:
    """Run the cases in child processes: {case: result dict, or {"crashed": stderr}}."""
    env = dict(os.environ, SIMDNORM_NUM_THREADS="1")
    results: dict = {}
    todo = list(cases)
    while todo:
        r = subprocess.run([sys.executable, os.path.join(HERE, "dlpack_producers.py"), *todo],
                           capture_output=True, text=True, timeout=300, env=env, check=False)
        started: Optional[str] = None
        for line in r.stdout.splitlines():
            msg = json.loads(line)
            if "started" in msg:
                started = msg["started"]
            else:
                results[msg["case"]] = msg
                started = None
        if r.returncode != 0 or started is not None:  # died in `started`, or before its first case
            crashed = started or next(c for c in todo if c not in results)
            results[crashed] = {"crashed": f"exit {r.returncode}\n{r.stderr[-3000:]}"}
        left = [c for c in todo if c not in results]
        if len(left) == len(todo):  # pragma: no cover - no progress: report them all
            results.update({c: {"crashed": f"no result\n{r.stderr[-3000:]}"} for c in left})
        todo = left
    return results


@pytest.fixture(scope="module")
def results():
    return _run_children(CASES)


def _check_deleter(case: str, res: dict) -> None:
    if res["exports"] is None:  # (no capsule was made: __dlpack__ raised or returned something else)
        assert res["deleted"] is None
        return
    want = 0 if case in NOT_DELETED else res["exports"]
    assert res["exports"] >= 1, f"{case}: no capsule was exported"
    assert res["deleted"] == want, (
        f"{case}: the deleter ran {res['deleted']} times for {res['exports']} capsules (expected {want})")


@pytest.mark.parametrize("case", list(EXPECT))
def test_hostile_producer_is_a_clear_error(case, results):
    res = results[case]
    assert "crashed" not in res, f"{case}: the child process died: {res.get('crashed')}"
    cls, pattern = EXPECT[case]
    assert res["raised"] is not None, f"{case}: accepted"
    assert res["type_or_value_error"], f"{case}: {res['raised']} is neither a TypeError nor a ValueError: {res['msg']}"
    # (the package's own subclasses are allowed: DescriptorError is a ValueError)
    assert res["raised"] == cls or (cls == VE and res["raised"] == "DescriptorError"), (
        f"{case}: {res['raised']} where a {cls} was expected: {res['msg']}")
    assert re.search(pattern, res["msg"]), f"{case}: message {res['msg']!r} does not match {pattern!r}"
    assert res["out_untouched"], f"{case}: the poisoned out= was written before the error"
    assert res["memory_untouched"] is not False, f"{case}: the producer's memory was written before the error"
    _check_deleter(case, res)


@pytest.mark.parametrize("case", ACCEPTED)
def test_accepted_producer_is_read_in_place(case, results):
    res = results[case]
    assert "crashed" not in res, f"{case}: the child process died: {res.get('crashed')}"
    assert res["raised"] is None, f"{case}: refused with {res['raised']}: {res['msg']}"
    assert res["good"], f"{case}: the result differs from the float64 reference (or the memory was not shared)"
    assert res["memory_untouched"] is not False, f"{case}: the input's memory was written"
    _check_deleter(case, res)


def test_every_case_has_an_expectation():
    """The catalogue in dlpack_producers.py and the expectations here name the same cases."""
    import numpy as np

    import dlpack_producers

    built = set(dlpack_producers.catalogue(np.zeros((3, 4), np.float32)))
    assert built == set(CASES), built ^ set(CASES)


_EXCHANGE_API_CASES = r'''
import ctypes, numpy as np
from simdnorm import _core
new_capsule = ctypes.pythonapi.PyCapsule_New
new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# a header of major version 2 with no older table chained: no version simdnorm reads
header = (ctypes.c_uint32 * 6)(2, 0, 0, 0, 0, 0)
cases = {
    "none": object,
    "not a capsule": type("NotCapsule", (), {"__dlpack_c_exchange_api__": 5}),
    "another capsule": type("OtherName", (), {"__dlpack_c_exchange_api__": new_capsule(
        ctypes.addressof(header), b"not_the_api", None)}),
    "major version 2": type("Future", (), {"__dlpack_c_exchange_api__": new_capsule(
        ctypes.addressof(header), b"dlpack_exchange_api", None)}),
}
out = np.empty((2, 3), np.float32)
for name, cls in cases.items():
    for _ in range(2):  # (the second call: the type's cached answer)
        try:
            _core.mvn(cls(), (1,), None, None, out, 1e-5, True, True, False, (0, 0.0, 0.0), None, None, -1, False)
        except TypeError as e:
            assert str(e).startswith("input must be a numpy.ndarray or a tensor with the DLPack C exchange API"), e
        else:
            raise AssertionError(name + ": accepted")
print("ok")
'''


def test_kernels_refuse_objects_without_a_usable_exchange_api():
    """The kernels read a tensor through its type's DLPack C exchange API (the torch modules' per-call
    route); an object whose type has none, or one that is not a capsule of that name, or a table of
    an unknown major version, is a TypeError (in a child process: a crash fails the test)."""
    r = subprocess.run([sys.executable, "-c", _EXCHANGE_API_CASES], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
