"""``torchtitan.<variant>.stock``: the case's module parallelized by
torchtitan's own functions (``apply_fsdp_to_decoder`` with its reshard
policy, and for the AC variants its ``FullAC`` or ``SelectiveAC`` per
block), trained as torchtitan's ``Trainer.train_step`` accumulates: one
forward and ``loss.backward()`` per microbatch, FSDP reducing every one, the
loss divided by the step's global token count. On the worker pool's process
group (gloo on CPU).

Grads (``full_tensor()``), outputs and input grads are compared after every
micro-step on every rank against the float64 eager oracle, in torchtitan's
convention (sum over ranks, the loss over global tokens), which ``rank``
undoes through the labels each rank is given.
"""

from __future__ import annotations

from dataclasses import replace
import functools
import importlib.metadata
import importlib.util
from typing import Any

from harness.case.ops import draws_random
from harness.case.spec import Case
from harness.observation import OPTIMIZER_STATE, Observation
from harness.paths.assemble import observation as assemble
from harness.paths.base import STACK_LOOP, Availability, Contract, Options, Repro
from harness.paths.engine_rules import exact_mean, replay_only
from harness.paths.pooled import PooledPath, warm_once
from harness.paths.torchtitan.data import KNOBS, NO_TRAINING_STEP, knobs, trainer_refusal

STOCK = "stock"
# variant -> (activation checkpointing policy, per-block compile), torchtitan's
# ``activation_checkpoint`` and ``compile.enable``
VARIANTS = {"fsdp": ("none", False), "fsdp_ac": ("full", False), "fsdp_sac": ("selective", False),
            "fsdp_compile": ("none", True)}
INSTALL = "pip install 'gradfuzz[torchtitan]'"


# The trainer's runs cannot show these (its activation checkpointing reruns
# blocks inside torchtitan's wrappers, uncounted: NO_RECOMPUTATION's count is
# not taken there either).
BLIND = (*STACK_LOOP, (OPTIMIZER_STATE, NO_TRAINING_STEP))


class TorchtitanPath(PooledPath):
    # Each block's and the root's unsharded grads accumulate through eager's
    # AccumulateGrad within a backward: where plain .backward() already
    # diverges, so does this.
    contract = Contract(retained_grads=True, draws=(KNOBS,), model_parts=True, judged_against="eager.accumulate",
                        blind=BLIND)

    def __init__(self, name: str, ac: str, compiled: bool = False, impl: str = STOCK, world_size: int = 2,
                 timeout: float = 10.0, backend: str | None = None) -> None:
        super().__init__(name, world_size, timeout, backend)
        self.ac, self.compiled, self.impl = ac, compiled, impl
        if compiled:  # fullgraph=True: dynamo refuses the case's tensor hooks and retain_grad (supports says so)
            self.contract = replace(TorchtitanPath.contract, tensor_hooks=False)

    def availability(self) -> Availability:
        if importlib.util.find_spec("torchtitan") is None:
            return Availability(False, f"torchtitan is not installed here: {INSTALL}")
        version = importlib.metadata.version("torchtitan")
        if tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < (0, 3):
            return Availability(False, f"torchtitan {version} has no torchtitan.distributed.fsdp (0.3 moved its "
                                f"parallelize functions there): {INSTALL}")
        where = self.group_availability()
        return where if not where.ok else Availability(True, f"{where.reason}; torchtitan FSDP2, AC {self.ac}"
                                                             f"{', compiled per block' if self.compiled else ''}")

    def supports(self, case: Case) -> str | None:
        if reason := trainer_refusal(case):
            return reason
        if case.dtype != "float32":
            return "torchtitan's FSDP mixed precision takes float32 or bfloat16 parameters, not float64"
        if self.ac != "none" and not knobs(case).preserve_rng and draws_random(case):
            return ("activation checkpointing with preserve_rng_state=False redraws dropout in the recomputation "
                    "(documented by torch.utils.checkpoint)")
        if self.compiled and (case.hooks or case.retain_grad):
            return ("torchtitan compiles each block with fullgraph=True, and dynamo cannot trace a tensor hook or "
                    "retain_grad inside one without a graph break (fullgraph raises at any graph break)")
        block_view, root_view = _views_handed_on(case)
        held = root_view or (block_view if knobs(case).reshard != "never" else "")
        if held:
            return (f"{held} is a view of a weight of the FSDP unit that hands it on, which reshards after forward "
                    f"(the root always does): its unsharded storage is freed under the view (a crash on torch "
                    f"2.13; pytorch/pytorch PR #195862 makes it an error; benchmarks/torchtitan_reshard_view.py)")
        return exact_mean(case, self._world(), "the loss is divided by the global token count, summed")

    def run(self, case: Case) -> Observation:
        warm(self.group)
        outcome = self.group.request({"op": "call", "module": "harness.paths.torchtitan.rank", "case": case.dumps(),
                                      "ac": self.ac, "compile": self.compiled, "impl": self.impl}, self.timeout)
        return assemble(self.name, case, outcome)

    def repro(self, case: Case) -> Repro:
        return replay_only(self.name)


WARM_TIMEOUT = 600.0  # torchtitan's first import in a rank on a loaded 2-core machine


def warm(group: Any) -> None:
    """torchtitan's first import in a rank (its models and configs, and the
    data stack they pull in) took over a minute under load, inside the first
    case's time limit: the case was reported hung, with one rank in an
    import and the other waiting on it in a collective. The ranks import it
    here, once per group and outside any case's time limit."""
    warm_once(group, "harness.paths.torchtitan.rank", WARM_TIMEOUT)


@functools.lru_cache(maxsize=64)
def _views_handed_on(case: Case) -> tuple[str, str]:
    """The first value a block hands to a later block or the outputs that
    aliases a weight only that block holds, and the first output aliasing a
    root weight ("" where none): FSDP2 frees those weights' unsharded storage
    when the unit's forward ends. Found by running the blocks once eagerly."""
    import torch

    from harness.materialize.tensors import Built
    from harness.paths.torchtitan.model import Decoder

    built = Built(case)
    model = Decoder(built, built.params(), torch.device("cpu"), built.dtype, knobs(case).layers)
    env: dict = {n: t.to(built.dtype) for n, t in built.inputs(0).items()}
    env.update({n: model.weight(n) for n, j in model.owner.items() if j < 0})
    root = _storages(model.weight(n) for n, j in model.owner.items() if j < 0)
    built.seed_rng()
    block_view = ""
    with torch.no_grad():
        for block in model.blocks:
            own = _storages(model.weight(n) for n in model.owned_by(block))
            got = block(env)
            env.update(got)
            later = {u.ref for n in case.nodes[block.span[1]:] for u in n.args} | {u.ref for u in case.outputs}
            block_view = block_view or next((n for n in sorted(later & got.keys()) if _storages([got[n]]) & own), "")
    root_view = next((u.ref for u in case.outputs if _storages([env[u.ref]]) & root), "")
    return block_view, root_view


def _storages(values: Any) -> set[int]:
    import torch

    out = set()
    for v in values:
        for t in v if isinstance(v, tuple) else (v,):
            if isinstance(t, torch.Tensor):
                out.add(t.untyped_storage().data_ptr())
    return out


def fsdp_paths(options: Options) -> list[Any]:
    """The FSDP2 / AC / compile variants (``factory.paths`` adds the TP one)."""
    return [TorchtitanPath(f"torchtitan.{v}.stock", ac, compiled, STOCK, options.world_size,
                           max(options.timeout, 60.0), options.backend) for v, (ac, compiled) in VARIANTS.items()]