"""``mesh.*``: 2-D device meshes ("dp", "tp") of 4 ranks.

- ``mesh.fsdp_tp.stock``: tensor parallelism over "tp" (``parallelize_module``
  with ColwiseParallel / RowwiseParallel for weights used as ``h @ w``, every
  other parameter Replicate) composed with FSDP2 ``fully_shard`` over "dp";
  the dp groups get different shares of each grad output, so FSDP2's mean is
  the oracle's grad.
- ``mesh.fsdp_tp.fixed``: ``oracles.mesh_fixed``, the same promise kept with
  plain tensors and all-reduces over the mesh's "tp" and "dp" groups.
- ``mesh.dtensor2d.stock`` / ``.fixed``: parameters as DTensors with a
  placement on each mesh dim, the forward on DTensors; fixed installs
  ``oracles.dtensor_fixed`` as ``dtensor.fixed`` does on one dim.

Values are compared after every backward (full tensors, assembled by
``harness.paths.assemble``), with the replica rule (every rank sees the
same grad) and the layout rule (``.grad``'s local strides as its
parameter's). The AccumulateGrad placement and collective rules of
``dtensor.*`` are written for one mesh dim and are not applied here
(``PLACEMENT`` is blind).

The group is the worker pool's at world size 4 (``pool.group(4, backend)``),
whatever ``--world-size`` says: the pool is keyed by world size, so it is a
group of its own beside the 2-rank one the other families share (and the
same one with ``--world-size 4``). Under torchrun the paths run only when the
launcher started 4 ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.version import Version

from harness.case.spec import Case
from harness.generate import tp_eligible
from harness.observation import PLACEMENT, Observation
from harness.paths.assemble import observation
from harness.paths.base import NO_RECOMPUTATION, RANK_LOOP, RNG_NOT_COMPARED, Availability, Contract, Options, Repro
from harness.paths.engine_rules import replay_only
from harness.paths.mesh.data import STYLES, placements, split
from harness.paths.mesh.strategy import MESH
from harness.paths.pooled import PooledPath

WORLD = 4
STOCK = "stock"
FIXED = {"fsdp_tp": "oracles.mesh_fixed", "dtensor2d": "oracles.dtensor_fixed"}
# A 4-rank case on a loaded machine takes seconds: a hang is told from slowness by a longer wait.
MIN_TIMEOUT = 60.0

_REFUSES_INPLACE_REDISTRIBUTION = Version(torch.__version__.split("+")[0]) < Version("2.13")

NOT_2D = (PLACEMENT, "the mesh paths report full values only: the AccumulateGrad placement and collective rules "
                     "are written for a 1-d mesh (dtensor.*)")


class MeshPath(PooledPath):
    contract = Contract(retained_grads=True, draws=(MESH,), model_parts=True,
                        blind=(*RANK_LOOP, NO_RECOMPUTATION, RNG_NOT_COMPARED, NOT_2D))

    def __init__(self, name: str, kind: str, impl: str, timeout: float = 10.0, backend: str | None = None) -> None:
        super().__init__(name, WORLD, max(timeout, MIN_TIMEOUT), backend)
        self.kind = kind
        self.impl = impl
        self.broken = ""  # why the 4-rank group could not start, once it failed to

    def availability(self) -> Availability:
        if self.broken:
            return Availability(False, self.broken)
        if self._world() != WORLD:  # before group_availability, which joins torchrun's group
            return Availability(False, f"the mesh paths need {WORLD} ranks (a 2 x 2 mesh); torchrun started "
                                       f"{self._world()}")
        where = self.group_availability()
        if not where.ok:
            return where
        try:
            import importlib

            needs = [("torch.distributed.device_mesh", "init_device_mesh"), ("torch.distributed.tensor", "distribute_tensor")]
            if self.kind == "fsdp_tp":
                needs += [("torch.distributed.fsdp", "fully_shard"), ("torch.distributed.tensor.parallel", "parallelize_module")]
            for module, attr in needs:
                if not hasattr(importlib.import_module(module), attr):
                    raise ImportError(f"{module} has no {attr}")
        except ImportError as e:
            return Availability(False, f"this torch lacks what a 2-D mesh needs ({e})")
        what = "torch as installed" if self.impl == STOCK else self.impl
        return Availability(True, f"{where.reason}, mesh (dp=2, tp=2); {self.kind}: {what}")

    def supports(self, case: Case) -> str | None:
        s = case.schedule
        if s.events or s.retain_outputs or s.param_hooks:
            return "buffer-lifetime schedules (allocator events, held outputs, parameter hooks) are the graphed paths'"
        if s.optimizer and s.optimizer_impl == "fused":
            return "fused optimizers have no DTensor sharding strategy on every torch (the parameters are DTensors)"
        if s.optimizer == "rprop":
            return ("rprop on sharded DTensor parameters: its foreach form needs _foreach_copy_, its loop form an "
                    "in-place index_put_, neither with a sharding strategy that keeps the shards")
        from harness.case.ops import OPS

        plain = sorted({n.op for n in case.nodes if OPS[n.op].plain_tensors})
        if plain:
            return (f"{', '.join(plain)} build(s) a plain index or mask tensor inside the forward: DTensor refuses "
                    f"mixed operands (the forward runs on DTensors)")
        inplace = sorted({n.op for n in case.nodes if n.op.endswith("_")})
        if inplace and _REFUSES_INPLACE_REDISTRIBUTION:
            return (f"{', '.join(inplace)} in place on a DTensor: this torch's DTensor refuses in-place ops that "
                    f"change a placement; 2.13 takes them")
        if any(n.op == "sdpa" for n in case.nodes):
            return ("scaled_dot_product_attention falls back to the math kernel, which builds a plain attention "
                    "bias: DTensor refuses mixed operands")
        if any(n.op == "layout_matmul" and n.attr("layout") == "buffer_view" for n in case.nodes):
            return "a buffer_view grad copies a DTensor into a plain buffer (DTensor refuses mixed operands)"
        codes = dict(zip((p.name for p in case.params), placements(case)))
        styled = [p.name for p in case.params if split(codes[p.name])[1] in STYLES]
        if any(not tp_eligible(case, n) for n in styled):
            return "a tensor-parallel style needs a weight used only as the right operand of a matmul (h @ w)"
        unused = _unused_output(case)
        if unused:
            return (f"an output of a multi-output {unused} is unused: torch materializes its missing grad as a plain "
                    f"tensor, not a DTensor, and the backward mixes the two (a Function's raises, see cases/dtensor/; "
                    f"chunk's cat raises 'got mixed torch.Tensor and DTensor' on 2.13, on the fixed paths too: "
                    f"cases/pipeline/inner_chunk_output_stride_mismatch.json)")
        sharded = styled if self.kind == "fsdp_tp" else [n for n, c in codes.items() if c != "R,R"]
        if inplace and sharded:
            return (f"{', '.join(inplace)} in place with sharded parameters: a value can be Partial (sum, or avg "
                    f"from a mean over a sharded dim), and DTensor refuses in-place ops that would change it ('in-place "
                    f"operations that require placement changes are not supported', raised on 2.13 on the fixed path too)")
        if sharded and any(n.op == "reshape" for n in case.nodes):
            return ("a reshape with sharded parameters: DTensor refuses views that would shard a dim unevenly "
                    "(\"Please redistribute the tensor before this operation\", pytorch/pytorch#143372)")
        if self.kind == "dtensor2d":
            thin = _thin(case, codes)
            writes = (s.grad_init != "none" or s.microbatches > 1 or s.optimizer or s.clip
                      or (s.steps > 1 and s.zero_grad != "set_to_none"))
            expanded = {u.ref for n in case.nodes if n.op == "expand" for u in n.args}
            if thin & expanded:
                return (f"expand of {', '.join(sorted(thin & expanded))}, sharded on a dim with fewer elements than "
                        f"the ranks that shard it: DTensor's sharding propagation raises a bare KeyError (torch bug, "
                        f"seen on 2.13 on one mesh dim: _rewrite_plain_shard)")
            if thin and writes:
                return (f"{', '.join(sorted(thin))} sharded on a dim with fewer elements than the ranks that shard it: "
                        f"DTensor has no in-place strategy for it, so accumulating into its .grad raises (torch bug, "
                        f"see cases/dtensor/)")
        return None

    def run(self, case: Case) -> Observation:
        from harness.workers.pool import PoolError

        try:
            outcome = self.group.request({"op": "call", "module": "harness.paths.mesh.rank", "case": case.dumps(),
                                          "kind": self.kind, "impl": self.impl}, self.timeout)
        except PoolError as e:
            self.broken = f"the {WORLD}-rank process group did not start here: {e}"[:2000]
            raise
        return observation(self.name, case, outcome)

    def repro(self, case: Case) -> Repro:
        return replay_only(self.name)


def _thin(case: Case, codes: dict[str, str]) -> set[str]:
    """Parameters some dim of which has fewer elements than the mesh ranks that shard it."""
    out = set()
    for p in case.params:
        dp, tp = split(codes[p.name])
        tp = {"colwise": "S1", "rowwise": "S0"}.get(tp, tp)
        ways: dict[int, int] = {}
        for part in (dp, tp):
            if part.startswith("S"):
                ways[int(part[1:])] = ways.get(int(part[1:]), 1) * 2
        if any(p.shape[d] < n for d, n in ways.items()):
            out.add(p.name)
    return out


def _unused_output(case: Case) -> str:
    """The op of a live multi-output node (a custom Function's ``pair``, ``chunk``)
    one of whose results no live node or output uses ("" if none)."""
    from harness.case.validate import infer_shapes

    shapes = infer_shapes(case)
    live: set[str] = {u.ref for u in case.outputs}
    used: set[tuple[str, Any]] = {(u.ref, u.index) for u in case.outputs}
    for node in reversed(case.nodes):
        if node.name in live:
            for u in node.args:
                live.add(u.ref)
                used.add((u.ref, u.index))
    for n in case.nodes:
        shape = shapes.get(n.name)
        if n.name in live and shape and isinstance(shape[0], tuple):
            if not {(n.name, i) for i in range(len(shape))} <= used:
                return n.op
    return ""


def paths(options: Options) -> list[MeshPath]:
    """The registry's hook: four paths on one 4-rank group."""
    t, b = options.timeout, options.backend
    return [MeshPath(f"mesh.{kind}.{variant}", kind, STOCK if variant == "stock" else FIXED[kind], t, b)
            for kind in ("fsdp_tp", "dtensor2d") for variant in ("stock", "fixed")]
