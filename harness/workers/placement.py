"""Which GPUs a harness process's work goes on.

The gate and ``fuzz -n`` run many harness processes at once: pytest-xdist
workers (``gw<n>``) and the gate's replay and canary children (their slot,
``jobs.SLOT_ENV``). Left to torch's defaults every one of them works on GPU 0:
on four GPUs ``gate -n 32`` put every process and all its memory on GPU 0
while GPUs 2 and 3 held almost none (docs/benchmarks.md). Each process's index picks a block instead.
"""

from __future__ import annotations

import os

from harness.workers.jobs import SLOT_ENV


def process_index() -> int:
    """This process's index among the harness's parallel processes: the
    xdist worker's number, else the gate child's slot, else 0."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit() and worker[2:].isascii():
        return int(worker[2:])
    slot = os.environ.get(SLOT_ENV, "")
    return int(slot) if slot.isdigit() and slot.isascii() and len(slot) < 6 else 0


def first_gpu(world_size: int) -> int:
    """The GPU a harness-started group's rank 0 takes: groups of different
    processes spread over the machine's GPUs in blocks of ``world_size``
    (process n takes block n mod blocks), instead of every group's rank r
    sitting on GPU r. With -n 32 on four GPUs every group put its ranks on
    GPUs 0 and 1 and ran GPU 0 out of memory; the 4-rank mesh
    groups still take all four."""
    import torch

    blocks = torch.cuda.device_count() // world_size if torch.cuda.is_available() else 0
    return (process_index() % blocks) * world_size if blocks > 1 else 0


def one_gpu_env() -> dict[str, str]:
    """The environment of a one-process worker (the compile and graphed
    flavours' children): only its block's GPU visible, so its CUDA work and
    any context torch makes on the side land there and not on GPU 0. Empty
    where fewer than two GPUs are visible."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    return {"CUDA_VISIBLE_DEVICES": entries[first_gpu(1) % len(entries)]}
