"""The training ops' descriptors: compile() gives operators whose results are bitwise the
functional ops', an invalid descriptor raises at validate()/compile(), arrays that do not match
the descriptors raise, descriptors compare, hash and pickle."""
import pickle

import ml_dtypes
import numpy as np
import pytest

import simdnorm
from simdnorm import TensorDesc as T

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64]


def _data(rng, shape, dt):
    return rng.standard_normal(shape).astype(dt)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("act", [None, "relu", "gelu"])
def test_compiled_operators_match_the_functions(rng, dt, act):
    x, dy = _data(rng, (3, 6, 4, 5), dt), _data(rng, (3, 6, 4, 5), dt)
    g, b = _data(rng, (6,), dt), _data(rng, (6,), dt)
    p = T(np.dtype(dt), (6,))
    train = simdnorm.compile(simdnorm.BatchNormalizationTrainingDesc(T(np.dtype(dt), x.shape), p, p, activation=act))
    y1, m1, v1 = train(x, g, b)
    y2, m2, v2 = simdnorm.batch_normalization_training(x, g, b, activation=act)
    for a, c in ((y1, y2), (m1, m2), (v1, v2)):
        assert a.dtype == c.dtype and np.array_equal(a.view(np.uint8), c.view(np.uint8))
    sd = T(m1.dtype, m1.shape)
    grad = simdnorm.compile(simdnorm.BatchNormalizationGradDesc(T(np.dtype(dt), x.shape), sd, sd, p, p, activation=act))
    r1 = grad(dy, x, m1, v1, g, b)
    r2 = simdnorm.batch_normalization_backward(dy, x, m1, v1, g, b, activation=act)
    assert len(r1) == 3 and all(np.array_equal(a.view(np.uint8), c.view(np.uint8)) for a, c in zip(r1, r2))
    _, mean, inv_std = simdnorm.mean_variance_normalization(x, (1, 3), return_stats=True)
    st = T(mean.dtype, mean.shape)
    mvn = simdnorm.compile(simdnorm.MeanVarianceNormalizationGradDesc(T(np.dtype(dt), x.shape), (1, 3), st, st,
                                                                      activation=act))
    a = mvn(dy, x, mean, inv_std)
    c = simdnorm.mean_variance_normalization_backward(dy, x, (1, 3), mean, inv_std, activation=act)
    assert a[1] is None and np.array_equal(a[0].view(np.uint8), c[0].view(np.uint8))


def test_invalid_descriptors_raise_at_validate():
    x = T("float32", (2, 8, 3))
    with pytest.raises(simdnorm.DescriptorError, match="mean"):
        simdnorm.BatchNormalizationGradDesc(x, T("float32", (7,)), T("float32", (8,))).validate()
    with pytest.raises(simdnorm.DescriptorError, match="activation"):
        simdnorm.compile(simdnorm.BatchNormalizationGradDesc(x, T("float32", (8,)), T("float32", (8,)),
                                                             activation="tanh"))
    with pytest.raises(simdnorm.DescriptorError, match="grad_scale"):
        simdnorm.BatchNormalizationGradDesc(x, T("float32", (8,)), T("float32", (8,)), grad_scale=True).validate()
    with pytest.raises(simdnorm.DescriptorError, match="inv_std"):
        simdnorm.MeanVarianceNormalizationGradDesc(x, 2, T("float32", (2, 8, 1)), T("float32", (2, 8, 3))).validate()
    with pytest.raises(simdnorm.DescriptorError, match="epsilon"):
        simdnorm.BatchNormalizationTrainingDesc(x, epsilon=-1.0).validate()
    with pytest.raises(TypeError):
        simdnorm.BatchNormalizationTrainingDesc(np.zeros(3)).validate()


def test_arrays_that_do_not_match_raise(rng):
    x = _data(rng, (2, 8, 3), np.float32)
    op = simdnorm.compile(simdnorm.BatchNormalizationGradDesc(T("float32", x.shape), T("float32", (8,)),
                                                              T("float32", (8,))))
    m, v = np.zeros(8, np.float32), np.ones(8, np.float32)
    with pytest.raises(simdnorm.DescriptorError, match="grad_output"):
        op(x[:1], x, m, v)
    with pytest.raises(simdnorm.DescriptorTypeError, match="input"):
        op(x, x.astype(np.float64), m, v)
    with pytest.raises(simdnorm.DescriptorError, match="scale"):
        op(x, x, m, v, np.ones(8, np.float32))


def test_grad_output_takes_any_strides(rng):
    """grad_output must have the input's dtype and shape (SPEC section 9), not its descriptor's
    strides: a channels-last input descriptor with a packed grad_output, and the other way."""
    x = np.ascontiguousarray(_data(rng, (2, 4, 3, 5), np.float32).transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    dy = _data(rng, x.shape, np.float32)
    xd = T("float32", x.shape, tuple(s // 4 for s in x.strides))
    _, m, v = simdnorm.batch_normalization_training(x)
    _, mean, inv = simdnorm.mean_variance_normalization(x, (2, 3), return_stats=True)
    ops = [
        (simdnorm.compile(simdnorm.BatchNormalizationGradDesc(xd, T("float32", (4,)), T("float32", (4,)))),
         lambda g, a: simdnorm.batch_normalization_backward(g, a, m, v), (m, v)),
        (simdnorm.compile(simdnorm.MeanVarianceNormalizationGradDesc(xd, (2, 3), T("float32", mean.shape),
                                                                     T("float32", inv.shape))),
         lambda g, a: simdnorm.mean_variance_normalization_backward(g, a, (2, 3), mean, inv), (mean, inv)),
    ]
    for op, functional, stats in ops:
        for g in (dy, np.ascontiguousarray(dy.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2), dy[:, ::-1][:, ::-1]):
            for a, c in zip(op(g, x, *stats), functional(g, x)):
                assert (a is None) == (c is None)
                assert a is None or np.array_equal(*(np.ascontiguousarray(r).view(np.uint8) for r in (a, c)))
        with pytest.raises(simdnorm.DescriptorError, match="input: strides"):  # (the input's are the descriptor's)
            op(dy, np.ascontiguousarray(x), *stats)


def test_compiled_operators_cost_less_than_the_functions(rng):
    """SPEC section 7: calling a compiled operator costs less than the functional call (the best of
    interleaved rounds of small calls, where the per-call work is what there is to see). A pair is
    timed again, up to three times, where it does not hold: on a shared machine (CI's, with the
    sanitized build beside the suite) a neighbour's burst once outlasted all 15 rounds of one side."""
    import timeit

    x, dy = _data(rng, (2, 8, 4), np.float32), _data(rng, (2, 8, 4), np.float32)
    xd, cd = T("float32", x.shape), T("float32", (8,))
    _, m, v = simdnorm.batch_normalization_training(x)
    _, mu, inv = simdnorm.mean_variance_normalization(x, -1, return_stats=True)
    sd = T("float32", mu.shape)
    pairs = {
        "batch_normalization": (lambda: simdnorm.batch_normalization(x, m, v),
                                simdnorm.compile(simdnorm.BatchNormalizationDesc(xd, cd, cd)), (x, m, v)),
        "mean_variance_normalization": (lambda: simdnorm.mean_variance_normalization(x, -1),
                                        simdnorm.compile(simdnorm.MeanVarianceNormalizationDesc(xd, -1)), (x,)),
        "batch_normalization_training": (lambda: simdnorm.batch_normalization_training(x),
                                         simdnorm.compile(simdnorm.BatchNormalizationTrainingDesc(xd)), (x,)),
        "batch_normalization_backward": (lambda: simdnorm.batch_normalization_backward(dy, x, m, v),
                                         simdnorm.compile(simdnorm.BatchNormalizationGradDesc(xd, cd, cd)),
                                         (dy, x, m, v)),
        "mean_variance_normalization_backward": (
            lambda: simdnorm.mean_variance_normalization_backward(dy, x, -1, mu, inv),
            simdnorm.compile(simdnorm.MeanVarianceNormalizationGradDesc(xd, -1, sd, sd)), (dy, x, mu, inv)),
    }
    for name, (functional, op, args) in pairs.items():
        compiled = lambda: op(*args)  # noqa: E731
        for _attempt in range(3):
            best = {functional: float("inf"), compiled: float("inf")}
            for _ in range(15):
                for f in best:
                    best[f] = min(best[f], timeit.timeit(f, number=300))
            if best[compiled] < best[functional]:
                break
        assert best[compiled] < best[functional], (name, best[compiled] / 300 * 1e6, best[functional] / 300 * 1e6)


def test_descriptors_compare_hash_pickle_and_are_immutable():
    d = simdnorm.MeanVarianceNormalizationGradDesc(T("float32", (2, 3)), [1], T("float32", (2, 1)),
                                                   T("float32", (2, 1)), epsilon_mode="outside")
    e = pickle.loads(pickle.dumps(d))
    assert e == d and hash(e) == hash(d) and e.axes == (1,)
    assert simdnorm.compile(e).desc == d
    with pytest.raises(AttributeError):
        d.epsilon = 1.0
