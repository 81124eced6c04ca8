#!/usr/bin/env python
"""torch only: a .grad set before the first schedule.step() of an FSDP2 stage is
dropped (torch 2.12+: PipelineStage._post_metadata_inference_cleanup sets every
FSDP parameter's .grad to None after the real forward/backward that infers the
stage metadata). Two ranks on gloo (CPU), one stage each, FSDP2 on a 1-rank dp
mesh. Prints OK or WRONG; exit status 1 when wrong."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Stage(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w)

    def forward(self, x):
        return x @ self.w


def run(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    ws = [torch.randn(3, 3) for _ in range(2)]
    x = torch.randn(2, 3)
    prefill = torch.ones(3, 3)
    # the reference: eager, the prefilled grad plus this step's grad
    w_ref = [w.clone().requires_grad_() for w in ws]
    (x @ w_ref[0] @ w_ref[1]).sum().backward()
    expected = prefill + w_ref[rank].grad

    module = Stage(ws[rank].clone())
    fully_shard(module, mesh=mesh["dp"])
    module.w.grad = torch.distributed.tensor.DTensor.from_local(prefill.clone(), mesh["dp"], module.w.placements)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    sched = ScheduleGPipe(stage, 1, loss_fn=lambda y, t: y.sum(), scale_grads=False)
    if rank == 0:
        sched.step(x)
    else:
        sched.step(target=torch.zeros(2, 3))
    got = module.w.grad.full_tensor()
    q.put((rank, torch.allclose(got, expected), (got - expected).abs().max().item()))
    dist.destroy_process_group()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, 2, 29611, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    res = sorted(q.get() for _ in procs)
    ok = all(r[1] for r in res)
    for rank, good, diff in res:
        print(f"stage {rank}: w.grad {'matches' if good else 'differs from'} prefill + grad (max abs diff {diff:.4g})")
    print(f"torch {torch.__version__}: {'OK' if ok else 'WRONG'}")
    sys.exit(0 if ok else 1)
