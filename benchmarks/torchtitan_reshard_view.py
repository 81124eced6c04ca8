"""A transformer block that hands on a view of its own weight, under
torchtitan's FSDP2 (torch and torchtitan only; 2 gloo ranks on CPU).

Block 0 returns ``w.expand(2, 3)``; block 1 multiplies the input by it.
``apply_fsdp_to_decoder`` makes each block an FSDP2 unit with torchtitan's
default reshard policy (reshard after forward), so the all-gathered weight's
storage is freed (resized to 0 bytes) when block 0's forward returns, and
block 1 reads the view of freed storage: a segfault on CPU here, an illegal
memory access on CUDA. With ``POLICY=never`` it runs and matches eager.
``TORCHTITAN=0`` uses plain ``fully_shard`` (the same crash: FSDP2's, not
torchtitan's). Upstream: pytorch/pytorch PR #195862 ("[FSDP2] Raise a Python
error instead of IMA when accessing freed unsharded storage").

    python benchmarks/torchtitan_reshard_view.py            # crashes (SIGSEGV)
    POLICY=never python benchmarks/torchtitan_reshard_view.py
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

POLICY = os.environ.get("POLICY", "default")


class Weight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([[1.0, 2.0, 3.0]]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.w.expand(2, 3)  # a view of the (unsharded) weight, handed on


class Mul(torch.nn.Module):
    def forward(self, xv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return xv[0] * xv[1]


class Decoder(torch.nn.Module):
    enable_weight_tying = False
    tok_embeddings = norm = lm_head = None

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": Weight(), "1": Mul()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["1"](self.layers["0"](x))


def run(rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29631")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    model = Decoder()
    x = torch.arange(6.0).reshape(2, 3)
    want = x * model.layers["0"].w.detach()
    if os.environ.get("TORCHTITAN", "1") == "1":
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

        apply_fsdp_to_decoder(model, mesh, torch.float32, torch.float32, pp_enabled=False,
                              reshard_after_forward_policy=POLICY)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh, reshard_after_forward=POLICY != "never")
        fully_shard(model, mesh=mesh)
    out = model(x)
    print(f"rank {rank}: policy {POLICY}: output matches eager: {torch.equal(out, want)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.start_processes(run, nprocs=2, start_method="fork")
