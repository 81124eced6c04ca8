"""Standalone torchrun scripts for DeepSpeed ZeRO findings.

The script needs torch and DeepSpeed only: the case's forward as plain code
inside one ``nn.Module``, handed to ``deepspeed.initialize`` with the
case's config (stage, accumulation, knobs, as data), driven as the path
drove it (``rank.DRIVES``). Rank 0 gets the world size times each grad
output and the other ranks zeros, and the loss is scaled by the
accumulation steps, so DeepSpeed's mean over ranks and micro-steps is
eager's sum. At each accumulation boundary every grad is read with
``safe_get_full_grad`` and compared with float64 eager autograd. Rank 0
prints the verdict; exit status 1 when they differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from harness.case.spec import Case
from harness.materialize.names import PREFIX
from harness.materialize.source import CASE_MODULE, EAGER_WINDOWS, checked, forward_source, function_helpers, schedule_data
from harness.materialize.tensors import Built
from harness.paths import loopback
from harness.paths.base import Repro
from harness.paths.deepspeed.data import MISUSES, ONE_STEP_A_WINDOW, config, config_gas, knobs


@dataclass(frozen=True)
class Engine:
    """What the script needs of a ZeRO path (``Repro.family``)."""

    stage: int
    drive: str  # rank.DRIVES
    world_size: int


def script(case: Case, machinery: Repro, title: str) -> str:
    case = checked(case)
    e: Engine = machinery.family
    gas = config_gas(case, e.drive == "nosync")
    misuse = knobs(case).misuse
    data = [
        f"TITLE = {str(title)!r}",
        f"PREFIX = {PREFIX!r}",
        f"DRIVE = {e.drive!r}",
        f"MISUSE = {misuse!r}  # how the loop drives the engine against DeepSpeed's docs ('': as documented)",
        f"STEP_EVERY_MICRO_STEP = {e.drive in ('auto', 'torch') and misuse not in ONE_STEP_A_WINDOW!r}",
        # The config as JSON text read at run time: data, never code.
        f"CONFIG = json.loads({json.dumps(config(case, e.stage, 1, gas), sort_keys=True)!r})",
        *schedule_data(case, Built(case)),
    ]
    header = f'''#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64. Actual: the module under a DeepSpeed engine, ZeRO stage {e.stage},
on {e.world_size} rank(s), in {case.dtype}, accumulation driven {e.drive!r} (CONFIG below).
Schedule: {case.schedule.steps} step(s) x {case.schedule.microbatches} microbatch(es); grads read with
deepspeed.utils.safe_get_full_grad at each accumulation boundary.
Run:  {loopback.RUN.format(world_size=e.world_size)}   (gloo on CPU with DS_ACCELERATOR=cpu; nccl with a GPU per rank)
{_misuse_words(misuse)}Exit status 1 on rank 0 when they differ.
"""
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
'''
    return "\n".join([header, *function_helpers(case), "", *data, "", "", forward_source(case), "", "", _RUNNER, ""])


def _misuse_words(misuse: str) -> str:
    """The header's line on a misuse: what the loop does, and that the
    expected grads are what the user meant (the documented drive's)."""
    if not misuse:
        return ""
    return (f"The loop MISUSES the engine ({misuse}): {MISUSES[misuse]}. DeepSpeed accepts it without an error;\n"
            "expected is what the user meant, the grads of the documented drive.\n")


_RUNNER = EAGER_WINDOWS + "\n\n" + CASE_MODULE + "\n\n" + loopback.SOURCE + "\n\n" + loopback.VERDICT + '''

def main():
    _gradfuzz_loopback()
    world = int(os.environ["WORLD_SIZE"])
    rank, device, gpus = start_group(world)
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if gpus else "cpu")  # read when deepspeed is imported
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    module = Module(device)
    params = module.weights()
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.0)  # weights stay put
    engine, optimizer, *_ = deepspeed.initialize(model=module, optimizer=opt, config=CONFIG)
    gas = CONFIG["gradient_accumulation_steps"]
    want, bad = expected(), 0
    for k in range(MICROBATCHES * STEPS):
        boundary = (k + 1) % MICROBATCHES == 0
        if DRIVE == "manual":
            engine.set_gradient_accumulation_boundary(boundary)
        if MISUSE == "zero_grad":
            engine.zero_grad()
        elif MISUSE == "optimizer_zero_grad":
            optimizer.zero_grad()
        inputs = [torch.tensor(INPUTS[k][n], dtype=DTYPE, device=device).requires_grad_(INPUT_GRAD[n]) for n in INPUT_NAMES]
        cots = [torch.tensor(c, dtype=DTYPE, device=device) * (world if rank == 0 else 0) for c in GRAD_OUTPUTS[k]]
        live = [(o, c) for o, c in zip(engine(*inputs), cots) if o.requires_grad]
        if live:
            loss = sum((o * c).sum() for o, c in live) * gas  # the engine divides by its accumulation steps
            if DRIVE == "torch":
                loss.backward()  # PyTorch-style: the engine's output hooks divide by its accumulation steps
            elif MISUSE == "backward_twice":
                engine.backward(loss / 2, retain_graph=True)
                engine.backward(loss / 2)
            else:
                with engine.no_sync() if DRIVE == "nosync" and not boundary else contextlib.nullcontext():
                    engine.backward(loss)
        if boundary:
            for n, p in params.items():
                # safe_get_full_grad reads ZeRO's flat buffers, which hold zeros for a parameter without a grad
                bad += differs(rank, k, n, want[k][n], safe_get_full_grad(p) if p.requires_grad else None, p.shape)
        if STEP_EVERY_MICRO_STEP or boundary:
            engine.step()
    return verdict(bad, device, f"torch {torch.__version__}, deepspeed {deepspeed.__version__}")
''' + loopback.ENTRY
