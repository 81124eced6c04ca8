"""DeepSpeed pipeline engine: the in-place all-reduce of a tied weight's grad
also changes another parameter's grad, when AccumulateGrad made the two
``.grad`` tensors views of one buffer (pytorch#34082).

Stage 1 computes ``x @ (stack([tied, w1]).sum(0))``: the backward of
``sum`` expands one grad, ``stack``'s backward hands out two views of it,
and AccumulateGrad adopts those views as ``tied.grad`` and ``w1.grad``.
``PipelineEngine._exec_reduce_tied_grads`` then runs
``dist.all_reduce(tied.grad)`` in place, which writes the first stage's
share of the tied grad into ``w1.grad`` as well. The tied all-reduce runs
before any ZeRO stage 1 bookkeeping, so stage 1 is affected the same way.

Run: DS_ACCELERATOR=cpu python benchmarks/deepspeed_pipe_tied_alias.py [stage]
(two gloo ranks on CPU; DeepSpeed 0.19.8, torch 2.13 CPU). Prints the w1
grad the optimizer steps on and the one autograd gives; exit 1 when they differ.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.multiprocessing as mp

W0 = torch.arange(9.0).reshape(3, 3) / 4 - 1
W1 = torch.arange(9.0).flip(0).reshape(3, 3) / 8
X = torch.tensor([[1.0, -2.0, 0.5], [0.25, 1.0, -1.0]])


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(W0.clone())


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(W1.clone())

    def forward(self, h_and_tied: tuple) -> torch.Tensor:
        h, tied = h_and_tied
        return h @ torch.stack([tied, self.w1]).sum(0)


def first(module: Tied, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight


def second(module: Tied, h: torch.Tensor) -> tuple:
    return h, module.weight


def expected_w1_grad() -> torch.Tensor:
    w0, w1 = W0.double().requires_grad_(), W1.double().requires_grad_()
    h = X.double() @ w0
    (h @ (w0 + w1)).sum().backward()
    return w1.grad


def rank_main(rank: int, stage: int, port: int) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.utils import safe_get_full_grad

    deepspeed.init_distributed(dist_backend="gloo")
    # Stage 0: the first tied use (and an identity); stage 1: the second tied use and the head.
    layers = [TiedLayerSpec("w0", Tied, forward_fn=first), lambda h: h, TiedLayerSpec("w0", Tied, forward_fn=second),
              LayerSpec(Head)]
    module = PipelineModule(layers, num_stages=2, loss_fn=lambda out, label: out.sum(), partition_method="uniform")
    opt = torch.optim.SGD([p for p in module.parameters()], lr=0.0)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=config)
    seen = {}
    step = engine.optimizer.step

    def reading_step(*a, **k):
        for name, p in module.named_parameters():
            seen[name] = safe_get_full_grad(p).clone()
        return step(*a, **k)

    engine.optimizer.step = reading_step
    engine.train_batch(iter([(X.clone(), torch.zeros(1))]))
    if rank == 1:
        got, want = seen["3.w1"].double(), expected_w1_grad()
        print(f"ZeRO stage {stage}: w1 grad the optimizer steps on:\n{got}\nautograd's:\n{want}")
        print("WRONG" if not torch.allclose(got, want, atol=1e-5) else "ok")
        sys.exit(1 if not torch.allclose(got, want, atol=1e-5) else 0)


if __name__ == "__main__":
    stage = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    ctx = mp.start_processes(rank_main, args=(stage, 29571), nprocs=2, join=False, start_method="spawn")
    try:
        while not ctx.join():
            pass
    except mp.ProcessExitedException as e:
        sys.exit(e.exit_code or 1)
