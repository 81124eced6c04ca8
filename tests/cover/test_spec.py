import json

import pytest
from hypothesis import given, settings

from harness.materialize.tensors import EXACT_LIMIT, magnitude_bounds
from harness.case.spec import Case, SpecError
from harness.generate import cases
from tests.helpers import nested


@settings(max_examples=150, deadline=None)
@given(cases())
def test_generated_cases_round_trip_json_exactly(case):
    text = case.dumps()
    assert Case.loads(text) == case
    assert json.loads(Case.loads(text).dumps()) == json.loads(text)


@settings(max_examples=150, deadline=None)
@given(cases(exact=True))
def test_exact_mode_stays_inside_float32_exact_integers(case):
    # Every forward value, intermediate grad and accumulated grad is bounded
    # by the magnitude network; exact mode promises all of them < 2**24.
    assert float(magnitude_bounds(case)["__peak__"]) < EXACT_LIMIT


@pytest.mark.parametrize(
    "mutate, field, words",
    [
        (lambda d: d.update(version=99), "version", "unknown case schema version 99"),
        (lambda d: d["nodes"][1].update(op="conv9d"), "nodes[1].op", "unknown op 'conv9d'"),
        (lambda d: d["nodes"][1]["args"][0].update(ref="ghost"), "nodes[1].args[0].ref", "'ghost' names no"),
        (lambda d: d["params"][0].update(shape=[3, 4]), "nodes[1]", "matmul inner dims differ"),
        (lambda d: d["schedule"].update(grad_init="maybe"), "schedule.grad_init", "unknown 'maybe'"),
        (lambda d: d["outputs"][0].update(index=1), "outputs[0].index", "single result"),
        (lambda d: d.update(colour="red"), "case.colour", "unknown field"),
        (lambda d: d["nodes"][0].pop("op"), "case.nodes[0].op", "missing field"),
    ],
)
def test_validation_errors_name_the_field(mutate, field, words):
    data = nested().to_json()
    mutate(data)
    with pytest.raises(SpecError) as info:
        Case.from_json(data)
    assert field in str(info.value) and words in str(info.value)


def test_bad_json_is_a_spec_error():
    with pytest.raises(SpecError, match="not valid JSON"):
        Case.loads("{nope")


def test_exact_mode_rejects_nonexact_ops():
    data = nested().to_json()
    data["nodes"][1]["op"] = "tanh"
    data["nodes"][1]["args"] = [{"ref": "n0", "transpose": False, "index": None}]
    with pytest.raises(SpecError, match=r"nodes\[1\]\.op: tanh is not exact"):
        Case.from_json(data)
    data["exact"] = False
    assert Case.from_json(data).nodes[1].op == "tanh"


def test_a_family_part_names_its_field_when_no_family_reads_it_or_its_version_is_other():
    """A case's family data is read by that family only: a part no installed
    family reads, or of another version, is refused naming the field."""
    from tests.helpers import nested

    data = nested().to_json()
    data["family"] = {"no_such_family": {"version": 1}}
    with pytest.raises(SpecError) as e:
        Case.from_json(data)
    assert e.value.where == "case.family.no_such_family" and "no installed family" in str(e.value)
    data["family"] = {"pipeline": {"version": 7, "cuts": []}}
    with pytest.raises(SpecError) as e:
        Case.from_json(data)
    assert e.value.where == "case.family.pipeline.version" and "reads version 1" in str(e.value)
    data["family"] = {"pipeline": {"version": 1, "cuts": [], "extra": 1}}
    with pytest.raises(SpecError) as e:
        Case.from_json(data)
    assert e.value.where == "case.family.pipeline.extra"
