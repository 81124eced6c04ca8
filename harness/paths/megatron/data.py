"""The megatron family's part of a case: the ``DistributedDataParallelConfig``
fields a user sets (and the ``shared_embedding`` mark megatron gives a tied
embedding), each a draw that shrinks to megatron's default; for
``megatron.pp.*`` also where the node list is cut into the two pipeline
stages and the ``ModelParallelConfig`` p2p fields."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from harness.case import schema as sc
from harness.case.namespace import DataNamespace
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


def knobs(case: Case) -> Knobs:
    return case.data("megatron") or Knobs()


def ddp_config(case: Case, distopt: bool) -> dict:
    """The ``DistributedDataParallelConfig`` fields of a case, as keyword arguments."""
    k = knobs(case)
    return {"overlap_grad_reduce": k.overlap, "bucket_size": k.bucket or None, "use_distributed_optimizer": distopt,
            "grad_reduce_in_fp32": k.fp32_reduce, "check_for_nan_in_grad": k.nan_check,
            "average_in_collective": False}


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


@st.composite
def _pp_knobs(draw, case: Case, stages: int) -> Case:
    """The DDP knobs of each stage (``shared`` is not drawn: a pipeline marks
    its shared weight as megatron does, always), one cut, drawn as a pick
    among the free node positions so that it shrinks towards the first, and
    the p2p fields."""
    overlap = draw(st.booleans())
    free = list(range(1, len(case.nodes)))
    tied = tied_cuts(case)
    # Half the cases cut between two uses of one weight where the case has
    # such a place (a random cut splits one in about one case in eight).
    pool = tied if tied and not draw(st.booleans()) else free
    cut = pool[draw(st.integers(0, 255)) % len(pool)] if pool else 0
    k = Knobs(overlap, draw(st.sampled_from(BUCKETS)) if overlap else 0,
              case.dtype == "float32" and draw(st.booleans()), draw(st.booleans()), False, cut,
              not draw(st.booleans()), draw(st.booleans()), pow2(case.schedule.microbatches) and draw(st.booleans()),
              draw(st.booleans()))
    return case.with_data("megatron", None if k == Knobs() else k)


def pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(case: Case, k: Knobs, where: str) -> None:
    if k.cut and not 0 < k.cut < len(case.nodes):
        raise SpecError(f"{where}.cut", f"a cut must be a node position in 1..{len(case.nodes) - 1}, got {k.cut}")


KNOBS = Draw("megatron", (_knobs,))
# Its own args, so that the pp paths' contract differs from the ddp paths'
# (a Draw compares by name and args) and each gets its own case stream.
PP_KNOBS = Draw("megatron", (_pp_knobs,), (2,))
CASE_DATA = DataNamespace("megatron", Knobs, {
    "overlap": sc.boolean, "bucket": lambda v, w: sc.integer(v, w, 0, 2**31),
    "fp32_reduce": sc.boolean, "nan_check": sc.boolean, "shared": sc.boolean,
    "cut": lambda v, w: sc.integer(v, w, 0, 256), "batch_p2p": sc.boolean, "deallocate": sc.boolean,
    "per_token": sc.boolean, "distopt": sc.boolean,
}, check=_check)
