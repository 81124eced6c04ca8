"""The DeepSpeed family: optional, honest when absent, and, where DeepSpeed
is installed (``pip install 'gradfuzz[deepspeed]'``), held to the oracle on
every ZeRO stage with its canary caught."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from harness.artifacts import corpus
from harness.case.spec import Case
from harness.paths import resolve
from harness.paths.deepspeed.data import Knobs, config, pipe_config
from tests.helpers import torchrun_verdict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INSTALLED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not INSTALLED, reason="deepspeed is not installed: pip install 'gradfuzz[deepspeed]'")


def test_the_paths_are_listed_and_say_how_to_install_when_absent():
    paths = resolve("deepspeed")
    assert [p.name for p in paths] == ([f"deepspeed.zero{s}.stock" for s in range(4)]
                                       + [f"deepspeed.zero{s}.manual" for s in range(4)]
                                       + ["deepspeed.zero0.nosync", "deepspeed.zero1.nosync"]
                                       + [f"deepspeed.zero{s}.torch" for s in (1, 2, 3)]
                                       + [f"deepspeed.zero{s}.misuse" for s in range(4)]
                                       + [f"deepspeed.zero{s}.fp16" for s in (0, 1, 2)]
                                       + ["deepspeed.pipe.stock", "deepspeed.pipe.zero1"])
    for p in paths:
        a = p.availability()
        if INSTALLED and p.name.endswith(".fp16"):  # gloo here: DeepSpeed's CPU accelerator has no fp16
            assert not a.ok and "CUDA accelerator" in a.reason and "--backend nccl" in a.reason, a.reason
            continue
        assert a.ok == INSTALLED and (INSTALLED or "pip install 'gradfuzz[deepspeed]'" in a.reason)


def test_fp16_knobs_reach_the_config_and_round_trip():
    """fp16 is drawn for the fp16 paths only, on integer-valued cases,
    with its loss scaling; clipping is off so the step applies the grad."""
    from tests.helpers import nested

    k = Knobs(fp16=True, loss_scale=0, scale_power=5, scale_window=2, hysteresis=1)
    case = nested(microbatches=2).with_data("deepspeed", k)
    assert Case.loads(case.dumps()) == case
    cfg = config(case, 1, 1)
    assert cfg["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 5, "loss_scale_window": 2,
                           "hysteresis": 1, "min_loss_scale": 1} and cfg["gradient_clipping"] == 0.0
    assert "fp16" not in config(nested(microbatches=2), 1, 1)


def test_the_knobs_are_case_data_that_reach_the_config():
    from tests.helpers import nested

    case = nested(microbatches=4).with_data("deepspeed", Knobs(bucket=8, contiguous=False, overlap=True))
    assert Case.loads(case.dumps()) == case
    cfg = config(case, 2, 1)
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["zero_optimization"]["stage"] == 2
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 8 and cfg["zero_optimization"]["overlap_comm"] is True
    assert cfg["zero_optimization"]["contiguous_gradients"] is False
    json.dumps(cfg)  # DeepSpeed takes it as a config dict


def test_contract_refuses_what_the_engine_owns():
    from dataclasses import replace

    from tests.helpers import nested

    (zero0,) = resolve("deepspeed.zero0.stock")
    case = nested(microbatches=2)
    assert zero0.supports(replace(case, schedule=replace(case.schedule, zero_grad="keep")))
    assert zero0.supports(replace(case, dtype="float64"))
    assert "powers of two" in zero0.supports(replace(case, schedule=replace(case.schedule, microbatches=3)))


def _two_stages(case, at=1):
    from harness import registry

    return case.with_data("pipeline", registry.namespace("pipeline").cls((at,)))


def test_pipe_ties_what_both_stages_use_and_turns_clipping_off():
    from harness.paths.deepspeed.pipe.stages import cut_of, tied_params
    from tests.helpers import nested

    case = _two_stages(nested(microbatches=2))
    assert [s.params for s in cut_of(case)] == [("w0",), ("w0",)] and tied_params(case) == {"w0"}
    cfg = pipe_config(case, 1)
    assert cfg["gradient_clipping"] == 0.0 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["zero_optimization"]["stage"] == 1


def test_pipe_refuses_only_what_the_engine_cannot_express():
    from dataclasses import replace

    from harness.case.spec import Case, Input, Node, Param, Use
    from harness.paths.deepspeed.pipe.paths import refusal
    from tests.helpers import nested

    (pipe,) = resolve("deepspeed.pipe.stock")
    assert "one stage cut" in refusal(nested())
    assert refusal(_two_stages(nested())) is None
    frozen = nested()
    assert "trainable" in refusal(_two_stages(replace(frozen, params=(replace(frozen.params[0], requires_grad=False),
                                                                    Param("w1", (3, 3))),
                                                      nodes=frozen.nodes[:1] + (Node("n1", "matmul", (
                                                          Use("n0"), Use("w1"))),))))
    # x0 reaches the second stage untouched: the engine backpropagates every floating activation.
    skip = Case(params=(Param("w0", (3, 3)),), inputs=(Input("x0", (2, 3)),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("n1", "add", (Use("n0"), Use("x0"))),
                       Node("n2", "matmul", (Use("n1"), Use("w0")))),
                outputs=(Use("n2"),))
    assert "without requiring grad" in refusal(_two_stages(skip))
    assert "power of two" in pipe.supports(_two_stages(nested(microbatches=3)))


@needs_deepspeed
def test_pipe_agrees_with_the_oracle_on_a_tied_case():
    from harness.engine.check import check
    from tests.helpers import nested

    case = _two_stages(nested(microbatches=2))
    for p in resolve("deepspeed.pipe"):
        assert p.supports(case) is None and check(case, p) == [], p.name


@needs_deepspeed
def test_stages_0_and_1_are_compared_inside_the_window_and_manual_accumulation_agrees():
    from dataclasses import replace

    from harness.engine.check import check
    from tests.helpers import nested

    case = nested(microbatches=2)
    case = replace(case, schedule=replace(case.schedule, steps=2))
    for p in resolve("deepspeed"):
        if p.name.endswith(("manual", "nosync")) or p.name == "deepspeed.zero1.stock":
            obs = p.run(case)
            mid = [s.grads is not None for s in obs.steps]
            assert mid == [p.stage in (0, 1), True] * 2, (p.name, mid)
            assert check(case, p) == [], p.name


@needs_deepspeed
def test_every_stage_agrees_with_the_oracle_on_a_tied_case_and_the_canary_is_caught():
    from harness.canaries import all_canaries
    from harness.engine.check import check
    from harness.gate.selfcheck import run_canary
    from tests.helpers import nested

    case = nested(microbatches=2)
    for p in resolve("deepspeed"):
        if not p.availability().ok:  # the fp16 paths: GPUs only (tests/cover/test_probes.py, -m gpu)
            continue
        if not p.name.startswith("deepspeed.pipe.") and not p.name.endswith(".misuse"):  # test_pipe_agrees, test_misuse...
            assert p.supports(case) is None and check(case, p) == [], p.name
    (canary,) = [c for c in all_canaries() if c.name == "deepspeed_keeps_last_micro_step"]
    result = run_canary(canary, seed=0)
    assert result.caught and "expected g1 + g2" in result.detail, result.detail


def test_a_zero_finding_gets_a_torchrun_script_whose_config_is_data():
    """Written without DeepSpeed: the script is text; the engine is its reader's."""
    from harness.artifacts.repro import script
    from tests.helpers import nested

    case = nested(microbatches=2).with_data("deepspeed", Knobs(bucket=8))
    for p in resolve("deepspeed.zero2.stock,deepspeed.zero1.nosync"):
        text = script(case, p.name, p.repro(case))
        compile(text, "repro.py", "exec")
        assert "deepspeed.initialize(model=module, optimizer=opt, config=CONFIG)" in text
        assert f"DRIVE = {p.drive!r}" in text and '"reduce_bucket_size": 8' in text


# The tied all-reduce writes into w1's grad, a view of the same buffer (deepspeed.pipe.*, 0.19.8).
TIED_ALIAS = Path(__file__).parents[2] / "cases" / "deepspeed" / "pipe_tied_allreduce_writes_sibling_grad.json"


def test_a_pipe_finding_gets_a_torchrun_script_with_its_stages_and_tied_layers():
    """Written without DeepSpeed: the stages are plain classes, the tied weights TiedLayerSpecs, the config data."""
    from harness.artifacts.repro import script
    from tests.helpers import nested

    case = _two_stages(nested(microbatches=2))
    for p in resolve("deepspeed.pipe"):
        text = script(case, p.name, p.repro(case))
        compile(text, "repro.py", "exec")
        assert "import harness" not in text and "from harness" not in text
        assert f'"zero_optimization": {{"stage": {p.stage}}}' in text and '"gradient_accumulation_steps": 2' in text
        assert "STAGE_TIED = [['w0'], ['w0']]" in text and "class Stage1(torch.nn.Module):" in text
        assert "TiedLayerSpec(n, Holder, n, forward_fn=append_weight)" in text and "engine.train_batch(" in text


@needs_deepspeed
def test_the_zero_script_runs_alone_agrees_and_fails_when_the_grads_are_doubled(tmp_path):
    """The script's own check can fail: the same script with the loss doubled
    (a grad counted twice, as an accumulation bug would) must say DIVERGES."""
    from harness.artifacts.repro import script
    from tests.helpers import nested

    case = nested(microbatches=2)
    (p,) = resolve("deepspeed.zero2.stock")
    text = script(case, p.name, p.repro(case))
    line, rc = torchrun_verdict(text, tmp_path)
    assert "agrees (0 differences)" in line and rc == 0, line
    doubled = text.replace("loss = sum((o * c).sum() for o, c in live) * gas ",
                           "loss = sum((o * c).sum() for o, c in live) * gas * 2 ")
    assert doubled != text
    line, rc = torchrun_verdict(doubled, tmp_path)
    assert "DIVERGES" in line and rc == 1, line


@needs_deepspeed
def test_bf16_runs_in_bfloat16_is_compared_at_bf16_and_a_lost_micro_step_is_still_found():
    """bf16.enabled (a knob): the engine's grads carry bfloat16 rounding (not
    float32's), agree within bf16's tolerance, and the last micro-step alone
    (what the canary keeps) is still a finding."""
    from dataclasses import replace

    from harness.compare.values import compare
    from harness.engine.check import CaseCheck
    from tests.helpers import nested

    case = replace(nested(microbatches=2), exact=False).with_data("deepspeed", Knobs(bf16=True))
    assert config(case, 2, 1)["bf16"] == {"enabled": True}
    cc = CaseCheck(case)
    for p in resolve(["deepspeed.zero0.stock", "deepspeed.zero2.stock"]):
        obs = cc.observe(p)
        assert obs.precision == "bfloat16" and compare(case, cc.oracle, obs, tol=cc.tol) == [], p.name
        last, want = obs.steps[-1], cc.oracle.steps[-1]
        rel = max(float(((last.grads[n] - e).abs() / e.abs().clamp_min(1e-6)).max())
                  for n, e in want.grads.items() if e is not None)
        assert rel > 1e-5, f"{p.name}: no bfloat16 rounding seen"
        lone = {n: g - cc.oracle.steps[-2].grads[n] if g is not None else g for n, g in last.grads.items()}
        wrong = replace(obs, steps=[*obs.steps[:-1], replace(last, grads=lone)])
        assert compare(case, cc.oracle, wrong, tol=cc.tol), p.name


def _misuse(misuse: str, microbatches: int = 2):
    return nested_case(microbatches).with_data("deepspeed", Knobs(misuse=misuse))


def nested_case(microbatches: int):
    from tests.helpers import nested

    return nested(microbatches=microbatches)


def test_misuse_is_a_knob_the_misuse_paths_take_and_the_documented_paths_refuse():
    """Drawn for ``deepspeed.zero<N>.misuse`` only, as case data that round-trips
    and is refused, naming the field, when it is not one of the misuses."""
    from harness.case.spec import SpecError
    from harness.paths.deepspeed.data import MISUSES

    case = _misuse("zero_grad")
    assert Case.loads(case.dumps()) == case
    (stock,) = resolve("deepspeed.zero0.stock")
    (misuse,) = resolve("deepspeed.zero0.misuse")
    assert "deepspeed.zero0.misuse runs it" in stock.supports(case) and misuse.supports(case) is None
    assert "no misuse drawn" in misuse.supports(nested_case(2))
    assert misuse.finding_class == "misuse" and stock.contract != misuse.contract  # a case stream of their own
    assert set(MISUSES) >= {"zero_grad", "backward_twice", "step_at_boundary"}
    assert "loss_backward" not in MISUSES  # documented since 0.18: the deepspeed.zero{1,2,3}.torch paths
    bad = json.loads(case.dumps())
    bad["family"]["deepspeed"]["misuse"] = "rm -rf /"
    with pytest.raises(SpecError, match="family.deepspeed.misuse"):
        Case.from_json(bad)


def test_a_hostile_misuse_in_a_corpus_file_is_refused_with_exit_2_naming_file_and_field(tmp_path, capsys):
    from harness.cli import main as cli

    data = {"gradfuzz_corpus": 1, "case": json.loads(_misuse("zero_grad").dumps()), "meta": {}}
    data["case"]["family"]["deepspeed"]["misuse"] = ["zero_grad"]
    f = tmp_path / "misuse.json"
    f.write_text(json.dumps(data))
    assert cli.main(["replay", str(f)]) == 2
    err = capsys.readouterr().err
    assert "misuse.json" in err and "family.deepspeed.misuse" in err, err


@needs_deepspeed
def test_a_misuse_deepspeed_silently_gets_wrong_is_a_misuse_finding_and_a_refused_one_is_none():
    """Measured on DeepSpeed 0.19.8 (README "Misuse"): ``engine.zero_grad()``
    inside the window keeps the last micro-step only at ZeRO 0 (``1*g2``);
    two ``engine.backward`` calls a micro-step keep half the last at ZeRO 2
    (``0.5*g2``); each is signed by its use. ``engine.zero_grad()`` at ZeRO 2
    is right (the grads live in ZeRO's partitions): no finding. Two backward
    calls at ZeRO 3 raise (``mat2 must be a matrix``): refused, no finding.
    ``engine.step()`` once a window skips the optimizer's step: a ``step``
    finding. The documented drive removes each (the ``documented-drive``
    workaround the gate runs to call a ledger misuse known)."""
    from harness.engine.check import CaseCheck
    from harness.observation import signature
    from harness.paths.workarounds import apply

    for misuse, stage, shape in (("zero_grad", 0, "actual = 1*g2, expected g1 + g2"),
                                 ("backward_twice", 2, "actual = 0.5*g2, expected g1 + g2"),
                                 ("step_at_boundary", 3, "the optimizer has stepped 0 time(s), not 1")):
        case = _misuse(misuse)
        (p,) = resolve(f"deepspeed.zero{stage}.misuse")
        divs = CaseCheck(case).run(p)
        assert divs and all(d.finding_class == "misuse" for d in divs), (misuse, divs)
        assert any(shape in d.detail for d in divs), [d.detail for d in divs]
        assert all(d.signature == signature(p.name, d.kind, f"misuse {misuse}") for d in divs)
        assert CaseCheck(case).run(apply(p, "documented-drive")) == [], misuse
    (zero2,) = resolve("deepspeed.zero2.misuse")
    assert CaseCheck(_misuse("zero_grad")).run(zero2) == []  # accepted, and right: no finding
    (zero3,) = resolve("deepspeed.zero3.misuse")
    obs = zero3.run(_misuse("backward_twice"))
    assert "mat2 must be a matrix" in obs.refused and not obs.steps
    assert CaseCheck(_misuse("backward_twice")).run(zero3) == []


@needs_deepspeed
def test_loss_backward_is_a_documented_drive_and_double_divides_a_chained_output_at_zero_1_and_2():
    """``loss.backward()`` (deepspeed.zero{1,2,3}.torch) agrees on the plain
    case; when an output is computed from another output, ZeRO 1 and 2 divide
    the grad through both by the accumulation steps (a bug, not a misuse:
    benchmarks/deepspeed_torch_backward_chained_outputs.py); engine.backward is right."""
    from dataclasses import replace

    from harness.case.spec import Use
    from harness.engine.check import CaseCheck

    plain = nested_case(2)
    chained = replace(plain, outputs=(Use("n1"), Use("n0")))
    (torch1,) = resolve("deepspeed.zero1.torch")
    (stock1,) = resolve("deepspeed.zero1.stock")
    assert CaseCheck(plain).run(torch1) == []
    divs = CaseCheck(chained).run(torch1)
    assert divs and all(d.finding_class == "bug" and d.signature.startswith("deepspeed.torch-") for d in divs)
    assert CaseCheck(chained).run(stock1) == []


@needs_deepspeed
def test_fuzzing_the_misuse_paths_saves_misuse_findings_listed_apart(tmp_path, capsys):
    """End to end: ``gradfuzz fuzz`` on a misuse path saves a finding whose
    file says ``finding_class: misuse``, and the summary lists it under the
    misuse head, not among the divergences."""
    from harness.artifacts import corpus
    from harness.cli import main as cli
    from harness.cli.report import MISUSE_HEAD

    save = tmp_path / "found"
    rc = cli.main(["fuzz", "--paths", "deepspeed.zero0.misuse", "--examples", "12", "--seed", "0",
                   "--save", str(save), "--db", "none"])
    out = capsys.readouterr().out
    assert rc == 1 and MISUSE_HEAD in out and "\ndivergences (" not in out, out[-3000:]
    files = sorted(save.glob("*.json"))
    assert files and all(corpus.load(f).meta["finding_class"] == "misuse" for f in files)


@needs_deepspeed
def test_a_misuse_finding_gets_a_standalone_script_that_shows_it(tmp_path):
    """The script drives the engine as the misuse does and compares with what
    the user meant: DIVERGES for engine.zero_grad() inside the window at ZeRO 0."""
    from harness.artifacts.repro import script

    case = _misuse("zero_grad")
    (p,) = resolve("deepspeed.zero0.misuse")
    text = script(case, p.name, p.repro(case))
    assert "MISUSE = 'zero_grad'" in text and "The loop MISUSES the engine (zero_grad)" in text
    line, rc = torchrun_verdict(text, tmp_path)
    assert "DIVERGES" in line and rc == 1, line


@needs_deepspeed
def test_the_pipe_script_runs_alone_shows_the_corpus_finding_agrees_on_a_clean_case_and_sees_a_doubled_grad(tmp_path):
    """The tied-alias finding's script diverges as the path does (w1's grad);
    a tied case without the alias agrees over two microbatches; the same
    script with the loss doubled must say DIVERGES."""
    from harness.artifacts.corpus import load
    from harness.artifacts.repro import script
    from tests.helpers import nested

    stock, zero1 = resolve("deepspeed.pipe")
    case = load(str(TIED_ALIAS)).case
    line, rc = torchrun_verdict(script(case, stock.name, stock.repro(case)), tmp_path)
    assert "DIVERGES (1 differences)" in line and rc == 1, line
    clean = _two_stages(nested(microbatches=2))
    text = script(clean, zero1.name, zero1.repro(clean))
    line, rc = torchrun_verdict(text, tmp_path)
    assert "agrees (0 differences)" in line and rc == 0, line
    doubled = text.replace("return MICROBATCHES * sum(", "return 2 * MICROBATCHES * sum(")
    assert doubled != text
    line, rc = torchrun_verdict(doubled, tmp_path)
    assert "DIVERGES" in line and rc == 1, line


def test_what_fp16_overflowed_is_judged_on_nothing():
    """An input grad the loss scale pushed past fp16's range (DeepSpeed checks
    only the parameters' grads) and a window whose step DeepSpeed skipped
    for overflow are left unjudged, never read as wrong grads; a case all
    of whose windows were skipped counts as unjudged."""
    from harness.compare.values import compare
    from harness.paths.deepspeed.paths import judged_at_fp16
    from oracles.eager import observe

    case = corpus.load(os.path.join(ROOT, "tests", "data", "deepspeed_fp16_input_grad_overflow.json")).case
    oracle = observe(case)

    def seen(input_inf: bool = False, zeroed: bool = False, **extra):
        obs = observe(case)
        obs.path, obs.precision = "deepspeed.zero2.fp16", "float16"
        if input_inf:
            obs.steps[0].input_grads["x0"] = torch.full_like(obs.steps[0].input_grads["x0"], float("inf"))
        if zeroed:
            obs.steps[0].grads = {n: torch.zeros_like(g) for n, g in obs.steps[0].grads.items()}
        obs.extra.update(extra)
        obs = judged_at_fp16(case, obs)
        return compare(case, oracle, obs), obs.extra.get("unjudged")

    assert seen() == ([], None)
    assert seen(input_inf=True)[0] and seen(zeroed=True)[0]  # unmarked: a finding
    assert seen(input_inf=True, input_overflow=[0]) == ([], None)
    assert seen(zeroed=True, overflow=[0]) == ([], None)  # one of two windows skipped: the other judged
    assert seen(zeroed=True, overflow=[0, 1])[1]  # every window skipped: unjudged
