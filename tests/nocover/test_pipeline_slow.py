"""The pipeline paths at length: fixed clean on every schedule and layout,
canary stages caught from a cold start (with statistics), stock's own
zero-bubble bug found cold. Run with ``pytest -m slow``.

GRADFUZZ_PIPELINE_EXAMPLES raises the per-path budget of the clean runs
(the issue's bar is 1000; the default keeps the suite to a few minutes).
"""

from __future__ import annotations

import os
import statistics
import time

import pytest

from harness.paths.pipeline.paths import FIXED, PipelinePath, probe
from harness.paths.pipeline.canaries import CANARIES
from harness.engine.runner import Result, fuzz_path

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("GRADFUZZ_PIPELINE_EXAMPLES", "300"))
SCHEDULES = sorted(probe(1)["layouts"])


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fixed_is_clean_on_every_schedule(schedule, world_size):
    path = PipelinePath(schedule, FIXED, world_size)
    result = Result()
    start = time.monotonic()
    fuzz_path(path, examples=EXAMPLES, deadline=None, seed=11, result=result, save_dir=None)
    tally = result.paths[path.name]
    print(f"{path.name}: {tally.examples} examples ({tally.run} run) in {time.monotonic() - start:.1f}s, "
          f"{tally.run / max(time.monotonic() - start, 1e-9):.1f} run/s")
    assert result.divergences == [], [d.detail for d in result.divergences]
    # Four-stage layouts (two ranks, ZBV/DualPipeV) skip cases with fewer than four nodes.
    assert tally.run >= EXAMPLES // 3


@pytest.mark.parametrize("name, schedule", [("pre_clamp", "ZBVZeroBubble"), ("double_weight", "ZBVZeroBubble"),
                                            ("overwrite", "InterleavedZeroBubble"), ("no_input_grad", "Interleaved1F1B")])
def test_canary_stages_are_caught_from_a_cold_start(name, schedule):
    hits, secs = [], []
    base = PipelinePath(schedule, "stock") if name == "pre_clamp" else PipelinePath(schedule, FIXED)
    for seed in range(5):
        path = PipelinePath(schedule, CANARIES[name], name=f"canary.pipeline_{name}")
        result = Result()
        fuzz_path(path, examples=300, deadline=None, seed=seed, result=result, save_dir=None, relative_to=base)
        tally = result.paths[path.name]
        assert result.divergences, f"{name}: not caught in 300 examples (seed {seed})"
        hits.append(tally.first_hit_examples)
        secs.append(tally.first_hit_seconds)
        if seed == 0:
            print(f"{name}: shrunk: {result.divergences[0].detail}")
    print(f"{name} on {schedule}: median {statistics.median(hits)} examples, {statistics.median(secs):.2f}s to detection")


def test_stock_zero_bubble_drops_weights_of_a_stage_without_input_grads_cold():
    path = PipelinePath("ZBVZeroBubble", "stock")
    result = Result()
    fuzz_path(path, examples=600, deadline=None, seed=1, result=result, save_dir=None)
    details = [d.detail for d in result.divergences]
    assert any("no grad" in d or "got 0" in d for d in details), details
