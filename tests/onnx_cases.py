"""ONNX node conformance cases for the normalization operators simdnorm implements.

The `onnx` package regenerates its node test cases in memory: every module under
`onnx.backend.test.case.node` calls `expect(...)` at import time, which appends a `TestCase` (the
model and its input/output arrays) to `onnx.backend.test.case.node._NodeTestCases`; that list is what
`onnx.backend.test.loader.load_model_tests(kind="node")` returns after importing *all* those
modules (about 1900 cases, 8-20 s). For a fast suite `selected_cases()` imports only the modules whose
name mentions a normalization, which produces exactly the same TestCase objects for our operators;
`official_case_names()` runs the full official loader so that a test can check nothing was missed.

Older onnx releases shipped the cases as files (`model.onnx`, `test_data_set_*/input_*.pb`,
`output_*.pb`); `case_data()` reads either form, and always gives the arrays as a backend sees them:
through a TensorProto (`onnx.numpy_helper`).
"""

from __future__ import annotations

import glob
import importlib
import os
import pkgutil
import re
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import onnx
from onnx import numpy_helper

# test-name prefixes of the operators simdnorm covers (their real names in onnx >= 1.16)
PREFIXES: Dict[str, str] = {
    "test_batchnorm": "BatchNormalization",
    "test_mvn": "MeanVarianceNormalization",
    "test_layer_normalization": "LayerNormalization",
    "test_instancenorm": "InstanceNormalization",
    "test_group_normalization": "GroupNormalization",
    "test_rms_normalization": "RMSNormalization",
}

_EXPANDED = re.compile(r"_expanded(_ver\d+)?$")


def is_selected(name: str) -> bool:
    return name.startswith(tuple(PREFIXES))


def stem(name: str) -> str:
    """The name of the single-op case an `_expanded` / `_expanded_verNN` case was generated from."""
    return _EXPANDED.sub("", name)


def _wanted_module(name: str) -> bool:
    n = name.lower()
    return "norm" in n or "mvn" in n or "meanvariance" in n


def case_modules() -> Dict[str, bool]:
    """Every case module under onnx.backend.test.case.node -> whether selected_cases() imports it."""
    import onnx.backend.test.case.node as node_pkg

    return {info.name: _wanted_module(info.name) for info in pkgutil.iter_modules(node_pkg.__path__)}


def modules_naming_our_cases() -> List[str]:
    """Case modules whose source mentions one of our test-name prefixes (a cheap static check that
    the module filter of selected_cases() misses none)."""
    import onnx.backend.test.case.node as node_pkg

    found = []
    for info in pkgutil.iter_modules(node_pkg.__path__):
        path = os.path.join(info.module_finder.path, info.name + ".py")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            src = f.read()
        if any(p in src for p in PREFIXES):
            found.append(info.name)
    return found


def selected_cases() -> List[Any]:
    """The onnx TestCases of our operators (fast: imports only the normalization case modules)."""
    import onnx.backend.test.case.node as node_pkg

    # generating cases runs numpy code that may warn; the suite runs with filterwarnings=error
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in pkgutil.iter_modules(node_pkg.__path__):
            if _wanted_module(info.name):
                importlib.import_module(f"{node_pkg.__name__}.{info.name}")
    seen = set()
    out = []
    for tc in node_pkg._NodeTestCases:
        if is_selected(tc.name) and tc.name not in seen:
            seen.add(tc.name)
            out.append(tc)
    return out


def official_case_names() -> List[str]:
    """Names of our operators' cases as the official loader lists them (slow: generates them all)."""
    from onnx.backend.test.loader import load_model_tests

    # other operators' case generators warn (overflowing casts, log(0)); filterwarnings=error
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = load_model_tests(kind="node")
    return sorted({tc.name for tc in cases if is_selected(tc.name)})


def _through_proto(a: Any) -> np.ndarray:
    if isinstance(a, onnx.TensorProto):
        return numpy_helper.to_array(a)
    t = onnx.TensorProto()
    t.ParseFromString(numpy_helper.from_array(np.asarray(a)).SerializeToString())
    return numpy_helper.to_array(t)


def _load_pb(path: str) -> np.ndarray:
    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return numpy_helper.to_array(t)


def case_data(tc: Any) -> Tuple[onnx.ModelProto, List[Tuple[List[np.ndarray], List[np.ndarray]]]]:
    """(model, [(inputs, outputs), ...]) of a TestCase, in memory or on disk."""
    if tc.model_dir is not None:
        model = onnx.load(os.path.join(tc.model_dir, "model.onnx"))
        sets = []
        for d in sorted(glob.glob(os.path.join(tc.model_dir, "test_data_set_*"))):
            n_in = len(glob.glob(os.path.join(d, "input_*.pb")))
            n_out = len(glob.glob(os.path.join(d, "output_*.pb")))
            ins = [_load_pb(os.path.join(d, f"input_{i}.pb")) for i in range(n_in)]
            outs = [_load_pb(os.path.join(d, f"output_{i}.pb")) for i in range(n_out)]
            sets.append((ins, outs))
        return model, sets
    sets = [([_through_proto(a) for a in ins], [_through_proto(a) for a in outs]) for ins, outs in tc.data_sets]
    return tc.model, sets


def onnx_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    raise ValueError("model imports no ai.onnx opset")


@dataclass
class NodeSpec:
    """What the single-op case says: the op, its attributes, the opset, which inputs and outputs."""

    op_type: str
    attrs: Dict[str, Any]
    opset: int
    inputs: List[str]  # node input names ('' = omitted optional input)
    outputs: List[str]  # node output names ('' = omitted optional output)


def node_spec(model: onnx.ModelProto) -> NodeSpec:
    nodes = list(model.graph.node)
    if len(nodes) != 1:
        raise ValueError(f"expected a single-node model, got {[n.op_type for n in nodes]}")
    n = nodes[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
    return NodeSpec(n.op_type, attrs, onnx_opset(model), list(n.input), list(n.output))


class NotExpressible(Exception):
    """The case's semantics are outside the simdnorm SPEC: the test skips with this reason."""


def present(names: Sequence[str], arrays: Sequence[np.ndarray]) -> Dict[int, np.ndarray]:
    """Map node slot index -> array (the data set lists only present inputs/outputs, in order)."""
    it = iter(arrays)
    return {i: next(it) for i, nm in enumerate(names) if nm != ""}


def _check_stash(op: str, attrs: Dict[str, Any], x: np.ndarray) -> None:
    """stash_type: the precision of the statistics. simdnorm computes in float32, or float64 for a
    float64 input: stash_type=1 (float32) always fits (rounding aside, float64 input is computed more
    precisely), stash_type=11 (double) only for float64 input."""
    st = int(attrs.get("stash_type", onnx.TensorProto.FLOAT))
    if st == onnx.TensorProto.FLOAT or (st == onnx.TensorProto.DOUBLE and x.dtype == np.float64):
        return
    raise NotExpressible(
        f"{op} stash_type={st} with {x.dtype} input (simdnorm computes in float32, float64 for float64)"
    )


def run_simdnorm(spec: NodeSpec, inputs: Sequence[np.ndarray]) -> Dict[int, np.ndarray]:
    """Compute the case with simdnorm; returns node output slot -> array for every present output."""
    import simdnorm

    x = present(spec.inputs, inputs)
    want = [i for i, nm in enumerate(spec.outputs) if nm != ""]
    a = spec.attrs
    op = spec.op_type

    if op == "BatchNormalization":
        if a.get("spatial", 1) == 0:
            raise NotExpressible("BatchNormalization spatial=0 (opset < 9, per-element statistics)")
        if spec.opset < 14 and len(spec.outputs) > 1:
            raise NotExpressible(f"BatchNormalization-{spec.opset} training outputs (saved mean/var)")
        X, s, b, mean, var = x[0], x[1], x[2], x[3], x[4]
        eps = float(a.get("epsilon", 1e-5))
        if int(a.get("training_mode", 0)) == 0:
            if want != [0]:
                raise NotExpressible("BatchNormalization inference with extra outputs")
            return {0: simdnorm.batch_normalization(X, mean, var, s, b, epsilon=eps, channel_axis=1)}
        # training mode: Y uses the batch statistics (mean and population variance over every dim
        # but the channel) -> MVN over those dims with per-channel scale/bias. The running-stat
        # outputs are momentum blends of the given mean/var with those batch statistics: the blend
        # itself is not a simdnorm operation (done here in numpy) but the statistics are
        # simdnorm's own (return_stats: mean and inv_std = 1/sqrt(var + eps)).
        mom = float(a.get("momentum", 0.9))
        axes = tuple(d for d in range(X.ndim) if d != 1)
        pshape = (X.shape[1],) + (1,) * (X.ndim - 2)
        y, bmean, inv_std = simdnorm.mean_variance_normalization(
            X, axes, s.reshape(pshape), b.reshape(pshape), epsilon=eps, return_stats=True
        )
        bmean = bmean.reshape(-1).astype(np.float64)
        bvar = 1.0 / inv_std.reshape(-1).astype(np.float64) ** 2 - eps
        res = {0: y}
        if 1 in want:
            res[1] = (mean.astype(np.float64) * mom + bmean * (1 - mom)).astype(mean.dtype)
        if 2 in want:
            res[2] = (var.astype(np.float64) * mom + bvar * (1 - mom)).astype(var.dtype)
        return res

    if op == "MeanVarianceNormalization":
        axes = tuple(a.get("axes", (0, 2, 3)))
        # ONNX: (X - mean) / (sqrt(var) + 1e-9): the fixed epsilon is outside the square root
        return {0: simdnorm.mean_variance_normalization(x[0], axes, epsilon=1e-9, epsilon_mode="outside")}

    if op == "LayerNormalization":
        _check_stash(op, a, x[0])
        y, m, isd = simdnorm.layer_norm(
            x[0], x.get(1), x.get(2), axis=int(a.get("axis", -1)), epsilon=float(a.get("epsilon", 1e-5)),
            return_stats=True,
        )
        return {k: v for k, v in {0: y, 1: m, 2: isd}.items() if k in want}

    if op == "InstanceNormalization":
        return {0: simdnorm.instance_norm(x[0], x[1], x[2], epsilon=float(a.get("epsilon", 1e-5)))}

    if op == "GroupNormalization":
        X, s, b = x[0], x[1], x[2]
        g = int(a["num_groups"])
        _check_stash(op, a, X)
        if spec.opset < 21:
            # GroupNormalization-18: scale and bias per group; per channel is the same numbers repeated
            c = X.shape[1]
            s = np.repeat(s, c // g)
            b = np.repeat(b, c // g)
        return {0: simdnorm.group_norm(X, g, s, b, epsilon=float(a.get("epsilon", 1e-5)))}

    if op == "RMSNormalization":
        _check_stash(op, a, x[0])
        return {0: simdnorm.rms_norm(x[0], x.get(1), axis=int(a.get("axis", -1)),
                                     epsilon=float(a.get("epsilon", 1e-5)))}

    raise NotExpressible(f"no simdnorm mapping for {op}")


def assert_similar(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float, what: str) -> None:
    """onnx.backend.test.runner.Runner.assert_similar_outputs, for one output."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    if expected.dtype.name == "bfloat16":
        rtol = max(rtol, 2**-6)  # two bfloat16 ULPs, as the onnx runner allows
        actual = actual.astype(np.float32)
        expected = expected.astype(np.float32)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)
