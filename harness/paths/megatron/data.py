"""The megatron family's part of a case: the ``DistributedDataParallelConfig``
fields a user sets (and the ``shared_embedding`` mark megatron gives a tied
embedding), each a draw that shrinks to megatron's default; for
``megatron.pp.*`` also where the node list is cut into the two pipeline
stages and the ``ModelParallelConfig`` p2p fields; for ``megatron.vpp.*`` the
three cuts into four virtual stages and the interleaved schedule's own
fields."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from hypothesis import strategies as st

from harness.case import schema as sc
from harness.case.namespace import DataNamespace, check_cuts
from harness.case.namespace import cuts as cuts_checker
from harness.case.spec import Case
from harness.case.vocab import SpecError
from harness.generate import Draw

# bucket_size in elements (read only with overlap_grad_reduce, as megatron
# does): 0 = megatron's default (one bucket here); 1 = every parameter its
# own bucket; 40 = a few parameters a bucket, tied ones apart now and then.
BUCKETS = (0, 1, 40)


@dataclass(frozen=True)
class Knobs:
    overlap: bool = False  # overlap_grad_reduce
    bucket: int = 0  # bucket_size (0: megatron's default)
    fp32_reduce: bool = False  # grad_reduce_in_fp32
    nan_check: bool = False  # check_for_nan_in_grad
    shared: bool = False  # param.shared_embedding on tied parameters (own bucket under the distributed optimizer)
    # megatron.pp.* only (the ddp paths ignore them):
    cut: int = 0  # nodes[cut:] are the second pipeline stage (0: not cut; the pp paths refuse it)
    batch_p2p: bool = True  # ModelParallelConfig.batch_p2p_comm (batch_isend_irecv, else paired isend/irecv)
    deallocate: bool = False  # ModelParallelConfig.deallocate_pipeline_outputs (custom_backward on a freed output)
    # TransformerConfig.calculate_per_token_loss: each microbatch's loss function reports one token, the schedule
    # does not divide the loss, and finalize_model_grads broadcasts the token count from the last stage and
    # scales the grad buffers by 1 / tokens
    per_token: bool = False
    # DistributedDataParallelConfig.use_distributed_optimizer on each stage (data-parallel size 1: one shard, but the
    # bucket layout, padding and the shared_embedding's own bucket are the distributed optimizer's)
    distopt: bool = False
    # megatron.vpp.* only: nodes cut into four virtual stages at these three positions (stage s on rank s % 2, as
    # model chunk s // 2); ModelParallelConfig.microbatch_group_size_per_vp_stage (0: megatron's default, the
    # pipeline size) and overlap_p2p_comm (the interleaved schedule's async p2p, only without batch_p2p_comm)
    cuts: tuple[int, ...] = ()
    group: int = 0
    overlap_p2p: bool = False


def knobs(case: Case) -> Knobs:
    return case.data("megatron") or Knobs()


def ddp_config(case: Case, distopt: bool) -> dict:
    """The ``DistributedDataParallelConfig`` fields of a case, as keyword arguments."""
    k = knobs(case)
    return {"overlap_grad_reduce": k.overlap, "bucket_size": k.bucket or None, "use_distributed_optimizer": distopt,
            "grad_reduce_in_fp32": k.fp32_reduce, "check_for_nan_in_grad": k.nan_check,
            "average_in_collective": False}


def model_config(case: Case, chunks: int) -> dict:
    """The ``ModelParallelConfig`` p2p and schedule fields of a pipeline case
    (``chunks`` model chunks a rank), as keyword arguments: JSON data, so the
    path's ranks and its standalone script set the same ones."""
    k = knobs(case)
    out = {"batch_p2p_comm": k.batch_p2p, "deallocate_pipeline_outputs": k.deallocate,
           "calculate_per_token_loss": k.per_token}
    if chunks > 1:
        out.update({"virtual_pipeline_model_parallel_size": chunks, "overlap_p2p_comm": k.overlap_p2p,
                    "microbatch_group_size_per_vp_stage": k.group or None})
    return out


@st.composite
def _knobs(draw, case: Case) -> Case:
    overlap = draw(st.booleans())
    k = Knobs(overlap, draw(st.sampled_from(BUCKETS)) if overlap else 0,
              case.dtype == "float32" and draw(st.booleans()), draw(st.booleans()), draw(st.booleans()))
    return case.with_data("megatron", None if k == Knobs() else k)


def tied_cuts(case: Case) -> list[int]:
    """Cut positions with exactly one parameter used on both sides (the
    outputs count as after the last node): megatron's shared weight."""
    params = {p.name for p in case.params}
    out = []
    for c in range(1, len(case.nodes)):
        before = {u.ref for n in case.nodes[:c] for u in n.args} & params
        after = ({u.ref for n in case.nodes[c:] for u in n.args} | {u.ref for u in case.outputs}) & params
        if len(before & after) == 1:
            out.append(c)
    return out


def stage_uses(case: Case, cuts: tuple[int, ...]) -> dict[str, set[int]]:
    """Which stages use each parameter, for cuts at ``cuts`` (the outputs
    count as the last stage's)."""
    params = {p.name for p in case.params}
    edges = [*cuts, len(case.nodes)]
    out: dict[str, set[int]] = {}
    for i, node in enumerate(case.nodes):
        s = next(j for j, e in enumerate(edges) if i < e)
        for u in node.args:
            if u.ref in params:
                out.setdefault(u.ref, set()).add(s)
    for u in case.outputs:
        if u.ref in params:
            out.setdefault(u.ref, set()).add(len(cuts))
    return out


def tied_vcuts(case: Case, stages: int) -> list[tuple[int, ...]]:
    """Cut triples (``stages - 1`` cuts) under which one parameter, and only
    it, is used by more than one stage, by the first and the last only:
    megatron's word embedding and output layer on the first and last virtual
    stage."""
    out = []
    for cuts in itertools.combinations(range(1, len(case.nodes)), stages - 1):
        many = [s for s in stage_uses(case, cuts).values() if len(s) > 1]
        if len(many) == 1 and many[0] == {0, stages - 1}:
            out.append(cuts)
    return out


def groups(microbatches: int, pipeline: int) -> list[int]:
    """The ``microbatch_group_size_per_vp_stage`` values megatron's
    interleaved schedule accepts for ``microbatches`` (0: its default, the
    pipeline size): at least the pipeline size and at most the microbatches,
    with a remainder of 0 or at least the pipeline size
    (``forward_backward_pipelining_with_interleaving``)."""
    ok = [g for g in range(pipeline, microbatches + 1) if microbatches % g == 0 or microbatches % g >= pipeline]
    return [0 if g == pipeline else g for g in ok]


@st.composite
def _pp_knobs(draw, case: Case, stages: int) -> Case:
    """The DDP knobs of each stage (``shared`` is not drawn: a pipeline marks
    its shared weight as megatron does, always), the cuts, drawn as a pick
    among the free node positions so that they shrink towards the first, and
    the p2p fields; with four stages (``megatron.vpp``) three cuts, the
    microbatch group and ``overlap_p2p_comm``."""
    overlap = draw(st.booleans())
    if stages == 2:
        free: list = list(range(1, len(case.nodes)))
        tied: list = tied_cuts(case)
    else:
        free = list(itertools.combinations(range(1, len(case.nodes)), stages - 1))
        tied = tied_vcuts(case, stages)
    # Half the cases cut between two uses of one weight where the case has
    # such a place (a random cut splits one in about one case in eight).
    pool = tied if tied and not draw(st.booleans()) else free
    picked = pool[draw(st.integers(0, 255)) % len(pool)] if pool else ()
    cut, cuts = (picked or 0, ()) if stages == 2 else (0, tuple(picked))
    k = Knobs(overlap, draw(st.sampled_from(BUCKETS)) if overlap else 0,
              case.dtype == "float32" and draw(st.booleans()), draw(st.booleans()), False, cut,
              not draw(st.booleans()), draw(st.booleans()), pow2(case.schedule.microbatches) and draw(st.booleans()),
              draw(st.booleans()), cuts)
    if stages > 2:  # drawn after the two-stage knobs, so megatron.pp's case stream is as it was
        choices = groups(case.schedule.microbatches, 2)
        group = choices[draw(st.integers(0, 255)) % len(choices)] if choices and draw(st.booleans()) else 0
        k = replace(k, group=group, overlap_p2p=not k.batch_p2p and draw(st.booleans()))
    return case.with_data("megatron", None if k == Knobs() else k)


def pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(case: Case, k: Knobs, where: str) -> None:
    if k.cut and not 0 < k.cut < len(case.nodes):
        raise SpecError(f"{where}.cut", f"a cut must be a node position in 1..{len(case.nodes) - 1}, got {k.cut}")
    check_cuts(case, k.cuts, f"{where}.cuts")
    if k.overlap_p2p and k.batch_p2p:
        raise SpecError(f"{where}.overlap_p2p", "overlap_p2p_comm needs batch_p2p false: megatron raises \"Can not "
                        "use both overlap_p2p_comm and batch_p2p_comm\"")


KNOBS = Draw("megatron", (_knobs,))
# Its own args, so that the pp paths' contract differs from the ddp paths'
# (a Draw compares by name and args) and each gets its own case stream.
PP_KNOBS = Draw("megatron", (_pp_knobs,), (2,))
VPP_KNOBS = Draw("megatron", (_pp_knobs,), (4,))
CASE_DATA = DataNamespace("megatron", Knobs, {
    "overlap": sc.boolean, "bucket": lambda v, w: sc.integer(v, w, 0, 2**31),
    "fp32_reduce": sc.boolean, "nan_check": sc.boolean, "shared": sc.boolean,
    "cut": lambda v, w: sc.integer(v, w, 0, 256), "batch_p2p": sc.boolean, "deallocate": sc.boolean,
    "per_token": sc.boolean, "distopt": sc.boolean, "cuts": cuts_checker(3),
    "group": lambda v, w: sc.integer(v, w, 0, 256), "overlap_p2p": sc.boolean,
}, check=_check)
