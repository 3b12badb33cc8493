"""The torch per-call route's fuzzer (tests/torch_fuzz.py) at its CI budget, in child processes: a
crash fails the test with the case that crashed. SIMDNORM_TORCH_FUZZ_CASES sets the count and
SIMDNORM_TORCH_FUZZ_SEED the seed (a fresh one by default, printed on failure)."""
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
