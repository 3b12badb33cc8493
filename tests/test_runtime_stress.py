"""Runtime under stress (SPEC §1, §8): many Python threads at once with the pool size changing under
them, the GIL released during a long call, fork after threaded use (also while another thread is
inside a call), every instruction set forced through SIMDNORM_ISA in a fresh process, a bad
SIMDNORM_ISA, no memory growth over 2,000 calls, and a float16 tensor of more than 2**31 elements
(slow; skipped when the machine lacks the memory)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import simdnorm
from reference import BF16, F16, F32, F64, check_bn, check_close, check_mvn

bn = simdnorm.batch_normalization
mvn = simdnorm.mean_variance_normalization


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def under_asan() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:  # pragma: no cover
        return False


def clean_env(**update):
    env = {k: v for k, v in os.environ.items() if k not in ("SIMDNORM_ISA", "SIMDNORM_NUM_THREADS", "OMP_NUM_THREADS")}
    env.update(update)
    return env


def run_script(code, env, timeout=300):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


# ----------------------------------------------------------------------------------------------
# 8 Python threads for ~2.5 s, pool size changing under them; every result bitwise as expected
# ----------------------------------------------------------------------------------------------

def _jobs(rng):
    """(name, fn) pairs; fn() returns arrays. Big ones use the thread pool, small ones do not."""
    xb = rng.normal(1.0, 2.0, (4, 32, 48, 48)).astype(F32)          # 295k elements: 2+ parts
    xh = rng.normal(0.0, 1.0, (2, 3 * 32768 + 11)).astype(F16)      # few large MVN groups
    xl = rng.normal(0.0, 1.0, (600, 130)).astype(BF16)              # many rows
    xc = np.ascontiguousarray(rng.normal(0.0, 1.0, (8, 24, 24, 64)).astype(F32))  # NHWC lanes
    xs = rng.normal(0.0, 1.0, (3, 5, 7)).astype(F64)                # small: one thread
    c32 = np.linspace(0.5, 1.5, 32).astype(F32)
    c64 = np.linspace(-1.0, 1.0, 64).astype(F32)
    desc = simdnorm.MeanVarianceNormalizationDesc(simdnorm.TensorDesc(F32, xc.shape), (1, 2))
    op = simdnorm.compile(desc)
    return [
        ("bn_nchw", lambda: bn(xb, c32, c32 + 1, c32, c32, activation="gelu")),
        ("mvn_few_groups", lambda: mvn(xh, -1, return_stats=True)),
        ("layer_norm_rows", lambda: simdnorm.layer_norm(xl)),
        ("instance_nhwc", lambda: simdnorm.instance_norm(xc, c64, c64, channel_axis=-1)),
        ("group_norm", lambda: simdnorm.group_norm(xb, 8, c32, c32, return_stats=True)),
        ("compiled_mvn", lambda: op(xc, return_stats=True)),
        ("small_f64", lambda: mvn(xs, (0, 2), epsilon_mode="outside")),
        ("rms_strided", lambda: simdnorm.rms_norm(xb[:, ::2, ::-1], axis=-2)),
    ]


def _as_list(r):
    return [a for a in (r if isinstance(r, tuple) else (r,)) if a is not None]


def test_eight_threads_concurrently_with_changing_pool(threads):
    threads(2)
    jobs = _jobs(np.random.default_rng(0))
    want = {name: [bits(a) for a in _as_list(fn())] for name, fn in jobs}
    deadline = time.monotonic() + 2.5
    errors, counts = [], [0] * 8
    stop = threading.Event()

    def worker(i):
        try:
            k = i
            while time.monotonic() < deadline:
                name, fn = jobs[k % len(jobs)]
                got = [bits(a) for a in _as_list(fn())]
                assert len(got) == len(want[name]), name
                for g, w in zip(got, want[name]):
                    if not np.array_equal(g, w):
                        raise AssertionError(f"thread {i}: {name} differs from its single-caller result")
                counts[i] += 1
                k += 1
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    def resizer():  # SPEC §8: results are the same for any thread count; the pool is rebuilt under load
        n = 0
        while not stop.is_set():
            simdnorm.set_num_threads((1, 2, 3)[n % 3])
            n += 1
            time.sleep(0.02)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    rz = threading.Thread(target=resizer)
    rz.start()
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    stop.set()
    rz.join(timeout=30)
    assert not any(t.is_alive() for t in ts), "a thread did not finish: deadlock?"
    assert not errors, errors[:3]
    assert min(counts) >= 1, counts


# ----------------------------------------------------------------------------------------------
# the GIL is released during a long call
# ----------------------------------------------------------------------------------------------

def _long_call_input(fn, target=0.3):
    """An input big enough that fn(x) takes about `target` seconds here (capped at 2**26 elements)."""
    n = 1 << 20
    while True:
        x = np.sin(np.arange(n, dtype=F32)).reshape(-1, 1024)
        t0 = time.perf_counter()
        fn(x)
        dt = time.perf_counter() - t0
        if dt >= target or n >= 1 << 26:
            return x
        n = min(1 << 26, int(n * min(16.0, max(2.0, target * 1.2 / max(dt, 1e-4)))) // 1024 * 1024)


@pytest.mark.parametrize("op", ["batch_normalization", "mean_variance_normalization"])
def test_gil_released_during_a_long_call(threads, op):
    threads(1)  # one core computes, the other runs the counter thread
    c = np.linspace(0.5, 1.5, 1024).astype(F32)
    fn = (lambda x: bn(x, c, c, channel_axis=-1)) if op == "batch_normalization" else (lambda x: mvn(x, (0,)))
    x = _long_call_input(fn)
    count = [0]
    stop = threading.Event()

    def counter():
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=counter)
    t.start()
    try:
        c0 = count[0]
        time.sleep(0.2)  # the counter's rate with the GIL free
        rate = (count[0] - c0) / 0.2
        c1, t1 = count[0], time.perf_counter()
        fn(x)
        c2, t2 = count[0], time.perf_counter()
    finally:
        stop.set()
        t.join()
    during = c2 - c1
    expected = rate * (t2 - t1)
    # with the GIL held the counter could only run in the ~5 ms switch intervals around the call
    assert during >= 0.1 * expected and during > 1000, (
        f"{op}: the counter advanced {during} times during a {t2 - t1:.3f} s call (free rate {rate:.0f}/s): "
        "the GIL is held while the kernel runs")


# ----------------------------------------------------------------------------------------------
# fork after threaded use, and while another thread is inside a call
# ----------------------------------------------------------------------------------------------

FORK_SCRIPT = r"""
import os, sys, threading, time
import numpy as np
import simdnorm

simdnorm.set_num_threads(2)
rng = np.random.default_rng(0)
x = rng.normal(0.0, 1.0, (4, 32, 64, 64)).astype(np.float32)
c = np.linspace(0.5, 1.5, 32).astype(np.float32)
run = lambda: (simdnorm.batch_normalization(x, c, c, c, c), simdnorm.mean_variance_normalization(x, (2, 3)))
want = run()            # the pool now has a worker thread
want = run()

def child():
    try:
        simdnorm.set_num_threads(2)
        for _ in range(3):
            got = run()
            if not all(np.array_equal(g, w) for g, w in zip(got, want)):
                os._exit(3)
        simdnorm.set_num_threads(3)
        got = run()
        os._exit(0 if all(np.array_equal(g, w) for g, w in zip(got, want)) else 5)
    except BaseException:
        os._exit(4)

def fork_and_wait(label):
    pid = os.fork()
    if pid == 0:
        child()
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print(f"{label}: child hung", flush=True)
            sys.exit(2)
        time.sleep(0.01)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        print(f"{label}: child exited {code}", flush=True)
        sys.exit(1)

fork_and_wait("after threaded use")
stop = threading.Event()
def hammer():
    while not stop.is_set():
        run()
t = threading.Thread(target=hammer)
t.start()
for i in range(6):
    time.sleep(0.013 * (i + 1))
    fork_and_wait(f"during a call #{i}")
stop.set()
t.join()
print("ok")
"""


def test_fork_after_threaded_use():
    r = run_script(FORK_SCRIPT, clean_env(), timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout, r.stderr[-3000:])


# ----------------------------------------------------------------------------------------------
# Daemon threads inside a call when the interpreter exits: the process exits as numpy's would
# ----------------------------------------------------------------------------------------------

DAEMON_SCRIPT = r"""
import sys, threading, time
import numpy as np
import simdnorm
x = np.ones((256, 4096), np.float32)
_, m, inv = simdnorm.layer_norm(x, return_stats=True)
calls = {
    "layer_norm": lambda: simdnorm.layer_norm(x),
    "batch_normalization_training": lambda: simdnorm.batch_normalization_training(x, channel_axis=1),
    "layer_norm_backward": lambda: simdnorm.layer_norm_backward(x, x, m, inv),
}
started = threading.Event()
def loop(call):
    started.set()
    while True:
        call()
for _ in range(2):
    threading.Thread(target=loop, args=(calls[sys.argv[1]],), daemon=True).start()
started.wait()
time.sleep(0.05)
print("exiting")
"""


@pytest.mark.skipif(os.environ.get("SIMDNORM_SANITIZED_RUN") == "1",
                    reason="ASan's no-return handler reports the forced unwinding of pthread_exit (its sigaltstack "
                           "interceptor, then a CHECK failure in asan_thread.cpp): the sanitizer's, not the call's")
@pytest.mark.parametrize("op", ["layer_norm", "batch_normalization_training", "layer_norm_backward"])
def test_daemon_threads_inside_calls_at_exit(op):
    """A daemon thread that retakes the GIL while the interpreter finalizes is ended by Python
    (pthread_exit before 3.14): a call releasing the GIL must let that unwind pass, not abort."""
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", DAEMON_SCRIPT, op], env=clean_env(), capture_output=True, text=True,
                           timeout=120, check=False)
        assert r.returncode == 0 and r.stdout.strip() == "exiting", (r.returncode, r.stdout, r.stderr[-3000:])


# ----------------------------------------------------------------------------------------------
# Worker threads that cannot start: the call still completes, with the same bits
# ----------------------------------------------------------------------------------------------

THREADS_FAIL_SCRIPT = r"""
import os, resource
import numpy as np
import simdnorm

rng = np.random.default_rng(11)
x = rng.normal(0.5, 2.0, (64, 1 << 14)).astype(np.float32)
simdnorm.set_num_threads(1)
want = simdnorm.layer_norm(x)
out = np.empty_like(x)
with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
# Address space for a few dozen thread stacks more, not for 1000.
resource.setrlimit(resource.RLIMIT_AS, (mapped + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
simdnorm.set_num_threads(1000)
for _ in range(3):
    out[...] = np.nan
    simdnorm.layer_norm(x, out=out)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
print("ok")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc/self/statm")
@pytest.mark.skipif(under_asan(), reason="ASan's shadow memory does not fit under an address-space limit")
def test_threads_that_cannot_start_leave_the_call_working():
    # Before: the pool's constructor threw out of its loop of thread starts and destroyed the
    # condition variables under the workers already waiting on them; the call never returned.
    r = run_script(THREADS_FAIL_SCRIPT, clean_env(), timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout, r.stderr[-3000:])


# ----------------------------------------------------------------------------------------------
# SIMDNORM_ISA: every available ISA forced in a fresh process gives equal results
# ----------------------------------------------------------------------------------------------

ISA_SCRIPT = r"""
import sys
import ml_dtypes
import numpy as np
import simdnorm

rng = np.random.default_rng(5)
res = {"isa": np.array(simdnorm.isa())}
for dt in (np.float32, np.float16, ml_dtypes.bfloat16, np.float64):
    name = np.dtype(dt).name
    x = rng.normal(1.0, 2.0, (3, 6, 17, 29)).astype(dt)
    m, v = rng.normal(0, 1, 6).astype(dt), rng.uniform(0.5, 2, 6).astype(dt)
    s, b = rng.normal(0, 1, 6).astype(dt), rng.normal(0, 1, 6).astype(dt)
    xt = x.transpose(0, 2, 3, 1)[:, ::-1]
    for k, v_ in {"x": x, "m": m, "v": v, "s": s, "b": b}.items():
        res[f"{name}_{k}"] = v_.astype(np.float64)
    res[f"{name}_bn"] = simdnorm.batch_normalization(x, m, v, s, b, activation="silu").astype(np.float64)
    res[f"{name}_bn_t"] = simdnorm.batch_normalization(xt, m, v, s, b, channel_axis=-1).astype(np.float64)
    res[f"{name}_mvn"] = simdnorm.mean_variance_normalization(x, (0, 2)).astype(np.float64)
    res[f"{name}_mvn_t"] = simdnorm.mean_variance_normalization(xt, (1, 2)).astype(np.float64)
    res[f"{name}_ln"] = simdnorm.layer_norm(x, activation="tanh").astype(np.float64)
np.savez(sys.argv[1], **res)
print(simdnorm.isa())
"""


def test_each_isa_forced_by_environment_agrees(tmp_path):
    isas = simdnorm.available_isas()
    script = tmp_path / "isa_run.py"
    script.write_text(ISA_SCRIPT)
    results = {}
    for name in isas:
        path = tmp_path / f"{name}.npz"
        r = subprocess.run([sys.executable, "-W", "error", str(script), str(path)],
                           env=clean_env(SIMDNORM_ISA=name), capture_output=True, text=True, timeout=300,
                           check=False)
        assert r.returncode == 0, (name, r.stderr[-3000:])
        assert r.stdout.split()[-1] == name, f"SIMDNORM_ISA={name} but simdnorm.isa() says {r.stdout!r}"
        with np.load(path) as f:
            results[name] = dict(f)
        assert str(results[name]["isa"]) == name
    ref_isa = isas[-1]
    base = results[ref_isa]
    dts = {"float32": F32, "float16": F16, "bfloat16": BF16, "float64": F64}
    for name, res in results.items():
        for dname, dt in dts.items():
            x, m, v, s, b = (res[f"{dname}_{k}"].astype(dt) for k in "xmvsb")
            xt = x.transpose(0, 2, 3, 1)[:, ::-1]
            ctx = f"SIMDNORM_ISA={name} {dname}"
            check_bn(res[f"{dname}_bn"].astype(dt), x, m, v, s, b, activation="silu", context=ctx)
            check_bn(res[f"{dname}_bn_t"].astype(dt), xt, m, v, s, b, channel_axis=-1, context=ctx)
            check_mvn(res[f"{dname}_mvn"].astype(dt), x, (0, 2), context=ctx)
            check_mvn(res[f"{dname}_mvn_t"].astype(dt), xt, (1, 2), context=ctx)
            check_mvn(res[f"{dname}_ln"].astype(dt), x, (3,), activation="tanh", context=ctx)
            # and the ISAs agree with each other (float32 math everywhere; a unit or two in the last
            # place of the output type, vectorized activations within 1e-5)
            tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2, "float64": 1e-12}[dname]
            for k in ("bn", "bn_t", "mvn", "mvn_t", "ln"):
                a, w = res[f"{dname}_{k}"], base[f"{dname}_{k}"]
                np.testing.assert_allclose(a, w, rtol=tol, atol=tol * np.abs(w).max(), err_msg=f"{ctx} {k} vs {ref_isa}")


def test_bad_isa_environment_warns_naming_valid_values():
    code = "import simdnorm; print(simdnorm.isa())"
    r = run_script(code, clean_env(SIMDNORM_ISA="avx9000"), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == simdnorm.available_isas()[0]
    assert "RuntimeWarning" in r.stderr and "avx9000" in r.stderr
    for name in simdnorm.available_isas():
        assert name in r.stderr, f"the warning does not name the valid value {name!r}: {r.stderr}"


# ----------------------------------------------------------------------------------------------
# 2,000 calls do not grow memory
# ----------------------------------------------------------------------------------------------

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(under_asan(), reason="ASan's quarantine holds freed memory: RSS says nothing here")
def test_repeated_calls_do_not_grow_memory(threads):
    rng = np.random.default_rng(3)
    c = np.linspace(0.5, 1.5, 16).astype(F32)
    op = simdnorm.compile(simdnorm.BatchNormalizationDesc(
        simdnorm.TensorDesc(F32, (4, 16, 32, 32)), *[simdnorm.TensorDesc(F32, (16,))] * 4))

    def one(i):
        # fresh arrays every call: a leaked reference to any of them would grow RSS by its size
        x = rng.standard_normal((4, 16, 32, 32), dtype=F32)  # 256 KiB: 2 parts with 2 threads
        k = i % 8
        if k == 0:
            bn(x, c, c, c, c, activation="relu")
        elif k == 1:
            mvn(x, (2, 3), c[:, None, None], return_stats=True)
        elif k == 2:
            simdnorm.group_norm(x, 4, c, c, return_stats=True)
        elif k == 3:
            op(x, c, c, c, c, out=np.empty_like(x))
        elif k == 4:
            simdnorm.instance_norm(x.transpose(0, 2, 3, 1), c, channel_axis=-1)
        elif k == 5:
            simdnorm.layer_norm(x.astype(F16), out=np.empty(x.shape, F16))
        elif k == 6:
            simdnorm.rms_norm(x, axis=1, return_stats=True)
            try:
                bn(x, c, c, epsilon=-1.0)
            except ValueError:
                pass
        else:
            y = x.copy()
            mvn(y, -1, out=y)  # in place
        if i % 250 == 0:
            simdnorm.set_num_threads(1 + (i // 250) % 2)  # the pool is rebuilt now and then

    threads(2)
    for i in range(300):  # warm-up: plan caches, the pool, numpy's allocator
        one(i)
    gc.collect()
    before = _rss_bytes()
    for i in range(2000):
        one(i)
    gc.collect()
    grown = _rss_bytes() - before
    assert grown < 8 << 20, f"RSS grew by {grown / 2 ** 20:.1f} MiB over 2,000 calls"


# ----------------------------------------------------------------------------------------------
# a float16 tensor of more than 2**31 elements (SPEC §1: 64-bit indexing throughout)
# ----------------------------------------------------------------------------------------------

def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover
        pass
    return 0


ROW = 2 ** 30 + 17          # elements per row: a row alone is more than 2**31 bytes
N = 2 * ROW                 # 2**31 + 34 elements, 4 GiB of float16
PERIOD = 4099               # the data repeat with this (prime) period: references in O(PERIOD)


@pytest.mark.slow
@pytest.mark.skipif(_mem_available() < 10 * 2 ** 30, reason="needs ~10 GiB of available memory")
def test_float16_tensor_beyond_2_31_elements():
    pattern = np.random.default_rng(11).normal(0.75, 2.0, PERIOD).astype(F16)
    x = np.empty(N, F16)
    x[:PERIOD] = pattern
    filled = PERIOD
    while filled < N:  # doubling copies keep x[i] == pattern[i % PERIOD]
        k = min(filled, N - filled)
        x[filled:filled + k] = x[:k]
        filled += k
    pv = pattern.astype(np.float64)
    probe = np.array(sorted({0, 1, PERIOD - 1, ROW - 1, ROW, ROW + 1, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 1,
                             N - 2, N - 1} | set(np.random.default_rng(12).integers(0, N, 24).tolist())), np.int64)
    vals = pv[probe % PERIOD]
    assert np.array_equal(x[probe].astype(np.float64), vals)

    # MVN over each row of 2**30 + 17 elements, with statistics
    x2 = x.reshape(2, ROW)
    y = np.empty_like(x)
    y2 = y.reshape(2, ROW)
    res = mvn(x2, -1, out=y2, return_stats=True)
    assert res[0] is y2
    mean_got, inv_got = res[1].astype(np.float64).ravel(), res[2].astype(np.float64).ravel()
    full, rem = divmod(ROW, PERIOD)
    means, invs, stds = [], [], []
    for r in range(2):
        start = (r * ROW) % PERIOD
        counts = np.full(PERIOD, full, np.float64)
        counts[(start + np.arange(rem)) % PERIOD] += 1
        mean = (counts * pv).sum() / ROW
        var = (counts * (pv - mean) ** 2).sum() / ROW
        means.append(mean)
        stds.append(np.sqrt(var))
        invs.append(1.0 / np.sqrt(var + 1e-5))
    means, invs, stds = map(np.array, (means, invs, stds))
    assert (np.abs(mean_got - means) <= 1e-5 * (np.abs(means) + stds)).all(), (mean_got, means)
    assert (np.abs(inv_got - invs) <= 4e-5 * invs).all(), (inv_got, invs)
    row = probe // ROW
    z = (vals - means[row]) * invs[row]
    zs = (np.abs(vals) + np.abs(means[row]) + stds[row]) * invs[row]
    check_close(y[probe], z, zs, dtype=F16, context="MVN beyond 2**31")

    # batch norm over the same data, channel axis 0 (C = 2), into the same output buffer
    m = np.array([0.25, -0.5], F32)
    v = np.array([2.0, 0.5], F32)
    s = np.array([1.5, -0.75], F32)
    b = np.array([0.125, 1.0], F32)
    assert bn(x2, m, v, s, b, channel_axis=0, out=y2) is y2
    a = s.astype(np.float64)[row] / np.sqrt(v.astype(np.float64)[row] + 1e-5)
    z = (vals - m[row]) * a + b[row]
    zs = np.abs(vals * a) + np.abs(m[row] * a) + np.abs(b[row])
    check_close(y[probe], z, zs, dtype=F16, context="batch norm beyond 2**31")
