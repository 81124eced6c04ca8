"""torch alone: pipeline metadata inference runs a later stage's real forward
on inputs it makes up, so a stage valid for every real input raises at the
schedule's first step, depending on what the made-up input holds.

    python pipeline_metadata_inference_made_up_inputs.py [PORT]

Two ranks (gloo, GPipe, one stage each), a fresh pair per variant. Stage 0
ends in a sigmoid, whose values lie strictly in (0, 1). Stage 1 applies:

- ``bce``: binary cross entropy to it (raises for an input outside [0, 1]);
- ``draw``: one entry per row drawn by ``torch.multinomial`` with it as
  the weights (raises for a row of zeros, or a negative or non-finite one).

Both are valid on every input stage 0 can produce. Before the step each
rank frees buffers full of 2.0, so memory torch allocates next may hold
them. Each variant runs with the metadata inferred, then with
``input_args``/``output_args`` given (the documented way to skip the
inference). Prints, per variant, the torch version and whether the step
raised (a rank whose peer raised times out after 10 s).

Seen: 2.11.0 infers on zeros: ``draw`` raises every run, ``bce`` runs;
2.13.0 and 2.14.1 infer on ``torch.empty_strided`` memory: either raises
or runs from run to run; with the arguments given, every variant runs.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

MB, N = 2, 3  # microbatches, width


class First(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(N, N, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x @ self.w)


class Second(torch.nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.w = torch.nn.Parameter(torch.ones(N))

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        if self.variant == "bce":
            return F.binary_cross_entropy(p, torch.full_like(p, 0.5), reduction="none") * self.w
        return p.gather(-1, torch.multinomial(p, 1)) * self.w


def step(rank: int, variant: str, given: bool) -> str:
    x = torch.randn(MB, N, generator=torch.Generator().manual_seed(1))
    example_in = First()(x[:1]).detach()
    module = First() if rank == 0 else Second(variant)
    kw = {}
    if given:
        inp = x[:1] if rank == 0 else example_in.requires_grad_()
        kw = {"input_args": (inp,), "output_args": (module(inp).detach().requires_grad_(),)}
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), **kw)
    schedule = ScheduleGPipe(stage, n_microbatches=MB, loss_fn=lambda out, target: out.sum())
    for _ in range(64):  # freed memory holding 2.0, of the sizes the inference asks for
        torch.full((1, N), 2.0).sum()
        torch.full((N,), 2.0).sum()
    try:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=torch.zeros(MB, N))
        return "ran"
    except Exception as e:
        return f"RAISED {type(e).__name__}: {str(e).splitlines()[0][:90]}"


def run(rank: int, port: int, variant: str, given: bool) -> None:
    # A short timeout: when rank 1 raises, rank 0 waits for a grad that never comes.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=10))
    verdict = step(rank, variant, given)
    try:
        dist.barrier()  # both done (or timed out) before either goes
    except Exception:
        pass
    if rank == 1 or "RAISED" in verdict:
        how = "input_args/output_args given" if given else "metadata inferred"
        print(f"torch {torch.__version__} rank {rank} {variant:4} {how:28}: {verdict}", flush=True)
    os._exit(0)  # no teardown: a peer may still be blocked in its recv


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 29541
    for variant in ("bce", "draw"):
        for given in (False, True):
            port += 1
            mp.spawn(run, args=(port, variant, given), nprocs=2)
