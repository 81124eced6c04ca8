"""DeepSpeed misuse drives, with torch and DeepSpeed only: what the optimizer
steps on when a training loop drives the engine in a way DeepSpeed's docs do
not describe, against what the user meant (the documented drive).

The model is ``y = x @ W`` with the loss ``sum(y * c)``, so a micro-step's
grad ``x^T c`` does not depend on W, and SGD at learning rate 1 moves W by
exactly the grad it steps on: ``W_before - W_after``, read after each
window's last ``engine.step()``. Two gloo ranks, two windows of
``gradient_accumulation_steps`` (2) micro-steps; every rank and micro-step has
its own small-integer data, so every number is exact. What the user meant is
DeepSpeed's documented semantics: the mean over ranks and micro-steps.

Each misuse (``harness/paths/deepspeed/data.py`` MISUSES) runs on a fresh
engine at ZeRO 0 to 3 and is reported as ``refused`` (DeepSpeed raised or
warned), ``ok`` (the update the user meant) or ``WRONG`` with each window's
update against the intended one: the least-squares ratio and, where one
fits exactly, what it is (the last micro-step only, half of it, nothing, ...).

Run: python benchmarks/deepspeed_misuse.py [stage ...]   (DeepSpeed 0.19.8, torch 2.13 CPU)
Exit status 1 when any misuse is silently WRONG.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import torch
import torch.multiprocessing as mp

GAS, WORLD, WINDOWS, N = 2, 2, 2, 3
MISUSES = ("documented", "zero_grad", "optimizer_zero_grad", "step_at_boundary", "backward_twice", "gas1_manual",
           "loss_backward")  # the last is documented since 0.18 (deepspeedai/DeepSpeed#7665), here as a check


def data(rank: int, window: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-step's input and grad output on one rank: small integers, all different."""
    g = torch.Generator().manual_seed(1000 * rank + 100 * window + micro)
    return (torch.randint(-3, 4, (2, N), generator=g).double(), torch.randint(-3, 4, (2, N), generator=g).double())


def contribution(window: int, micro: int) -> torch.Tensor:
    """A micro-step's grad in DeepSpeed's convention: the mean over ranks, over GAS."""
    return sum(x.T @ c for x, c in (data(r, window, micro) for r in range(WORLD))) / WORLD / GAS


def explain(actual: torch.Tensor, window: int) -> str:
    """The update against the intended one, named where a simple form fits exactly."""
    parts = [contribution(window, m) for m in range(GAS)]
    want = sum(parts)
    ratio = float((actual * want).sum() / (want * want).sum())
    named = {"nothing (no optimizer step)": torch.zeros_like(want), "the last micro-step only": parts[-1],
             "half the last micro-step": parts[-1] / 2, "the last micro-step x GAS": parts[-1] * GAS,
             "this window and the one before": want + sum(contribution(window - 1, m) for m in range(GAS))
             if window else None, "the intended update x GAS": want * GAS}
    fits = [k for k, v in named.items() if v is not None and torch.allclose(actual, v, atol=1e-6)]
    return f"ratio {ratio:.4g}, max diff {float((actual - want).abs().max()):.4g}" + (f" = {fits[0]}" if fits else "")


def drive(deepspeed, stage: int, misuse: str, rank: int) -> list[torch.Tensor]:
    """One fresh engine driven as ``misuse`` says; each window's update W_before - W_after."""
    torch.manual_seed(0)
    module = torch.nn.Linear(N, N, bias=False).double().float()
    opt = torch.optim.SGD(module.parameters(), lr=1.0)
    gas = 1 if misuse == "gas1_manual" else GAS
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, optimizer, *_ = deepspeed.initialize(model=module, optimizer=opt, config=config)
    updates = []
    for w in range(WINDOWS):
        before = _weight(deepspeed, module)
        for m in range(GAS):
            if misuse == "zero_grad":
                engine.zero_grad()
            elif misuse == "optimizer_zero_grad":
                optimizer.zero_grad()
            x, c = data(rank, w, m)
            loss = (engine(x.float()) * c.float()).sum()  # y = x @ W^T: the grad of W is c^T x
            if misuse == "gas1_manual":  # accumulating by hand, the user takes the mean over micro-steps
                loss = loss / GAS
            if misuse == "loss_backward":
                loss.backward()
            elif misuse == "backward_twice":
                engine.backward(loss / 2, retain_graph=True)
                engine.backward(loss / 2)
            else:
                engine.backward(loss)
            if m == GAS - 1 or misuse not in ("step_at_boundary", "gas1_manual"):
                engine.step()
        updates.append((before - _weight(deepspeed, module)).T)  # Linear keeps W^T
    return updates


def _weight(deepspeed, module: torch.nn.Module) -> torch.Tensor:
    with deepspeed.zero.GatheredParameters([module.weight]):  # ZeRO 3 partitions it; a no-op below
        return module.weight.detach().double().clone()


def rank_main(rank: int, stages: list[int], port: int, out: dict) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    import deepspeed
    from deepspeed.utils import logger

    deepspeed.init_distributed(dist_backend="gloo")
    logger.setLevel(logging.ERROR + 1)  # its start-up notices; warnings are caught below
    told: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                told.append(record.getMessage())

    for stage in stages:
        for misuse in MISUSES:
            told.clear()
            logger.addHandler(handler := Keep())
            try:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    updates = drive(deepspeed, stage, misuse, rank)
                said = told + [str(w.message) for w in seen if not issubclass(w.category, (DeprecationWarning, FutureWarning))]
                verdict = f"refused (warned: {said[0][:120]})" if said and misuse != "documented" else None
            except Exception as e:
                verdict, updates = f"refused (raised {type(e).__name__}: {str(e).splitlines()[0][:120]})", []
            finally:
                logger.removeHandler(handler)
            if rank == 0:
                if verdict is None:
                    wrong = [w for w, u in enumerate(updates)
                             if not torch.allclose(u, sum(contribution(w, m) for m in range(GAS)), atol=1e-6)]
                    verdict = "ok" if not wrong else "WRONG: " + "; ".join(
                        f"window {w}: {explain(updates[w], w)}" for w in wrong)
                out[(stage, misuse)] = verdict
                print(f"ZeRO {stage}  {misuse:<20} {verdict}", flush=True)


if __name__ == "__main__":
    stages = [int(s) for s in sys.argv[1:]] or [0, 1, 2, 3]
    results = mp.Manager().dict()
    mp.start_processes(rank_main, args=(stages, 29583, results), nprocs=WORLD, start_method="spawn")
    import deepspeed

    print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}: "
          f"{sum(v.startswith('WRONG') for v in results.values())} silently wrong, "
          f"{sum(v.startswith('refused') for v in results.values())} refused, "
          f"{sum(v == 'ok' for v in results.values())} ok")
    sys.exit(1 if any(v.startswith("WRONG") for v in results.values()) else 0)
