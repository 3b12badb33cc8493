"""simdnorm's parallel calls on torch's OpenMP threads (simdnorm.torch.share_threads): shared on
import of simdnorm.torch and on the first torch tensor through a plain function, unless the user
decided before; bitwise the same results as on simdnorm's own pool, with torch's team hot or cold,
from several Python threads at once; the pool in a forked child and where torch has fewer threads
than the call wants (a child that hung in the OpenMP runtime would fail the test by its timeout)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install '.[torch]'): "
                                           "simdnorm.torch needs it")

import simdnorm  # noqa: E402
import simdnorm.torch as st  # noqa: E402
from simdnorm import _core  # noqa: E402

OPENMP = sys.platform.startswith("linux") and "OpenMP" in torch.__config__.parallel_info().split(
    "ATen parallel backend:")[-1]
needs_openmp = pytest.mark.skipif(not OPENMP, reason="torch's parallel backend here is not OpenMP on Linux")


def run_child(*code: str, timeout: float = 120) -> str:
    """Runs the pieces of code in a fresh interpreter; its stdout (a failure or a hang fails the test)."""
    r = subprocess.run([sys.executable, "-c", "".join(map(textwrap.dedent, code))], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"child exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.fixture
def two_threads():
    previous, previous_torch = simdnorm.get_num_threads(), torch.get_num_threads()
    simdnorm.set_num_threads(2)
    torch.set_num_threads(2)
    yield
    simdnorm.set_num_threads(previous)
    torch.set_num_threads(previous_torch)
    st.share_threads()


@needs_openmp
def test_shared_on_import_and_on_first_torch_tensor():
    out = run_child("""
        import torch, simdnorm
        from simdnorm import _core
        print(_core.sharing_openmp_team())
        simdnorm.layer_norm(torch.randn(4, 8))  # a torch tensor: shared from now on
        print(_core.sharing_openmp_team())
    """)
    assert out.split() == ["False", "True"]
    out = run_child("""
        import torch, simdnorm
        from simdnorm import _core
        import simdnorm.torch as st
        print(_core.sharing_openmp_team(), st.share_threads(False), _core.sharing_openmp_team())
        simdnorm.layer_norm(torch.randn(4, 8))  # the user's choice stands
        print(_core.sharing_openmp_team(), st.share_threads(), _core.sharing_openmp_team())
    """)
    assert out.split() == ["True", "False", "False", "False", "True", "True"]


def _calls(rng):
    """(name, fn(out) -> None) over inputs that two threads split, forward and backward."""
    x = rng.standard_normal((512, 1536)).astype(np.float32) * 2 + 0.5
    dy = rng.standard_normal(x.shape).astype(np.float32)
    g = rng.standard_normal(1536).astype(np.float32)
    _, m, s = simdnorm.layer_norm(x, g, g, return_stats=True)
    xc = np.ascontiguousarray(rng.standard_normal((8, 24, 24, 64)).astype(np.float32).transpose(0, 3, 1, 2))
    dyc = np.ascontiguousarray(rng.standard_normal(xc.shape).astype(np.float32).transpose(0, 2, 3, 1)).transpose(
        0, 3, 1, 2)
    gc = rng.standard_normal(64).astype(np.float32)
    _, bm, bv = simdnorm.batch_normalization_training(xc, gc, gc)
    xg = rng.standard_normal((4, 64, 40, 40)).astype(np.float16)
    return [
        ("layer_norm", x, lambda o: simdnorm.layer_norm(x, g, g, activation="gelu", out=o)),
        ("layer_norm_backward", x, lambda o: simdnorm.layer_norm_backward(dy, x, m, s, g, g, out=o)),
        ("bn_training_nhwc", xc, lambda o: simdnorm.batch_normalization_training(xc, gc, gc, out=o)),
        ("bn_backward_nhwc", xc, lambda o: simdnorm.batch_normalization_backward(dyc, xc, bm, bv, gc, gc, out=o)),
        ("group_norm_f16", xg, lambda o: simdnorm.group_norm(xg, 8, out=o)),
        ("mvn_023", xg, lambda o: simdnorm.mean_variance_normalization(xg, (0, 2, 3), out=o)),
    ]


def _run(x, fn):
    o = np.full_like(x, np.nan)  # poisoned: an element no thread wrote shows
    fn(o)
    assert not np.isnan(o.astype(np.float32)).any()
    return o.view(np.uint16 if o.itemsize == 2 else np.uint32)


@needs_openmp
def test_shared_team_same_bits_as_own_pool(rng, two_threads):
    hot = torch.randn(1 << 21)
    for name, x, fn in _calls(rng):
        assert not st.share_threads(False)
        own = _run(x, fn)
        assert st.share_threads()
        cold = _run(x, fn)
        torch.relu(hot)  # torch's team just ran: its threads spin
        warm = _run(x, fn)
        np.testing.assert_array_equal(cold, own, err_msg=name)
        np.testing.assert_array_equal(warm, own, err_msg=name)


@needs_openmp
def test_shared_team_from_several_python_threads(rng, two_threads):
    calls = _calls(rng)
    st.share_threads(False)
    expected = [_run(x, fn) for _, x, fn in calls]
    assert st.share_threads()
    failures = []

    def worker(k):
        try:
            for _ in range(3):
                for (name, x, fn), e in zip(calls[k % 2::2], expected[k % 2::2]):
                    if not np.array_equal(_run(x, fn), e):
                        failures.append((k, name))
        except Exception as err:  # pragma: no cover - reported below
            failures.append((k, repr(err)))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert failures == []


@needs_openmp
def test_fewer_torch_threads_than_the_call_takes_the_pool(rng, two_threads):
    torch.set_num_threads(1)
    st.share_threads(False)
    name, x, fn = _calls(rng)[1]
    own = _run(x, fn)
    assert st.share_threads()
    np.testing.assert_array_equal(_run(x, fn), own)


CHILD_PREAMBLE = """
    import os, numpy as np, torch
    torch.set_num_threads(2)
    t = torch.randn(1 << 22)
    for _ in range(3): torch.relu(t)  # the parent's OpenMP team has run
    a = np.random.default_rng(0).standard_normal((256, 65536)).astype(np.float32)
"""


@needs_openmp
def test_forked_child_of_a_sharing_process_uses_the_pool():
    out = run_child(CHILD_PREAMBLE, """
        import simdnorm, simdnorm.torch as st
        simdnorm.set_num_threads(2)
        print(st.share_threads())
        expected = simdnorm.layer_norm(a)
        pid = os.fork()
        if pid == 0:
            ok = np.array_equal(simdnorm.layer_norm(a), expected)
            print(st.share_threads(), ok, flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(status)
    """)
    assert out.split() == ["True", "False", "True", "0"]


@needs_openmp
def test_child_forked_before_any_sharing_uses_the_pool():
    # simdnorm imported (not simdnorm.torch, nothing shared or run in parallel yet), torch's team run,
    # then fork(): the child's first torch tensor must not start sharing the runtime, whose team
    # waits there for threads that are gone
    out = run_child(CHILD_PREAMBLE, """
        import simdnorm
        simdnorm.set_num_threads(2)
        t = torch.from_numpy(a)
        pid = os.fork()
        if pid == 0:
            y = simdnorm.layer_norm(t)
            import simdnorm.torch as st
            print(st.share_threads(), bool(np.abs(y.numpy().mean(axis=1)).max() < 1e-4), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(status)
    """)
    assert out.split() == ["False", "True", "0"]


@needs_openmp
def test_child_with_one_torch_thread_shares_but_runs_the_pool():
    # as DataLoader's workers: forked after torch's team ran, torch.set_num_threads(1), and only then
    # simdnorm.torch: its 2-thread calls must not wait in the OpenMP runtime for threads that are gone
    out = run_child(CHILD_PREAMBLE, """
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)
            import simdnorm, simdnorm.torch as st
            simdnorm.set_num_threads(2)
            y = simdnorm.layer_norm(a)
            print(st.share_threads(), bool(np.abs(y.mean(axis=1)).max() < 1e-4), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(status)
    """)
    assert out.split() == ["True", "True", "0"]


@needs_openmp
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "own_pool"])
def test_torch_in_a_child_forked_after_simdnorm_ran_on_its_team(shared):
    # simdnorm's parallel call on numpy arrays ran on torch's team (torch itself ran nothing in
    # parallel), then fork(): torch's own parallel op in the child waited for ever for the team's
    # threads; torch now runs there on one thread, as in DataLoader's workers. A process whose calls
    # stayed on simdnorm's pool leaves torch's thread count alone.
    out = run_child("""
        import os, numpy as np, torch, simdnorm, simdnorm.torch as st
        from simdnorm import _core
        simdnorm.set_num_threads(2)
        torch.set_num_threads(2)
        st.share_threads(""" + str(shared) + """)
        simdnorm.layer_norm(np.random.default_rng(0).standard_normal((256, 65536)).astype(np.float32))
        print(_core.openmp_team_entered(), flush=True)
        pid = os.fork()
        if pid == 0:
            t = torch.randn(16, 64, 32, 16)
            y = torch.nn.functional.layer_norm(t, (16,))
            print(torch.get_num_threads(), bool(y.abs().max() < 10), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(status)
    """, timeout=60)
    assert out.split() == ([str(shared), "1" if shared else "2", "True", "0"])
