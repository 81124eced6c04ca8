"""The megatron family: optional, honest when absent, its one CPU patch
inert for every other gradient path, and, where megatron-core is installed
(``pip install 'gradfuzz[megatron]'``), held to the oracle on both reduce
kinds with its canary caught."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.case.spec import Case, Input, Node, Param, Schedule, Use
from harness.paths import resolve
from harness.paths.megatron.cpu import PATCHED, cuda_factories_on_cpu, on_cpu
from harness.paths.megatron.data import Knobs, ddp_config
from harness.paths.megatron.paths import installed

INSTALLED = installed()
needs_megatron = pytest.mark.skipif(not INSTALLED, reason="megatron-core is not installed: pip install 'gradfuzz[megatron]'")


def _nested(microbatches: int = 2) -> Case:
    from tests.helpers import nested

    return nested(microbatches=microbatches)


def _two_params() -> Case:
    """Two parameters, the second tied: under the distributed optimizer's
    64-element alignment the second lands in rank 1's shard of the bucket."""
    return Case(params=(Param("w0", (3, 3)), Param("w1", (3, 3))), inputs=(Input("x0", (2, 3), requires_grad=True),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("n1", "matmul", (Use("n0"), Use("w1"))),
                       Node("n2", "matmul", (Use("n1"), Use("w1")))),
                outputs=(Use("n2"),), schedule=Schedule(microbatches=2, steps=2))


def test_both_paths_are_listed_and_say_how_to_install_when_absent():
    paths = resolve("megatron")
    assert [p.name for p in paths] == ["megatron.ddp.stock", "megatron.distopt.stock", "megatron.pp.stock",
                                       "megatron.vpp.stock"]
    for p in paths:
        a = p.availability()
        assert a.ok == INSTALLED and (INSTALLED or "pip install 'gradfuzz[megatron]'" in a.reason)


def test_the_knobs_are_case_data_that_reach_the_ddp_config():
    case = _nested(4).with_data("megatron", Knobs(overlap=True, bucket=40, nan_check=True, shared=True))
    assert Case.loads(case.dumps()) == case
    cfg = ddp_config(case, True)
    assert cfg["overlap_grad_reduce"] and cfg["bucket_size"] == 40 and cfg["use_distributed_optimizer"]
    assert cfg["check_for_nan_in_grad"] and cfg["average_in_collective"] is False and not cfg["grad_reduce_in_fp32"]
    assert ddp_config(_nested(), False)["bucket_size"] is None  # megatron's default
    json.dumps(cfg)


def test_contract_refuses_what_megatron_owns_or_the_harness_cannot_run():
    ddp = resolve("megatron")[0]
    case = _nested(2)
    assert ddp.supports(case) is None
    assert ddp.supports(replace(case, schedule=replace(case.schedule, zero_grad="keep")))
    assert ddp.supports(replace(case, schedule=replace(case.schedule, optimizer="sgd")))
    assert "powers of two" in ddp.supports(replace(case, schedule=replace(case.schedule, microbatches=3)))
    wide = replace(case, dtype="float64").with_data("megatron", Knobs(fp32_reduce=True))
    assert "grad_reduce_in_fp32" in ddp.supports(wide)


def test_the_cpu_patch_replaces_only_its_attributes_and_only_while_in_force():
    before = dict(vars(torch.cuda))
    with on_cpu(torch.device("cpu")):
        during = dict(vars(torch.cuda))
        assert torch.cuda.current_device() == "cpu"
    assert {n for n in before if during.get(n) is not before[n]} == set(PATCHED)
    assert set(during) == set(before)
    assert all(vars(torch.cuda)[n] is v for n, v in before.items())
    with on_cpu(torch.device("cuda", 0)):  # a GPU rank is left as installed
        assert all(vars(torch.cuda)[n] is v for n, v in before.items())


def test_eager_grads_are_bitwise_the_same_under_the_cpu_patch():
    (eager,) = resolve("eager.accumulate")
    case = replace(_two_params(), exact=False, dtype="float32")
    plain = eager.run(case)
    with on_cpu(torch.device("cpu")):
        patched = eager.run(case)
    assert len(plain.steps) == len(patched.steps) == 4
    for a, b in zip(plain.steps, patched.steps):
        assert a.grads.keys() == b.grads.keys()
        assert all(torch.equal(a.grads[n], b.grads[n]) for n in a.grads)
        assert all(torch.equal(x, y) for x, y in zip(a.outputs, b.outputs))


@needs_megatron
def test_both_reduces_agree_with_the_oracle_and_every_knob_runs():
    from harness.engine.check import check

    for knobs in (None, Knobs(overlap=True, bucket=1, nan_check=True, shared=True), Knobs(fp32_reduce=True)):
        for case in (_nested(2), _two_params(), replace(_two_params(), exact=False)):
            case = case.with_data("megatron", knobs)
            for p in resolve("megatron.ddp") + resolve("megatron.distopt"):
                assert p.supports(case) is None and check(case, p) == [], (p.name, knobs)


@needs_megatron
def test_the_canary_is_caught_from_a_cold_start():
    from harness.canaries import all_canaries
    from harness.gate.selfcheck import run_canary

    (canary,) = [c for c in all_canaries() if c.name == "megatron_keeps_last_micro_step"]
    result = run_canary(canary, seed=0)
    assert result.caught and "expected g1 + g2" in result.detail, result.detail


# megatron-core raises on it (NVIDIA/Megatron-LM#1150)
UNUSED = Path(__file__).parents[2] / "cases" / "megatron" / "unused_param_overlap_reset_assert.json"


def test_a_ddp_finding_gets_a_torchrun_script_with_the_config_as_data_and_the_cpu_patches():
    """Written without megatron-core: the script is text; the stack is its reader's."""
    from harness.artifacts.repro import script

    case = _two_params().with_data("megatron", Knobs(overlap=True, bucket=40, shared=True))
    for p in resolve("megatron.ddp,megatron.distopt"):
        text = script(case, p.name, p.repro(case))
        compile(text, "repro.py", "exec")
        assert "import harness" not in text and "from harness" not in text
        assert '"bucket_size": 40' in text and f'"use_distributed_optimizer": {str(p.distopt).lower()}' in text
        assert "SHARED = ['w1']" in text and "CPU_PATCHES = {'current_device': _cpu_device" in text
        assert "finalize_model_grads([ddp])" in text and "os._exit(code)" in text


@needs_megatron
def test_the_ddp_script_runs_alone_shows_the_raise_agrees_on_a_clean_case_and_sees_a_doubled_grad(tmp_path):
    """A corpus finding's script diverges as the path does (megatron raises on
    the second zero_grad_buffer); a clean case agrees (distributed optimizer,
    overlap, one bucket a parameter, a shared embedding, grads read inside
    the window); the same script with the loss doubled must say DIVERGES."""
    from harness.artifacts.corpus import load
    from harness.artifacts.repro import script
    from tests.helpers import torchrun_verdict

    (ddp,) = resolve("megatron.ddp")
    case = load(str(UNUSED)).case
    line, rc = torchrun_verdict(script(case, ddp.name, ddp.repro(case)), tmp_path)
    assert "DIVERGES" in line and rc == 1, line  # every release the ledger names (>= 0.12) raises
    (distopt,) = resolve("megatron.distopt")
    clean = _two_params().with_data("megatron", Knobs(overlap=True, bucket=1, shared=True))
    text = script(clean, distopt.name, distopt.repro(clean))
    line, rc = torchrun_verdict(text, tmp_path)
    assert "agrees (0 differences)" in line and rc == 0, line
    doubled = text.replace("/ MICROBATCHES).backward()", "/ MICROBATCHES * 2).backward()")
    assert doubled != text
    line, rc = torchrun_verdict(doubled, tmp_path)
    assert "DIVERGES" in line and rc == 1, line


# megatron-core runs it and the grads are wrong (NVIDIA/Megatron-LM#750)
SWAPS = Path(__file__).parents[2] / "cases" / "megatron" / "vpp_pp2_batched_p2p_swaps_fwd_bwd.json"


def test_a_pipeline_finding_gets_a_torchrun_script_with_its_stages_and_configs_as_data():
    """Written without megatron-core: the stages spelled out, the tied weight
    named, batch_p2p_comm as the case sets it; a canary's stays replay-only."""
    from harness.artifacts.repro import script
    from harness.paths.megatron.paths import MegatronVppPath

    case = _vtied().with_data("megatron", Knobs(cuts=(1, 2, 3), overlap=True, distopt=True))
    text = script(case, _vpp().name, _vpp().repro(case))
    compile(text, "repro.py", "exec")
    assert "import harness" not in text and "from harness" not in text
    assert '"batch_p2p_comm": true' in text and '"virtual_pipeline_model_parallel_size": 2' in text
    assert '"use_distributed_optimizer": true' in text and "SHARED = 'w0'" in text and "class Stage3(" in text
    assert "class MegatronStage(" in text and "def tie(" in text and "class CudaFactoriesOnCpu(" in text
    assert "CPU_PATCHES = {'current_device': _cpu_device" in text and "os._exit(code)" in text
    paired = _tied().with_data("megatron", Knobs(cut=2, batch_p2p=False))
    text = script(paired, _pp().name, _pp().repro(paired))
    assert '"batch_p2p_comm": false' in text and "virtual_pipeline" not in text and "class Stage2(" not in text
    canary = MegatronVppPath("megatron.vpp.broken", "harness.paths.megatron.canaries:skips_embedding_allreduce", 60.0)
    assert canary.repro(case).template == "none"


@needs_megatron
def test_the_pipeline_script_runs_alone_diverges_as_the_path_agrees_paired_and_sees_a_doubled_grad(tmp_path):
    """The corpus finding's script diverges as megatron.vpp does and agrees
    with batch_p2p_comm off (the maintainers' workaround); megatron.pp's on a
    tied weight (distributed optimizer, overlap, a bucket a parameter)
    agrees, and the same script with each grad output doubled must not."""
    from harness.artifacts.corpus import load
    from harness.artifacts.repro import script
    from tests.helpers import torchrun_verdict

    case = load(str(SWAPS)).case
    text = script(case, _vpp().name, _vpp().repro(case))
    line, rc = torchrun_verdict(text, tmp_path)
    assert "DIVERGES" in line and rc == 1, line
    line, rc = torchrun_verdict(text.replace('"batch_p2p_comm": true', '"batch_p2p_comm": false'), tmp_path)
    assert "agrees (0 differences)" in line and rc == 0, line
    tied = _tied().with_data("megatron", Knobs(cut=2, overlap=True, bucket=1, distopt=True))
    text = script(tied, _pp().name, _pp().repro(tied))
    line, rc = torchrun_verdict(text, tmp_path)
    assert "agrees (0 differences)" in line and rc == 0, line
    doubled = text.replace("* MICROBATCHES for c in GRAD_OUTPUTS[k]]", "* MICROBATCHES * 2 for c in GRAD_OUTPUTS[k]]")
    assert doubled != text
    line, rc = torchrun_verdict(doubled, tmp_path)
    assert "DIVERGES" in line and rc == 1, line


# megatron.pp.stock: two pipeline stages, the shared weight all-reduced by finalize_model_grads.

def _tied(microbatches: int = 2, steps: int = 2) -> Case:
    """x0 @ w0 | @ w1 @ w0.T: w0 is the embedding and the output layer, one
    copy on each stage when cut at 1 or 2; its grad is the sum of both uses."""
    return Case(params=(Param("w0", (3, 3)), Param("w1", (3, 3))), inputs=(Input("x0", (2, 3), requires_grad=True),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("n1", "matmul", (Use("n0"), Use("w1"))),
                       Node("n2", "matmul", (Use("n1"), Use("w0", transpose=True)))),
                outputs=(Use("n2"),), schedule=Schedule(microbatches=microbatches, steps=steps))


def _pp():
    (pp,) = resolve("megatron.pp")
    return pp


def test_the_pipeline_contract_refuses_what_the_cut_or_megatron_cannot_express():
    pp = _pp()
    case = _tied()
    assert "no pipeline cut" in pp.supports(case)
    assert pp.supports(case.with_data("megatron", Knobs(cut=2))) is None
    both = Case(params=case.params, inputs=case.inputs,
                nodes=case.nodes[:2] + (Node("n2", "matmul", (Use("n1"), Use("w1", transpose=True))),
                                        Node("n3", "matmul", (Use("n2"), Use("w0", transpose=True)))),
                outputs=(Use("n3"),), schedule=case.schedule).with_data("megatron", Knobs(cut=2))
    assert "megatron shares one weight" in pp.supports(both)  # w0 and w1 on both stages
    apart = replace(case, nodes=case.nodes[:1] + (Node("n1", "matmul", (Use("w1"), Use("w1"))),),
                    outputs=(Use("n1"),)).with_data("megatron", Knobs(cut=1))
    assert "nothing crosses the cut" in pp.supports(apart)
    cut = case.with_data("megatron", Knobs(cut=2))
    assert "powers of two" in pp.supports(replace(cut, schedule=replace(cut.schedule, microbatches=3)))
    assert pp.supports(replace(cut, schedule=replace(cut.schedule, optimizer="sgd")))
    assert pp.supports(replace(cut, schedule=replace(cut.schedule, zero_grad="keep")))
    dropout = replace(cut, nodes=cut.nodes[:2] + (Node("n2", "dropout", (Use("n1"),)),),
                      outputs=(Use("n2"),))
    assert "dropout" in pp.supports(dropout)
    with pytest.raises(Exception, match="cut"):
        Case.loads(case.with_data("megatron", Knobs(cut=3)).dumps())  # past the last node


def test_the_factory_mode_moves_only_cuda_constructors_and_changes_no_grad():
    with cuda_factories_on_cpu(torch.device("cpu")):
        assert torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=torch.device("cuda", 0)).device.type == "cpu"
        x = torch.ones(2, requires_grad=True)
        assert (x * 2).device.type == "cpu"
    (eager,) = resolve("eager.accumulate")
    case = replace(_tied(), exact=False, dtype="float32")
    plain = eager.run(case)
    with on_cpu(torch.device("cpu")), cuda_factories_on_cpu(torch.device("cpu")):
        patched = eager.run(case)
    for a, b in zip(plain.steps, patched.steps):
        assert all(torch.equal(a.grads[n], b.grads[n]) for n in a.grads)


@needs_megatron
def test_the_pipeline_agrees_with_the_oracle_on_a_tied_weight_and_every_knob_runs():
    from harness.engine.check import check

    pp = _pp()
    for knobs in (Knobs(cut=2), Knobs(cut=1, overlap=True, bucket=1, nan_check=True, batch_p2p=False, deallocate=True),
                  Knobs(cut=2, fp32_reduce=True, deallocate=True), Knobs(cut=2, per_token=True, overlap=True),
                  Knobs(cut=2, distopt=True, overlap=True, bucket=1), Knobs(cut=1, distopt=True)):
        for case in (_tied(), replace(_tied(4, 1), exact=False)):
            case = case.with_data("megatron", knobs)
            assert pp.supports(case) is None and check(case, pp) == [], knobs
    obs = pp.run(_tied().with_data("megatron", Knobs(cut=2)))
    assert [s.grads is not None for s in obs.steps] == [False, True, False, True]  # after each iteration
    ddp = resolve("megatron.ddp")[0]  # the ranks re-make megatron's parallel state for data parallelism
    assert check(_two_params(), ddp) == []


@needs_megatron
def test_the_pipeline_canary_is_caught_from_a_cold_start():
    from harness.canaries import all_canaries
    from harness.gate.selfcheck import run_canary

    (canary,) = [c for c in all_canaries() if c.name == "megatron_pp_skips_embedding_allreduce"]
    assert run_canary(canary, seed=3).caught


@needs_megatron
def test_a_finalize_without_the_embedding_allreduce_is_caught():
    from harness.engine.check import check
    from harness.paths.megatron.paths import MegatronPipePath

    broken = MegatronPipePath("megatron.pp.broken", "harness.paths.megatron.canaries:skips_embedding_allreduce", 60.0)
    found = check(_tied().with_data("megatron", Knobs(cut=2)), broken)
    assert {(d.kind, d.param) for d in found} == {("replica", "w0"), ("value", "w0")}, found
    untied = replace(_tied(), nodes=_tied().nodes[:2], outputs=(Use("n1"),)).with_data("megatron", Knobs(cut=1))
    assert check(untied, broken) == []  # nothing shared: the all-reduce has nothing to do
    tokens = MegatronPipePath("megatron.pp.tokens", "harness.paths.megatron.canaries:drops_token_count", 60.0)
    per_token = _tied().with_data("megatron", Knobs(cut=2, per_token=True))
    assert {d.ratio for d in check(per_token, tokens) if d.kind == "value" and d.param in ("w0", "w1")} == {2.0}
    assert _pp().supports(replace(per_token, exact=False, schedule=replace(per_token.schedule, microbatches=3)))


@needs_megatron
def test_a_stage_that_raises_is_the_finding_not_its_peers_wait():
    """The known unused-parameter bug (NVIDIA/Megatron-LM#1150) through the
    pipeline: w2 feeds a node nothing uses, so with overlap_grad_reduce the
    first stage's next zero_grad_buffer() asserts while the last stage waits
    for its activations. One finding, the ledger's signature; no hang."""
    from harness.engine.check import check

    case = Case(params=(Param("w0", (3, 3)), Param("w1", (3, 3)), Param("w2", (3, 3))), inputs=(Input("x0", (2, 3)),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("n1", "matmul", (Use("x0"), Use("w2"))),
                       Node("n2", "matmul", (Use("n0"), Use("w1")))),
                outputs=(Use("n2"),), schedule=Schedule(microbatches=2, steps=2))
    found = check(case.with_data("megatron", Knobs(cut=2, overlap=True)), _pp())
    assert [(d.kind, d.signature) for d in found] == [("error", "megatron.stock-error-a4118d4439")], found
    assert check(case.with_data("megatron", Knobs(cut=2)), _pp()) == []  # without overlap it agrees
    # A parameter no node uses is held by the first stage, as a model chunk holds one: the same bug.
    unused = replace(case, nodes=case.nodes[:1] + case.nodes[2:]).with_data("megatron", Knobs(cut=1, overlap=True))
    assert [d.signature for d in check(unused, _pp())] == ["megatron.stock-error-a4118d4439"]


# megatron.vpp.stock: four virtual stages, two model chunks on each of two ranks, the interleaved schedule.

def _vtied(microbatches: int = 2, steps: int = 2) -> Case:
    """x0 @ w0 | @ w1 | @ w2 | @ w0.T cut at (1, 2, 3): w0 is the embedding on
    stage 0 (rank 0, chunk 0) and the output layer on stage 3 (rank 1, chunk 1)."""
    return Case(params=(Param("w0", (3, 3)), Param("w1", (3, 3)), Param("w2", (3, 3))),
                inputs=(Input("x0", (2, 3), requires_grad=True),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("n1", "matmul", (Use("n0"), Use("w1"))),
                       Node("n2", "matmul", (Use("n1"), Use("w2"))),
                       Node("n3", "matmul", (Use("n2"), Use("w0", transpose=True)))),
                outputs=(Use("n3"),), schedule=Schedule(microbatches=microbatches, steps=steps))


def _vpp():
    (vpp,) = resolve("megatron.vpp")
    return vpp


def test_the_vpp_layout_puts_chunk_c_of_rank_r_at_stage_c_times_two_plus_r():
    from harness.paths.megatron.pipe.rank import boundary_width, rank_stages, stage_specs

    assert rank_stages(0, 2) == [0, 2] and rank_stages(1, 2) == [1, 3] and rank_stages(1, 1) == [1]
    # x0 passes through stage 1 to stage 2 beside n1: boundaries of 6, 12 and 6 elements, all sent as 12.
    skip = replace(_vtied(), nodes=_vtied().nodes[:2] + (Node("n2", "add", (Use("n1"), Use("x0"))),)
                   + _vtied().nodes[3:]).with_data("megatron", Knobs(cuts=(1, 2, 3)))
    specs = stage_specs(skip, 2)
    assert [s.params for s in specs] == [("w0", "w2"), ("w1",), (), ("w0",)]  # w2, unused, held by the first
    assert boundary_width(skip, specs) == 12


def test_the_vpp_contract_encodes_the_interleaved_schedules_rules():
    vpp = _vpp()
    case = _vtied()
    assert "needs 3" in vpp.supports(case.with_data("megatron", Knobs(cut=2)))
    assert vpp.supports(case.with_data("megatron", Knobs(cuts=(1, 2, 3)))) is None
    # megatron's microbatch groups: M=3 raises with the default group of 2, runs with a group of 3.
    odd = replace(_vtied(3), exact=False)
    assert "groups of 2" in vpp.supports(odd.with_data("megatron", Knobs(cuts=(1, 2, 3))))
    assert vpp.supports(odd.with_data("megatron", Knobs(cuts=(1, 2, 3), group=3))) is None
    assert "groups of 4" in vpp.supports(odd.with_data("megatron", Knobs(cuts=(1, 2, 3), group=4)))
    one = _vtied(1).with_data("megatron", Knobs(cuts=(1, 2, 3)))
    assert "[2, 1]" in vpp.supports(one)
    # w0 on stages 0 and 2 (both on rank 0): not the embedding / output layer pair megatron shares.
    apart = replace(case, nodes=case.nodes[:2] + (Node("n2", "matmul", (Use("n1"), Use("w0"))),
                                                  Node("n3", "matmul", (Use("n2"), Use("w2")))))
    assert "stages [0, 2]" in vpp.supports(apart.with_data("megatron", Knobs(cuts=(1, 2, 3))))
    freed = Knobs(cuts=(1, 2, 3), batch_p2p=False, overlap_p2p=True, deallocate=True)
    assert "gloo" in vpp.supports(case.with_data("megatron", freed))
    with pytest.raises(Exception, match="overlap_p2p"):
        Case.loads(case.with_data("megatron", Knobs(cuts=(1, 2, 3), overlap_p2p=True)).dumps())
    with pytest.raises(Exception, match="cuts"):
        Case.loads(case.with_data("megatron", Knobs(cuts=(1, 3, 2))).dumps())


def test_the_vpp_draw_cuts_between_the_embedding_and_the_output_layer():
    from harness.paths.megatron.data import groups, tied_vcuts

    assert tied_vcuts(_vtied(), 4) == [(1, 2, 3)]
    assert groups(2, 2) == [0] and groups(3, 2) == [3] and groups(4, 2) == [0, 4] and groups(5, 2) == [3, 5]


@needs_megatron
def test_the_interleaved_pipeline_agrees_with_the_oracle_and_every_knob_runs():
    from harness.engine.check import check

    vpp = _vpp()
    paired = dict(cuts=(1, 2, 3), batch_p2p=False)
    for knobs, case in ((Knobs(cuts=(1, 2, 3)), _vtied()),  # batched p2p agrees with two microbatches
                        (Knobs(**paired, overlap=True, bucket=1, nan_check=True), _vtied(4, 2)),
                        (Knobs(**paired, overlap_p2p=True, per_token=True, distopt=True), _vtied(4, 1)),
                        (Knobs(**paired, group=4, deallocate=True, fp32_reduce=True), _vtied(4, 1)),
                        (Knobs(**paired, group=3), replace(_vtied(3, 1), exact=False)),
                        (Knobs(**paired, overlap_p2p=True, overlap=True, distopt=True, bucket=1),
                         replace(_vtied(4, 2), exact=False))):
        case = case.with_data("megatron", knobs)
        assert vpp.supports(case) is None and check(case, vpp) == [], knobs
    obs = vpp.run(_vtied().with_data("megatron", Knobs(cuts=(1, 2, 3))))
    assert [s.grads is not None for s in obs.steps] == [False, True, False, True]
    # The ranks re-make megatron's parallel state (no virtual pipeline) for the other paths.
    assert check(_tied().with_data("megatron", Knobs(cut=2)), _pp()) == []
    assert check(_two_params(), resolve("megatron.ddp")[0]) == []


@needs_megatron
def test_batched_p2p_with_two_pipeline_ranks_mixes_forward_and_backward_tensors():
    """Known upstream (NVIDIA/Megatron-LM#750): with pipeline size 2 a rank's
    previous and next stage are one peer, so the batched isend / irecv of
    send_forward_backward_recv_forward_backward cannot tell an activation from
    a grad; megatron-core 0.16.1 runs it and the grads are wrong. The paired
    p2p (megatron sends one direction on the WORLD group) agrees. If this
    starts failing, megatron fixed it: update the ledger entry."""
    from harness.engine.check import check

    vpp = _vpp()
    batched = _vtied(4, 1).with_data("megatron", Knobs(cuts=(1, 2, 3)))
    found = check(batched, vpp)
    assert {d.kind for d in found} == {"value"} and "w0" in {d.param for d in found}, found
    assert check(batched.with_data("megatron", Knobs(cuts=(1, 2, 3), batch_p2p=False)), vpp) == []


@needs_megatron
def test_the_vpp_canary_is_caught_from_a_cold_start_and_its_fault_on_a_direct_case():
    from harness.canaries import all_canaries
    from harness.engine.check import check
    from harness.gate.selfcheck import run_canary
    from harness.paths.megatron.paths import MegatronVppPath

    (canary,) = [c for c in all_canaries() if c.name == "megatron_vpp_skips_embedding_allreduce"]
    assert run_canary(canary, seed=0).caught
    broken = MegatronVppPath("megatron.vpp.broken", "harness.paths.megatron.canaries:skips_embedding_allreduce", 60.0)
    found = check(_vtied().with_data("megatron", Knobs(cuts=(1, 2, 3))), broken)
    assert {(d.kind, d.param) for d in found} == {("replica", "w0"), ("value", "w0")}, found
