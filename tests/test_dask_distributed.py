"""simdnorm.dask on dask.distributed: a LocalCluster of 2 process workers (one thread each), started
and closed by this module. Every op's results there are bitwise those of the threaded scheduler
(the statistics merge in a fixed order, whatever runs where), within the float64 reference's
bound, and the workers' simdnorm thread count is left as it was."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("dask.array", reason="simdnorm.dask needs dask: pip install '.[dask]' (the test extra has it)")
distributed = pytest.importorskip("distributed", reason="the distributed tests need dask[distributed]")

import dask  # noqa: E402
import dask.array as da  # noqa: E402

import simdnorm  # noqa: E402
import simdnorm.dask as sd  # noqa: E402
from cases import bits, rand_values, scale_bias_values  # noqa: E402
from reference import F32, check_mvn  # noqa: E402


@pytest.fixture(scope="module")
def client():
    # Processes, so that tasks, their functions and results cross a pickle; no dashboard; the
    # workers import simdnorm from the same sys.path (PYTHONPATH is inherited).
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                       memory_limit="1GiB")
    c = distributed.Client(cluster)
    try:
        yield c
    finally:
        c.close()
        cluster.close()


def graphs(rng):
    x = rand_values(rng, (24, 10, 9), F32, loc=300.0, scale=0.5)
    X = da.from_array(x, chunks=((7, 9, 8), (4, 6), (5, 4)))
    s = scale_bias_values(rng, (10, 9), F32)
    return x, s, {
        "mvn split": sd.mean_variance_normalization(X, (0, 2), s[:, :1], return_stats=True),
        "layer norm in chunks": sd.layer_norm(X.rechunk({1: -1, 2: -1}), s, return_stats=True),
        "layer norm split": sd.layer_norm(X, axis=1, return_stats=True),
        "group norm": sd.group_norm(X, 5, s[:, 0], activation="relu", return_stats=True),
        "training": sd.batch_normalization_training(X, s[:, 0], fused_add=X[0]),
    }


def test_bitwise_the_threaded_schedulers_results(client, rng):
    x, s, built = graphs(rng)
    names = list(built)
    flat = [a for n in names for a in built[n] if a is not None]
    there = client.compute(flat, sync=True)
    with warnings.catch_warnings():  # (dask 2024.x warns of the client beside; on purpose here)
        warnings.filterwarnings("ignore", "Running on a single-machine scheduler", UserWarning)
        here = dask.compute(*flat, scheduler="threads")
    for a, b, arr in zip(there, here, flat):
        assert isinstance(a, np.ndarray) and a.shape == arr.shape and a.dtype == arr.dtype
        assert (bits(a) == bits(b)).all()
    y, mean, inv = there[:3]
    check_mvn(y, x, (0, 2), s[:, :1], stats=(mean, inv), context="distributed")


def test_workers_keep_their_thread_count(client, rng):
    before = client.run(simdnorm.get_num_threads)
    X = da.from_array(rand_values(rng, (64, 40), F32), chunks=(16, 40))
    y = client.compute(sd.layer_norm(X, num_threads=2), sync=True)
    assert y.shape == (64, 40)
    assert client.run(simdnorm.get_num_threads) == before
