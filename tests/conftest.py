"""Shared fixtures: a per-test seeded RNG, the `isa` fixture (one run per instruction set this
machine has, restoring the previous one), the `num_threads` helper, and a safety net that puts
the ISA and thread count back after every test."""

from __future__ import annotations

import os
import sys
import warnings
import zlib

import numpy as np
import pytest

# the test helpers (reference.py, cases.py) are imported as top-level modules
sys.path.insert(0, os.path.dirname(__file__))

# When a hypothesis test fails, hypothesis imports its patch writer, which imports libcst, which (on
# some installs) imports mypy_extensions.TypedDict and triggers a DeprecationWarning; under
# filterwarnings=error that turns the report of a real failure into an INTERNALERROR. When the
# session has hypothesis tests, import it once up front with that third-party warning silenced, so
# a failure reports normally.
def pytest_collection_finish(session):
    if any(getattr(getattr(item, "obj", None), "is_hypothesis_test", False) for item in session.items):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                import hypothesis.extra._patching  # noqa: F401
            except Exception:  # hypothesis or libcst missing, or a version without it
                pass

def pytest_generate_tests(metafunc):
    # parametrize at collection time, only for tests that ask for it, so that files which do not
    # use the package never import it here
    if "isa" in metafunc.fixturenames:
        from cases import isas_under_test

        isas = isas_under_test()
        metafunc.parametrize("isa", isas, ids=[f"isa={i}" for i in isas], indirect=True)


@pytest.fixture
def isa(request):
    """Force one ISA (simdnorm.set_isa) for the test; restore the previous one afterwards."""
    import simdnorm

    previous = simdnorm.isa()
    simdnorm.set_isa(request.param)
    assert simdnorm.isa() == request.param
    try:
        yield request.param
    finally:
        simdnorm.set_isa(previous)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's node id: reproducible, different per test."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture
def threads():
    """Call threads(n) to set the pool size for this test; the previous size comes back after."""
    import simdnorm

    previous = simdnorm.get_num_threads()

    def set_(n):
        simdnorm.set_num_threads(n)
        assert simdnorm.get_num_threads() == n

    yield set_
    simdnorm.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _restore_runtime_state():
    """Whatever a test (anyone's) does to the ISA or the thread count, the next test starts from the
    same state. Only acts when the package was already imported."""
    mod = sys.modules.get("simdnorm")
    state = None
    if mod is not None:
        try:
            state = (mod.isa(), mod.get_num_threads())
        except Exception:  # the package may be half-built; nothing to restore then
            state = None
    yield
    if state is not None:
        try:
            if mod.isa() != state[0]:
                mod.set_isa(state[0])
            if mod.get_num_threads() != state[1]:
                mod.set_num_threads(state[1])
        except Exception:
            pass
