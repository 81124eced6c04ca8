"""The pipeline paths: stage cutting, the schedules torch offers, stock and fixed.

Fast checks on CPU: cutting a case into stages is plain data and the stages
compose to the whole module; every installed schedule is discovered and
probed; the fixed stage agrees with the oracle where stock does not (the
founding patterns and the findings of this path), on one process and on
two ranks; a raising rank is reported as its error, not as a hang; the
repro script runs with plain python; a canary stage is caught cold.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from harness.artifacts import corpus
from harness.paths.pipeline import script as pipeline_repro
from harness.paths.pipeline.data import Stages, stage_cuts
from harness.paths.pipeline.data import layout_draw
from harness.materialize.tensors import Built
from harness.paths import resolve
from harness.paths.pipeline.paths import FIXED, PipelinePath, observation, probe
from harness.paths.pipeline.rank import discover
from harness.workers.pool import Outcome
from harness.engine.runner import Result, check, fuzz_path
from harness.case.spec import Case, Input, Node, Param, Schedule, SpecError, Use
from harness.materialize.stages import StageModule, Value, cut
from harness.generate import cases
from harness.paths.pipeline.canaries import CANARIES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIPELINE_CASES = os.path.join(ROOT, "cases", "pipeline")


def chain(stages: tuple[int, ...] = (1,), frozen: tuple[str, ...] = (), x_grad: bool = True,
          microbatches: int = 2, steps: int = 1, zero_grad: str = "set_to_none") -> Case:
    """x0 -> @w0 -> @w1 -> @w0 (+ an input without grad), cut as asked."""
    return Case(
        params=(Param("w0", (3, 3), requires_grad="w0" not in frozen), Param("w1", (3, 3), requires_grad="w1" not in frozen)),
        inputs=(Input("x0", (2, 3), requires_grad=x_grad), Input("x1", (2, 3), requires_grad=False)),
        nodes=(
            Node("n0", "matmul", (Use("x0"), Use("w0"))),
            Node("n1", "matmul", (Use("n0"), Use("w1"))),
            Node("n2", "add", (Use("n1"), Use("x1"))),
            Node("n3", "matmul", (Use("n2"), Use("w0"))),
        ),
        outputs=(Use("n3"),),
        schedule=Schedule(microbatches=microbatches, steps=steps, zero_grad=zero_grad),
    ).with_data("pipeline", Stages(stages) if stages else None)


# --- cutting ------------------------------------------------------------------


def test_cuts_round_trip_and_are_omitted_when_empty():
    c = chain((1, 3))
    assert Case.loads(c.dumps()) == c
    assert "family" not in chain(()).to_json()  # a case without cuts has no pipeline part
    assert Case.from_json(chain(()).to_json()).data("pipeline") is None
    assert c.to_json()["family"] == {"pipeline": {"version": 1, "cuts": [1, 3]}}


def test_a_schema_1_case_keeps_its_cuts_for_every_family_that_read_them():
    """Schema 1 had ``stages`` at the top, read by pipeline stages, checkpoint
    regions and (with ``units``) FSDP2 units: each family takes its part."""
    old = {k: v for k, v in chain(()).to_json().items() if k != "family"}
    old.update(version=1, stages=[1, 3], parallel=["units", "no_sync"])
    case = Case.from_json(old)
    assert case.version == 2 and stage_cuts(case) == (1, 3)
    assert case.data("checkpoint").cuts == (1, 3)
    assert case.data("parallel").options == ("units", "no_sync") and case.data("parallel").units == (1, 3)
    assert Case.loads(case.dumps()) == case
    old["parallel"] = ["no_such_switch"]
    with pytest.raises(SpecError) as info:
        Case.from_json(old)
    assert info.value.where == "parallel[0]"


@pytest.mark.parametrize("stages, where", [((0,), "cuts[0]"), ((4,), "cuts[0]"), ((2, 2), "cuts[1]"),
                                           ((3, 1), "cuts[1]"), ((1, 2, 3, 3), "cuts")])
def test_bad_cuts_name_the_field(stages, where):
    data = chain(()).to_json()
    data["family"] = {"pipeline": {"version": 1, "cuts": list(stages)}}
    with pytest.raises(SpecError) as info:
        Case.from_json(data)
    assert info.value.where.removeprefix("case.") == f"family.pipeline.{where}"


def test_boundaries_carry_what_later_stages_use():
    specs = cut(chain((1, 3)), (1, 3))
    assert [len(s.nodes) for s in specs] == [1, 2, 1]
    assert specs[0].inputs == (Value("x0"), Value("x1"))
    # x1 is used in stage 1: it passes through stage 0 as an output that is its input.
    assert specs[1].inputs == (Value("x1"), Value("n0"))
    assert specs[2].inputs == (Value("n2"),)
    # w0 is used by stages 0 and 2: each owns a copy (a weight tied across the pipeline).
    assert [s.params for s in specs] == [("w0",), ("w1",), ("w0",)]


def test_multi_output_values_cross_one_result_at_a_time():
    c = Case(params=(Param("w0", (2, 2)),), inputs=(Input("x0", (2, 2), True),),
             nodes=(Node("n0", "chunk", (Use("x0"),), (("chunks", 2), ("dim", 1))),
                    Node("n1", "cat", (Use("n0", index=1), Use("n0", index=0)), (("dim", 1),)),
                    Node("n2", "matmul", (Use("n1"), Use("w0")))),
             outputs=(Use("n2", transpose=True),)).with_data("pipeline", Stages((1,)))
    specs = cut(Case.loads(c.dumps()), (1,))
    assert specs[1].inputs == (Value("n0", 0), Value("n0", 1))
    assert specs[1].outputs == (Use("n2", transpose=True),)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases(draws=(layout_draw(((1, 2), (2, 2), (3, 3), (4, 1))),)))
def test_stages_compose_to_the_whole_module(case):
    """Running the stage modules one after another is the case's forward."""
    built = Built(case)
    values = built.params()
    assert (len(stage_cuts(case)) + 1, case.schedule.microbatches) in {(1, 2), (2, 2), (3, 3), (4, 1)} or \
        len(stage_cuts(case)) + 1 < 4  # too few nodes for the cuts: fewer stages, skipped by the paths
    inputs = built.inputs(0)
    want = built.forward({**{n: t.to(built.dtype).requires_grad_(p.requires_grad) for (n, t), p in
                             zip(values.items(), case.params)},
                          **{n: t.to(built.dtype) for n, t in inputs.items()}})
    h: tuple = tuple(inputs[x.name].to(built.dtype) for x in case.inputs)
    for spec in cut(case, stage_cuts(case)):
        out = StageModule(case, spec, values)(*h)
        h = out if isinstance(out, tuple) else (out,)
    assert len(h) == len(want)
    for a, e in zip(h, want):
        assert torch.equal(a.detach(), e.detach())


# --- discovery and layouts ---------------------------------------------------------


def test_every_installed_schedule_is_discovered_and_probed():
    found = discover()
    import torch.distributed.pipelining as pp

    exported = {n[len("Schedule"):] for n in pp.__all__ if n.startswith("Schedule")}
    assert set(found) == exported  # from torch, not from a list here
    info = probe(1)
    for name in found:
        assert info["layouts"][name], name
    names = [p.name for p in resolve("pipeline")]
    assert "pipeline.ZBVZeroBubble.stock" in names and "pipeline.ZBVZeroBubble.ranks2.fixed" in names


def test_the_schedule_names_are_parsed_once_however_many_threads_ask(monkeypatch):
    """A rank's case threads overlap; two ``ast.parse`` at once break on CPython 3.11."""
    import ast
    import threading
    import time

    from harness.paths.pipeline import rank

    parses = []
    parse = ast.parse

    def slow_parse(*args, **kwargs):
        parses.append(threading.get_ident())
        time.sleep(0.05)  # wide enough that unserialized threads would overlap here
        return parse(*args, **kwargs)

    rank._read_schedule_names.cache_clear()
    monkeypatch.setattr(rank.ast, "parse", slow_parse)
    seen: list[list[str]] = []
    threads = [threading.Thread(target=lambda: seen.append(rank.schedule_names())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rank._read_schedule_names.cache_clear()
    assert len(parses) == 1 and len(seen) == 4 and all(s == seen[0] and s for s in seen)


def test_a_case_outside_the_schedules_layouts_is_skipped_with_the_reason():
    p = PipelinePath("ZBVZeroBubble", FIXED)
    reason = p.supports(chain((1, 3)))  # three stages: ZBV takes two per rank
    assert reason is not None and "(3, 2)" in reason
    assert p.supports(chain((2,), frozen=("w0", "w1"), x_grad=False)) is not None  # nothing to train
    assert p.supports(chain((2,))) is None


def test_two_stages_on_one_rank_run_on_this_torch():
    """The probe ran one step of two stages on one rank for every
    multi-stage schedule, with either stage class, on the one-rank pool and
    on a group of one rank of the two-rank pool, and each worked (2.13
    passes them directly)."""
    import harness.paths.pipeline.paths as pipeline

    multi = {name for name, layouts in probe(1)["layouts"].items() if any(n == 2 for n, _ in layouts)}
    assert {"ZBVZeroBubble", "InterleavedZeroBubble"} <= multi
    for ws in (1, 2):
        for impl in ("stock", FIXED):
            for name in multi:
                assert pipeline.same_rank_self_send(name, impl, ws) is None, (ws, impl, name)
            assert pipeline._same_rank[(ws, impl)] == {"works": sorted(multi, key=list(discover()).index),
                                                       "self_send": {}}, (ws, impl)


# What torch 2.11's PipelineScheduleMulti._initialize_stages does before any
# forward: every local stage's neighbour warm-up ops in one batch, whatever
# rank the neighbour is on (torch/distributed/pipelining/schedules.py as of
# pytorch commit 00722e648b7; PR #160210). Put back into this torch's warm-up.
EMULATE_211 = r"""
import json, sys
import torch.distributed as dist
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining._utils import InferenceMode
from harness.paths.pipeline import rank as pipeline_rank

def warmup_211(self, stages, has_backward, p2p_done):
    if not p2p_done:
        ops = [op for stage in stages for op in stage._get_init_p2p_neighbors_ops()]
        S._wait_batch_p2p(S._batch_p2p(ops))
    for stage in stages:
        stage._inference_mode = InferenceMode.DYNAMIC

S._PipelineSchedule._warmup_p2p = warmup_211
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
print(json.dumps({impl: pipeline_rank.same_rank_p2p(impl=impl)
                  for impl in ("stock", "oracles.pipeline_fixed:FixedPipelineStage")}))
"""


def test_the_probe_finds_a_runtime_that_sends_between_stages_on_one_rank(tmp_path):
    from torch.distributed.pipelining import schedules

    if not hasattr(schedules._PipelineSchedule, "_warmup_p2p"):
        pytest.skip("this torch has no separate p2p warm-up to put 2.11's back into")
    import json

    run = subprocess.run([sys.executable, "-c", EMULATE_211, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    stock, fixed = found["stock"], found[FIXED]
    multi = {name for name, layouts in probe(1)["layouts"].items() if any(n == 2 for n, _ in layouts)}
    assert stock["works"] == [] and set(stock["self_send"]) == multi
    assert all("RuntimeError" in e for e in stock["self_send"].values()), found  # gloo: "Pair is not connected"
    # The fixed stage leaves its own rank out of 2.11's warm-up: it runs them all.
    assert set(fixed["works"]) == multi and fixed["self_send"] == {}, found


# The schedule's metadata inference runs a later stage's forward on memory
# torch.empty_strided did not fill: poisoned with NaN here, so what it holds
# is known. Each run: the failure's message, and the steps it recorded.
POISONED_INFERENCE = r"""
import json, sys, torch
import torch.distributed as dist
from torch.distributed.pipelining import _utils
from harness.artifacts import corpus
from harness.materialize.workarounds import in_force
from harness.paths.pipeline import rank as R

made_up = _utils._make_tensor_from_meta
def poisoned(meta, device):
    return made_up(meta, device).fill_(float("nan"))

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
case = corpus.load(sys.argv[2]).case
def run(impl, *effects):
    with in_force(*effects):
        r = R.run_case(0, 1, case, "Interleaved1F1B", impl, [0, 0])
    return [r["failure"] and r["failure"]["message"], repr(r["steps"])]
out = {"unpoisoned": run("stock", "stage-example-args")}
_utils._make_tensor_from_meta = poisoned
out.update(stock=run("stock"), worked_around=run("stock", "stage-example-args"), fixed=run(sys.argv[3]))
print(json.dumps(out))
"""


def test_stages_built_with_example_activations_never_meet_the_made_up_inference_inputs(tmp_path):
    from torch.distributed.pipelining import _utils

    if not hasattr(_utils, "_make_tensor_from_meta"):
        pytest.skip("this torch infers metadata on zeros_like inputs, not on memory it leaves unfilled")
    import json

    case = os.path.join(ROOT, "benchmarks", "triage", "pipeline_metadata_inference_bce.json")
    run = subprocess.run([sys.executable, "-c", POISONED_INFERENCE, str(tmp_path / "store"), case, FIXED],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert "between 0 and 1" in found["stock"][0]  # binary cross entropy met the NaN the inference made up
    # With examples the inference never runs: the step is the same, grad for grad, whatever memory holds.
    assert found["unpoisoned"][0] is None and found["worked_around"] == found["unpoisoned"], found
    assert found["fixed"][0] is None, found["fixed"]


def test_where_stages_on_one_rank_cannot_talk_such_layouts_are_outside_the_contract(monkeypatch):
    import harness.paths.pipeline.paths as pipeline

    error = "RuntimeError: [enforce fail at pair.cc:789] state_ >= CONNECTED. 1 vs 4. Pair is not connected"
    monkeypatch.setattr(pipeline, "same_rank_self_send", lambda schedule, *rest: error)
    # One process: every multi-stage layout has stages 0 and 1 on rank 0.
    looped = PipelinePath("InterleavedZeroBubble", FIXED)
    reason = looped.supports(chain((2,)))
    assert reason is not None and "stages 0 and 1 on rank 0" in reason and "no pair to itself" in reason
    assert "pipeline.InterleavedZeroBubble.ranks2.*" in reason and error in reason
    assert {n for n, _ in looped.layouts} == {1}  # fuzzing draws one stage only
    assert looped.availability().ok
    one = chain(())
    assert looped.supports(one) is None
    obs = looped.run(one)  # a one-stage case still runs
    assert obs.failure is None and len(obs.steps) == one.schedule.microbatches
    # ZBV takes only two stages on one rank: nothing left, the path says why.
    zbv = PipelinePath("ZBVZeroBubble", FIXED)
    assert not zbv.availability().ok and "no pair to itself" in zbv.availability().reason
    assert zbv.layouts == () and "stages 0 and 1 on rank 0" in zbv.supports(chain((2,)))
    # Two ranks: the V placement holds stages 1 and 2 on rank 1; looped placements hold no neighbours.
    v = PipelinePath("ZBVZeroBubble", FIXED, world_size=2).supports(chain((1, 2, 3), microbatches=4))
    assert v is not None and "stages 1 and 2 on rank 1" in v and "ranks2.*" not in v
    two = PipelinePath("InterleavedZeroBubble", FIXED, world_size=2)
    assert two.supports(chain((2,))) is None and two.supports(chain((1, 2, 3), microbatches=4)) is None
    monkeypatch.setattr(pipeline, "same_rank_self_send", lambda schedule, *rest: None)
    assert looped.supports(chain((2,))) is None and zbv.availability().ok


# --- stock against fixed -----------------------------------------------------------


def test_fixed_agrees_where_stock_drops_the_weights_of_a_stage_without_input_grads():
    """A frozen first stage: the next stage's inputs need no grad, and the
    zero-bubble split finds no weight group there (torch bug, cases/pipeline/)."""
    case = chain((1,), frozen=("w0",), x_grad=False)
    case = Case.from_json({**case.to_json(), "params": [{"name": "w0", "shape": [3, 3], "requires_grad": False},
                                                        {"name": "w1", "shape": [3, 3]}],
                           "nodes": case.to_json()["nodes"][:2], "outputs": [{"ref": "n1"}]})
    assert check(case, PipelinePath("ZBVZeroBubble", FIXED)) == []
    divs = check(case, PipelinePath("ZBVZeroBubble", "stock"))
    assert [(d.param, d.kind) for d in divs] == [("w1", "value")] and "no grad" in divs[0].detail


def test_fixed_agrees_on_every_schedule_and_accumulation_across_steps():
    for schedule, layouts in probe(1)["layouts"].items():
        stages, micro = max(layouts)
        cuts = {1: (), 2: (2,), 3: (1, 2), 4: (1, 2, 3)}[stages]
        case = chain(cuts, microbatches=micro, steps=2, zero_grad="keep")
        assert check(case, PipelinePath(schedule, FIXED)) == [], schedule


def test_two_ranks_fixed_agrees_and_a_raising_rank_is_an_error_not_a_hang():
    ranks = probe(2)["layouts"]
    assert (4, 4) in ranks["ZBVZeroBubble"] and (2, 1) in ranks["GPipe"]
    case = chain((1, 2, 3), microbatches=4)
    assert check(case, PipelinePath("ZBVZeroBubble", FIXED, world_size=2)) == []
    # A transposed stage output crosses ranks: stock allocates the receive
    # buffer with the sender's strides and gloo refuses it on one rank while
    # the other waits for it. Reported as that rank's error, at once.
    viewed = corpus.load(os.path.join(PIPELINE_CASES, "noncontiguous_activation_across_ranks.json")).case
    stock = check(viewed, PipelinePath("GPipe", "stock", world_size=2))
    assert [d.kind for d in stock] == ["error"] and "contiguous" in stock[0].detail
    assert check(viewed, PipelinePath("GPipe", FIXED, world_size=2)) == []


def test_fresh_ranks_build_their_p2p_group_before_a_case_is_timed(monkeypatch):
    """A new pool's p2p group is built and used in a request of its own
    (``path._warm``), once per pool start, so a case's time limit never pays
    for communicator set-up (NCCL builds them on first use)."""
    from harness.paths.pipeline import paths as pipeline_path
    from harness.workers import pool

    group = pool.group(2, "gloo")
    sent = []
    request = group.request
    monkeypatch.setattr(group, "request", lambda msg, timeout: sent.append(msg.get("what")) or request(msg, timeout))
    fixed = PipelinePath("GPipe", FIXED, world_size=2, backend="gloo")
    group.close()
    for _ in range(2):
        assert check(chain(), fixed) == []
    assert sent.count("warm") == 1 and pipeline_path._warmed[group] == group.starts
    group.close()
    assert check(chain(), fixed) == [] and sent.count("warm") == 2
    reply = request({"op": "call", "module": "harness.paths.pipeline.rank", "what": "warm", "wait": 3.0}, 60)
    assert reply.status == "ok" and all(r["warm"] is True for r in reply.replies.values())


def test_a_rank_that_hangs_with_no_cause_is_a_timeout():
    obs = observation("pipeline.X.ranks2.stock", chain(), Outcome("ok", {
        0: {"steps": [], "failure": {"step": 0, "type": "RuntimeError", "message": "Timed out waiting 3000ms",
                                    "waited": True}},
        1: {"steps": [], "failure": {"step": 0, "type": "RuntimeError", "message": "Timed out waiting 3000ms",
                                    "waited": True}}}))
    assert obs.failure is None and [v.kind for v in obs.violations] == ["timeout"]


# --- corpus, repro, canaries --------------------------------------------------------


def test_pipeline_corpus_cases_diverge_on_stock_as_expected_and_never_on_fixed():
    files = corpus.discover([PIPELINE_CASES])
    assert files
    version = torch.__version__
    for f in files:
        entry = corpus.load(f)
        expected = {e["path"] for e in entry.meta.get("expect", [])}
        assert expected, f
        for p in resolve("pipeline"):
            if p.supports(entry.case) is not None:
                continue
            divs = check(entry.case, p)
            if p.name.endswith(".fixed"):
                assert divs == [], (f, p.name, [d.detail for d in divs])
            elif divs:
                assert entry.expected_on(p.name, version), (f, p.name, divs[0].detail)


def test_repro_script_builds_stages_and_schedule_in_plain_torch(tmp_path):
    case = Case.from_json({**chain((1,), frozen=("w0",), x_grad=False).to_json(), "outputs": [{"ref": "n1"}]})
    case = Case.from_json({**case.to_json(), "nodes": case.to_json()["nodes"][:2]})
    text = pipeline_repro.script(case, PipelinePath("ZBVZeroBubble", "stock", 1).repro(case), "frozen first stage")
    assert "import harness" not in text and "class Stage1(torch.nn.Module)" in text
    script = tmp_path / "repro.py"
    script.write_text(text)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path), env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "w1.grad DIFFERS" in run.stdout and "actual   None" in run.stdout


def test_canary_stage_is_caught_from_a_cold_start():
    path = PipelinePath("ZBVZeroBubble", CANARIES["double_weight"])
    result = Result()
    fuzz_path(path, examples=150, deadline=None, seed=3, result=result, save_dir=None, exact=True)
    assert result.divergences, "the double-counting stage was not caught in 150 examples"
    d = result.divergences[0]
    print(f"double_weight: caught after {result.paths[path.name].first_hit_examples} examples; shrunk: {d.detail}")
    assert d.kind == "value"


def test_a_send_written_before_its_wait_is_reported_and_one_written_after_it_is_not(monkeypatch):
    """The watch reads version counters at the schedule's own post and wait:
    the same order on every run, whatever the transport's thread did."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from harness.paths.pipeline.inflight import watched

    monkeypatch.setattr(schedules, "_batch_p2p", lambda ops, desc=None: [object()])
    monkeypatch.setattr(schedules, "_wait_batch_p2p", lambda work: None)
    early, late, received = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    with watched([]) as found:
        work = schedules._batch_p2p([SimpleNamespace(op=dist.isend, tensor=early, peer=1),
                                     SimpleNamespace(op=dist.irecv, tensor=received, peer=1)])
        early.add_(1)
        received.add_(1)  # a receive buffer's writes are not the send's business
        schedules._wait_batch_p2p(work)
        work = schedules._batch_p2p([SimpleNamespace(op=dist.isend, tensor=late, peer=1)])
        schedules._wait_batch_p2p(work)
        late.add_(1)
    assert len(found) == 1 and "sent to rank 1" in found[0] and "version 0 -> 1" in found[0], found
    assert schedules._batch_p2p is not None and "watched" not in repr(schedules._wait_batch_p2p)


def test_a_send_written_in_flight_is_the_finding_and_the_racy_grads_are_not_compared():
    case = corpus.load(os.path.join(os.path.dirname(corpus.__file__), "..", "..", "cases", "pipeline",
                                    "zbv_two_ranks_tied_weight_passthrough_input_grad.json")).case
    path = next(p for p in resolve("pipeline.ZBVZeroBubble.ranks2.stock") if p.supports(case) is None)
    kinds = [[d.kind for d in check(case, path)] for _ in range(3)]
    assert kinds == [["race"]] * 3, kinds


def test_clone_grads_reaches_the_ranks_case_thread_and_removes_the_send_race():
    """The gate's causal "known" for the pipeline entries: the workaround rides
    the pool's request into the rank's case thread (a copied context), where
    the stages' parameters take the clone hook."""
    from harness.engine.check import CaseCheck
    from harness.paths.workarounds import apply

    case = corpus.load(os.path.join(os.path.dirname(corpus.__file__), "..", "..", "cases", "pipeline",
                                    "zbv_two_ranks_tied_weight_passthrough_input_grad.json")).case
    path = next(p for p in resolve("pipeline.ZBVZeroBubble.ranks2.stock") if p.supports(case) is None)
    cc = CaseCheck(case)
    assert [d.kind for d in cc.run(path)] == ["race"]
    assert cc.run(apply(path, "clone-grads")) == []
