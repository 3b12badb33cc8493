"""The torch fuzzers at their CI budgets, in child processes (a crash fails the test with the case
that crashed): the per-call route's (tests/torch_fuzz.py) and the drop-in modules' under autograd
(tests/torch_module_fuzz.py). SIMDNORM_TORCH_FUZZ_CASES sets the first's count and
SIMDNORM_TORCH_FUZZ_SEED the seed of both (a fresh one by default, printed on failure)."""
from __future__ import annotations

import os
import secrets

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install '.[torch]'): the route is simdnorm.torch's")

import torch_fuzz  # noqa: E402


def test_torch_route_fuzz():
    cases = int(os.environ.get("SIMDNORM_TORCH_FUZZ_CASES", "2000"))
    seed = int(os.environ.get("SIMDNORM_TORCH_FUZZ_SEED", str(secrets.randbelow(2 ** 32))))
    fails, crashes = torch_fuzz.run_in_children(seed, cases)
    assert not fails and not crashes, (f"seed {seed} (replay: python tests/torch_fuzz.py --seed {seed} --replay I):\n"
                                       + "\n".join(crashes + fails[:20]))


def test_drop_in_module_fuzz():
    """The drop-in modules under autograd against torch.nn in float64 (tests/torch_module_fuzz.py);
    SIMDNORM_TORCH_MODULE_FUZZ_CASES sets the count, SIMDNORM_TORCH_FUZZ_SEED the seed."""
    cases = int(os.environ.get("SIMDNORM_TORCH_MODULE_FUZZ_CASES", "1500"))
    seed = int(os.environ.get("SIMDNORM_TORCH_FUZZ_SEED", str(secrets.randbelow(2 ** 32))))
    fails, crashes = torch_fuzz.run_in_children(seed, cases, module="torch_module_fuzz")
    assert not fails and not crashes, (f"seed {seed} (replay: python tests/torch_module_fuzz.py --seed {seed} "
                                       "--replay I):\n" + "\n".join(crashes + fails[:20]))
