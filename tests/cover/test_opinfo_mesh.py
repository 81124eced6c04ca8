"""OpInfo ops on DTensors: the op's input sharded as the case says, on a
real process group (gloo, 2 ranks), judged against the plain float64 node.

The op table records, per sample, the placements of the op's input that ran
under DTensor on a one-rank mesh with the plain node's value and grad
(``optable_build.mesh_places``); a DTensor-placed case draws only those.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from harness.case import opinfo
from harness.case.opcall import PARTIAL
from harness.case.spec import Case, Schedule
from harness.case.vocab import SpecError
from harness.engine.runner import check
from harness.generate import interpret
from harness.paths import resolve

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TABLE = opinfo.table()
pytestmark = pytest.mark.skipif(not TABLE, reason=f"no op table for torch {opinfo.version_key()}")


def _sharded_case(key: str, sample: int, place: int) -> Case:
    """w0 Shard(0) and x @ w0 into the op, whose input is sharded on ``place``."""
    k = opinfo.draws().index((key, sample))
    case = interpret([("linear", 0, 0), ("opinfo", 0, k)], dim=3, batch=2, x_grad=True, exact=False, out_kind=0,
                     schedule=Schedule(microbatches=2), seed=4)
    params = tuple(replace(p, placement="shard0") for p in case.params)
    nodes = tuple(replace(n, attrs=n.attrs + (("place", place),)) if n.op == "opinfo" else n for n in case.nodes)
    return replace(case, params=params, nodes=nodes)


# Ops whose input is sharded along the dimension they reduce or scan over, and one elementwise op.
SHARDED = [("cumsum", 0, 1), ("var", 1, 2), ("nn.functional.layer_norm", 1, 2), ("softmax", 1, 1), ("cos", 0, 0)]


@pytest.mark.parametrize("key, sample, place", [s for s in SHARDED if s[0] in TABLE])
def test_a_sharded_opinfo_op_agrees_with_the_oracle_on_two_ranks(key, sample, place):
    assert place in TABLE[key]["places"][sample], TABLE[key]["places"]
    case = _sharded_case(key, sample, place)
    assert Case.loads(case.dumps()) == case
    for path in resolve("dtensor.fixed,dtensor.stock"):
        assert path.supports(case) is None, path.supports(case)
        assert not check(case, path), path.name


def _replicated_sample(key: str) -> int | None:
    return next((i for i, p in enumerate(TABLE[key]["places"]) if -1 in p), None) if key in TABLE else None


# Ops that DTensor keeps Partial through (linear ones) and ones it must reduce first.
PARTIALS = [("cumsum", -2), ("softmax", -2), ("var", -3), ("nn.functional.layer_norm", -3), ("cos", -4),
            ("mean", -5)]


@pytest.mark.parametrize("key, place", [p for p in PARTIALS if _replicated_sample(p[0]) is not None])
def test_an_opinfo_op_on_a_partial_input_agrees_with_the_oracle_on_two_ranks(key, place):
    """The input split over the ranks (sum, avg: each element on one rank),
    or the same on each (max, min); DTensor must reduce it where the op is
    not linear, and the grad of every piece must come back whole."""
    case = _sharded_case(key, _replicated_sample(key), place)
    assert Case.loads(case.dumps()) == case
    for path in resolve("dtensor.fixed,dtensor.stock"):
        assert path.supports(case) is None, path.supports(case)
        assert not check(case, path), path.name


def test_an_in_place_op_on_a_partial_input_is_refused_as_dtensor_documents():
    key = next((k for k in TABLE if k.endswith(opinfo.INPLACE) and _replicated_sample(k) is not None), None)
    if key is None:
        pytest.skip("no in-place OpInfo op ran Replicate in this torch's screen")
    case = _sharded_case(key, _replicated_sample(key), -2)
    (path,) = resolve("dtensor.stock")
    why = path.supports(case)
    assert why is not None and key in why and "Partial(sum)" in why and "out-of-place" in why, why
    assert -2 not in opinfo.even_places(key, TABLE[key]["samples"][_replicated_sample(key)], 2)


def test_a_placement_the_screen_did_not_run_is_refused_naming_the_op():
    key = next(k for k, e in TABLE.items() if any(p and max(p) < 2 for p in e["places"]))
    sample = next(i for i, p in enumerate(TABLE[key]["places"]) if p and max(p) < 2)
    case = _sharded_case(key, sample, 3)
    (path,) = resolve("dtensor.fixed")
    why = path.supports(case)
    assert why is not None and key in why and "Shard(3)" in why, why


def test_an_op_without_a_strategy_keeps_the_to_local_pattern():
    from hypothesis import given, settings, strategies as st

    from harness.generate.draws import dtensor_placements

    key = next(k for k, e in TABLE.items() if not any(e["places"]))
    k = opinfo.draws().index((key, 0))
    case = interpret([("linear", 0, 0), ("opinfo", 0, k)], dim=3, batch=2, x_grad=True, exact=False, out_kind=0,
                     schedule=Schedule(microbatches=1), seed=4)

    @settings(max_examples=20, database=None)
    @given(st.data())
    def draw(data):
        placed = data.draw(dtensor_placements(case))
        assert all((p.placement or "partial") == "partial" for p in placed.params), key

    draw()


@pytest.mark.parametrize("places, words", [
    ([[-1, 0]], "one list per sample"),
    ([[-2]], "one list per sample"),
    ([[0, 9]], "one list per sample"),
    ("Shard", "one list per sample"),
])
def test_a_hostile_places_field_is_refused_naming_it(places, words):
    key, e = next(iter(TABLE.items()))
    raw = {"fn": e["fn"], "samples": [json.loads(json.dumps(c)) for c in e["samples"]], "places": places}
    if len(e["samples"]) == 1 and places == [[-1, 0]]:
        raw["places"] = [[-1], [0]]
    with pytest.raises(SpecError) as err:
        opinfo._entry(key, raw, "t: ops.k")
    assert "places" in str(err.value) and words in str(err.value)


def test_the_screen_reproduces_the_shipped_places():
    """Every 40th sample's placements, screened again in a fresh process."""
    code = ("import json, sys\n"
            "from harness.case import opinfo, optable_build as b\n"
            "out = {}\n"
            "for key, i in opinfo.draws()[::40]:\n"
            "    e = opinfo.table()[key]\n"
            "    out[f'{key}/{i}'] = [b.mesh_places(opinfo._resolve(e['fn']), e['samples'][i]), list(e['places'][i])]\n"
            "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(got) >= 25
    assert {k: v[0] for k, v in got.items()} == {k: v[1] for k, v in got.items()}


def test_drawn_shards_divide_over_two_ranks_and_are_screened():
    """Drawn cases shard an op's input only where two ranks divide the dim:
    DTensor refuses to flatten an uneven shard, which one rank cannot show."""
    for key, e in TABLE.items():
        for call, ran in zip(e["samples"], e["places"]):
            even = opinfo.even_places(key, call, 2)
            assert set(even) <= set(ran) | (set(PARTIAL) if -1 in ran else set())
            assert all(p < 0 or call[1][1][p] % 2 == 0 for p in even), (key, even)


def test_off_the_cpu_an_opinfo_case_is_refused_naming_the_screen():
    from harness.paths.engine_rules import off_its_devices

    case = _sharded_case("cos", 0, -1) if "cos" in TABLE else None
    if case is None:
        pytest.skip("no cos in this torch's table")
    assert off_its_devices(case, "cpu") is None
    why = off_its_devices(case, "cuda")
    assert why is not None and "screened on the CPU" in why
    plain = interpret([("linear", 0, 0)], dim=3, batch=2, x_grad=True, exact=False, out_kind=0,
                      schedule=Schedule(microbatches=1), seed=4)
    assert off_its_devices(plain, "cuda") is None
