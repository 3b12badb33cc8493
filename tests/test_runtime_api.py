"""Runtime controls (SPEC section 8) as the Python layer exposes them: threads (and their
environment variables), the instruction set (and SIMDNORM_ISA), threadpoolctl, the CLI, and calls
from many Python threads at once."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import simdnorm
from cases import F32, SANITIZED_RUN, run_in_threads
from simdnorm import _core
from simdnorm._runtime import MAX_THREADS


def run_py(code: str, env_update: dict, drop=("SIMDNORM_NUM_THREADS", "OMP_NUM_THREADS", "SIMDNORM_ISA")):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_update)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip(), r.stderr


# ----------------------------------------------------------------------------------------------
# threads
# ----------------------------------------------------------------------------------------------

def test_set_num_threads_returns_previous():
    before = simdnorm.get_num_threads()
    assert simdnorm.set_num_threads(3) == before
    assert simdnorm.get_num_threads() == 3
    assert simdnorm.set_num_threads(np.int64(1)) == 3
    assert simdnorm.get_num_threads() == 1
    simdnorm.set_num_threads(before)


@pytest.mark.parametrize("n,exc,msg", [
    (0, ValueError, r"^set_num_threads: n must be >= 1, got 0$"),
    (-4, ValueError, r"^set_num_threads: n must be >= 1, got -4$"),
    (2.0, TypeError, r"^set_num_threads: n must be an int >= 1, got float$"),
    ("2", TypeError, r"^set_num_threads: n must be an int >= 1, got str$"),
    (None, TypeError, r"^set_num_threads: n must be an int >= 1, got NoneType$"),
    (True, TypeError, r"^set_num_threads: n must be an int >= 1, got bool$"),
    (1 << 40, ValueError, rf"^set_num_threads: n must be <= {MAX_THREADS}, got 1099511627776$"),
    # past 4300 digits an int has no str(): named by its size, not Python's "Exceeds the limit" ValueError
    pytest.param(10 ** 5000, ValueError, rf"^set_num_threads: n must be <= {MAX_THREADS}, got about 10\*\*5000$",
                 id="10**5000"),
    pytest.param(-10 ** 5000, ValueError, r"^set_num_threads: n must be >= 1, got about -10\*\*5000$", id="-10**5000"),
    (np.int64(2 ** 63 - 1), ValueError, rf"^set_num_threads: n must be <= {MAX_THREADS}, got 9223372036854775807$"),
])
def test_set_num_threads_errors(n, exc, msg):
    before = simdnorm.get_num_threads()
    with pytest.raises(exc, match=msg):
        simdnorm.set_num_threads(n)
    assert simdnorm.get_num_threads() == before


CODE_THREADS = "import simdnorm; print(simdnorm.get_num_threads())"


@pytest.mark.parametrize("env,want", [
    ({"SIMDNORM_NUM_THREADS": "3"}, 3),
    ({"OMP_NUM_THREADS": "5"}, 5),
    ({"OMP_NUM_THREADS": "4,2"}, 4),
    ({"SIMDNORM_NUM_THREADS": "2", "OMP_NUM_THREADS": "7"}, 2),
    ({"SIMDNORM_NUM_THREADS": " 6 "}, 6),
    ({}, None),
    ({"OMP_NUM_THREADS": "lots"}, None),
    ({"SIMDNORM_NUM_THREADS": ""}, None),
])
def test_initial_threads_from_environment(env, want):
    out, err = run_py(CODE_THREADS, env)
    if want is None:
        want = len(os.sched_getaffinity(0))
    assert int(out) == want
    assert "Warning" not in err


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "100000"])
def test_bad_simdnorm_num_threads_warns_and_falls_back(value):
    out, err = run_py(CODE_THREADS, {"SIMDNORM_NUM_THREADS": value, "OMP_NUM_THREADS": "3"})
    assert int(out) == 3
    assert "RuntimeWarning" in err
    assert f"SIMDNORM_NUM_THREADS={value!r} is not a positive integer <= {MAX_THREADS}" in err


def test_threads_limited_by_affinity():
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity")
    code = "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); " \
           "import simdnorm; print(simdnorm.get_num_threads())"
    out, _ = run_py(code, {})
    assert int(out) == 1


# ----------------------------------------------------------------------------------------------
# instruction sets
# ----------------------------------------------------------------------------------------------

def test_isa_functions():
    avail = simdnorm.available_isas()
    assert isinstance(avail, list) and avail and avail[-1] == "baseline"
    assert set(avail) <= {"avx512bf16", "avx512", "avx2", "baseline"}
    assert simdnorm.isa() in avail
    prev = simdnorm.isa()
    for name in avail:
        before = simdnorm.isa()
        assert simdnorm.set_isa(name) == before
        assert simdnorm.isa() == name
        y = simdnorm.layer_norm(np.arange(12, dtype=F32).reshape(3, 4))
        np.testing.assert_allclose(y[0], (np.arange(4) - 1.5) / np.sqrt(1.25 + 1e-5), rtol=1e-5)
    simdnorm.set_isa(prev)


@pytest.mark.parametrize("name,msg", [
    ("sse9", r"^set_isa: 'sse9' is unknown; available on this CPU: "),
    ("", r"^set_isa: '' is unknown"),
])
def test_set_isa_errors(name, msg):
    before = simdnorm.isa()
    with pytest.raises(ValueError, match=msg) as info:
        simdnorm.set_isa(name)
    for n in simdnorm.available_isas():
        assert n in str(info.value)
    assert simdnorm.isa() == before
    with pytest.raises(TypeError, match=r"^set_isa: name must be a str, got int"):
        simdnorm.set_isa(2)


def test_set_isa_unavailable():
    cpu = simdnorm._core.cpu_isas()
    assert cpu[-1] == "baseline" and set(simdnorm.available_isas()) <= set(cpu)
    missing = [n for n in ("avx512bf16", "avx512", "avx2") if n not in simdnorm.available_isas()]
    if not missing:
        pytest.skip("every known ISA is available here")
    for name in missing:
        what = "not built into this install" if name in cpu else "not available on this CPU"
        with pytest.raises(ValueError, match=rf"'{name}' is {what}"):
            simdnorm.set_isa(name)


def test_set_isa_is_case_insensitive():
    before = simdnorm.isa()
    simdnorm.set_isa(" BASELINE ")
    assert simdnorm.isa() == "baseline"
    simdnorm.set_isa(before)


CODE_ISA = "import simdnorm; print(simdnorm.isa(), ','.join(simdnorm.available_isas()))"


@pytest.mark.parametrize("name", ["baseline", "avx2", "avx512", "avx512bf16"])
def test_simdnorm_isa_env_forces(name):
    if name not in simdnorm.available_isas():
        pytest.skip(f"{name} not available")
    out, err = run_py(CODE_ISA, {"SIMDNORM_ISA": name})
    assert out.split()[0] == name and "Warning" not in err


@pytest.mark.parametrize("value", ["sse9", "AVX-1024", "fast"])
def test_bad_simdnorm_isa_warns_and_uses_best(value):
    out, err = run_py(CODE_ISA, {"SIMDNORM_ISA": value})
    active, avail = out.split()
    assert active == avail.split(",")[0]
    assert "RuntimeWarning" in err and f"SIMDNORM_ISA={value!r} is not valid" in err
    assert f"valid values: {', '.join(avail.split(','))}" in err
    assert f"using the best available, {active!r}" in err


def test_simdnorm_isa_env_names_a_unit_not_built():
    unbuilt = [n for n in simdnorm._core.cpu_isas() if n not in simdnorm.available_isas()]
    if not unbuilt:
        pytest.skip("every unit this CPU runs is built")
    out, err = run_py(CODE_ISA, {"SIMDNORM_ISA": unbuilt[0]})
    assert out.split()[0] == simdnorm.available_isas()[0]
    assert f"SIMDNORM_ISA={unbuilt[0]!r} is not built into this install" in err


def test_bad_simdnorm_isa_is_an_error_under_strict_warnings():
    env = {k: v for k, v in os.environ.items() if k != "SIMDNORM_ISA"}
    env["SIMDNORM_ISA"] = "bogus"
    r = subprocess.run([sys.executable, "-W", "error", "-c", "import simdnorm"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "SIMDNORM_ISA='bogus'" in r.stderr


# ----------------------------------------------------------------------------------------------
# threadpoolctl
# ----------------------------------------------------------------------------------------------

def _ours(info):
    core = os.path.realpath(_core.__file__)
    return [e for e in info if e["internal_api"] == "simdnorm" and os.path.realpath(e["filepath"]) == core]


def test_threadpoolctl_lists_simdnorm():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    entries = _ours(threadpoolctl.threadpool_info())
    assert len(entries) == 1
    e = entries[0]
    assert e["user_api"] == "simdnorm" and e["prefix"] == "_core"
    assert e["num_threads"] == simdnorm.get_num_threads()
    assert e["version"] == simdnorm.__version__


def test_threadpool_limits_limits_simdnorm():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    before = simdnorm.set_num_threads(2)
    try:
        with threadpoolctl.threadpool_limits(1, user_api="simdnorm"):
            assert simdnorm.get_num_threads() == 1
            assert _ours(threadpoolctl.threadpool_info())[0]["num_threads"] == 1
        assert simdnorm.get_num_threads() == 2
        with threadpoolctl.threadpool_limits({"simdnorm": 1}):
            assert simdnorm.get_num_threads() == 1
        assert simdnorm.get_num_threads() == 2
        controller = threadpoolctl.ThreadpoolController()
        with controller.limit(limits=1, user_api="simdnorm"):
            assert simdnorm.get_num_threads() == 1
        assert simdnorm.get_num_threads() == 2
    finally:
        simdnorm.set_num_threads(before)


def test_threadpoolctl_registered_in_a_fresh_process():
    code = """
        import simdnorm, threadpoolctl, os
        from simdnorm import _core
        info = [e for e in threadpoolctl.threadpool_info() if e["internal_api"] == "simdnorm"]
        same = os.path.realpath(info[0]["filepath"]) == os.path.realpath(_core.__file__)
        print(len(info), info[0]["num_threads"], same)
    """
    out, _ = run_py(code, {"SIMDNORM_NUM_THREADS": "2"})
    assert out == "1 2 True"


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

def test_cli_info():
    env = {k: v for k, v in os.environ.items() if k != "SIMDNORM_ISA"}
    env["SIMDNORM_NUM_THREADS"] = "2"
    r = subprocess.run([sys.executable, "-m", "simdnorm", "info"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"simdnorm {simdnorm.__version__}"
    assert lines[1] == f"isa: {simdnorm.available_isas()[0]}"
    assert lines[2] == f"available isas: {', '.join(simdnorm.available_isas())}"
    assert lines[3] == "threads: 2"
    built = simdnorm._core.built_isas.split(",")
    assert lines[4] == f"built isas: {', '.join(built)} (SIMDNORM_ISAS={simdnorm._core.isas_setting})"


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def test_build_holds_the_unit_the_dispatcher_picks_here():
    """The default build (SIMDNORM_ISAS=host) compiles the baseline and the unit the dispatcher picks
    on this CPU (avx512 with avx512bf16, which delegates to it), by the dispatcher's conditions, which
    /proc/cpuinfo's flags mirror (Linux lists AVX-512 only where the OS saves its registers): a probe
    that missed one would leave the machine on slower kernels."""
    built = simdnorm._core.built_isas.split(",")
    assert "baseline" in built
    assert set(simdnorm.available_isas()) <= set(built)
    if simdnorm._core.isas_setting != "host":
        pytest.skip(f"built with SIMDNORM_ISAS={simdnorm._core.isas_setting}, not for this host")
    flags = _cpu_flags()
    if flags is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs /proc/cpuinfo on x86-64")
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags
    runs = ["baseline"] + ["avx2"] * avx2 + ["avx512"] * avx512 + ["avx512bf16"] * (avx512 and "avx512_bf16" in flags)
    assert sorted(simdnorm._core.cpu_isas()) == sorted(runs)
    # (the sanitized build leaves avx512bf16 out: its loops are avx512's, instrumented there)
    bf16 = "avx512_bf16" in flags and not SANITIZED_RUN
    expected = ["baseline"] + (["avx512"] + ["avx512bf16"] * bf16 if avx512 else ["avx2"] * avx2)
    assert sorted(built) == sorted(expected)
    assert sorted(simdnorm.available_isas()) == sorted(expected)


def test_cli_usage_and_unknown_command(capsys):
    from simdnorm.__main__ import main

    assert main([]) == 2
    no_args = capsys.readouterr()
    assert "usage: python -m simdnorm {info,bench,accuracy}" in no_args.err and no_args.out == ""
    assert main(["--help"]) == 0
    assert "usage: python -m simdnorm {info,bench,accuracy}" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert main(["info", "extra"]) == 2


def test_cli_bench_delegates(monkeypatch):
    from simdnorm.__main__ import main

    seen = []
    fake = types.ModuleType("simdnorm.bench")
    fake.main = lambda args: seen.append(list(args)) or 7
    monkeypatch.setitem(sys.modules, "simdnorm.bench", fake)
    assert main(["bench", "--quick", "-k", "bn"]) == 7
    assert seen == [["--quick", "-k", "bn"]]


def test_cli_ctrl_c_is_a_line_and_status_130(monkeypatch, capsys):
    from simdnorm.__main__ import main

    def interrupted(args):
        raise KeyboardInterrupt

    fake = types.ModuleType("simdnorm.bench")
    fake.main = interrupted
    monkeypatch.setitem(sys.modules, "simdnorm.bench", fake)
    assert main(["bench"]) == 130
    err = capsys.readouterr().err
    assert err == "interrupted\n", err


# ----------------------------------------------------------------------------------------------
# many Python threads at once
# ----------------------------------------------------------------------------------------------

def test_concurrent_calls_from_python_threads():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((4, 8, 16, 16)).astype(F32) for _ in range(6)]
    p = np.linspace(0.5, 1.5, 8).astype(F32)
    want = [(simdnorm.batch_normalization(x, p, p, p, p), simdnorm.group_norm(x, 4, p, p),
             simdnorm.layer_norm(x)) for x in xs]

    def work(i):
        for _ in range(20):
            x = xs[i]
            got = (simdnorm.batch_normalization(x, p, p, p, p), simdnorm.group_norm(x, 4, p, p),
                   simdnorm.layer_norm(x))
            for g, w in zip(got, want[i]):
                np.testing.assert_array_equal(g, w)

    run_in_threads(work, len(xs))
