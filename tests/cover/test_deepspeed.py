"""The DeepSpeed family: optional, honest when absent, and, where DeepSpeed
is installed (``pip install 'gradfuzz[deepspeed]'``), held to the oracle on
every ZeRO stage with its canary caught."""

import importlib.util
import json

import pytest

from harness.case.spec import Case
from harness.paths import resolve
from harness.paths.deepspeed.data import Knobs, config

INSTALLED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not INSTALLED, reason="deepspeed is not installed: pip install 'gradfuzz[deepspeed]'")


def test_the_four_stages_are_listed_and_say_how_to_install_when_absent():
    paths = resolve("deepspeed")
    assert [p.name for p in paths] == [f"deepspeed.zero{s}.stock" for s in range(4)]
    for p in paths:
        a = p.availability()
        assert a.ok == INSTALLED and (INSTALLED or "pip install 'gradfuzz[deepspeed]'" in a.reason)


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

    (zero0,) = resolve("deepspeed.zero0")
    case = nested(microbatches=2)
    assert zero0.supports(replace(case, schedule=replace(case.schedule, zero_grad="keep")))
    assert zero0.supports(replace(case, dtype="float64"))
    assert "powers of two" in zero0.supports(replace(case, schedule=replace(case.schedule, microbatches=3)))


@needs_deepspeed
def test_every_stage_agrees_with_the_oracle_on_a_tied_case_and_the_canary_is_caught():
    from harness.canaries import all_canaries
    from harness.engine.check import check
    from harness.gate.selfcheck import run_canary
    from tests.helpers import nested

    case = nested(microbatches=2)
    for p in resolve("deepspeed"):
        assert p.supports(case) is None and check(case, p) == [], p.name
    (canary,) = [c for c in all_canaries() if c.name == "deepspeed_keeps_last_micro_step"]
    result = run_canary(canary, seed=0)
    assert result.caught and "expected g1 + g2" in result.detail, result.detail
