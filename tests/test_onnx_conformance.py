"""ONNX node conformance: the `onnx` package's own test cases for BatchNormalization (inference and
training mode), MeanVarianceNormalization, LayerNormalization, InstanceNormalization,
GroupNormalization and RMSNormalization, including their `_expanded` / `_expanded_verNN` variants
(the same inputs and expected outputs, the op written as a subgraph of primitive ops), each run
through the matching simdnorm call on every ISA this machine has and compared as the onnx backend
runner compares (same shape, same dtype, rtol/atol of the case: 1e-3 / 1e-7).

The cases come from onnx itself (see onnx_cases.py); `test_selection_matches_official_loader` checks
with `onnx.backend.test.loader.load_model_tests(kind="node")` that none is missed.
"""

from __future__ import annotations

import pytest

onnx = pytest.importorskip("onnx")

import onnx_cases as oc  # noqa: E402  (tests/ is on sys.path, see conftest.py)

CASES = oc.selected_cases()
BY_NAME = {tc.name: tc for tc in CASES}
NAMES = [tc.name for tc in CASES]


def _base_spec(name: str) -> oc.NodeSpec:
    """The single-op node an (expanded) case stands for: attributes and opset come from it."""
    base = BY_NAME.get(oc.stem(name))
    assert base is not None, f"{name}: no single-op case {oc.stem(name)!r} to take the attributes from"
    model, _ = oc.case_data(base)
    return oc.node_spec(model)


def test_every_operator_has_cases():
    missing = [
        prefix
        for prefix, op in oc.PREFIXES.items()
        if onnx.defs.has(op) and not any(n.startswith(prefix) for n in NAMES)
    ]
    assert not missing, f"onnx {onnx.__version__} defines these ops but no case was found: {missing}"
    for name in NAMES:
        if oc.stem(name) != name:
            assert oc.stem(name) in BY_NAME, f"{name}: its single-op case is missing"


def test_selection_imports_every_module_naming_our_cases():
    modules = oc.case_modules()
    naming = oc.modules_naming_our_cases()
    assert naming, "no onnx case module mentions our test names"
    assert all(modules[m] for m in naming), f"case modules not imported: {[m for m in naming if not modules[m]]}"


@pytest.mark.slow
def test_selection_matches_official_loader():
    """The fast per-module generation finds exactly the cases the official loader lists (~10 s)."""
    assert oc.official_case_names() == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_onnx_node_case(name, isa):
    tc = BY_NAME[name]
    spec = _base_spec(name)
    model, data_sets = oc.case_data(tc)
    expanded = oc.stem(name) != name
    if expanded:
        ops = {n.op_type for n in model.graph.node}
        assert spec.op_type not in ops and len(model.graph.node) > 1, f"{name}: not an expansion: {ops}"
    assert data_sets, f"{name}: no test data"
    for inputs, outputs in data_sets:
        try:
            got = oc.run_simdnorm(spec, inputs)
        except oc.NotExpressible as e:
            pytest.skip(f"outside the simdnorm SPEC: {e}")
        expected = oc.present(spec.outputs, outputs)
        assert sorted(got) == sorted(expected), f"{name}: outputs {sorted(got)} vs expected {sorted(expected)}"
        for slot, exp in expected.items():
            oc.assert_similar(got[slot], exp, tc.rtol, tc.atol, f"{name}: output {slot} ({spec.outputs[slot]})")
