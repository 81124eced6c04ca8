"""The ZeRO paths' contract: a case whose outputs need no grad has no
backward for the engine's loop to call. Run anyway, the loop read grads and
stepped where DeepSpeed documents neither, and DeepSpeed's raises there
("Gradients are only available immediately after backward and before engine
step") were reported as its bugs. No DeepSpeed is needed to judge the contract."""

import json
from dataclasses import replace
from pathlib import Path

from harness.case.spec import Case, Input, Node, Param, Use
from harness.paths import resolve
from harness.paths.deepspeed.data import Knobs

CORPUS = Path(__file__).resolve().parents[2] / "cases"


def _zero_paths() -> list:
    return [p for p in resolve("deepspeed") if p.name.startswith("deepspeed.zero")]


def _no_output_needs_grad() -> Case:
    """``x0 @ w0`` with ``w0`` frozen and the one trainable parameter unused:
    the corpus case the gate first misread (filed for the graphed paths)."""
    saved = json.loads((CORPUS / "graphed" / "make_graphed_callables_output_without_grad.json").read_text())
    return Case.from_json(saved["case"])


def test_every_zero_path_refuses_a_case_whose_outputs_need_no_grad() -> None:
    case = _no_output_needs_grad()
    for path in _zero_paths():
        reason = path.supports(_its_knobs(path, case))
        assert reason and "no output requires grad" in reason, path.name


def _its_knobs(path, case: Case) -> Case:
    """A misuse path takes only a case with a misuse drawn, an fp16 path one with fp16."""
    if path.name.endswith(".misuse"):
        return case.with_data("deepspeed", Knobs(misuse="zero_grad"))
    return case.with_data("deepspeed", Knobs(fp16=True)) if path.name.endswith(".fp16") else case


def test_an_output_that_needs_grad_through_an_input_alone_still_runs() -> None:
    """The user's ``engine.backward(loss)`` is then the documented drive: what
    DeepSpeed does with it is its own to answer for, so nothing is refused."""
    case = _no_output_needs_grad()
    through_input = replace(case, inputs=(replace(case.inputs[0], requires_grad=True),))
    (stock,) = resolve("deepspeed.zero1.stock")
    assert stock.supports(through_input) is None


def test_a_trainable_output_is_still_taken() -> None:
    case = Case(params=(Param("w0", (3, 3)),), inputs=(Input("x0", (2, 3)),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))),), outputs=(Use("n0"),))
    for path in _zero_paths():
        if not path.name.endswith(".misuse"):
            assert path.supports(_its_knobs(path, case)) is None, path.name
