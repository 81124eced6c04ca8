"""Outside workarounds of known bugs, as the code that builds and trains a case applies them.

A ledger entry names what a user would do to avoid its bug without
touching the machinery (``harness.paths.workarounds`` says which paths can
apply which). "Known" is causal: a finding is that bug only when running
the same case again with the workaround in force removes it. The workarounds
in force for the run in this process are a context variable, so a path that
builds its parameters and trainer here (``make_params``, ``Trainer``) needs
no code of its own to take them.

Beside them are the fix probes (``harness.materialize.probes``): for a bug
nothing outside removes, the in-process patch of torch that removes exactly
it. They are named, carried and put in force the same way (``in_force``
patches torch here for what runs inside, in every process a case message
reaches), but they are a check, never advice: ``KINDS`` says which is which
and reports keep them apart.
"""

from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch

from harness.materialize import probes

ACTIVE: ContextVar[frozenset[str]] = ContextVar("gradfuzz_workarounds", default=frozenset())

# name -> what a user does, in one sentence (shown in reports beside "known").
WORKAROUNDS = {
    "clone-grads": "register a hook on every parameter that returns a clone of its incoming grad "
                   "(AccumulateGrad then never adopts a view of a shared buffer)",
    "optimizer-for-loop": "construct the optimizer with foreach=False (and without fused=True): the for-loop step",
    "split-clone-adopted": "after stage_backward_weight, replace each .grad it set on a parameter whose .grad was None "
                           "by a contiguous clone",
    "stage-example-args": "construct each PipelineStage with input_args and output_args (one microbatch's real "
                          "activations), so the schedule skips its metadata inference",
    # A misuse finding's fix (docs/gate.md "Misuse findings"): a path that makes them applies it itself.
    "documented-drive": "drive the stack as its docs say: the same case without the misuse",
    # Megatron's answer to NVIDIA/Megatron-LM#750 (pipeline size 2): its paths apply it themselves.
    "paired-p2p": "run megatron's pipeline schedule with batch_p2p_comm off (paired isend/irecv, not batch_isend_irecv)",
    # DeepSpeed's PyTorch-style drive (loss.backward() on the engine's outputs): its paths apply it themselves.
    "engine-backward": "call engine.backward(loss) instead of loss.backward() (the engine scales the loss once)",
    # megatron-core DDP with overlap_grad_reduce: its paths apply it themselves.
    "no-overlap-grad-reduce": "run megatron's DistributedDataParallel with overlap_grad_reduce off (the grads "
                              "reduced after the window's last backward, no buckets waiting on hooks)",
}
WORKAROUND = "workaround"
# Every named effect the gate can put in force: the workarounds, then the fix probes.
EFFECTS = {**WORKAROUNDS, **{n: p.effect for n, p in probes.PROBES.items()}}
KINDS = {n: (WORKAROUND if n in WORKAROUNDS else probes.KIND) for n in EFFECTS}


def _none_in_child() -> None:
    """A process forked inside ``in_force`` (a worker pool restarted during
    the gate's worked-around run) has in force only what its messages name."""
    ACTIVE.set(frozenset())


os.register_at_fork(after_in_child=_none_in_child)


@contextmanager
def in_force(*names: str, here: bool = True) -> Iterator[None]:
    """``names`` in force for what runs inside: the gate's worked-around run
    here, or a worker's case whose message names them (names outside
    ``EFFECTS`` are not applied). A fix probe among them patches torch in
    this process until the block ends (one not in force already: nested
    blocks patch once); not ``here``, where the case runs in a child that
    the message reaches, so checks of such paths can run side by side
    without one's patch reaching another's oracle."""
    before = ACTIVE.get()
    added = {n for n in names if n in EFFECTS}
    token = ACTIVE.set(before | added)
    try:
        with ExitStack() as stack:
            for n in sorted(added - before):
                if here and n in probes.PROBES:
                    stack.enter_context(probes.patch(n))
            yield
    finally:
        ACTIVE.reset(token)


def in_force_now() -> list[str]:
    """What a message to a worker carries, so the workaround reaches where the case runs."""
    return sorted(ACTIVE.get())


def _cloned(grad: torch.Tensor) -> torch.Tensor:
    """A fresh copy of ``grad`` as it arrives. A DTensor grad is copied shard
    by shard with its placements kept: ``torch.clone`` of a Partial grad
    would reduce it first (a collective per parameter), which no user's
    clone hook means and a path's collective count would report."""
    to_local = getattr(grad, "to_local", None)
    if to_local is None:
        return grad.clone()
    return type(grad).from_local(to_local().clone(), grad.device_mesh, grad.placements, run_check=False,
                                 shape=grad.shape, stride=grad.stride())


def on_params(params: dict[str, torch.nn.Parameter]) -> None:
    """What the workarounds in force do to freshly made parameters."""
    if "clone-grads" in ACTIVE.get():
        for p in params.values():
            if p.requires_grad:
                p.register_hook(_cloned)


def stage_example_args(wanted: bool = False) -> bool:
    """Whether pipeline stages are built with example activations: the
    stage-example-args workaround in force, or a stage class that takes
    them (``wanted``) as the fixed reference does."""
    return wanted or "stage-example-args" in ACTIVE.get()


def optimizer_impl(impl: str) -> str:
    """The optimizer implementation the case names ("" is torch's choice), or
    the for-loop one when that workaround is in force."""
    return "for_loop" if "optimizer-for-loop" in ACTIVE.get() else impl
