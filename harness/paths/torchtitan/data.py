"""The torchtitan family's part of a case: the knobs of torchtitan's config
that reach its parallelize functions, and where the case is cut into the
transformer blocks (``model.layers``) those functions wrap one by one.
Each draw shrinks to torchtitan's default (and to no cut).

The ``torchtitan.tp`` path reads the rest: a small Llama config for
torchtitan's own ``Llama3Model`` (heads, kv heads, head size, layers,
vocabulary, ``multiple_of``, norm eps, weight tying), its token batches
(sequence length, batch, labels set to ``IGNORE_INDEX``, the seed of the
weights and tokens) and the parallelism switches (sequence parallel, loss
parallel). The FSDP paths never read them and their draw leaves them at
the defaults; every field has a default, so older case files still load."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from harness.case import schema as sc
from harness.case.namespace import DataNamespace, check_cuts, cuts
from harness.case.spec import Case
from harness.case.vocab import SpecError
from harness.generate import Draw

# parallelism.fsdp_reshard_after_forward
POLICIES = ("default", "always", "never")
# activation_checkpoint.determinism_check (torch.utils.checkpoint's choices)
DETERMINISM = ("default", "none")


@dataclass(frozen=True)
class Knobs:
    reshard: str = "default"
    layers: tuple[int, ...] = ()  # cut positions in case.nodes: a block per span; none: one block
    preserve_rng: bool = True  # activation_checkpoint.preserve_rng_state
    determinism: str = "default"
    # torchtitan.tp: the generated Llama (dim = heads * head_dim) and its data
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 2
    n_layers: int = 1
    vocab: int = 8
    multiple_of: int = 2
    eps_exp: int = 5  # norm eps = 10 ** -eps_exp
    tie: bool = False  # Decoder.Config.enable_weight_tying
    sp: bool = True  # parallelism.enable_sequence_parallel
    loss_parallel: bool = True  # the vocab-sharded lm_head output into the loss (see tp_rank)
    seq: int = 4
    batch: int = 1
    ignored: int = 0  # labels set to IGNORE_INDEX in each microbatch
    seed: int = 0


def knobs(case: Case) -> Knobs:
    return case.data("torchtitan") or Knobs()


@st.composite
def _knobs(draw, case: Case) -> Case:
    free = list(range(1, len(case.nodes)))
    picks = draw(st.lists(st.integers(0, 255), max_size=min(3, len(free))))
    layers = tuple(sorted({free.pop(r % len(free)) for r in picks if free}))
    k = Knobs(draw(st.sampled_from(POLICIES)), layers, not draw(st.booleans()), draw(st.sampled_from(DETERMINISM)))
    return case.with_data("torchtitan", None if k == Knobs() else k)


KNOBS = Draw("torchtitan", (_knobs,))

# Two TP ranks. torchtitan requires the TP degree to divide heads and kv heads
# (``Decoder.Config.update_from_config`` raises otherwise) and, with sequence
# parallelism, the sequence length (``Trainer.__init__``: "Training sequence
# length must be divisible by ..."); those are drawn even. RoPE rotates
# pairs, so the head size is even. The vocabulary and the FFN width
# (``multiple_of`` 1 gives an odd one) may split unevenly: torchtitan's
# vocab-parallel embedding and loss, and DTensor's colwise shards, take that.
TP = 2


@st.composite
def _llama(draw, case: Case) -> Case:
    heads = draw(st.sampled_from((2, 4)))
    kv = draw(st.sampled_from(tuple(d for d in (2, 4) if heads % d == 0)))
    sp = not draw(st.booleans())
    seq = draw(st.sampled_from((4, 2, 6, 8) if sp else (4, 2, 3, 5, 6, 7, 8)))
    k = Knobs(heads=heads, kv_heads=kv, head_dim=draw(st.sampled_from((2, 4))), n_layers=draw(st.integers(1, 3)),
              vocab=draw(st.integers(8, 33) | st.integers(2, 7)),
              multiple_of=draw(st.sampled_from((2, 1, 4, 8, 16))),
              eps_exp=draw(st.sampled_from((5, 6))), tie=draw(st.booleans()), sp=sp,
              loss_parallel=not draw(st.booleans()), seq=seq, batch=draw(st.integers(1, 2)),
              ignored=draw(st.integers(0, seq - 1)), seed=draw(st.integers(0, 2**16 - 1)))
    return case.with_data("torchtitan", None if k == Knobs() else k)


LLAMA = Draw("torchtitan.tp", (_llama,))


def _even(lo: int, hi: int):
    def check(v, w):
        n = sc.integer(v, w, lo, hi)
        if n % TP:
            raise SpecError(w, f"must be a multiple of {TP} (the tensor-parallel degree), got {n}")
        return n
    return check


def _check(case: Case, v: Knobs, where: str) -> None:
    check_cuts(case, v.layers, f"{where}.layers")
    if v.heads % v.kv_heads:
        raise SpecError(f"{where}.kv_heads", f"must divide heads ({v.heads}), got {v.kv_heads}")
    if v.sp and v.seq % TP:
        raise SpecError(f"{where}.seq", f"with sequence parallel the sequence length must be a multiple of {TP} "
                                        f"(torchtitan's Trainer refuses others), got {v.seq}")
    if v.ignored >= v.seq:
        raise SpecError(f"{where}.ignored", f"must leave a label in each sequence of {v.seq}, got {v.ignored}")
CASE_DATA = DataNamespace("torchtitan", Knobs, {
    "reshard": lambda v, w: sc.string(v, w, choices=POLICIES),
    "layers": cuts(3),
    "preserve_rng": sc.boolean,
    "determinism": lambda v, w: sc.string(v, w, choices=DETERMINISM),
    "heads": _even(2, 8), "kv_heads": _even(2, 8), "head_dim": _even(2, 8),
    "n_layers": lambda v, w: sc.integer(v, w, 1, 4), "vocab": lambda v, w: sc.integer(v, w, 2, 64),
    "multiple_of": lambda v, w: sc.integer(v, w, 1, 32),
    "eps_exp": lambda v, w: sc.integer(v, w, 1, 8), "tie": sc.boolean, "sp": sc.boolean,
    "loss_parallel": sc.boolean, "seq": lambda v, w: sc.integer(v, w, 2, 16),
    "batch": lambda v, w: sc.integer(v, w, 1, 4),
    "ignored": lambda v, w: sc.integer(v, w, 0, 15), "seed": lambda v, w: sc.integer(v, w, 0, 2**31 - 1),
}, check=_check)


NO_TRAINING_STEP = "the trainer's optimizer and clipping are not driven here: grads are compared, not a step"


def trainer_refusal(case: Case) -> str | None:
    """What torchtitan's trainer owns, for every path of the family: the
    engine's parts, the optimizer step and clipping (grads are compared, not
    a step), and the grads at a step's start (train_step zeroes them)."""
    from harness.paths.engine_rules import engine_owned

    s = case.schedule
    if reason := engine_owned(case, "torchtitan's trainer"):
        return reason
    if s.optimizer or s.clip:
        return NO_TRAINING_STEP
    if s.grad_init != "none" or s.zero_grad == "keep":
        return "torchtitan's train_step zeroes every grad at the start of each step (no prefilled or kept grads)"
    return None
