"""The stub types what a user writes: a type checker (mypy, from the test extra) accepts a script
that uses the statistics return_stats=True gives, and refuses one that misuses them."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mypy", reason="mypy is in the test extra: pip install '.[test]'")

USER_SCRIPT = """
import numpy as np
import simdnorm

x = np.zeros((2, 8, 4), np.float32)
y, mu, inv_std = simdnorm.layer_norm(x, return_stats=True)
print(y.shape, mu.shape, inv_std.shape)
_, mean, istd = simdnorm.group_norm(x, 2, return_stats=True)
print(mean.shape, istd.shape)
_, mean, istd = simdnorm.instance_norm(x, return_stats=True)
print(mean.shape, istd.shape)
z, none, inv_rms = simdnorm.rms_norm(x, return_stats=True)
print(inv_rms.shape)
w = simdnorm.batch_normalization(x=x, mean=np.zeros(8, np.float32), variance=np.ones(8, np.float32))
print(w.shape)
op = simdnorm.compile(simdnorm.MeanVarianceNormalizationDesc(simdnorm.TensorDesc("float32", (2, 8, 4)), (2,)))
out = op(x)
print(out.shape)
try:
    simdnorm.layer_norm(np.zeros((2, 3), np.int32))
except simdnorm.DescriptorTypeError as e:
    print(e)
"""


def _mypy(tmp_path, source):
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--strict-optional", str(script)],
                          capture_output=True, text=True, cwd=tmp_path)


def test_mypy_accepts_a_user_script_using_the_statistics(tmp_path):
    run = _mypy(tmp_path, USER_SCRIPT)
    assert run.returncode == 0, run.stdout + run.stderr


def test_mypy_refuses_a_statistic_that_may_be_none(tmp_path):
    # MVN's mean is None when normalize_mean=False: typed Optional, it must be checked before use
    source = ("import numpy as np, simdnorm\n"
              "y, mu, s = simdnorm.mean_variance_normalization(np.zeros((2, 3), np.float32), 1, return_stats=True)\n"
              "print(mu.shape)\n")
    run = _mypy(tmp_path, source)
    assert run.returncode != 0 and 'Item "None"' in run.stdout, run.stdout
