"""F.rms_norm on a DTensor sharded along the normalized dim raises on CPU.

Torch only, two ranks on gloo (spawned here, no torchrun):

    python benchmarks/dtensor_rms_norm_partial_avg.py

On CPU F.rms_norm is the composite ``x * rsqrt(x.pow(2).mean(-1, keepdim=True)
.add_(eps)) * w`` (CUDA takes _fused_rms_norm, which has a DTensor strategy).
With the last dim Shard(1), the mean is Partial(avg) and DTensor refuses the
in-place ``add_(eps)`` ("aten.add_.Scalar: in-place operations that require
placement changes are not supported"), although adding a scalar to every rank's
share keeps an average an average. gradfuzz reached it as ``rms_norm(rms_norm(x,
g), g)`` with a Shard(0) gain g (the first norm's output is Shard(1)):
dtensor.stock-error-91af57f13c, cases/dtensor/rms_norm_sharded_dim_partial_avg_add_raises.json.
The same shapes through F.layer_norm run. An even shard is needed (D=4 on two
ranks): with D=3 the mean's strategy replicates first and nothing raises.

Workaround: redistribute the input to Replicate before F.rms_norm (or compute
the norm out of place); the result then matches eager.
Upstream: pytorch/pytorch#197501 (open PR: scalar in-place add/sub on Partial(avg)).
Prints one line per check; exit 1 when the bug shows.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def run(rank: int, world: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    x, g = torch.randn(2, 4), torch.randn(4)
    want = F.rms_norm(F.rms_norm(x.double(), (4,), g.double(), eps=1e-2), (4,), g.double(), eps=1e-2)
    out = {}

    def attempt(name, fn):
        try:
            y = fn()
            y.sum().backward()
            full = y.full_tensor().double()
            out[name] = "ok" if want is None or torch.allclose(full, want, atol=1e-5) else "WRONG VALUE"
        except Exception as e:  # what the user sees
            out[name] = f"raises {type(e).__name__}: {str(e).splitlines()[0][:150]}"

    gd = distribute_tensor(g, mesh, [Shard(0)]).requires_grad_()
    xr = distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    attempt("rms_norm(rms_norm(x, g), g), g Shard(0)", lambda: F.rms_norm(F.rms_norm(xr, (4,), gd, eps=1e-2), (4,), gd, eps=1e-2))
    want = None  # the rest compare shapes of other functions: only whether they run
    attempt("rms_norm(x Shard(1), no weight)", lambda: F.rms_norm(distribute_tensor(x, mesh, [Shard(1)]).requires_grad_(), (4,), eps=1e-2))
    attempt("layer_norm(layer_norm(x, g), g), same placements",
            lambda: F.layer_norm(F.layer_norm(xr, (4,), gd, eps=1e-2), (4,), gd, eps=1e-2))
    want = F.rms_norm(F.rms_norm(x.double(), (4,), g.double(), eps=1e-2), (4,), g.double(), eps=1e-2)
    attempt("workaround: redistribute to Replicate before rms_norm",
            lambda: F.rms_norm(F.rms_norm(xr, (4,), gd, eps=1e-2).redistribute(mesh, [Replicate()]), (4,), gd, eps=1e-2))
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.spawn(run, args=(2, 29000 + os.getpid() % 1000, q), nprocs=2)
    out = q.get()
    print(f"torch {torch.__version__}")
    for k, v in out.items():
        print(f"  {k}: {v}")
    first = next(iter(out.values()))
    print("BUG: rms_norm on a DTensor sharded along the normalized dim raises" if first != "ok" else "agrees")
    sys.exit(1 if first != "ok" else 0)
