"""Fix probes: each removes its ledger bug's finding on the bug's own corpus
case, leaves the path agreeing there, and the finding is back without it;
the gate calls such a row known_probe, apart from a workaround's known."""

import json
import os

import pytest
import torch

from harness.artifacts import corpus
from harness.case import opinfo
from harness.engine.check import CaseCheck
from harness.gate import ledger
from harness.gate import run as gate
from harness.materialize import probes, workarounds
from harness.paths import resolve
from harness.paths.workarounds import apply

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
V = torch.__version__.split("+")[0]
LEDGER = ledger.load(os.path.join(ROOT, "cases", "ledger.json"))

# probe, a ledger bug it checks, one of the bug's corpus cases, a path the bug shows on there.
IN_PROCESS = [
    ("split-clamp-every-intermediate", "split-hook-applied-twice", "split/scale_hook_applied_twice.json",
     "split.stock"),
    ("split-clamp-every-intermediate", "split-hook-applied-twice",
     "pipeline/scale_hook_applied_twice_zero_bubble_one_microbatch.json", "pipeline.ZBVZeroBubble.stock"),
    ("split-param-groups-apart", "split-param-groups-share-graph", "pipeline/param_groups_share_graph_zero_bubble.json",
     "split.twin"),
    ("split-group-unreached-weights", "split-weights-never-meet-an-input", "split/gelu_gate_weights_never_meet_input.json",
     "split.twin"),
    ("split-group-unreached-weights", "pipeline-zero-bubble-stage-without-input-grad",
     "pipeline/zero_bubble_stage_input_needs_no_grad_zero_expected.json", "pipeline.InterleavedZeroBubble.stock"),
    ("split-grad-like-param", "split-weight-grad-ignores-layout", "split/weight_grad_keeps_transposed_layout.json",
     "split.stock"),
    ("split-detach-no-views", "pipeline-split-detaches-view-outputs", "pipeline/view_output_detached_in_place.json",
     "pipeline.InterleavedZeroBubble.stock"),
    ("split-keep-outputs-attached", "pipeline-split-detached-output-needed",
     "pipeline/output_computed_from_output_detached.json", "pipeline.ZBVZeroBubble.stock"),
    ("tensor-split-indices-as-list", "func-tensor-split-tensor-indices", "func/tensor_split_tensor_indices.json",
     "func.vmap"),
    ("rms-norm-add-eps-out-of-place", "rms-norm-cpu-eps-added-in-place", "checkpoint/sac_rms_norm_cached_mean_mutated.json",
     "checkpoint.selective.inverse.stock"),
    ("matmul-vector-squeeze-out-of-place", "sac-matmul-vector-squeeze-inplace",
     "checkpoint/sac_matmul_vector_squeeze_inplace.json", "checkpoint.selective.stock"),
    # Fixes of bugs gone in 2.13, written against 2.11's source: they run where the bug is in range
    # (the test file under an older torch), and are skipped as out of range on a newer one.
    ("split-clamp-saved-grads", "split-nested-double-count", "split/nested_weight_double_count.json", "split.stock"),
    ("split-edge-per-output", "split-multi-output-grads-summed", "split/multi_output_intermediate_grads_summed.json",
     "split.stock"),
    ("split-input-grads-allow-unused", "split-unused-input-raises", "split/unused_input_requires_grad_raises.json",
     "split.stock"),
    ("split-outputs-with-grad-only", "split-no-grad-output-raises", "split/no_grad_output_beside_grad_output_raises.json",
     "split.stock"),
    ("split-input-grads-per-input", "split-input-grads-misaligned", "split/input_grads_misaligned_after_no_grad_input.json",
     "split.stock"),
    ("pipeline-output-meta-real-strides", "pipeline-output-meta-stride-mismatch",
     "pipeline/inner_chunk_output_stride_mismatch.json", "pipeline.GPipe.stock"),
]
# On the worker pool's ranks: the probe reaches them with the case message.
ON_RANKS = [
    ("fsdp2-post-backward-no-materialized-grads", "fsdp2-unused-input-gets-zero-grad",
     "split/unused_input_requires_grad_raises.json", "fsdp2.stock"),
    ("ddp-sink-skipped-under-no-sync", "ddp-static-graph-no-sync-first-backward",
     "parallel/ddp_static_graph_no_sync_first_backward.json", "ddp.stock"),
    ("pipeline-keep-grads-through-metadata-inference", "pipeline-fsdp-metadata-cleanup-drops-grads",
     "mesh/pp_dp_fsdp2_prefilled_grad_dropped.json", "mesh.pp_dp.stock"),
    ("pipeline-p2p-dense", "pipeline-p2p-noncontiguous-buffers", "pipeline/noncontiguous_activation_across_ranks.json",
     "mesh.pp_dp.stock"),
    ("fsdp2-own-storage-for-adopted-grads", "accumulategrad-steals-views", "parallel/fsdp2_no_sync_stack_alias.json",
     "fsdp2.stock"),
    ("fsdp2-clone-outputs-of-unsharded-params", "fsdp2-unit-output-views-freed-param",
     "parallel/fsdp2_unit_returns_param_view.json", "fsdp2.stock"),
    ("dtensor-conv-redistribute-first", "dtensor-conv-batch-smaller-than-mesh-labelled-replicate",
     "dtensor/conv_batch_smaller_than_mesh_labelled_replicate.json", "dtensor.stock"),
    ("norm-backward-out-of-place", "dtensor-norm-backward-partial-input-raises",
     "dtensor/norm_partial_sum_input_backward_raises.json", "dtensor.stock"),
    ("norm-backward-out-of-place", "dtensor-norm-backward-partial-input-raises",
     "dtensor/dist_partial_input_backward_raises.json", "dtensor.fixed"),
    ("dtensor-conv-redistribute-first", "dtensor-conv3d-depth-sharded-raises",
     "dtensor/conv3d_depth_sharded_same_padding_raises.json", "dtensor.stock"),
    ("dtensor-conv-redistribute-first", "dtensor-conv-partial-input-sum-dropped",
     "dtensor/conv_partial_input_sum_dropped.json", "dtensor.fixed"),
    ("dtensor-conv-redistribute-first", "dtensor-conv-partial-input-sum-dropped",
     "dtensor/conv_partial_input_sum_dropped.json", "mesh.dtensor2d.stock"),
    ("pipeline-recv-buffers-need-grad", "pipeline-passthrough-detaches-recv-buffer",
     "pipeline/passthrough_output_detaches_recv_buffer.json", "pipeline.GPipe.ranks2.stock"),
    ("dtensor-norm-backward-replicated-weight", "dtensor-layer-norm-backward-keeps-sharded-weight",
     "dtensor/layer_norm_sharded_weight_backward_raises.json", "dtensor.fixed"),
    ("mvlgamma-backward-out-of-place", "dtensor-mvlgamma-backward-partial-input-raises",
     "dtensor/mvlgamma_partial_input_backward_raises.json", "dtensor.stock"),
    ("dtensor-inf-norm-of-empty-shard", "fsdp2-clip-inf-norm-empty-shard",
     "parallel/fsdp2_clip_inf_norm_empty_shard.json", "fsdp2.stock"),
    ("dtensor-foreach-mul-linear", "dtensor-foreach-mul-drops-partial",
     "dtensor/clip_foreach_partial_grad_unscaled.json", "dtensor.stock"),
    ("dtensor-inf-norm-of-empty-shard", "fsdp2-clip-inf-norm-empty-shard",
     "parallel/fsdp2_clip_inf_norm_empty_shard.json", "mesh.fsdp_tp.stock"),
    ("mvlgamma-backward-out-of-place", "dtensor-mvlgamma-backward-partial-input-raises",
     "dtensor/mvlgamma_partial_input_backward_raises.json", "mesh.dtensor2d.stock"),
    ("dtensor-in-place-keeps-placement", "dtensor-scatter-add-inplace-sharded-self-backward",
     "dtensor/scatter_add_inplace_sharded_self_backward_raises.json", "dtensor.stock"),
    ("dtensor-in-place-keeps-placement", "dtensor-scatter-add-inplace-sharded-self-backward",
     "dtensor/scatter_add_inplace_sharded_self_backward_raises.json", "mesh.dtensor2d.fixed"),
    # DeepSpeed installed (CPU, gloo): the probe reaches the ranks' ZeRO optimizer.
    ("deepspeed-zero-skip-unallocated-bucket", "deepspeed-zero12-backward-reaches-no-parameter",
     "deepspeed/zero12_backward_reaches_no_parameter.json", "deepspeed.zero1.stock"),
    ("deepspeed-zero-skip-unallocated-bucket", "deepspeed-zero12-backward-reaches-no-parameter",
     "deepspeed/zero12_backward_reaches_no_parameter.json", "deepspeed.zero2.torch"),
]
# In the compile flavours' child process (a compile each way: tens of seconds).
IN_CHILD = [
    ("inductor-index-add-fallback", "inductor-index-add-self-source", "compile/inductor_index_add_self_source.json",
     "compile.inductor"),
    ("inductor-embedding-backward-fallback", "inductor-gather-grad-dropped-beside-embedding",
     "compile/inductor_gather_grad_dropped_beside_embedding.json", "compile.inductor"),
    ("inductor-frexp-exponent-vectors", "inductor-frexp-float64-exponent-vectors",
     "compile/inductor_frexp_float64_exponent_vectors.json", "compile.dynamic.symbolic"),
]

# On a CUDA device only (the graphed paths): run with -m gpu where one is.
ON_GPU = [
    ("graphed-clone-static-grads", "graphed-static-grad-alias", "graphed/make_graphed_callables_static_grad_alias.json",
     "graphed.stock"),
    ("graphed-non-differentiable-outputs", "graphed-output-without-grad-requires-grad",
     "graphed/make_graphed_callables_output_without_grad.json", "graphed.stock"),
    ("graphed-wire-params-with-grads", "graphed-unused-param-hooks",
     "graphed/make_graphed_callables_unused_param_hooks.json", "graphed.stock"),
    ("sgd-nesterov-foreach-out-of-place", "optim-sgd-nesterov-foreach-writes-grad",
     "dtensor/sgd_nesterov_foreach_writes_grad.json", "graphed.stock"),
    ("sgd-nesterov-foreach-out-of-place", "optim-sgd-nesterov-foreach-writes-grad",
     "dtensor/sgd_nesterov_foreach_writes_grad.json", "graphed.compile"),
    # DeepSpeed's fp16 (two GPUs and DeepSpeed installed): the probe reaches the NCCL ranks.
    ("deepspeed-fp16-engine-scales-loss", "deepspeed-fp16-zero0-loss-never-scaled",
     "deepspeed/fp16_zero0_update_divided_by_loss_scale.json", "deepspeed.zero0.fp16"),
    ("deepspeed-zero-scale-updated-after-step", "deepspeed-fp16-raised-scale-halves-update",
     "deepspeed/fp16_zero_raised_scale_halves_update.json", "deepspeed.zero1.fp16"),
]

# Two bugs in one case, each probe alone leaving it wrong: ZeRO 0's fp16 (the loss never scaled, and the
# scale raised before the grads are unscaled by it); both in force, the case agrees.
STACKED_ON_GPU = [
    (("deepspeed-fp16-engine-scales-loss", "deepspeed-fp16-scale-updated-after-step"),
     "deepspeed-fp16-raised-scale-halves-update", "deepspeed/fp16_zero_raised_scale_halves_update.json",
     "deepspeed.zero0.fp16"),
]


def _path(name: str):
    (p,) = [p for p in resolve(name) if p.name == name]
    if not p.availability().ok:
        pytest.skip(f"{name} cannot run here")
    return p


def _removes(probe: str, bug_id: str, case_file: str, path_name: str) -> None:
    """The bug's place names the probe; without it the case diverges on the
    path by a signature of that bug, with it the path agrees."""
    site = LEDGER.bug(bug_id).at(path_name)
    assert site is not None and site.probe == probe and site.workaround == ledger.NO_WORKAROUND
    if site.relation(V) != "in":
        pytest.skip(f"{bug_id} is not in its range on torch {V}")
    assert case_file in site.cases
    path = _path(path_name)
    case = corpus.load(os.path.join(ROOT, "cases", case_file)).case
    if here := opinfo.unavailable(case.nodes):
        pytest.skip(here)
    cc = CaseCheck(case)
    plain = cc.run(path)
    assert plain, f"{case_file} agrees on {path_name} without the probe"
    assert cc.run(apply(path, probe)) == [], f"{probe} leaves {case_file} wrong on {path_name}"
    assert cc.run(path), "the finding is back once the probe is out of force"


@pytest.mark.parametrize("probe, bug_id, case_file, path_name", IN_PROCESS, ids=[r[1] for r in IN_PROCESS])
def test_a_probe_removes_its_bug_in_process(probe, bug_id, case_file, path_name):
    _removes(probe, bug_id, case_file, path_name)


@pytest.mark.parametrize("probe, bug_id, case_file, path_name", ON_RANKS, ids=[r[1] for r in ON_RANKS])
def test_a_probe_reaches_the_ranks_and_removes_its_bug_there(probe, bug_id, case_file, path_name):
    _removes(probe, bug_id, case_file, path_name)


@pytest.mark.slow
@pytest.mark.parametrize("probe, bug_id, case_file, path_name", IN_CHILD, ids=[r[1] for r in IN_CHILD])
def test_a_compiler_probe_reaches_the_compile_child(probe, bug_id, case_file, path_name):
    _removes(probe, bug_id, case_file, path_name)


@pytest.mark.gpu
@pytest.mark.parametrize("probe, bug_id, case_file, path_name", ON_GPU, ids=[r[1] for r in ON_GPU])
def test_a_probe_removes_its_bug_on_gpus(probe, bug_id, case_file, path_name):
    _removes(probe, bug_id, case_file, path_name)


@pytest.mark.gpu
@pytest.mark.parametrize("both, bug_id, case_file, path_name", STACKED_ON_GPU, ids=[r[1] for r in STACKED_ON_GPU])
def test_two_probes_together_remove_two_stacked_bugs(both, bug_id, case_file, path_name):
    site = LEDGER.bug(bug_id).at(path_name)
    assert site is not None and site.probe in both and case_file in site.cases
    if site.relation(V) != "in":
        pytest.skip(f"{bug_id} is not in its range on torch {V}")
    path = _path(path_name)
    cc = CaseCheck(corpus.load(os.path.join(ROOT, "cases", case_file)).case)
    assert cc.run(path), f"{case_file} agrees on {path_name} without the probes"
    for one in both:
        assert cc.run(apply(path, one)), f"{one} alone makes {case_file} agree: the bugs are not stacked there"
    assert cc.run(apply(apply(path, both[0]), both[1])) == [], f"{both} together leave {case_file} wrong"


def test_every_probe_the_ledger_names_exists_applies_here_and_is_tested():
    named = {s.probe for s in LEDGER.sites if s.probe}
    assert named <= set(probes.PROBES)
    stacked = {p for r in STACKED_ON_GPU for p in r[0]}
    assert {r[0] for r in IN_PROCESS + ON_RANKS + IN_CHILD + ON_GPU} | stacked == set(probes.PROBES)
    for name in probes.PROBES:
        # A probe applies here, or fixes only bugs gone from this torch (written against an older one's source).
        here = [s for s in LEDGER.sites if s.probe == name and s.relation(V) == "in"]
        assert probes.available(name) is None or not here, name
        assert workarounds.KINDS[name] == probes.KIND and name in workarounds.EFFECTS
    for wa in workarounds.WORKAROUNDS:
        assert workarounds.KINDS[wa] == workarounds.WORKAROUND


def test_a_probe_patches_every_alias_and_restores_the_original():
    from torch.distributed.pipelining import _backward, stage

    before = _backward.stage_backward_weight
    assert stage.stage_backward_weight is before
    with workarounds.in_force("split-clamp-every-intermediate"):
        assert workarounds.in_force_now() == ["split-clamp-every-intermediate"]
        assert _backward.stage_backward_weight is not before
        assert stage.stage_backward_weight is _backward.stage_backward_weight
        with workarounds.in_force("split-clamp-every-intermediate"):  # nested: patched once, restored once
            pass
        assert _backward.stage_backward_weight is not before
    assert _backward.stage_backward_weight is before and stage.stage_backward_weight is before
    assert workarounds.in_force_now() == []


class _InChild:
    """A path whose cases run in a child of its own: what this process holds while one runs."""

    name, contract, worker = "child.standin", None, None  # ``worker``: what marks a path in a child

    def __init__(self):
        self.seen = []

    def start_soon(self):
        pass

    def run(self, case):
        from torch.distributed.pipelining import _backward

        self.seen.append((workarounds.in_force_now(), _backward.stage_backward_weight))
        return case


def test_a_probe_for_a_path_in_a_child_goes_with_the_message_and_leaves_this_process_as_shipped():
    """The gate checks the paths in children side by side from threads: a
    probe patched here for one of them would reach another thread's oracle."""
    from torch.distributed.pipelining import _backward

    from harness.paths import in_child
    from harness.paths.workarounds import WorkedAround

    shipped, child = _backward.stage_backward_weight, _InChild()
    worked = WorkedAround(WorkedAround(child, "clone-grads"), "split-clamp-every-intermediate")
    assert in_child(child) and not in_child(resolve("split.stock")[0])
    worked.run("case")
    assert child.seen == [(["clone-grads", "split-clamp-every-intermediate"], shipped)]
    with workarounds.in_force("split-clamp-every-intermediate"):  # a path running here still gets the patch
        assert _backward.stage_backward_weight is not shipped


def test_the_gate_checks_paths_in_children_side_by_side_each_in_its_own_order(monkeypatch):
    """Each path in a child gets its rows in row order from one thread; the
    rest run first, here; the verdicts are those of one thread."""
    import threading

    from harness.gate import known

    class Here:
        pass

    paths = {"a": _InChild(), "b": _InChild(), "h": Here()}
    for name, p in paths.items():
        p.name = name
    rows = [known.Row("known", path, "d", bug=f"bug{i}", signature=f"s{i}") for i, path in enumerate("ahbaab")]
    calls = []
    monkeypatch.setattr(known, "_verdict", lambda r, path, ev, slack: (
        calls.append((r.path, r.bug, threading.current_thread() is threading.main_thread())) or (r.bug, None)))
    firsts = {(r.bug, r.path, r.signature): r for r in rows}
    alone = known._all_verdicts(firsts, paths, None, None, workers=1)
    assert [c[1] for c in calls] == [f"bug{i}" for i in range(6)] and all(c[2] for c in calls)
    calls.clear()
    assert known._all_verdicts(firsts, paths, None, None, workers=4) == alone
    assert calls[0] == ("h", "bug1", True)
    for p, bugs in (("a", ["bug0", "bug3", "bug4"]), ("b", ["bug2", "bug5"])):
        assert [c[1] for c in calls if c[0] == p] == bugs and not any(c[2] for c in calls if c[0] == p)


def test_a_process_forked_while_a_probe_is_in_force_starts_from_torch_as_shipped():
    """On CPU the pool's ranks are forked from the harness; a pool restarted
    inside the gate's probed run (after a rank crashed) must not keep the
    probe for every later case: a child has in force what its messages name."""
    from torch.distributed.pipelining import _backward, stage

    shipped = _backward.stage_backward_weight
    read, write = os.pipe()
    with workarounds.in_force("split-clamp-every-intermediate"):
        pid = os.fork()
        if pid == 0:  # the child: report and leave at once
            ok = (_backward.stage_backward_weight is shipped and stage.stage_backward_weight is shipped
                  and workarounds.in_force_now() == [])
            with workarounds.in_force("split-clamp-every-intermediate"):
                ok = ok and _backward.stage_backward_weight is not shipped
            ok = ok and _backward.stage_backward_weight is shipped
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
        assert _backward.stage_backward_weight is not shipped  # the parent keeps its probe
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert _backward.stage_backward_weight is shipped


def test_a_probe_whose_lines_this_torch_lacks_is_refused_not_run(monkeypatch):
    gone = probes.Probe("gone", "changes a line no torch has",
                        (probes.Edit("torch.distributed.pipelining._backward", "stage_backward_weight",
                                     (("    no such line\n", "    pass\n"),)),))
    monkeypatch.setitem(probes.PROBES, "gone", gone)
    assert "does not hold the lines" in probes.available("gone")
    with pytest.raises(probes.Unavailable):
        with probes.patch("gone"):
            pass


def test_a_probe_takes_its_older_edits_where_this_torch_has_the_older_lines(monkeypatch):
    """One fix, two releases' sources: the newer edit set where its lines are
    there, else the older one; refused only where neither is."""
    older = probes.Edit("torch.distributed.pipelining._backward", "stage_backward_weight",
                        (("    for param_group in param_groups:\n", "    for param_group in param_groups:\n"),))
    nowhere = probes.Edit("torch.distributed.pipelining._backward", "stage_backward_weight",
                          (("    no such line\n", "    pass\n"),))
    moved = probes.Probe("moved", "a line written otherwise before", (nowhere,), older=(older,))
    assert moved.applicable() == (older,)
    assert probes.Probe("newer", "the lines as they are", (older,), older=(nowhere,)).applicable() == (older,)
    with pytest.raises(probes.Unavailable, match="no such line"):
        probes.Probe("neither", "no release has them", (nowhere,), older=(nowhere,)).applicable()
    monkeypatch.setitem(probes.PROBES, "moved", moved)
    assert probes.available("moved") is None


def test_a_probe_chosen_under_another_probe_reads_torchs_own_source():
    """The gate stacks two bugs' checks; a rank may first meet a probe while
    another rewrites the same function: the choice must read torch's source,
    not the other probe's copy (which has none to read)."""
    target = ("torch.distributed.pipelining._backward", "stage_backward_weight")
    moved = probes.Probe("moved", "a line written otherwise before",
                         (probes.Edit(*target, (("    no such line\n", "    pass\n"),)),),
                         older=(probes.Edit(*target, (("    for param_group in param_groups:\n",
                                                       "    for param_group in param_groups:  # moved\n"),)),))
    with probes.patch("split-clamp-every-intermediate"):
        assert moved.applicable() == moved.older


def test_two_probes_that_rewrite_one_function_are_not_stacked():
    assert not probes.stackable("split-clamp-every-intermediate", "split-param-groups-apart")
    assert probes.stackable("split-detach-no-views", "split-grad-like-param")


def _gate(tmp_path, places: list[dict], case_file: str = "split/scale_hook_applied_twice.json",
          paths: str = "split.stock"):
    """The gate on one corpus case under a ledger of one bug per place given."""
    cases = tmp_path / "cases"
    (cases / os.path.dirname(case_file)).mkdir(parents=True)
    (cases / case_file).write_text(open(os.path.join(ROOT, "cases", case_file)).read())
    bugs = [{"id": f"bug{i}", "path": paths, "torch": f">={V}", "summary": "s", "cases": [case_file], **place}
            for i, place in enumerate(places)]
    (cases / "ledger.json").write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": bugs}))
    return gate.run_gate(resolve(paths), corpus_dirs=[str(cases)], ledger_file=str(cases / "ledger.json"),
                         minutes=0, run_selfcheck=False)


@pytest.mark.parametrize("place, status, says", [
    ({"probe": "split-clamp-every-intermediate"}, "known_probe", "fix probe split-clamp-every-intermediate"),
    ({"probe": "split-param-groups-apart"}, "resembles", "fix probe split-param-groups-apart leaves"),
    ({"no_probe": "the fault is in a C++ kernel"}, "known_signature_only", "no fix probe: the fault is in a C++ kernel"),
    ({}, "known_signature_only", "no workaround or fix probe"),
])
def test_the_gate_calls_a_row_its_probe_removes_known_probe_apart_from_known(tmp_path, place, status, says):
    report = _gate(tmp_path, [place])
    assert [r.status for r in report.rows] == [status]
    assert says in report.rows[0].detail
    assert report.failed is (status == "resembles")


def test_a_probe_that_also_removes_another_bugs_divergence_is_not_a_check_of_its_bug(tmp_path):
    """An expanded dW adopted as .grad shows two bugs at once: its layout, and
    the next += raising on it. The layout probe lays it out like the weight
    and so removes the other bug's error too, which says nothing about the
    layout bug alone; the other bug's own workaround still confirms it."""
    layout = {"signatures": ["split.stock-layout-efd8561325"], "probe": "split-grad-like-param"}
    alias = {"signatures": ["split.stock-error-bad799480d"], "workaround": "split-clone-adopted"}
    report = _gate(tmp_path, [layout, alias], "split/expanded_grad_adopted.json")
    rows = {r.bug: r for r in report.rows}
    assert rows["bug0"].status == "known_signature_only" and "not a check of bug0 alone" in rows["bug0"].detail
    assert rows["bug1"].status == "known" and not report.failed


def test_a_divergence_the_bug_records_itself_is_not_another_bugs(tmp_path):
    """Coarse signatures are shared: where the row's own bug records the
    signature of the second divergence its probe removed, that divergence is
    evidence for the bug, not another bug's (the first bug in ledger order
    that records it can be any of them)."""
    alias = {"signatures": ["split.stock-error-bad799480d"], "workaround": "split-clone-adopted"}
    layout = {"signatures": ["split.stock-layout-efd8561325", "split.stock-error-bad799480d"],
              "probe": "split-grad-like-param"}
    report = _gate(tmp_path, [alias, layout], "split/expanded_grad_adopted.json")
    rows = {r.bug: r for r in report.rows}
    assert rows["bug1"].status == "known_probe", rows["bug1"].detail
    assert not report.failed


def test_a_divergence_a_bug_with_the_same_probe_records_is_not_another_bugs(tmp_path):
    """Two entries whose one fix probe removes both (forms of one mechanism)
    do not make each other's rows 'signature only', even where ledger order
    files the second divergence under a third bug with another check."""
    alias = {"signatures": ["split.stock-error-bad799480d"], "workaround": "split-clone-adopted"}
    twin = {"signatures": ["split.stock-error-bad799480d"], "probe": "split-grad-like-param"}
    layout = {"signatures": ["split.stock-layout-efd8561325"], "probe": "split-grad-like-param"}
    report = _gate(tmp_path, [alias, twin, layout], "split/expanded_grad_adopted.json")
    rows = {r.bug: r for r in report.rows}
    assert rows["bug2"].status == "known_probe", rows["bug2"].detail


def test_a_probe_is_isolated_by_a_workaround_that_takes_the_other_divergence_away(tmp_path):
    """The layout probe also removes a fused optimizer's after-step
    difference, which a coarse signature files under another bug whose own
    workaround removes the layout divergence too. With optimizer-for-loop in
    force the case shows the layout divergence alone, and the probe removes
    exactly it: known_probe, saying which workaround isolated it."""
    src = os.path.join(ROOT, "tests", "data", "split_layout_fused_adam_case.json")
    (tmp_path / "cases" / "split").mkdir(parents=True)
    (tmp_path / "cases" / "split" / "layout_fused_adam.json").write_text(open(src).read())
    layout = {"signatures": ["split.stock-layout-efd8561325"], "probe": "split-grad-like-param"}
    alias = {"signatures": ["split.stock-value-93e28b7921"], "workaround": "split-clone-adopted"}
    bugs = [{"id": f"bug{i}", "path": "split.stock", "torch": f">={V}", "summary": "s",
             "cases": ["split/layout_fused_adam.json"], **place} for i, place in enumerate([layout, alias])]
    led = tmp_path / "cases" / "ledger.json"
    led.write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": bugs}))
    report = gate.run_gate(resolve("split.stock"), corpus_dirs=[str(tmp_path / "cases")], ledger_file=str(led),
                           minutes=0, run_selfcheck=False)
    rows = {r.bug: r for r in report.rows}
    assert rows["bug0"].status == "known_probe", rows["bug0"].detail
    assert "with the workaround optimizer-for-loop in force" in rows["bug0"].detail


def test_the_ledger_refuses_an_unknown_probe_and_a_probe_beside_its_absence(tmp_path):
    from harness.artifacts.corpus import CorpusError

    for place, field in (({"probe": "no-such-probe"}, "probe"),
                         ({"probe": "split-grad-like-param", "no_probe": "why"}, "no_probe"),
                         ({"workaround": "split-grad-like-param"}, "workaround")):
        led = tmp_path / f"{field}.json"
        led.write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": [
            {"id": "b", "path": "split.stock", "torch": ">=2.0", "summary": "s", **place}]}))
        with pytest.raises(CorpusError, match=f"bugs\\[0\\].{field}"):
            ledger.load(str(led))


@pytest.mark.parametrize("ord", [0, 1, 2, 3, 0.5, 1.5, float("inf"), float("-inf")])
def test_the_norm_probe_is_torchs_own_backward_out_of_place(ord):
    """The probe's autograd kernel for linalg_vector_norm gives, bit for bit,
    the grads torch's C++ formula gives on plain tensors (it only moves the
    in-place fills out of place), and torch's own kernel is back after it."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 2, dtype=torch.float64, generator=g)
    x[0, 1, 0] = 0.0
    x[2, 3, 1] = x[2, 3, 0]  # a tie for the inf norms
    for dim, keepdim in ((None, False), (1, False), ((0, 2), True), ((-1,), False)):
        cot = torch.randn(torch.linalg.vector_norm(x, ord, dim, keepdim).shape, dtype=torch.float64, generator=g)

        def grad() -> torch.Tensor:
            t = x.clone().requires_grad_()
            (torch.linalg.vector_norm(t, ord, dim, keepdim) * cot).sum().backward()
            return torch.zeros_like(x) if t.grad is None else t.grad

        want = grad()
        with workarounds.in_force("norm-backward-out-of-place"):
            got = grad()
        assert torch.equal(got, want), (ord, dim, keepdim, (got - want).abs().max())
    t = x.clone().requires_grad_()
    assert type(torch.linalg.vector_norm(t).grad_fn).__name__ == "LinalgVectorNormBackward0"


@pytest.mark.parametrize("a, b", [((3,), (3,)), ((2, 3), (3,)), ((3,), (3, 4)), ((2, 3), (3, 4)), ((5, 2, 3), (3, 4)),
                                  ((2, 3), (5, 3, 4)), ((5, 2, 3), (5, 3, 4)), ((2, 1, 2, 3), (5, 3, 4)),
                                  ((5, 2, 3), (3,)), ((3,), (5, 3, 4))])
def test_the_matmul_probe_is_torchs_own_composite_with_the_squeeze_out_of_place(a, b):
    """torch's Python port of the matmul composite gives, bit for bit, the
    value and grads ATen's gives for every rank pair, and ATen's is back after."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(a, generator=g), torch.randn(b, generator=g)

    def run() -> tuple[torch.Tensor, ...]:
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = torch.matmul(xx, ww)
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        return out.detach(), xx.grad, ww.grad

    want = run()
    with workarounds.in_force("matmul-vector-squeeze-out-of-place"):
        got = run()
    assert all(torch.equal(u, v) for u, v in zip(got, want)), (a, b)
    assert [torch.equal(u, v) for u, v in zip(run(), want)] == [True] * 3


@pytest.mark.gpu
def test_a_dtensor_strategy_probe_reaches_the_backward_on_a_cuda_device_thread():
    """On CUDA autograd runs a backward on its device's thread, where DTensor
    keeps sharding decisions of its own: a probed layer norm backward after a
    plain one must run, and a plain one after it must raise again."""
    import subprocess
    import sys

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          os.path.join(ROOT, "benchmarks", "dtensor_norm_probe_ranks.py"), "cuda", "plain", "probed",
                          "plain"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    runs = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("  ")]
    assert len(runs) == 6 and [r.startswith("ran") for r in runs[:3]] == [False, True, False], out
