"""torch alone: pipeline metadata inference runs a later stage's real forward
on uninitialized memory, so a stage whose op checks its input's values
raises at the first step, or not, with what that memory held.

    python benchmarks/triage/pipeline_metadata_inference_empty_inputs.py

Two stages on one rank (Interleaved1F1B, world size 1, gloo): stage 0 ends in
a sigmoid, stage 1 applies binary cross entropy to it, valid for every real
input. Before building the schedule the script frees a buffer full of 2.0,
so an allocation of the same size may reuse it. Prints the torch version and
whether the step raised.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B


class First(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 3, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x @ self.w)


class Second(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy(p, torch.full_like(p, 0.5), reduction="none") * self.w


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    stages = [PipelineStage(First(), 0, 2, torch.device("cpu")), PipelineStage(Second(), 1, 2, torch.device("cpu"))]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=2, loss_fn=lambda out, target: out.sum())
    for _ in range(64):  # freed memory of the size the inference will ask for, holding 2.0
        torch.full((1, 3), 2.0).sum()
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    try:
        schedule.step(x, target=torch.zeros(2, 3))
        verdict = "ran"
    except RuntimeError as e:
        verdict = f"RAISED: {str(e).splitlines()[0]}"
    print(f"torch {torch.__version__}: {verdict}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
