"""`python -m simdnorm bench --torch-modules` (bench/torch_modules.py) on scaled-down shapes: every
row verifies simdnorm.torch against torch.nn before it is timed, a disagreement is reported as a
MISMATCH (exit 1) instead of a time, and `--quick` runs end to end at 1 and 2 threads with valid
JSON. Skips without torch or simdnorm.torch.

The bench is imported as the installed ``simdnorm.bench`` when that has this module, else from the
source tree's ``bench/``.
"""
from __future__ import annotations

import importlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("simdnorm.torch")

ROOT = Path(__file__).resolve().parents[1]


def _load():
    try:
        return importlib.import_module("simdnorm.bench.torch_modules")
    except ImportError:  # an install without it (older), or none: the source tree's
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        return importlib.import_module("bench.torch_modules")


TM = _load()
cli = importlib.import_module(TM.__package__ + ".cli")


def _small(case):
    """The case on a shape of the same rank, small enough for a test (GroupNorm's 32 groups divide
    its 64 channels; odd sizes for the vector tails)."""
    if case.tiny:
        return case
    return replace(case, shape=(2, 64, 5, 7) if len(case.shape) == 4 else (2, 3, 40))


SMALL = [_small(c) for c in TM.CASES]
QUICK_RUN = ["--torch-modules", "--quick", "--rounds", "1", "--min-sample-ms", "0.1", "--warmup-ms", "0",
             "--no-progress"]


@pytest.mark.parametrize("case", SMALL, ids=[c.name for c in SMALL])
def test_every_row_verifies(case):
    torch, _, sntorch = TM.load_torch()
    gen = torch.Generator().manual_seed(0)
    m = TM.make_module(torch, case, gen)
    twin = TM.make_twin(sntorch, m)
    assert type(twin).__module__.startswith("simdnorm.torch") and isinstance(twin, type(m))
    data = TM.make_data(torch, case, gen)
    for measure in case.measures():
        why, _torch_off, worst = TM.verify(torch, case, measure, m, twin, data)
        assert why is None, (measure, why)
        assert worst < 0.05, (measure, worst)


def test_quick_end_to_end_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(TM, "CASES", SMALL)
    path = tmp_path / "t.json"
    rc = cli.main(QUICK_RUN + ["--threads", "1,2", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for title in ("Module forward", "Forward + backward", "In a model, forward", "Per call", "Goal at threads=2"):
        assert title in out
    doc = json.loads(path.read_text())
    assert doc["suite"] == "simdnorm.bench.torch_modules" and doc["config"]["threads"] == [1, 2]
    want = [(n, c.name, m) for n in (1, 2) for c in TM.select(quick=True) for m in c.measures()]
    assert [(r["threads"], r["case"], r["measure"]) for r in doc["rows"]] == want
    for r in doc["rows"]:
        assert r["status"] == "ok", r
        assert r["ratio"] == pytest.approx(r["torch.nn"]["median_ns"] / r["simdnorm"]["median_ns"])
        assert len(r["simdnorm"]["samples_ns"]) == 1
        if r["measure"].startswith("model"):
            inside = r["norm_inside"]
            assert 0 < inside["simdnorm"]["median_ns"] < r["simdnorm"]["median_ns"]
            assert 0 < inside["torch.nn"]["median_ns"] < r["torch.nn"]["median_ns"]
        # the memory floor: timed with the plain measures, a model row's its plain measure's
        if r["measure"] == "call":
            assert "floor_ns" not in r and "ceiling" not in r
            continue
        if r["measure"] in ("fwd", "fwd+bwd"):
            copy_ns = min(r[k]["median_ns"] for k in TM.COPIES)
            assert r["floor_ns"] == pytest.approx(TM.FLOOR_PASSES[r["measure"]] * copy_ns / 2) and copy_ns > 0
            torch_ns = r["torch.nn"]["median_ns"]
        else:
            plain = [p for p in doc["rows"] if (p["threads"], p["case"], "model " + p["measure"]) ==
                     (r["threads"], r["case"], r["measure"])]
            assert len(plain) == 1 and r["floor_ns"] == plain[0]["floor_ns"]
            assert not set(TM.COPIES) & set(r)
            torch_ns = r["norm_inside"]["torch.nn"]["median_ns"]
        assert r["ceiling"] == pytest.approx(torch_ns / r["floor_ns"])
    assert "floor ms ceiling" in out


def test_a_mismatch_is_reported_instead_of_a_time(monkeypatch, capsys):
    make_twin = TM.make_twin

    def off_by_a_bit(sntorch, module):
        twin = make_twin(sntorch, module)
        with TM.load_torch()[0].no_grad():
            twin.bias.add_(1e-2)
        return twin

    monkeypatch.setattr(TM, "CASES", SMALL)
    monkeypatch.setattr(TM, "make_twin", off_by_a_bit)
    rc = cli.main(QUICK_RUN + ["--threads", "1", "--filter", "layer/2x3x40"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "!!! MISMATCH threads=1 layer/2x3x40/f32 fwd: out: max |err|" in out
    assert "layer/2x3x40/f32  MISMATCH: out: max |err|" in out  # in the table: no time


def test_list_and_thread_lists(capsys):
    assert cli.main(["--torch-modules", "--list", "--filter", "tiny/op"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == [c.name for c in TM.CASES if c.raw_op]
    with pytest.raises(SystemExit) as e:
        cli.main(["--list", "--threads", "1,2"])  # a list is for --torch-modules only
    assert e.value.code == 2 and "a list is for --torch-modules" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["--threads", "2,1,2"]).threads == (2, 1)


def test_goal_summary_names_the_ceilings_and_counts_those_under_the_goal():
    timing = importlib.import_module(TM.__package__ + ".timing").Timing
    case = next(c for c in TM.CASES if c.kind == "layer" and not c.tiny)

    def row(torch_ms, simdnorm_ms, copy_ms):  # a fwd row timed with its copies
        r = TM.Row(case, "fwd", 1, timings={"torch.nn": timing(1, [torch_ms * 1e6]),
                                            "simdnorm": timing(1, [simdnorm_ms * 1e6])})
        for k in TM.COPIES:
            r.timings[k] = timing(1, [copy_ms * 1e6])
        r.floor_ns = TM.FLOOR_PASSES["fwd"] * copy_ms * 1e6 / 2
        return r

    met, under, reachable = row(3.0, 1.0, 1.0), row(1.2, 1.0, 1.0), row(2.4, 2.0, 1.0)
    assert (met.ceiling, under.ceiling, reachable.ceiling) == (3.0, 1.2, 2.4)
    s = TM.format_goal_summary([met, under, reachable], 1)
    assert "met on 1 of 3 rows" in s
    assert f"{case.name} fwd (1.20x, ceiling 1.20x)" in s and f"{case.name} fwd (1.20x, ceiling 2.40x)" in s
    assert s.endswith("1 of the missed rows has a ceiling under the goal: torch.nn runs within 1.5x of the "
                      "memory floor there, so no implementation can meet it on this machine")


def test_ratios_near_the_goal_are_not_rounded_across_it():
    assert TM._x(1.4962, 1.5) == "1.49x" and TM._x(1.4999996, 1.5) == "1.49x" and TM._x(1.5, 1.5) == "1.50x"
    assert TM._x(1.5004, 1.5) == "1.50x" and TM._x(1.4962) == "1.50x" and TM._x(None, 1.5) == "-"
    assert TM._x(0.6660, TM.TINY_GOAL) == "0.66x" and TM._x(0.6670, TM.TINY_GOAL) == "0.67x"
