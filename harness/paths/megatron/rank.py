"""What every rank of the megatron paths runs.

Each rank builds the case's module and wraps it in megatron-core's
``DistributedDataParallel`` (contiguous grad buffers, ``param.main_grad``)
with the case's knobs (``data.ddp_config``), on the model-parallel state
``parallel_state.initialize_model_parallel(1, 1)`` builds over the pool's
group. It drives the case's microbatches as megatron's own
no-pipelining schedule does (whose ``forward_backward_func`` hard-codes a
CUDA tensor, so it is spelled out here): ``zero_grad_buffer()`` at a
window's start, every microbatch but the last under ``no_sync()``, the
loss divided by the number of microbatches, and ``finalize_model_grads``
after the window's last backward.

Every rank's grad output is its share times the world size times the
microbatches, so megatron's mean over ranks and micro-steps is exactly the
oracle's sum (``rankfacts.rank_data``; exact mode needs both factors to be
powers of two). ``param.main_grad`` is read after every backward: inside a
window it is each rank's own sum (their mean is the grad), at a boundary the
reduced grad every rank must agree on. Under the distributed optimizer a
rank owns only its shard of each bucket; the shards are gathered, which is
what the optimizer steps on.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

from harness.case.spec import Case
from harness.materialize.tensors import Built
from harness.materialize.units import CaseModule
from harness.objects import load_object
from harness.paths.megatron.cpu import on_cpu
from harness.paths.megatron.data import ddp_config, knobs
from harness.paths.rankfacts import encode, first_line, rank_data, rank_failure
from harness.workers.host import Rank

STOCK = "stock"


def _parallel_state(pipeline: int = 1, virtual: int | None = None) -> Any:
    """megatron's model-parallel state over the pool's group: tensor size 1,
    pipeline size ``pipeline`` (1: all ranks are data-parallel; the pp
    paths ask for 2) and virtual pipeline size ``virtual`` (the vpp path's
    model chunks per rank). Ranks that ran another kind of path last re-make
    it (every rank runs the same case, so the collective group creation matches)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_pipeline_model_parallel_world_size() != pipeline
            or parallel_state.get_virtual_pipeline_model_parallel_world_size() != virtual):
        parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, pipeline, virtual, create_gloo_process_groups=False)
    return parallel_state


def tied(case: Case) -> set[str]:
    uses = [u.ref for n in case.nodes for u in n.args] + [u.ref for u in case.outputs]
    return {p.name for p in case.params if uses.count(p.name) > 1}


def _wrap(case: Case, built: Built, distopt: bool, ctx: Rank) -> Any:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    _parallel_state()
    module = CaseModule(built, built.params(), ctx.device, built.dtype)
    if knobs(case).shared:
        for name in tied(case):
            module.params()[name].shared_embedding = True
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    return DistributedDataParallel(config, DistributedDataParallelConfig(**ddp_config(case, distopt)), module)


def gathered(buffer: Any) -> torch.Tensor:
    """A grad buffer as the distributed optimizer sees it: every bucket's
    reduced shard from the rank that owns it. (The standalone script runs this source.)"""
    out = buffer.grad_data.clone()
    group = buffer.data_parallel_group
    world = group.size()
    for bucket in buffer.buckets:
        flat = bucket.grad_data.view(-1)
        pieces = list(flat.clone().chunk(world))
        dist.all_gather(pieces, pieces[dist.get_rank(group)].clone(), group=group)
        out[bucket.offset:bucket.offset + flat.numel()] = torch.cat(pieces)
    return out


def buffer_grads(ddp: Any, names: dict, reduced: bool) -> dict[str, torch.Tensor]:
    """Every trainable parameter's ``main_grad`` by name (``names``: parameter -> name), read from the grad
    buffers; after a distributed-optimizer reduce, its gathered shards. (The standalone script runs this source.)"""
    out = {}
    for buffer in ddp.buffers:
        full = gathered(buffer) if reduced and ddp.ddp_config.use_distributed_optimizer else buffer.grad_data
        for p, (start, end, _) in buffer.param_index_map.items():
            out[names[p]] = full[start:end].view(p.shape)
    return out


def main_grads(ddp: Any, reduced: bool) -> dict[str, torch.Tensor]:
    """Every trainable parameter's ``main_grad``; after a distributed-optimizer reduce, its gathered shards."""
    return buffer_grads(ddp, {p: n for n, p in ddp.module.params().items()}, reduced)


def _facts(case: Case, built: Built, k: int, ddp: Any, sync: bool, inputs: list[torch.Tensor],
           outs: list[torch.Tensor]) -> dict[str, Any]:
    grads = main_grads(ddp, sync)
    pl = "R" if sync else "P(avg)"
    return {"k": k, "sync": sync, "grads": {p.name: encode(grads.get(p.name), pl) for p in case.params},
            "input_grads": {x.name: encode(t.grad, "P(avg)") for x, t in zip(case.inputs, inputs)},
            "outputs": [encode(o, "R") for o in outs],
            "retained": {n: encode(t.grad, "P(avg)") for n, t in built.retained.items()}}


def _micro(case: Case, built: Built, k: int, ddp: Any, fault: Any, ctx: Rank) -> dict[str, Any]:
    """Backward ``k`` as megatron's schedule runs a microbatch, then what it left."""
    from megatron.core.distributed import finalize_model_grads

    gas = case.schedule.microbatches
    micro, sync = k % gas, k % gas == gas - 1
    if micro == 0:
        ddp.zero_grad_buffer()
    inputs, cots = rank_data(case, built, k, ctx)
    with ddp.no_sync() if not sync else contextlib.nullcontext():
        outs = ddp(*inputs)
        live = [(o, c * gas) for o, c in zip(outs, cots) if o.requires_grad]
        if fault is not None:
            fault.before_backward(ddp, micro, gas)
        if live:
            (sum((o * c).sum() for o, c in live) / gas).backward()
    if sync:
        finalize_model_grads([ddp])
    return _facts(case, built, k, ddp, sync, inputs, outs)


def _raised_at(e: BaseException) -> str:
    """Where a bare ``assert`` fired (megatron has many without a message),
    so its finding names the check instead of an empty message."""
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"assert in {frame.name} ({os.path.basename(frame.filename)}: {(frame.line or '').strip()[:120]})"


def run_case(ctx: Rank, case: Case, distopt: bool, impl: str) -> dict[str, Any]:
    """One case on this rank. It never raises: the parent judges a failure next to its peers'."""
    built = Built(case)
    out: dict[str, Any] = {"rank": ctx.rank, "steps": [], "failure": None}
    k = -1
    try:
        with on_cpu(ctx.device):
            fault = load_object(impl, "megatron impl") if impl != STOCK else None
            ddp = _wrap(case, built, distopt, ctx)
            for k in range(case.schedule.backwards):
                out["steps"].append(_micro(case, built, k, ddp, fault, ctx))
    except Exception as e:  # a rank that raises reports it; the parent judges
        out["failure"] = rank_failure(k, e, first_line(e) or _raised_at(e))
    return out


def handle(ctx: Rank, msg: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank (a ``call`` message from ``harness.paths.megatron.paths``)."""
    return run_case(ctx, Case.loads(msg["case"]), bool(msg["distopt"]), msg["impl"])
