"""The benchmark suite reports what it says: each timed callable computes the named op on the named
shape, dtype and layout (checked against a float64 numpy reference), the copy really copies, the
byte count is 2 x the input's bytes (3 x for a backward op), and `--quick --filter tiny` runs end to
end with valid JSON. The training cases (forward-training batch norm, the backward ops) are checked
the same way: their float64 reference against finite differences, every output of every
implementation against it, the two-read floor bit for bit.

The suite is imported as the installed ``simdnorm.bench`` when available, else from the source
tree's ``bench/``. Tests that need simdnorm skip cleanly while ``import simdnorm`` fails; the peers'
tests skip when a peer is not installed.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_bench():
    try:
        return importlib.import_module("simdnorm.bench")
    except Exception:  # noqa: BLE001 - not installed (yet), or the package does not import
        if (ROOT / "bench" / "__init__.py").exists():
            if str(ROOT) not in sys.path:
                sys.path.insert(0, str(ROOT))
            return importlib.import_module("bench")
        raise


B = _load_bench()
shapes = importlib.import_module(B.__name__ + ".shapes")
bcases = importlib.import_module(B.__name__ + ".cases")
impls = importlib.import_module(B.__name__ + ".impls")
runner = importlib.import_module(B.__name__ + ".runner")
timing = importlib.import_module(B.__name__ + ".timing")
report = importlib.import_module(B.__name__ + ".report")
impl_base = importlib.import_module(B.__name__ + ".impl_base")


def _simdnorm_or_skip():
    mod, err = impls.load_simdnorm()
    if mod is None:
        pytest.skip(err)
    return mod


def small_shape(case):
    """A scaled-down shape of the same rank that keeps the op's constraints (groups divide C) and
    has odd sizes, so vector tails are exercised."""
    if "tiny" in case.tags:
        return case.shape
    if case.groups:
        return (2, 2 * case.groups, 5, 3)
    if len(case.shape) == 4:
        return (2, 24, 5, 7)
    if len(case.shape) == 2:  # (N, C) batch norm
        return (3, 37)
    return (2, 3, 37)


def _kinds():
    """One scaled case per distinct (op, dtype, layout, compiled, activation, rank) of the suite."""
    seen = {}
    for c in shapes.CASES:
        key = (c.op, c.dtype, c.layout, c.compiled, c.activation, len(c.shape))
        if key not in seen:
            seen[key] = c.scaled(small_shape(c))
    return list(seen.values())


KINDS = _kinds()
KIND_IDS = [c.name for c in KINDS]


def _needs_ml_dtypes(case):
    if case.dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")


def _check_timed_callable(case, prep, ref):
    """The output matches the reference; for a callable that writes a preallocated output, the
    *timed* callable alone, run on a poisoned output, writes it again (a callable that returns its
    output, like torch's, is what run_once converts). A training case's outputs: each of them."""
    out = prep.run_once()
    ok, err = bcases.check(case, out, ref)
    assert ok, f"{case.name}: max |err| {err}" + (
        f" {bcases.check_each(case, out, ref)}" if isinstance(ref, bcases.Expected) else "")
    if prep.out is not None:
        if isinstance(out, dict):
            out = out[ref.primary]
        assert out is prep.out
        prep.out[...] = np.nan
        prep.fn()
        ok, err = bcases.check(case, prep.out, ref)
        assert ok, f"{case.name}: timed callable: max |err| {err}"


# ------------------------------------------------------------------------------------ shapes
def test_named_shape_lists():
    assert shapes.RESNET50_BN_SHAPES == (
        (8, 64, 112, 112), (8, 256, 56, 56), (8, 64, 56, 56), (8, 512, 28, 28), (8, 128, 28, 28),
        (8, 1024, 14, 14), (8, 256, 14, 14), (8, 2048, 7, 7), (8, 512, 7, 7))
    names = [c.name for c in shapes.CASES]
    assert len(names) == len(set(names))
    bn = [c for c in shapes.CASES if c.op == "batch_norm" and not {"tiny", "bn1d"} & c.tags and c.dtype != "float64"]
    assert {(c.shape, c.layout, c.dtype) for c in bn} == {
        (s, lay, d) for s in shapes.RESNET50_BN_SHAPES for lay in ("nchw", "nhwc")
        for d in ("float32", "float16", "bfloat16")}
    for op in ("instance_norm", "group_norm", "mvn"):
        cs = [c for c in shapes.CASES if c.op == op and not c.activation]  # those: ACTIVATION_CASES
        assert cs and {c.shape for c in cs} == {(8, 256, 56, 56), (8, 512, 7, 7)}
    bn1d = [c for c in shapes.CASES if "bn1d" in c.tags]  # BatchNorm1d: (batch, features), features contiguous
    assert [(c.name, c.op, c.axes) for c in bn1d] == [
        ("bn/8x4096/nchw/f32", "batch_norm", (0,)), ("bn-train/8x4096/nchw/f32", "batch_norm_training", (0,)),
        ("bn-bwd/8x4096/nchw/f32", "batch_norm_backward", (0,))]
    assert all(c.dtype == "float32" and c.param_len == 4096 for c in bn1d)
    assert all(c.groups == 32 for c in shapes.CASES if c.op == "group_norm")
    assert all(c.axes == (0, 2, 3) for c in shapes.CASES if c.op == "mvn")
    for op in ("layer_norm", "rms_norm"):
        got = {(c.shape, c.dtype) for c in shapes.CASES if c.op == op and c.dtype != "float64"}
        assert got == {(s, d) for s in ((8, 512, 768), (32, 128, 1024), (4, 512, 4096), (96, 512, 64))
                       for d in ("float32", "float16", "bfloat16")}
    tiny = [c for c in shapes.CASES if "tiny" in c.tags]
    assert {c.compiled for c in tiny} == {False, True}
    assert all(c.shape == (1, 16, 8, 8) and c.op == "batch_norm" for c in tiny)
    quick = shapes.select(quick=True)
    assert tiny[0] in quick and len(quick) < len(shapes.CASES)
    assert all("nhwc" in c.name for c in shapes.select(filters=["nhwc"]))
    assert [c.name for c in shapes.select(quick=True, filters=["tiny"])] == [c.name for c in tiny]


# The 92 cases before the float64 ones, by name: adding cases must not rename or drop any.
CASES_BEFORE_FLOAT64 = (
    [f"bn/{shapes.shape_str(s)}/{lay}/{d}" for s in shapes.RESNET50_BN_SHAPES for lay in ("nchw", "nhwc")
     for d in ("f32", "f16", "bf16")]
    + [n for s in ("8x256x56x56", "8x512x7x7") for d in ("f32", "f16")
       for n in (f"instance/{s}/{d}", f"group32/{s}/{d}", f"mvn023/{s}/{d}")]
    + [f"{op}/{s}/{d}" for s in ("8x512x768", "32x128x1024", "4x512x4096", "96x512x64")
       for d in ("f32", "f16", "bf16") for op in ("layer", "rms")]
    + ["tiny/bn/1x16x8x8/f32", "tiny/bn-compiled/1x16x8x8/f32"])
FLOAT64_CASES = {  # name: (op, shape, layout, axes, tags)
    "layer/8x512x768/f64": ("layer_norm", (8, 512, 768), "contig", (2,), {"sequence", "float64"}),
    "bn/8x64x112x112/nchw/f64": ("batch_norm", (8, 64, 112, 112), "nchw", (0, 2, 3),
                                 {"bn", "nchw", "float64"}),
    "instance/8x256x56x56/f64": ("instance_norm", (8, 256, 56, 56), "nchw", (2, 3), {"spatial", "float64"}),
}


def test_float64_cases_are_added_beside_the_others():
    names = [c.name for c in shapes.CASES]
    assert len(CASES_BEFORE_FLOAT64) == 92
    assert [n for n in names if not n.endswith("/f64") and not shapes.get_case(n).is_training
            and not shapes.get_case(n).activation and "bn1d" not in shapes.get_case(n).tags] == CASES_BEFORE_FLOAT64
    f64 = [c for c in shapes.CASES if c.dtype == "float64"]
    assert [c.name for c in f64] == list(FLOAT64_CASES) == [c.name for c in shapes.select(filters=["f64"])]
    for c in f64:
        op, shape, layout, axes, tags = FLOAT64_CASES[c.name]
        assert (c.op, c.shape, c.layout, c.axes, set(c.tags)) == (op, shape, layout, axes, tags)
        assert c.name == shapes.make_name(c.op, c.shape, "float64", c.layout) and not c.compiled
        assert c.bytes_moved == 2 * 8 * math.prod(shape)
        assert c.describe().startswith(f"{op} {shapes.shape_str(shape)} float64 {layout}")
    assert all("float64" in c.tags for c in shapes.CASES if c.dtype == "float64")
    assert not any("float64" in c.tags for c in shapes.CASES if c.dtype != "float64")
    assert not any(c.dtype == "float64" for c in shapes.select(quick=True))
    assert shapes.select(quick=True, filters=["f64"]) == []


def test_byte_count_formula():
    for c in shapes.CASES:
        k = 3 if c.op.endswith("_backward") else 2  # backward: x and grad_output read, grad_input written
        assert c.bytes_moved == k * math.prod(c.shape) * shapes.ITEMSIZE[c.dtype]
        assert c.nbytes * k == c.bytes_moved
    c = shapes.get_case("bn/8x512x7x7/nhwc/f16")
    assert c.bytes_moved == 2 * 8 * 512 * 7 * 7 * 2
    data = bcases.make_data(c.scaled((2, 8, 3, 5)))
    assert data.case.bytes_moved == 2 * data.x.nbytes


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_layouts_are_the_named_ones(layout):
    case = shapes.get_case(f"bn/8x64x56x56/{layout}/f32").scaled((2, 6, 4, 5))
    data = bcases.make_data(case)
    x = data.x
    assert x.shape == (2, 6, 4, 5) and x.dtype == np.float32
    if layout == "nhwc":  # the NHWC-strided view of the same logical shape
        assert x.strides == (4 * 4 * 5 * 6, 4, 4 * 5 * 6, 4 * 6)
        assert x.transpose(0, 2, 3, 1).flags.c_contiguous
    else:
        assert x.flags.c_contiguous
    out = data.new_output()
    assert out.strides == x.strides and np.isnan(out).all()


def test_reference_is_the_named_op():
    # hand-written loops against the vectorized float64 reference, on tiny shapes
    case = shapes.get_case("bn/8x64x56x56/nchw/f32").scaled((2, 3, 2, 2))
    d = bcases.make_data(case)
    ref = bcases.reference(d)
    x, p = d.x.astype(np.float64), {k: v.astype(np.float64) for k, v in d.params.items()}
    for n, c, h, w in np.ndindex(*x.shape):
        want = p["scale"][c] * (x[n, c, h, w] - p["mean"][c]) / math.sqrt(p["var"][c] + 1e-5) + p["bias"][c]
        assert ref[n, c, h, w] == pytest.approx(want, rel=1e-12, abs=1e-12)
    case = shapes.get_case("group32/8x256x56x56/f32").scaled((1, 64, 2, 3))
    d = bcases.make_data(case)
    ref = bcases.reference(d)
    x = d.x.astype(np.float64)
    for g in range(32):
        blk = x[0, 2 * g:2 * g + 2]
        y = (blk - blk.mean()) / math.sqrt(blk.var() + 1e-5)
        y = y * d.params["scale"][2 * g:2 * g + 2, None, None] + d.params["bias"][2 * g:2 * g + 2, None, None]
        np.testing.assert_allclose(ref[0, 2 * g:2 * g + 2], y, rtol=1e-12, atol=1e-12)
    case = shapes.get_case("rms/8x512x768/f32").scaled((2, 2, 5))
    d = bcases.make_data(case)
    x = d.x.astype(np.float64)
    want = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * d.params["scale"]
    np.testing.assert_allclose(bcases.reference(d), want, rtol=1e-12)
    case = shapes.get_case("mvn023/8x256x56x56/f32").scaled((2, 3, 2, 2))
    d = bcases.make_data(case)
    x = d.x.astype(np.float64)
    for c in range(3):
        blk = x[:, c]
        np.testing.assert_allclose(bcases.reference(d)[:, c], (blk - blk.mean()) / np.sqrt(blk.var() + 1e-5),
                                   rtol=1e-12)


def test_parameters_exact_in_every_dtype():
    ml = pytest.importorskip("ml_dtypes")
    d = bcases.make_data(shapes.get_case("bn/8x64x56x56/nchw/f32").scaled((2, 40, 2, 2)))
    for v in d.params.values():
        assert np.array_equal(v.astype(np.float16).astype(np.float32), v)
        assert np.array_equal(v.astype(ml.bfloat16).astype(np.float32), v)


def test_float64_data_parameters_and_poisoned_output():
    """A float64 case's input holds float64 values (not float32 ones widened); its parameters are
    the float32 ones' values, given as float64 to whoever passes parameters in the input's dtype;
    its output starts as NaN."""
    for name in FLOAT64_CASES:
        case = shapes.get_case(name)
        case = case.scaled(small_shape(case))
        d = bcases.make_data(case)
        x = d.x
        assert x.dtype == np.float64 and x.shape == case.shape and x.flags.c_contiguous
        assert np.mean(x.astype(np.float32).astype(np.float64) != x) > 0.9
        assert abs(x.mean() - 0.25) < 0.3 and 0.5 < x.std() < 1.5
        assert d.param_dtype == np.float64
        up = d.user_params()
        assert set(up) == set(case.params) == set(d.params)
        for k, v in up.items():
            assert v.dtype == np.float64 and v.shape == (case.param_len,)
            assert d.params[k].dtype == np.float32 and np.array_equal(v, d.params[k])
        out = d.new_output()
        assert out.dtype == np.float64 and out.strides == x.strides and np.isnan(out).all()
        assert bcases.reference(d).dtype == np.float64
    f32 = bcases.make_data(shapes.get_case("layer/8x512x768/f32").scaled((2, 3, 37)))
    assert f32.param_dtype == np.float32 and f32.user_params() is f32.params


@pytest.mark.parametrize("threads", [1, 2])
def test_copy_really_copies_float64(threads):
    case = shapes.get_case("bn/8x64x112x112/nchw/f64").scaled((4, 64, 23, 25))  # 1.18 MB: > 1 MiB, split at 2 threads
    data = bcases.make_data(case)
    impl = impls.CopyImpl()
    impl.set_threads(threads)
    try:
        prep = impl.prepare(data)
        assert runner.copied_exactly(prep.run_once(), data.x)
        for f in (prep.variants or {"fn": prep.fn}).values():
            prep.out[...] = np.nan
            f()
            assert runner.copied_exactly(prep.out, data.x)
        assert set(prep.variants or {}) == ({"1 thread", "2 threads"} if threads == 2 else set())
    finally:
        impl.shutdown()
    y = data.x.copy()
    y.flat[7] = np.nextafter(y.flat[7], np.inf)  # one ulp off in one element: not a copy
    assert not runner.copied_exactly(y, data.x)


class _Float32WorkImpl(impls.Impl):
    """The op done exactly, but on the input read as float32: what a float64 case must catch."""
    name = "f32work"

    def prepare(self, data):
        x32 = data.x.astype(np.float32).astype(data.x.dtype)
        out = data.new_output()
        ref = bcases.reference(bcases.CaseData(data.case, x32, data.params))
        return impls.prepared_out(lambda: np.copyto(out, ref), out)


@pytest.mark.parametrize("name", list(FLOAT64_CASES))
def test_float64_tolerance_catches_float32_work(name):
    case = shapes.get_case(name)
    case = case.scaled(small_shape(case))
    assert bcases.TOLERANCE["float64"] == (1e-10, 1e-10)
    res = runner.run_case(case, [impls.CopyImpl(), _Float32WorkImpl()], rounds=1, min_sample_ns=1e4,
                          warmup_ns=0).results
    assert res["copy"].status == runner.OK
    assert res["f32work"].status == runner.WRONG and 1e-9 < res["f32work"].max_abs_err < 1e-5


# ---------------------------------------------------------------------------- fused activations
ACTIVATION_CASES = {  # name: (op, shape, layout, dtype, activation), after the float64 cases
    "bn+relu/8x256x56x56/nchw/f32": ("batch_norm", (8, 256, 56, 56), "nchw", "float32", "relu"),
    "group32+silu/2x320x64x64/f32": ("group_norm", (2, 320, 64, 64), "nchw", "float32", "silu"),
    "group32+silu/2x320x64x64/bf16": ("group_norm", (2, 320, 64, 64), "nchw", "bfloat16", "silu"),
}
ACTIVATION_KINDS = [c for c in KINDS if c.activation and not c.is_training]  # (forward ones)


def test_activation_cases_are_named_for_their_activation():
    names = [c.name for c in shapes.CASES]
    acts = [c for c in shapes.CASES if c.activation and not c.is_training]
    assert [c.name for c in acts] == list(ACTIVATION_CASES)
    first, last = names.index(acts[0].name), names.index(acts[-1].name)
    assert names[first - 1].endswith("/f64") and shapes.CASES[last + 1].is_training
    for c in acts:
        op, shape, layout, dtype, activation = ACTIVATION_CASES[c.name]
        assert (c.op, c.shape, c.layout, c.dtype, c.activation) == (op, shape, layout, dtype, activation)
        assert c.groups == (32 if op == "group_norm" else 0) and not c.compiled and not c.is_training
        assert c.params == {"batch_norm": ("mean", "var", "scale", "bias"),  # the op's own, none added
                            "group_norm": ("scale", "bias")}[op]
        assert c.bytes_moved == 2 * c.nbytes and {"activation", dtype} <= c.tags
        assert c.describe().startswith(f"{op} {shapes.shape_str(shape)} {dtype} {layout}")
        assert f"then {activation}" in c.describe()
        assert c.scaled(small_shape(c)).name == c.name.replace(shapes.shape_str(shape),
                                                               shapes.shape_str(small_shape(c)))
    assert [c.name for c in shapes.select(filters=["+relu", "+silu"]) if not c.is_training] == list(ACTIVATION_CASES)
    assert [c.name for c in shapes.select(quick=True) if c.activation] == ["group32+silu/2x320x64x64/f32"]
    assert not any(c.activation for c in shapes.select(filters=["bn/", "group32/"]))


@pytest.mark.parametrize("case", ACTIVATION_KINDS, ids=[c.name for c in ACTIVATION_KINDS])
def test_activation_reference_is_the_norm_then_the_activation(case):
    _needs_ml_dtypes(case)
    d = bcases.make_data(case)
    ref = bcases.reference(d)
    norm = bcases.reference(bcases.CaseData(dataclasses.replace(case, activation=None), d.x, d.params))
    assert ref.shape == norm.shape == case.shape and ref.dtype == np.float64
    assert 0.2 < np.mean(norm < 0) < 0.8  # the activation has negative inputs to act on
    act = {"relu": lambda v: max(v, 0.0), "silu": lambda v: v / (1.0 + math.exp(-v))}[case.activation]
    for got, y in zip(ref.flat, norm.flat):
        assert got == pytest.approx(act(y), rel=1e-12, abs=1e-15)


class _NormWithoutActivation(impls.NumpyImpl):
    """numpy's norm, without the case's activation: what an activation case must catch."""
    name = "noact"

    def prepare(self, data):
        plain = dataclasses.replace(data.case, activation=None)
        return super().prepare(bcases.CaseData(plain, data.x, data.params))


@pytest.mark.parametrize("case", ACTIVATION_KINDS, ids=[c.name for c in ACTIVATION_KINDS])
def test_runner_flags_a_result_without_the_activation(case):
    _needs_ml_dtypes(case)
    cr = runner.run_case(case, [impls.CopyImpl(), impls.NumpyImpl(), _NormWithoutActivation()], rounds=1,
                         min_sample_ns=1e4, warmup_ns=0)
    res = cr.results
    assert res["numpy"].status == runner.OK
    assert res["noact"].status == runner.WRONG and res["noact"].median_ns is None
    assert "float64 reference" in res["noact"].reason
    doc = json.loads(json.dumps(cr.to_json()))
    assert doc["activation"] == case.activation and doc["name"] == case.name
    assert doc["definition"].endswith(f"; then {case.activation}: "
                                      f"{shapes.ACTIVATION_DESCRIPTIONS[case.activation]}")


@pytest.mark.parametrize("case", ACTIVATION_KINDS, ids=[c.name for c in ACTIVATION_KINDS])
def test_simdnorm_fuses_the_activation_into_its_call(case):
    """simdnorm's timed call passes activation= and meets the float64 reference of the norm then
    the activation; the same call without it does not."""
    _simdnorm_or_skip()
    _needs_ml_dtypes(case)
    data = bcases.make_data(case)
    ref = bcases.reference(data)
    prep = impls.SimdnormImpl().prepare(data)
    assert prep.fn.keywords["activation"] == case.activation
    _check_timed_callable(case, prep, ref)
    plain = impls.SimdnormImpl().prepare(bcases.CaseData(dataclasses.replace(case, activation=None),
                                                         data.x, data.params))
    assert "activation" not in plain.fn.keywords  # the other cases' calls are as they were
    assert not bcases.check(case, plain.run_once(), ref)[0]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_peers_run_the_activation_after_the_norm():
    """ONNX Runtime's model is the norm, then Relu or Sigmoid+Mul, and its note says what ORT ran
    for them; OpenVINO's model ends in Relu or Swish; torch's result has the activation too."""
    f32 = [c for c in ACTIVATION_KINDS if c.dtype == "float32"]
    assert {c.activation for c in f32} == {"relu", "silu"}
    if importlib.util.find_spec("onnxruntime") and importlib.util.find_spec("onnx"):
        ort_impl = _peer("onnxruntime")
        for case in f32:
            data = bcases.make_data(case)
            model, _, keep = ort_impl.build_model(data)
            want = {"relu": ["Relu"], "silu": ["Sigmoid", "Mul"]}[case.activation]
            assert [n.op_type for n in model.graph.node] == [keep] + want
            prep = ort_impl.prepare(data)
            assert "then " in prep.note
            _check_timed_callable(case, prep, bcases.reference(data))
    if importlib.util.find_spec("openvino"):
        ov_impl = _peer("openvino")
        for case in f32:
            model, _ = ov_impl.build_model(bcases.make_data(case))
            last = model.get_results()[0].input_value(0).get_node()
            assert last.get_type_name() == {"relu": "Relu", "silu": "Swish"}[case.activation]
    if importlib.util.find_spec("torch"):
        torch_impl = _peer("torch")
        for case in f32:
            data = bcases.make_data(case)
            _check_timed_callable(case, torch_impl.prepare(data), bcases.reference(data))


# ---------------------------------------------------------------------------- training cases
TRAINING_CASES = {  # name: (op, shape, layout, dtype): the speed goals' shapes, after all the others
    "bn-train/8x256x56x56/nchw/f32": ("batch_norm_training", (8, 256, 56, 56), "nchw", "float32"),
    "bn-train/8x256x56x56/nhwc/f32": ("batch_norm_training", (8, 256, 56, 56), "nhwc", "float32"),
    "bn-bwd/8x256x56x56/nchw/f32": ("batch_norm_backward", (8, 256, 56, 56), "nchw", "float32"),
    "bn-bwd/8x256x56x56/nhwc/f32": ("batch_norm_backward", (8, 256, 56, 56), "nhwc", "float32"),
    "layer-bwd/8x512x768/f32": ("layer_norm_backward", (8, 512, 768), "contig", "float32"),
    "layer-bwd/8x512x768/bf16": ("layer_norm_backward", (8, 512, 768), "contig", "bfloat16"),
    "rms-bwd/8x512x768/f32": ("rms_norm_backward", (8, 512, 768), "contig", "float32"),
    "group32-bwd/8x256x56x56/f32": ("group_norm_backward", (8, 256, 56, 56), "nchw", "float32"),
    "group32-bwd/8x256x56x56/nhwc/f32": ("group_norm_backward", (8, 256, 56, 56), "nhwc", "float32"),
    "instance-bwd/8x256x56x56/f32": ("instance_norm_backward", (8, 256, 56, 56), "nchw", "float32"),
    "mvn023-bwd/8x256x56x56/f32": ("mvn_backward", (8, 256, 56, 56), "nchw", "float32"),
    "bn-train/8x512x7x7/nchw/f32": ("batch_norm_training", (8, 512, 7, 7), "nchw", "float32"),
    "bn-bwd/8x512x7x7/nchw/f32": ("batch_norm_backward", (8, 512, 7, 7), "nchw", "float32"),
    "group32-bwd/8x512x7x7/f32": ("group_norm_backward", (8, 512, 7, 7), "nchw", "float32"),
    "bn-train/8x1024x14x14/nchw/f32": ("batch_norm_training", (8, 1024, 14, 14), "nchw", "float32"),
    "bn-bwd-eval/8x256x56x56/nchw/f32": ("batch_norm_eval_backward", (8, 256, 56, 56), "nchw", "float32"),
    "bn-bwd-eval/8x256x56x56/nhwc/f32": ("batch_norm_eval_backward", (8, 256, 56, 56), "nhwc", "float32"),
    "bn-train/8x4096/nchw/f32": ("batch_norm_training", (8, 4096), "nchw", "float32"),
    "bn-bwd/8x4096/nchw/f32": ("batch_norm_backward", (8, 4096), "nchw", "float32"),
    # through the activation the forward fused (ACTIVATION_BACKWARD below)
    "bn-bwd+relu/8x256x56x56/nchw/f32": ("batch_norm_backward", (8, 256, 56, 56), "nchw", "float32"),
    "group32-bwd+silu/2x320x64x64/f32": ("group_norm_backward", (2, 320, 64, 64), "nchw", "float32"),
    "group32-bwd+silu/2x320x64x64/bf16": ("group_norm_backward", (2, 320, 64, 64), "nchw", "bfloat16"),
}
ACTIVATION_BACKWARD = {"bn-bwd+relu/8x256x56x56/nchw/f32": "relu", "group32-bwd+silu/2x320x64x64/f32": "silu",
                       "group32-bwd+silu/2x320x64x64/bf16": "silu"}
TRAINING_KINDS = [c for c in KINDS if c.is_training]
BACKWARD_KINDS = [c for c in TRAINING_KINDS if c.is_backward]
# what simdnorm's row calls (the timed callable), by op
SIMDNORM_CALL = {"batch_norm_training": "batch_normalization_training",
                 "batch_norm_backward": "batch_normalization_backward",
                 "batch_norm_eval_backward": "batch_normalization_backward",
                 "mvn_backward": "mean_variance_normalization_backward"}


def _output_names(case):
    """The outputs an implementation of a training case returns at least."""
    if case.op == "batch_norm_training":
        return {"out", "running_mean"}
    return {"grad_input"} | {f"grad_{k}" for k in case.grad_params}


def test_training_cases_come_last_with_the_issues_shapes():
    names = [c.name for c in shapes.CASES]
    assert names[-len(TRAINING_CASES):] == list(TRAINING_CASES)
    assert [c.name for c in shapes.select(filters=["train", "bwd"])] == list(TRAINING_CASES)
    for name, (op, shape, layout, dtype) in TRAINING_CASES.items():
        c = shapes.get_case(name)
        assert (c.op, c.shape, c.layout, c.dtype, c.compiled) == (op, shape, layout, dtype, False)
        assert c.is_training and "training" in c.tags and dtype in c.tags
        assert c.is_backward == ("backward" in c.tags) == (op != "batch_norm_training")
        assert c.describe().startswith(f"{op} {shapes.shape_str(shape)} {dtype} {layout}")
        assert c.scaled(small_shape(c)).op == op
        assert c.activation == ACTIVATION_BACKWARD.get(name) and ("activation" in c.tags) == (name in ACTIVATION_BACKWARD)
        if c.activation:
            assert f"through {c.activation}" in c.describe()
    assert [c.name for c in shapes.select(filters=["bwd+"])] == list(ACTIVATION_BACKWARD)
    assert shapes.get_case("group32-bwd/8x256x56x56/f32").groups == 32
    assert shapes.get_case("mvn023-bwd/8x256x56x56/f32").axes == (0, 2, 3)
    assert shapes.get_case("bn-bwd/8x256x56x56/nhwc/f32").params == ("scale", "bias")
    eval_bwd = shapes.get_case("bn-bwd-eval/8x256x56x56/nhwc/f32")
    assert eval_bwd.params == ("mean", "var", "scale", "bias") and eval_bwd.grad_params == ("scale", "bias")
    assert shapes.get_case("rms-bwd/8x512x768/f32").params == ("scale",)
    assert [c.name for c in shapes.select(quick=True) if c.is_training] == ["layer-bwd/8x512x768/f32"]
    assert not any(c.is_training for c in shapes.CASES if c.name not in TRAINING_CASES)
    assert not any(c.is_training for c in shapes.select(filters=["bn/", "layer/", "group32/"]))


def test_backward_cases_have_a_grad_output_like_the_input():
    for case in TRAINING_KINDS:
        d = bcases.make_data(case)
        if not case.is_backward:
            assert d.dy is None
            continue
        assert d.dy.shape == d.x.shape and d.dy.dtype == d.x.dtype and d.dy.strides == d.x.strides
        dy = d.dy.astype(np.float64)
        assert abs(dy.mean()) < 0.5 and 0.5 < dy.std() < 1.5 and not np.array_equal(d.dy, d.x)
    f = bcases.make_data(shapes.get_case("layer-bwd/8x512x768/f32").scaled((2, 3, 37)))
    g = bcases.make_data(shapes.get_case("layer/8x512x768/f32").scaled((2, 3, 37)))
    assert np.array_equal(f.x, g.x) and g.dy is None  # the same x as the forward case's


def _fd_case(case):
    """The case on a tiny float64 shape (group norm: 2 groups of 2 channels)."""
    shape = (2, 3, 5) if len(case.shape) == 3 else (2, 4, 3, 2)
    return dataclasses.replace(case, shape=shape, dtype="float64", groups=2 if case.groups else 0)


def _forward_out(case, x, params):
    """The backward case's forward op in float64 (batch norm: in training mode, with the batch's
    statistics), from the suite's forward references, then the case's activation if it names one."""
    plain = dataclasses.replace(case, activation=None)
    if case.op == "batch_norm_backward":
        fwd = dataclasses.replace(plain, op="batch_norm_training")
        y = bcases.reference(bcases.CaseData(fwd, x, params)).values["out"]
    elif case.op == "batch_norm_eval_backward":  # inference batch norm: mean and var are constants
        y = bcases.reference(bcases.CaseData(dataclasses.replace(plain, op="batch_norm"), x, params))
    else:
        y = bcases.reference(bcases.CaseData(dataclasses.replace(plain, op=shapes.forward_op(case.op)), x, params))
    act = {"relu": lambda v: np.maximum(v, 0.0), "silu": lambda v: v / (1.0 + np.exp(-v))}
    return act[case.activation](y) if case.activation else y


@pytest.mark.parametrize("case", BACKWARD_KINDS, ids=[c.name for c in BACKWARD_KINDS])
def test_backward_reference_is_the_gradient_by_finite_differences(case):
    """grad_input, grad_scale and grad_bias of the reference are the gradients of
    sum(grad_output * forward(x, scale, bias)), by central differences in float64."""
    case = _fd_case(case)
    d = bcases.make_data(case)
    ref = bcases.reference(d)
    assert isinstance(ref, bcases.Expected) and ref.primary == "grad_input"
    assert set(ref.values) == _output_names(case) and set(ref.sum_norms) == set(ref.values) - {"grad_input"}
    x = d.x
    p = {k: v.astype(np.float64) for k, v in d.params.items()}
    h = 1e-6

    def loss():
        return float(np.sum(d.dy * _forward_out(case, x, p)))

    def numeric(a):
        g = np.empty(a.shape)
        for i in np.ndindex(a.shape):
            v = a[i]
            a[i] = v + h
            up = loss()
            a[i] = v - h
            g[i] = (up - loss()) / (2 * h)
            a[i] = v
        return g

    for name, a in [("grad_input", x)] + [(f"grad_{k}", p[k]) for k in case.grad_params]:
        np.testing.assert_allclose(ref.values[name], numeric(a), rtol=1e-6, atol=1e-6, err_msg=name)


def test_forward_training_reference():
    case = shapes.get_case("bn-train/8x256x56x56/nchw/f32").scaled((2, 3, 4, 5))
    d = bcases.make_data(case)
    ref = bcases.reference(d)
    assert ref.primary == "out" and set(ref.values) == {"out", "mean", "variance", "running_mean",
                                                        "running_var", "running_var_onnx"}
    x = d.x.astype(np.float64)
    mean, var, unbiased = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3)), x.var(axis=(0, 2, 3), ddof=1)
    v = ref.values
    np.testing.assert_allclose(v["mean"], mean, rtol=1e-12)
    np.testing.assert_allclose(v["variance"], var, rtol=1e-12)
    np.testing.assert_allclose(v["running_mean"], 0.9 * 0.0 + 0.1 * mean, rtol=1e-12)  # torch.nn's
    np.testing.assert_allclose(v["running_var"], 0.9 * 1.0 + 0.1 * unbiased, rtol=1e-12)
    np.testing.assert_allclose(v["running_var_onnx"], 0.9 * 1.0 + 0.1 * var, rtol=1e-12)  # ONNX's
    sc, bi = d.params["scale"], d.params["bias"]
    for c in range(3):
        want = (x[:, c] - mean[c]) / math.sqrt(var[c] + 1e-5) * sc[c] + bi[c]
        np.testing.assert_allclose(v["out"][:, c], want, rtol=1e-12, atol=1e-12)


def test_check_takes_every_output_of_a_training_case():
    case = shapes.get_case("layer-bwd/8x512x768/f32").scaled((2, 3, 37))
    d = bcases.make_data(case)
    ref = bcases.reference(d)
    good = {k: v.astype(np.float32) for k, v in ref.values.items()}
    assert bcases.check(case, good, ref)[0]
    assert bcases.check(case, good["grad_input"], ref)[0]  # the primary output alone
    assert bcases.check(case, {**good, "grad_scale": good["grad_scale"].reshape(1, 1, -1)}, ref)[0]
    for bad in ({"grad_scale": good["grad_scale"]},  # no primary output
                {**good, "grad_weight": good["grad_scale"]},  # a name the reference does not know
                {**good, "grad_scale": good["grad_scale"][:-1]},  # the wrong size
                {**good, "grad_input": good["grad_input"].astype(np.float64)},  # the wrong dtype
                {**good, "grad_bias": good["grad_bias"] * np.nan}):
        assert not bcases.check(case, bad, ref)[0]
    # a long sum is within tolerance relative to |ref| + the L2 norm of its terms
    atol, rtol = bcases.TOLERANCE["float32"]
    bound = atol + rtol * (np.abs(ref.values["grad_bias"]) + ref.sum_norms["grad_bias"])
    assert np.all(ref.sum_norms["grad_bias"] > 3 * np.abs(ref.values["grad_bias"]).min())
    assert bcases.check(case, {**good, "grad_bias": ref.values["grad_bias"] + 0.9 * bound}, ref)[0]
    each = bcases.check_each(case, {**good, "grad_bias": ref.values["grad_bias"] + 1.1 * bound}, ref)
    assert [k for k, (ok, _) in each.items() if not ok] == ["grad_bias"]


class _OffImpl(impls.Impl):
    """The reference's outputs, one of them moved off by twice its tolerance."""

    def __init__(self, name, off):
        self.name, self.off = name, off

    def prepare(self, data):
        ref = bcases.reference(data)
        out = data.new_output()
        outs = dict(ref.values)
        atol, rtol = bcases.TOLERANCE[data.case.dtype]
        norm = ref.sum_norms.get(self.off, 0.0)
        outs[self.off] = outs[self.off] + 2 * (atol + rtol * (np.abs(outs[self.off]) + norm))
        prim = outs.pop(ref.primary).astype(out.dtype)

        def fn():
            np.copyto(out, prim)

        return impls.Prepared(fn, lambda: (fn(), {ref.primary: out, **outs})[1], out=out)


class _SlowImpl(impls.Impl):
    """The reference's outputs, each call 250 ms late: over 10000x a tiny case's copy (20 ms was
    9239x once, the 4 KB copy slowed to 2.2 us on a loaded machine)."""

    name = "slow"

    def prepare(self, data):
        import time

        out = data.new_output()
        want = bcases.reference(data).astype(out.dtype)  # (a forward case's: one array)

        def fn():
            time.sleep(0.25)
            np.copyto(out, want)

        return impls.Prepared(fn, lambda: (fn(), out)[1], out=out)


def test_runner_times_an_inaccurate_parameter_gradient_but_flags_it():
    """A wrong grad_input is WRONG and not timed; a grad_bias past its tolerance (PyTorch's bfloat16
    layer-norm backward sums in bfloat16) is timed, flagged INACCURATE in the table and the JSON."""
    case = shapes.get_case("layer-bwd/8x512x768/f32").scaled((4, 8, 64))
    cr = runner.run_case(case, [impls.CopyImpl(), impls.AddImpl(), _OffImpl("offgi", "grad_input"),
                                _OffImpl("offgb", "grad_bias")], rounds=2, min_sample_ns=1e5, warmup_ns=1e4)
    res = cr.results
    assert res["offgi"].status == runner.WRONG and res["offgi"].median_ns is None
    assert res["offgi"].reason.startswith("grad_input differs")
    gb = res["offgb"]
    assert gb.status == runner.OK and gb.median_ns and gb.inaccurate.startswith("grad_bias max |err|")
    assert res["copy"].inaccurate is None and "inaccurate" not in cr.to_json()["results"]["copy"]
    assert json.loads(json.dumps(cr.to_json()))["results"]["offgb"]["inaccurate"] == gb.inaccurate
    assert f"INACCURATE {gb.inaccurate}" in report.format_case(cr)
    assert "offgb*" in report.format_summary([cr])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name, shape", [("bn-bwd/8x256x56x56/nchw/f32", (4, 64, 33, 35)),
                                         ("bn-bwd/8x256x56x56/nhwc/f32", (4, 64, 33, 35)),
                                         ("layer-bwd/8x512x768/bf16", (4, 100, 1401))])  # > 1 MiB
def test_add_floor_really_adds(threads, name, shape):
    """np.add(x, dy, out=dx) into a like-laid-out output, split across threads as the copy is;
    16-bit floats through uint16 views (the same bytes)."""
    case = shapes.get_case(name).scaled(shape)
    if case.dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    data = bcases.make_data(case)
    impl = impls.AddImpl()
    impl.set_threads(threads)
    try:
        prep = impl.prepare(data)
        out = prep.run_once()
        assert out is prep.out and out.strides == data.x.strides and out.dtype == data.x.dtype
        if case.dtype == "float32":
            want = data.x + data.dy
        else:
            want = (data.x.view(np.uint16) + data.dy.view(np.uint16)).view(data.x.dtype)
        assert runner.copied_exactly(out, want) and runner.copied_exactly(prep.exact, want)
        for f in (prep.variants or {"fn": prep.fn}).values():
            prep.out[...] = np.nan
            f()
            assert runner.copied_exactly(prep.out, want)
        assert set(prep.variants or {}) == ({"1 thread", "2 threads"} if threads == 2 else set())
        assert prep.bytes_moved == 3 * data.x.nbytes == case.bytes_moved
    finally:
        impl.shutdown()


def test_add_floor_is_in_the_backward_cases_only():
    add = impls.AddImpl()
    assert [c.name for c in shapes.CASES if add.applies(c)] == [n for n in TRAINING_CASES if "-bwd" in n]
    fwd = shapes.get_case("bn-train/8x256x56x56/nchw/f32").scaled((2, 24, 5, 7))
    res = runner.run_case(fwd, [impls.CopyImpl(), add], rounds=1, min_sample_ns=1e4, warmup_ns=0).results
    assert set(res) == {"copy"}
    with pytest.raises(bcases.NotAvailable):
        add.prepare(bcases.make_data(fwd))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["bn-bwd/8x256x56x56/nhwc/f32", "bn-train/8x256x56x56/nchw/f32"])
def test_training_case_runs_through_every_implementation(name):
    """A scaled training case through the runner with every implementation: each is verified on
    every output it returns and timed, or n/a with its reason (numpy, OpenVINO, ORT's backward);
    the floors count their own bytes (copy 2 x, add 3 x the input's)."""
    case = shapes.get_case(name).scaled((2, 24, 5, 7))
    all_ = impls.all_impls()
    for i in all_:
        if i.unavailable() is None:
            i.set_threads(1)
    try:
        cr = runner.run_case(case, all_, rounds=2, min_sample_ns=1e5, warmup_ns=1e4)
    finally:
        for i in all_:
            i.shutdown()
    res = cr.results
    nbytes = 2 * 24 * 5 * 7 * 4
    assert set(res) == set(impls.IMPL_NAMES) - (set() if case.is_backward else {"add"})
    for n, r in res.items():
        assert r.status in (runner.OK, runner.NA), (n, r.status, r.reason)
        assert r.status == runner.OK or r.reason
        assert r.inaccurate is None, (n, r.inaccurate)
    assert res["copy"].gbps == pytest.approx(2 * nbytes / res["copy"].median_ns)
    assert res["numpy"].status == runner.NA and "training" in res["numpy"].reason
    if res["openvino"].status == runner.NA and impls.all_impls()[-1].unavailable() is None:
        assert "inference only" in res["openvino"].reason
    if case.is_backward:
        assert case.bytes_moved == 3 * nbytes
        assert res["add"].status == runner.OK and res["add"].gbps == pytest.approx(3 * nbytes / res["add"].median_ns)
        timed = [r for r in res.values() if r.status == runner.OK]
        assert all(r.vs_add == pytest.approx(r.median_ns / res["add"].median_ns) for r in timed)
        if "onnxruntime" in res and res["onnxruntime"].status == runner.NA:
            assert res["onnxruntime"].reason.startswith(("no backward op", "onnxruntime/onnx not importable"))
        assert " t/add " in report.format_case(cr) and "t/add" in report.format_summary([cr])
    else:
        assert " t/add " not in report.format_case(cr) and "t/add" not in report.format_summary([cr])
    for peer in ("torch", "onnxruntime"):  # installed: they run these (ORT: no backward op)
        if res[peer].status == runner.NA:
            assert "not importable" in res[peer].reason or (peer == "onnxruntime" and case.is_backward)
    for n in ("torch", "simdnorm"):
        if res[n].status == runner.OK:
            assert res[n].gbps == pytest.approx(case.bytes_moved / res[n].median_ns)
            assert res[n].best_other not in impl_base.FLOORS
    if impls.load_simdnorm()[0] is not None:
        assert res["simdnorm"].status == runner.OK
    doc = json.loads(json.dumps(cr.to_json()))
    assert doc["bytes_moved"] == case.bytes_moved and doc["op"] == case.op
    assert ("add_gbps" in doc["summary"]) == case.is_backward


# -------------------------------------------------------------------------------------- copy
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_copy_really_copies(threads, layout):
    case = shapes.get_case(f"bn/8x64x56x56/{layout}/f32").scaled((4, 64, 33, 35))  # > 1 MiB
    data = bcases.make_data(case)
    impl = impls.CopyImpl()
    impl.set_threads(threads)
    try:
        prep = impl.prepare(data)
        out = prep.run_once()
        assert out.strides == data.x.strides
        assert runner.copied_exactly(out, data.x)
        out[...] = 0
        prep.fn()
        assert runner.copied_exactly(out, data.x)
        if threads > 1:
            pairs = impls.CopyImpl.split(data.x, out, threads)
            assert len(pairs) == threads
            assert sum(o.size for o, _ in pairs) == out.size
    finally:
        impl.shutdown()


def test_copy_roofline_at_threads_is_the_faster_of_one_thread_and_the_split():
    """At N > 1 threads the split copy's Python thread pool costs tens of us per call (slower than
    one np.copyto up to ~12 MB here): both are timed in the same rounds, the faster by median is
    the roofline, and the JSON keeps both. At one thread nothing changes."""
    case = shapes.get_case("bn/8x64x56x56/nchw/f32").scaled((4, 64, 33, 35))  # > 1 MiB
    impl = impls.CopyImpl()
    impl.set_threads(2)
    try:
        cr = runner.run_case(case, [impl], rounds=3, min_sample_ns=2e5, warmup_ns=1e5)
    finally:
        impl.shutdown()
    c = cr.results["copy"]
    assert c.status == runner.OK and set(c.variants) == {"1 thread", "2 threads"}
    chosen = [k for k, v in c.variants.items() if v["chosen"]]
    assert len(chosen) == 1
    v = c.variants[chosen[0]]
    assert c.median_ns == v["median_ns"] == min(x["median_ns"] for x in c.variants.values())
    assert c.samples_ns == v["samples_ns"] and len(v["samples_ns"]) == 3
    assert c.note.startswith(chosen[0] + "; faster than ")
    assert json.loads(json.dumps(cr.to_json()))["results"]["copy"]["variants"] == c.variants
    one = runner.run_case(case, [impls.CopyImpl()], rounds=1, min_sample_ns=1e5, warmup_ns=1e4)
    assert one.results["copy"].variants is None and one.results["copy"].note == ""
    assert "variants" not in one.to_json()["results"]["copy"]


# ------------------------------------------------------------------------ numpy (always there)
@pytest.mark.parametrize("case", KINDS, ids=KIND_IDS)
def test_numpy_peer_computes_the_named_op(case):
    _needs_ml_dtypes(case)
    data = bcases.make_data(case)
    if case.is_training:  # PyTorch is the training ops' baseline
        with pytest.raises(bcases.NotAvailable, match="training"):
            impls.NumpyImpl().prepare(data)
        return
    ref = bcases.reference(data)
    prep = impls.NumpyImpl().prepare(data)
    _check_timed_callable(case, prep, ref)


# ---------------------------------------------------------------------------------- simdnorm
@pytest.mark.parametrize("case", KINDS, ids=KIND_IDS)
def test_simdnorm_callable_computes_the_named_op(case):
    _simdnorm_or_skip()
    _needs_ml_dtypes(case)
    data = bcases.make_data(case)
    ref = bcases.reference(data)
    prep = impls.SimdnormImpl().prepare(data)
    _check_timed_callable(case, prep, ref)


def _array_args(fn):
    """The array arguments of a functools.partial (numpy arrays or torch tensors), by position."""
    return [a for a in list(fn.args) + list(fn.keywords.values()) if hasattr(a, "dtype")]


@pytest.mark.parametrize("name", list(FLOAT64_CASES))
def test_simdnorm_gets_float64_parameters_for_float64_data(name):
    """SPEC: parameters in the input's dtype or float32; a float64 user passes float64 ones."""
    _simdnorm_or_skip()
    case = shapes.get_case(name)
    case = case.scaled(small_shape(case))
    data = bcases.make_data(case)
    prep = impls.SimdnormImpl().prepare(data)
    args = _array_args(prep.fn)
    assert len(args) == 2 + len(case.params)  # x, the parameters, out
    assert all(a.dtype == np.float64 for a in args)
    _check_timed_callable(case, prep, bcases.reference(data))


@pytest.mark.parametrize("compiled", [False, True], ids=["functional", "compiled"])
def test_simdnorm_tiny_batch_norm_in_float64(compiled):
    """The tiny cases are float32 only, but their code paths take float64 data and float64
    parameter descriptors too (compile(desc) with float64 TensorDescs)."""
    import dataclasses

    _simdnorm_or_skip()
    base = shapes.get_case(f"tiny/bn{'-compiled' if compiled else ''}/1x16x8x8/f32")
    case = dataclasses.replace(base, dtype="float64", tags=frozenset({"tiny", "float64"}))
    data = bcases.make_data(case)
    prep = impls.SimdnormImpl().prepare(data)
    assert prep.note == ("compile(desc)" if compiled else "")
    assert all(a.dtype == np.float64 for a in _array_args(prep.fn))
    _check_timed_callable(case, prep, bcases.reference(data))


@pytest.mark.parametrize("name", ["tiny/bn/1x16x8x8/f32", "tiny/bn-compiled/1x16x8x8/f32",
                                  "bn/8x512x7x7/nhwc/f16", "layer/8x512x768/f32",
                                  "layer/8x512x768/f64", "group32+silu/2x320x64x64/bf16"])
def test_simdnorm_real_cases(name):
    _simdnorm_or_skip()
    case = shapes.get_case(name)
    data = bcases.make_data(case)
    prep = impls.SimdnormImpl().prepare(data)
    _check_timed_callable(case, prep, bcases.reference(data))


@pytest.mark.parametrize("case", TRAINING_KINDS, ids=[c.name for c in TRAINING_KINDS])
def test_simdnorm_training_rows_time_the_named_call(case):
    """The timed callable is the training or backward call itself, into the preallocated output,
    with the statistics its forward returned computed before; it returns every output of the op."""
    sn = _simdnorm_or_skip()
    _needs_ml_dtypes(case)
    data = bcases.make_data(case)
    prep = impls.SimdnormImpl().prepare(data)
    fn = prep.fn
    assert fn.func is getattr(sn, SIMDNORM_CALL.get(case.op, case.op))
    assert fn.keywords["out"] is prep.out and fn.keywords["epsilon"] == case.epsilon
    assert fn.keywords.get("activation") == case.activation
    if case.is_backward:
        assert fn.args[0] is data.dy and fn.args[1] is data.x
        params = fn.args[len(fn.args) - len(case.params):]
        assert [a is data.params[k] for a, k in zip(params, case.params)] == [True] * len(case.params)
        stats = [a for a in fn.args[2:len(fn.args) - len(case.params)] if isinstance(a, np.ndarray)]
        if case.op == "batch_norm_eval_backward":  # the given statistics are parameters of the case
            stats = list(params[:2])
            assert fn.keywords["training"] is False
        assert len(stats) == (1 if case.op == "rms_norm_backward" else 2)  # mean and inv_std/variance
        assert all(a.dtype == np.float32 for a in stats)
        want = _output_names(case)
    else:
        assert fn.keywords["momentum"] == 0.1 and fn.keywords["momentum_convention"] == "pytorch"
        want = {"out", "mean", "variance", "running_mean", "running_var"}
    assert set(prep.run_once()) == want


@pytest.mark.parametrize("name", list(TRAINING_CASES))
def test_simdnorm_training_real_cases(name):
    _simdnorm_or_skip()
    case = shapes.get_case(name)
    _needs_ml_dtypes(case)
    data = bcases.make_data(case)
    prep = impls.SimdnormImpl().prepare(data)
    _check_timed_callable(case, prep, bcases.reference(data))


# ------------------------------------------------------------------------------------- peers
PEER_KINDS = [c for c in KINDS if c.dtype != "bfloat16" or c.op == "batch_norm"]


def _peer(name):
    mod = {"torch": "torch", "onnxruntime": "onnxruntime", "openvino": "openvino"}[name]
    pytest.importorskip(mod)
    if name == "onnxruntime":
        pytest.importorskip("onnx")
    for impl in impls.all_impls():
        if impl.name == name:
            impl.set_threads(1)
            return impl
    raise AssertionError(name)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("peer", ["torch", "onnxruntime", "openvino"])
def test_peer_computes_the_named_op_or_says_why_not(peer):
    impl = _peer(peer)
    done = 0
    for case in PEER_KINDS:
        if case.dtype == "bfloat16" and importlib.util.find_spec("ml_dtypes") is None:
            continue
        data = bcases.make_data(case)
        try:
            prep = impl.prepare(data)
        except bcases.NotAvailable as e:
            assert str(e), f"{peer} n/a on {case.name} without a reason"
            continue
        _check_timed_callable(case, prep, bcases.reference(data))
        done += 1
    assert done > 0


F64_KINDS = [c for c in KINDS if c.dtype == "float64"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("peer", ["torch", "onnxruntime", "openvino"])
def test_peer_on_float64_computes_in_float64_or_says_it_cannot(peer):
    """On float64 a peer either meets the float64 tolerance (1e-10), with its parameters in float64,
    or is n/a with a reason naming float64: a peer that computes in float32 (OpenVINO's CPU plugin
    converts f64 models to f32) or has no float64 kernel (ORT's InstanceNormalization) is never
    timed."""
    impl = _peer(peer)
    assert [c.op for c in F64_KINDS] == ["layer_norm", "batch_norm", "instance_norm"]
    done = []
    for case in F64_KINDS:
        data = bcases.make_data(case)
        try:
            prep = impl.prepare(data)
        except bcases.NotAvailable as e:
            assert "float64" in str(e), f"{peer} n/a on {case.name}: {e}"
            continue
        _check_timed_callable(case, prep, bcases.reference(data))
        if peer == "torch":
            assert all(str(a.dtype) == "torch.float64" for a in _array_args(prep.fn))
        done.append(case.op)
    if peer == "torch":  # torch has float64 kernels for all three
        assert done == ["layer_norm", "batch_norm", "instance_norm"]


def test_onnxruntime_float64_model_is_float64_throughout():
    impl = _peer("onnxruntime")
    TensorProto = impl._load()[4]
    for case in F64_KINDS:
        model, note, keep = impl.build_model(bcases.make_data(case))
        g = model.graph
        assert [v.type.tensor_type.elem_type for v in (*g.input, *g.output)] == [TensorProto.DOUBLE] * 2
        assert g.initializer and all(t.data_type == TensorProto.DOUBLE for t in g.initializer)
        assert [n.op_type for n in g.node] == [keep]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_float64_case_runs_through_every_implementation():
    """A scaled float64 case through the runner with every implementation: each is verified against
    the reference at the float64 tolerance and timed, or n/a with its reason; none is WRONG."""
    case = shapes.get_case("bn/8x64x112x112/nchw/f64").scaled((2, 24, 5, 7))
    all_ = impls.all_impls()
    for i in all_:
        if i.unavailable() is None:
            i.set_threads(1)
    try:
        cr = runner.run_case(case, all_, rounds=2, min_sample_ns=1e5, warmup_ns=1e4)
    finally:
        for i in all_:
            i.shutdown()
    res = cr.results
    assert set(res) == set(impls.IMPL_NAMES) - {"add"}  # the two-read floor: backward cases only
    for name, r in res.items():
        assert r.status in (runner.OK, runner.NA), (name, r.status, r.reason)
        if r.status == runner.OK:
            assert r.gbps == pytest.approx(2 * 8 * 2 * 24 * 5 * 7 / r.median_ns)
            assert name == "copy" or r.max_abs_err <= 1e-10
        else:
            assert r.reason
    assert res["copy"].status == res["numpy"].status == runner.OK
    if impls.load_simdnorm()[0] is not None:
        assert res["simdnorm"].status == runner.OK
    doc = json.loads(json.dumps(cr.to_json()))
    assert doc["dtype"] == "float64" and doc["tolerance"] == {"atol": 1e-10, "rtol": 1e-10}
    assert doc["input_bytes"] == 2 * 24 * 5 * 7 * 8
    assert "bn/2x24x5x7/nchw/f64" in report.format_case(cr)
    assert "bn/2x24x5x7/nchw/f64" in report.format_summary([cr])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_torch_backward_times_autograd_grad_of_a_graph_built_before():
    """What the torch row of a backward case times: torch.autograd.grad of the forward's output
    (built in setup) with respect to (x, weight, bias), x being the case's own memory."""
    impl = _peer("torch")
    torch, F = impl._load()
    for case in BACKWARD_KINDS:
        if case.dtype == "bfloat16" and importlib.util.find_spec("ml_dtypes") is None:
            continue
        data = bcases.make_data(case)
        prep = impl.prepare(data)
        fn = prep.fn
        assert fn.func is torch.autograd.grad and fn.keywords == {"retain_graph": True}
        y, wrt, dy = fn.args
        assert y.grad_fn is not None and y.shape == data.x.shape  # the forward ran before
        assert len(wrt) == 1 + len(case.grad_params) and all(t.requires_grad and t.is_leaf for t in wrt)
        assert wrt[0].data_ptr() == data.x.ctypes.data and dy.data_ptr() == data.dy.ctypes.data
        assert set(prep.run_once()) == _output_names(case)
    case = shapes.get_case("bn-train/8x256x56x56/nchw/f32").scaled((2, 24, 5, 7))
    prep = impl.prepare(bcases.make_data(case))
    assert prep.fn.func is F.batch_norm
    x, rm, rv, w, b, training, momentum, eps = prep.fn.args
    assert training is True and momentum == 0.1 and rm.shape == rv.shape == (24,)
    assert w.requires_grad and b.requires_grad  # as nn.BatchNorm2d's parameters
    assert set(prep.run_once()) == {"out", "running_mean", "running_var"}


def test_onnxruntime_runs_training_batch_norm_and_says_why_no_backward():
    impl = _peer("onnxruntime")
    onnx = impl._load()[0]
    case = shapes.get_case("bn-train/8x256x56x56/nchw/f32").scaled((2, 24, 5, 7))
    data = bcases.make_data(case)
    model, note, keep = impl.build_model(data)
    (node,) = model.graph.node
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.op_type == keep == "BatchNormalization" and list(node.output)[1:] == [
        "running_mean_out", "running_var_out"]
    assert attrs["training_mode"] == 1 and attrs["momentum"] == pytest.approx(0.9)
    prep = impl.prepare(data)
    _check_timed_callable(case, prep, bcases.reference(data))
    assert set(prep.run_once()) == {"out", "running_mean", "running_var_onnx"}
    with pytest.raises(bcases.NotAvailable, match="channels-first"):
        impl.prepare(bcases.make_data(dataclasses.replace(case, layout="nhwc")))
    for case in BACKWARD_KINDS:
        with pytest.raises(bcases.NotAvailable, match="^no backward op") as e:
            impl.prepare(bcases.make_data(case))
        grad = {"batch_norm_backward": "BatchNormalizationGrad", "layer_norm_backward": "LayerNormalizationGrad",
                "rms_norm_backward": "SimplifiedLayerNormalizationGrad"}.get(case.op)
        if grad:  # ORT's own words about its training-build kernel
            assert f"com.microsoft.{grad}" in str(e.value) or f"com.microsoft:{grad}" in str(e.value)


def test_openvino_has_no_training_ops():
    impl = _peer("openvino")
    for case in TRAINING_KINDS:
        with pytest.raises(bcases.NotAvailable, match="inference only"):
            impl.prepare(bcases.make_data(case))


# ------------------------------------------------------------------------------- runner, timing
class _WrongImpl(impls.Impl):
    name = "wrong"

    def prepare(self, data):
        out = data.new_output()
        fn = lambda: np.copyto(out, data.x)  # noqa: E731 - a copy is not the op
        return impls.Prepared(fn, lambda: (fn(), out)[1])


class _IdleImpl(impls.Impl):
    """Writes nothing, into an output that already holds the right answer (as a reused buffer may)."""
    name = "idle"

    def prepare(self, data):
        out = data.new_output()
        out[...] = bcases.reference(data).astype(out.dtype)
        return impls.prepared_out(lambda: None, out)


class _IdleCopy(impls.CopyImpl):
    """A copy whose second way of copying writes nothing into the output the first one filled."""
    name = "copy"

    def prepare(self, data):
        prep = super().prepare(data)
        prep.variants = {"copyto": prep.fn, "idle": lambda: None}
        return prep


class _NaImpl(impls.Impl):
    name = "cannot"

    def prepare(self, data):
        raise bcases.NotAvailable("no kernel for this")


def test_runner_verifies_before_timing_and_reports_ratios():
    case = shapes.get_case("layer/8x512x768/f32").scaled((4, 8, 64))
    res = runner.run_case(case, [impls.CopyImpl(), impls.NumpyImpl(), _WrongImpl(), _NaImpl()],
                          rounds=3, min_sample_ns=2e5, warmup_ns=1e5).results
    assert res["wrong"].status == runner.WRONG and res["wrong"].median_ns is None
    assert res["cannot"].status == runner.NA and res["cannot"].reason == "no kernel for this"
    c, n = res["copy"], res["numpy"]
    assert c.status == n.status == runner.OK
    assert len(n.samples_ns) == 3 and n.reps >= 1
    assert n.gbps == pytest.approx(case.bytes_moved / n.median_ns)
    assert n.vs_copy == pytest.approx(n.median_ns / c.median_ns)
    assert n.best_other is None  # the only other timed implementation is the copy
    assert n.q1_ns <= n.median_ns <= n.q3_ns and n.min_ns <= n.q1_ns and n.q3_ns <= n.max_ns


def test_runner_poisons_outputs_before_it_verifies():
    case = shapes.get_case("layer/8x512x768/f32").scaled((4, 8, 64))
    res = runner.run_case(case, [_IdleCopy(), _IdleImpl()], rounds=3, min_sample_ns=2e5, warmup_ns=1e5).results
    assert res["idle"].status == runner.WRONG and res["idle"].median_ns is None
    assert res["copy"].status == runner.WRONG and "(idle)" in res["copy"].reason


@pytest.mark.parametrize("k", range(1, 9))
def test_round_orders_let_every_implementation_follow_every_other_equally_often(k):
    # What a sample's first calls find in the caches depends on the implementation run before it:
    # over k rounds (2k for an odd k) each ordered pair of neighbours occurs equally often.
    rounds = k if k % 2 == 0 else 2 * k
    follows = Counter()
    for r in range(rounds):
        order = timing.round_order(k, r)
        assert sorted(order) == list(range(k))
        follows.update(zip(order, order[1:]))
    assert len(follows) == k * (k - 1)
    assert len(set(follows.values())) <= 1


def test_interleaved_timing_calls_each_callable_per_round():
    calls = {"a": 0, "b": 0}

    def mk(k):
        def f():
            calls[k] += 1
        return f

    t = timing.measure({"a": mk("a"), "b": mk("b")}, rounds=4, min_sample_ns=1e5, warmup_ns=1e4)
    for k in ("a", "b"):
        assert len(t[k].samples_ns) == 4 and t[k].reps > 1  # tiny calls loop inside a sample
        assert calls[k] >= 4 * t[k].reps
    assert timing.quartiles([1, 2, 3, 4, 5]) == (2, 3, 4)


def test_wait_until_quiet_outlasts_a_spinning_thread():
    """At several threads each sample waits until the threads other libraries left spinning have
    stopped: here a thread busy in numpy calls (the GIL released, state R) for 80 ms."""
    import threading
    import time

    if timing._others_running() is None:
        pytest.skip("no /proc/self/task here")
    stop = time.perf_counter() + 0.08

    def spin():
        a = np.ones(1 << 20)
        b = np.empty_like(a)
        while time.perf_counter() < stop:
            np.add(a, a, out=b)

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.01)
    waited = timing.wait_until_quiet(1e6, 5e9)
    returned = time.perf_counter()
    t.join()
    assert returned >= stop, f"returned {(stop - returned) * 1e3:.1f} ms before the spinning thread stopped"
    assert waited < 4e9
    assert timing.wait_until_quiet(1e6, 5e9) < 1e9  # nothing spinning: back within ~2 ms


# ---------------------------------------------------------------------------------------- CLI
def test_list(capsys):
    assert B.main(["--list", "--quick", "--filter", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "tiny/bn/1x16x8x8/f32" in out and "tiny/bn-compiled/1x16x8x8/f32" in out
    assert "bn/8x64x112x112" not in out
    assert B.main(["--list", "--filter", "f64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == list(FLOAT64_CASES)
    assert "float64" in lines[0] and "(50.3 MB moved)" in lines[0]  # 2 x 8 x 512 x 768 x 8 bytes
    assert B.main(["--list", "--filter", "+relu", "--filter", "+silu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == list(ACTIVATION_CASES) + list(ACTIVATION_BACKWARD)
    assert "then relu" in lines[0] and "(51.4 MB moved)" in lines[0]  # 2 x 8x256x56x56x4: the output once
    assert B.main(["--list", "--filter", "train", "--filter", "bwd"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == list(TRAINING_CASES)
    assert "(51.4 MB moved)" in lines[0] and "(77.1 MB moved)" in lines[2]  # 2 x, 3 x 8x256x56x56x4
    assert cli._wanted_impls("torch") == {"torch", "copy", "add"} and cli._wanted_impls("") is None


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_quick_tiny_end_to_end_json(tmp_path, capsys):
    path = tmp_path / "r.json"
    rc = B.main(["--quick", "--filter", "tiny", "--json", str(path), "--no-progress"])
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert rc == 0, out
    assert {"suite", "machine", "versions", "config", "cases"} <= set(doc)
    m = doc["machine"]
    assert {"cpu_model", "threads", "simdnorm_isa", "logical_cpus"} <= set(m) and m["threads"] == 1
    assert {"numpy", "torch", "onnxruntime", "openvino", "simdnorm"} <= set(doc["versions"])
    assert [c["name"] for c in doc["cases"]] == ["tiny/bn/1x16x8x8/f32", "tiny/bn-compiled/1x16x8x8/f32"]
    for c in doc["cases"]:
        assert c["bytes_moved"] == 2 * 16 * 8 * 8 * 4
        res = c["results"]
        assert set(res) == {"copy", "simdnorm", "numpy", "torch", "onnxruntime", "openvino"}
        for name, r in res.items():
            assert r["status"] in ("ok", "n/a"), (name, r)
            if r["status"] == "ok":
                assert r["median_ns"] > 0 and len(r["samples_ns"]) == doc["config"]["rounds"]
                assert r["gbps"] == pytest.approx(c["bytes_moved"] / r["median_ns"])
            else:
                assert r["reason"]
        assert res["copy"]["status"] == "ok" and res["numpy"]["status"] == "ok"
        if impls.load_simdnorm()[0] is not None:
            assert res["simdnorm"]["status"] == "ok"
    assert "tiny/bn/1x16x8x8/f32" in out and "Summary" in out


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    case = shapes.get_case("bn/8x64x56x56/nchw/f32").scaled((2, 8, 4, 4))
    cr = runner.run_case(case, [impls.CopyImpl(), impls.NumpyImpl()], rounds=2, min_sample_ns=1e5,
                         warmup_ns=1e4)
    path = tmp_path / "p.png"
    report.plot([cr, cr], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


cli = importlib.import_module(B.__name__ + ".cli")
TINY_RUN = ["--filter", "tiny/bn/", "--impl", "copy,simdnorm", "--rounds", "1", "--min-sample-ms", "0.1",
            "--warmup-ms", "0", "--no-progress"]


def _usage_error(capsys, argv):
    """main(argv) must stop with an argparse usage error (exit 2): returns its error line."""
    with pytest.raises(SystemExit) as e:
        B.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("python -m simdnorm bench: error: "), err
    return err[-1]


@pytest.mark.parametrize("opt, path, says", [
    ("--json", "nodir/r.json", "does not exist"),
    ("--json", ".", "is a directory"),
    ("--json", "newdir/", "names a directory"),  # (its parent exists: was written only after the run)
    ("--plot", "nodir/p.png", "does not exist"),
    ("--plot", "p.xyz", "cannot write .xyz"),
    ("--plot", "p.png", "needs matplotlib"),  # matplotlib made unimportable
    ("--plot", "newdir/", "names a directory"),  # (was written as newdir/.png.png, said newdir/.png)
], ids=["json-no-dir", "json-is-dir", "json-slash", "plot-no-dir", "plot-bad-ext", "plot-no-matplotlib",
        "plot-slash"])
def test_output_paths_are_checked_before_any_timing(tmp_path, capsys, monkeypatch, opt, path, says):
    """A --json/--plot that cannot be written is a usage error up front, not a traceback (or a
    late error) after the whole run, its results lost."""
    if opt == "--plot":
        pytest.importorskip("matplotlib")
    if says == "needs matplotlib":
        monkeypatch.setitem(sys.modules, "matplotlib", None)

    def no_timing(*a, **k):
        raise AssertionError("timed before checking the output paths")

    monkeypatch.setattr(cli, "run_case", no_timing)
    line = _usage_error(capsys, TINY_RUN + [opt, f"{tmp_path}/{path}"])  # (pathlib would drop a final /)
    assert opt in line and says in line


@pytest.mark.parametrize("opt", ["--json", "--plot"])
def test_an_empty_output_name_is_a_usage_error(capsys, opt):
    """`--json ""` (an unset shell variable) was taken as no option: the run ended with nothing
    written and nothing said."""
    line = _usage_error(capsys, TINY_RUN + [opt, ""])
    assert f"argument {opt}: expected a file name, got an empty one" in line


def test_json_and_plot_naming_one_file_is_a_usage_error(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    line = _usage_error(capsys, TINY_RUN + ["--json", str(tmp_path / "r.png"), "--plot", str(tmp_path / "r.png")])
    assert "--json and --plot name the same file" in line


def test_a_plot_that_fails_late_is_a_message_and_status_2(tmp_path, capsys, monkeypatch):
    """matplotlib can fail when it writes (pgf without LaTeX: RuntimeError): the results stand, the
    JSON is written, and the failure is one line and exit status 2, not a traceback."""
    pytest.importorskip("matplotlib")

    def fails(*a, **k):
        raise RuntimeError("'xelatex' not found; install it\nsecond line")

    monkeypatch.setattr(cli, "plot", fails)
    rc = B.main(TINY_RUN + ["--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert rc == 2 and "--plot: cannot write" in err and "RuntimeError: 'xelatex' not found" in err
    assert "Traceback" not in err and "second line" not in err
    assert json.loads((tmp_path / "r.json").read_text())["cases"]


def test_case_table_columns_stay_apart_however_wide(rng):
    """A t/copy of 10000 or more ran into the GB/s column ('0.0010470.89')."""
    case = shapes.get_case("tiny/bn/1x16x8x8/f32")
    cr = runner.run_case(case, [impls.CopyImpl(), _SlowImpl()], rounds=1, min_sample_ns=1e4, warmup_ns=0)
    row = next(line for line in report.format_case(cr).splitlines() if line.strip().startswith("slow"))
    gbps, vs_copy = f"{cr.results['slow'].gbps:.2f}", f"{cr.results['slow'].vs_copy:.2f}"
    assert float(vs_copy) >= 10000 and f" {gbps} " in row and f" {vs_copy}" in row, row


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_plot_without_an_extension_says_the_file_it_wrote(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "adir").mkdir()  # matplotlib appends .png: adir.png, beside the directory
    assert B.main(TINY_RUN + ["--plot", str(tmp_path / "adir")]) == 0
    assert f"wrote {tmp_path / 'adir.png'}\n" in capsys.readouterr().out
    assert (tmp_path / "adir.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv", [
    ["--rounds", "-1"], ["--rounds", "0"], ["--rounds", "2.5"],
    ["--min-sample-ms", "nan"], ["--min-sample-ms", "inf"], ["--min-sample-ms", "-1"],
    ["--warmup-ms", "inf"], ["--warmup-ms", "-5"], ["--warmup-ms", "x"],
    ["--seed", "-1"], ["--threads", "0"], ["--threads", "max+1"], ["--threads", "9" * 5000],
], ids=lambda a: " ".join(a)[:30])
def test_bad_numeric_options_are_usage_errors(capsys, argv):
    """Each was a traceback, a silent default (--rounds 0), a hang (--warmup-ms inf) or simdnorm's
    ValueError (--threads past its maximum)."""
    if argv[1] == "max+1":
        argv = [argv[0], str(cli.max_threads() + 1)]
    line = _usage_error(capsys, ["--list"] + argv)
    assert f"argument {argv[0]}: expected " in line and len(line) < 200


def test_numeric_options_at_their_limits_parse():
    a = cli.build_parser().parse_args(["--rounds", "1", "--min-sample-ms", "0", "--warmup-ms", "0",
                                       "--seed", "0", "--threads", str(cli.max_threads())])
    assert (a.rounds, a.min_sample_ms, a.warmup_ms, a.seed) == (1, 0.0, 0.0, 0)
    mod = impls.load_simdnorm()[0]
    if mod is not None:
        assert cli.max_threads() == importlib.import_module("simdnorm._runtime").MAX_THREADS


@pytest.mark.parametrize("argv, says", [
    (["--list", "--filter", "zzz"], "no case matches"),
    (["--list", "--impl", "bogus"], "unknown implementation(s): bogus"),
    (TINY_RUN + ["--impl", "bogus"], "unknown implementation(s): bogus"),
], ids=["list-filter", "list-impl", "run-impl"])
def test_list_and_run_refuse_the_same_selections(capsys, argv, says):
    """--list used to exit 0 where a run exits 2; an unknown --impl exited 1 (SystemExit(msg))."""
    assert says in _usage_error(capsys, argv)


def test_list_into_a_closed_pipe_ends_without_a_traceback():
    """`bench --list | head -1`: the reader goes away; no BrokenPipeError traceback."""
    import subprocess

    p = subprocess.Popen([sys.executable, "-m", B.__name__, "--list"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with p:
        p.stdout.close()  # before the child (still importing) writes anything
        err = p.stderr.read().decode()
        rc = p.wait(timeout=60)
    assert rc == 1 and "Traceback" not in err and "BrokenPipe" not in err, (rc, err)


# ---------------------------------------------------------------------------- A/B of two builds
def test_ab_runs_each_build_in_a_process_of_its_own(tmp_path):
    # simdnorm.bench.ab: each side's child imports its own directory's package, so a copy of the
    # installed one loads its own compiled module (one process would share the first one's)
    import shutil

    sn = _simdnorm_or_skip()
    if not B.__name__.startswith("simdnorm."):
        pytest.skip("the A/B tool runs the installed simdnorm.bench in its children")
    ab = importlib.import_module(B.__name__ + ".ab")
    installed = Path(sn.__file__).resolve().parent
    copy = tmp_path / "copy"
    shutil.copytree(installed, copy / "simdnorm", ignore=shutil.ignore_patterns("__pycache__"))
    cases = tmp_path / "cases.py"
    cases.write_text("import numpy as np\n"
                     "def cases(sn):\n"
                     "    x = np.arange(96, dtype=np.float32).reshape(2, 3, 4, 4)\n"
                     "    return {'mvn': lambda: sn.mean_variance_normalization(x, axes=(2, 3))}\n")
    a, b = ab._Build(str(installed.parent), str(cases), 1), ab._Build(str(copy), str(cases), 1)
    try:
        assert Path(a.module).parent == installed and Path(b.module).parent == copy / "simdnorm"
        assert a.names == b.names == ["mvn"]
        assert 0 < a.time("mvn", 3) < 1 and 0 < b.time("mvn", 3) < 1
    finally:
        a.close()
        b.close()
    for bad in (["--threads", "0"], ["--rounds", "0"]):  # (the child's traceback, before)
        with pytest.raises(SystemExit) as e:
            ab.main(bad + [str(installed.parent), str(copy), str(cases)])
        assert e.value.code == 2, bad
    res = ab.compare(str(installed.parent), str(copy), str(cases), rounds=3)
    assert set(res) == {"mvn"} and res["mvn"]["ratio"] == pytest.approx(res["mvn"]["B"] / res["mvn"]["A"])


# ---------------------------------------------------------------------------- output placement
def test_placement_puts_each_output_at_its_offset_and_times_the_call(capsys):
    # simdnorm.bench.placement: each output at its offset past the input's phase to a page (the
    # input at a page), written by the call timed, and a ratio per offset, 1 at the first
    _simdnorm_or_skip()
    placement = importlib.import_module(B.__name__ + ".placement")
    buffer = np.empty(3 * 4096, np.float32)
    for phase in (0, 16, 2052, 4092):
        v = placement.at_page_phase(buffer, phase, (2, 1000))
        assert v.ctypes.data % 4096 == phase and v.shape == (2, 1000) and np.shares_memory(v, buffer)
    rng = np.random.default_rng(0)
    call, out_at = placement.make_case("rms", rng)
    y = out_at(48)
    assert y.ctypes.data % 4096 == 48 and y.shape == placement.ROWS
    y[...] = np.nan
    call(y)
    assert np.isfinite(y).all()
    base, ratios = placement.sweep("group", [0, 80], 2, rng)
    assert base > 0 and ratios[0] == 1.0 and ratios[80] > 0
    placement.main(["bn-nhwc", "--offsets", "0,48", "--rounds", "1"])
    fields = capsys.readouterr().out.split()
    assert fields[0] == "bn-nhwc" and fields[3] == "0:1.00" and fields[4].startswith("48:"), fields
    for bad in (["nope"], ["--offsets", "0,4096"], ["--offsets", "abc"], ["--rounds", "0"], ["--threads", "0"]):
        with pytest.raises(SystemExit) as e:  # (the last three were tracebacks)
            placement.main(bad)
        assert e.value.code == 2, bad
