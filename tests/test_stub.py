"""python/simdnorm/__init__.pyi promises only what the package has: every public name the stub
declares exists at runtime, and the classes frozen at runtime are frozen dataclasses in the stub too,
with every field declared, so a type checker refuses an assignment that would raise."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

STUB = Path(__file__).resolve().parents[1] / "python" / "simdnorm" / "__init__.pyi"
simdnorm = pytest.importorskip("simdnorm")


def _stub():
    return ast.parse(STUB.read_text())


def _public_names(tree):
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")} | {"__version__"}


def test_every_public_name_in_the_stub_exists_at_runtime():
    missing = sorted(n for n in _public_names(_stub()) if not hasattr(simdnorm, n))
    assert not missing, f"declared in __init__.pyi but not in the package: {missing}"
    assert set(simdnorm.__all__) <= _public_names(_stub())
    assert simdnorm.ActivationLike == simdnorm._activation.ActivationLike  # the same alias


@pytest.mark.parametrize("cls", ["Activation", "TensorDesc", "BatchNormalizationDesc",
                                 "MeanVarianceNormalizationDesc"])
def test_attributes_of_frozen_classes_are_read_only_in_the_stub(cls):
    runtime = getattr(simdnorm, cls)
    assert dataclasses.is_dataclass(runtime) and runtime.__dataclass_params__.frozen
    node = next(n for n in _stub().body if isinstance(n, ast.ClassDef) and n.name == cls)
    frozen = any(isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "dataclass"
                 and any(k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value is True
                         for k in d.keywords) for d in node.decorator_list)
    assert frozen, f"{cls}: frozen at runtime, not declared @dataclass(frozen=True) in the stub"
    declared = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
    fields = {f.name for f in dataclasses.fields(runtime) if not f.name.startswith("_")}
    assert fields <= declared, f"{cls}: fields missing from the stub: {sorted(fields - declared)}"
