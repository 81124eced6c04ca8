"""What the ``func.*`` paths take: their contract, and each refusal with its reason.

torch.func differentiates a function of its arguments, so what eager
autograd offers beyond that is outside it: an intermediate's
``retain_grad`` (refused inside a transform), hooks on parameters (no
AccumulateGrad runs), and, under ``vmap``, anything that is not one
computation batched over the microbatches.
"""

from __future__ import annotations

import dataclasses

from harness.case.spec import Case
from harness.observation import HOOK_FIRING, HOOK_KEPT, LAYOUT, LIFETIME, PLACEMENT, RECOMPUTATION, RETAINED
from harness.paths.base import Contract
from harness.paths.engine_rules import lifetime_schedule

BLIND = (
    (RETAINED, "torch.func refuses retain_grad inside a transform (Tensor.retain_grad() raises): an intermediate "
               "has no .grad, so cases with retain_grad are refused"),
    (HOOK_KEPT, "parameter hooks (register_hook, register_post_accumulate_grad_hook) hang on AccumulateGrad, which "
                "no func path runs: the transforms hand grads back and the loop writes .grad"),
    (LAYOUT, "torch.func hands grads back and never writes .grad; the path's own loop copies each into a tensor laid "
             "out like its parameter, so a .grad's strides say nothing about the machinery"),
    (LIFETIME, "no graph outlives the call: grad() differentiates inside its own call, vjp's function is dropped "
               "after its one use; the saved-tensor watch of the eager loop does not apply inside a transform"),
    (RECOMPUTATION, "no checkpointed regions: a transform runs the forward once per call, there is no count to "
                    "compare"),
    (PLACEMENT, "one process and plain tensors: a grad has no placements and accumulating it issues no collective"),
)

# Where plain .backward() diverges too (an optimizer step, shared through
# torch.optim), a divergence is not held against the func paths: their
# training step is eager's.
CONTRACT = Contract(retained_grads=False, gap_cases=True, model_parts=True, grad_layout=False, graph_freed=False,
                    judged_against="eager.accumulate", blind=BLIND)
# The twin runs autograd's engine on the same leaves; its graph is freed by
# autograd.grad, so it is held to that as eager is.
TWIN_CONTRACT = dataclasses.replace(
    CONTRACT, graph_freed=True, blind=tuple(b for b in BLIND if b[0] != LIFETIME))

# vmap takes no tensor hooks (one would fire once per step, not per
# microbatch), so they are not drawn for it: drawn and refused, they cost
# it more than half of a shared target's cases. Its own target, then.
VMAP_CONTRACT = dataclasses.replace(CONTRACT, tensor_hooks=False, blind=BLIND + (
    (HOOK_FIRING, "under vmap a tensor hook fires once for a whole step's batch, not once per microbatch's backward "
                  "as eager fires it: tensor hooks are not drawn for it, and cases with them are refused"),))

# Ops of torch's OpInfo table (``opinfo`` nodes) that write running
# statistics into a buffer the op's call holds (one per case, not per microbatch).
RUNNING_STATS = ("batch_norm", "instance_norm")

# Ops that write into their first operand (on a fresh copy of it).
IN_PLACE = {"mul_", "add_", "relu_"}


def refuse(case: Case) -> str | None:
    """Why a case is outside ``func.grad``, ``func.vjp`` and ``func.eager`` (None: inside)."""
    if case.retain_grad:
        return "retain_grad on an intermediate: torch.func raises on Tensor.retain_grad() inside a transform"
    if case.schedule.param_hooks:
        return ("parameter hooks: they fire from AccumulateGrad, which no func path runs (the transform hands the "
                "grads back, the loop writes .grad)")
    return lifetime_schedule(case)


def refuse_vmap(case: Case) -> str | None:
    """``refuse``, and what one batched computation over a step's microbatches cannot be."""
    if reason := refuse(case):
        return reason
    if case.hooks:
        return ("tensor hooks: under vmap a hook fires once for the whole step's batch, not once per microbatch's "
                "backward as eager fires it")
    for node in case.nodes:
        fn = str(node.attr("fn", ""))
        if node.op == "opinfo" and any(norm in fn for norm in RUNNING_STATS):
            return (f"{fn} may update running statistics in place: vmap writes no batched value into an unbatched "
                    f"buffer (torch.func documents batch norm's running stats as unsupported under vmap)")
    batched = _batched(case)
    for node in case.nodes:
        if node.op in IN_PLACE and node.args[0].ref not in batched and any(u.ref in batched for u in node.args[1:]):
            return (f"{node.op} writes an input-dependent value into {node.args[0].ref}, which depends on "
                    f"parameters only: vmap cannot write a per-microbatch value into a tensor the microbatches share")
    return None


def _batched(case: Case) -> set[str]:
    """The names whose values differ between microbatches: the inputs and
    every node computed from one."""
    batched = {x.name for x in case.inputs}
    for node in case.nodes:
        if any(u.ref in batched for u in node.args):
            batched.add(node.name)
    return batched
