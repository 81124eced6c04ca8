"""Where a layer norm with an unevenly sharded weight fails under DTensor,
with and without the norm-backward fix probe, on CPU (gloo) or CUDA (NCCL).

    torchrun --nproc-per-node 2 benchmarks/dtensor_norm_probe_ranks.py cpu|cuda [plain|probed ...]

Each rank prints, for each run in the order given (default: plain, then
probed), whether the forward and the backward ran and the first line of
what raised. A plain run after a probed one must raise again and a probed
one after a plain one must run: DTensor's sharding decisions are cached per
thread, and on CUDA autograd runs the backward on its device's thread.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def once(device: str) -> str:
    mesh = init_device_mesh(device, (2,))
    g = torch.Generator().manual_seed(0)
    x = distribute_tensor(torch.randn(2, 3, generator=g).to(device).requires_grad_(), mesh, [Replicate()])
    w = distribute_tensor(torch.randn(3, generator=g).to(device), mesh, [Shard(0)]).detach().requires_grad_()
    try:
        y = F.layer_norm(x, (3,), w)
    except Exception as e:
        return f"forward raised {type(e).__name__}: {str(e).splitlines()[0]} | {_where(e)}"
    try:
        y.sum().backward()
    except Exception as e:
        return f"backward raised {type(e).__name__}: {str(e).splitlines()[0]} | {_where(e)}"
    return f"ran: w.grad {w.grad.full_tensor().tolist()}"


def _strategies() -> str:
    """Which strategy DTensor holds for the layer norm backward, and whether
    the probe's function is the one the math ops module calls."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._ops import _math_ops

    prop = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.native_layer_norm_backward.default
    held = [getattr(prop, t, {}).get(op) for t in ("op_strategy_funcs", "op_single_dim_strategy_funcs")]
    names = [getattr(f, "__qualname__", type(f).__name__) if f is not None else None for f in held]
    patched = "<fix probe" in getattr(_math_ops._common_norm_backward_strategy.__code__, "co_filename", "")
    return f"strategies {names}, helper patched {patched}"


def _where(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "torch" in f.filename]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.name}" for f in frames[-3:])


def main() -> None:
    device = sys.argv[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank())
    from harness.materialize import workarounds

    order = sys.argv[2:] or ["plain", "probed"]
    seen = {}
    for i, run in enumerate(order):
        if run == "plain":
            seen[f"{i} {run}"] = once(device)
            continue
        with workarounds.in_force("dtensor-norm-backward-replicated-weight"):
            seen[f"{i} {run}"] = f"{once(device)} | {_strategies()}"
    print(f"rank {dist.get_rank()} {device} torch {torch.__version__}"
          + "".join(f"\n  {k}: {v}" for k, v in seen.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
