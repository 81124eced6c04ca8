"""DeepSpeed's PyTorch-style backward (``loss.backward()`` on an engine's
outputs, an API since 0.18: deepspeedai/DeepSpeed#7665) divides a grad by the
accumulation steps once per engine output it passes through: when the model
returns an intermediate and something computed from it (hidden states and
logits, ``(h @ W, h)`` here), the part of the loss that reaches ``h`` through
the second output is divided twice, and the update is silently wrong.
``engine.backward(loss)`` on the same loss is right.

The model: ``h = x @ W``, outputs ``(h @ W, h)``, loss ``sum(out0 * c0) +
sum(out1 * c1)``, two gloo ranks, ``gradient_accumulation_steps`` 2, one
window, SGD at learning rate 1: ``W_before - W_after`` is the grad the
optimizer stepped on, compared with float64 autograd of the documented
semantics (the mean over ranks and micro-steps). Small integers: exact.

Run: python benchmarks/deepspeed_torch_backward_chained_outputs.py [stage ...]
(DeepSpeed 0.19.8, torch 2.13 CPU). Exit status 1 when loss.backward() is wrong.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.multiprocessing as mp

GAS, WORLD = 2, 2
W0 = torch.tensor([[1.0, -1.0, 0.0], [2.0, 0.0, 1.0], [0.0, 1.0, -2.0]])


def data(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * rank + micro)
    return tuple(torch.randint(-2, 3, (2, 3), generator=g).double() for _ in range(3))  # x, c0, c1


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(W0.clone())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x @ self.w
        return h @ self.w, h  # the second output is an input of the first


def expected() -> torch.Tensor:
    w = W0.double().requires_grad_()
    for r in range(WORLD):
        for m in range(GAS):
            x, c0, c1 = data(r, m)
            h = x @ w
            ((h @ w * c0).sum() + (h * c1).sum()).div(WORLD * GAS).backward()
    return w.grad


def rank_main(rank: int, stages: list[int], port: int, out: dict) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    for stage in stages:
        for drive in ("engine.backward(loss)", "loss.backward()"):
            module = Model()
            opt = torch.optim.SGD(module.parameters(), lr=1.0)
            config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS,
                      "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
                      "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
            engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=config)
            with deepspeed.zero.GatheredParameters([module.w]):
                before = module.w.detach().double().clone()
            for m in range(GAS):
                x, c0, c1 = (t.float() for t in data(rank, m))
                out0, out1 = engine(x)
                loss = (out0 * c0).sum() + (out1 * c1).sum()
                if drive == "loss.backward()":
                    loss.backward()
                else:
                    engine.backward(loss)
                engine.step()
            with deepspeed.zero.GatheredParameters([module.w]):
                got = before - module.w.detach().double()
            if rank == 0:
                want = expected()
                ok = torch.allclose(got, want, atol=1e-5)
                ratio = float((got * want).sum() / (want * want).sum())
                out[(stage, drive)] = ok
                print(f"ZeRO {stage}  {drive:<22} {'ok' if ok else 'WRONG'}: update ratio {ratio:.4g} to autograd's, "
                      f"max diff {float((got - want).abs().max()):.4g}", flush=True)


if __name__ == "__main__":
    stages = [int(s) for s in sys.argv[1:]] or [1, 2, 3]
    results = mp.Manager().dict()
    mp.start_processes(rank_main, args=(stages, 29591, results), nprocs=WORLD, start_method="spawn")
    import deepspeed

    wrong = [k for k, ok in results.items() if not ok]
    print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}: "
          f"{'WRONG on ' + ', '.join(f'ZeRO {s} {d}' for s, d in sorted(wrong)) if wrong else 'all agree'}")
    sys.exit(1 if wrong else 0)
