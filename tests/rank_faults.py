"""Rank code for the pool tests: one rank raises, the other enters a collective
its peer never joins (what a rank error inside DDP or FSDP2 leaves behind)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


def handle(ctx: Any, msg: dict[str, Any]) -> dict[str, Any]:
    if ctx.rank == msg.get("raise_on"):
        raise RuntimeError("injected rank failure")
    if ctx.rank == msg.get("leave_on"):  # a rank that stops and reports it (DeepSpeed's refused misuse)
        return {"refused": "raised RuntimeError: injected", "left_early": True}
    if msg.get("until_aborted"):  # a GPU rank in a stream sync behind a NCCL kernel its failed peer never matches
        from harness.workers import abort

        end = time.monotonic() + msg["until_aborted"]
        while not abort.fired.is_set() and time.monotonic() < end:
            time.sleep(0.01)
        if abort.fired.is_set():
            raise RuntimeError("NCCL communicator was aborted")
        return {"never_freed": True}
    if msg.get("busy_s"):  # a peer still computing when the other raises: it must get to answer
        end = time.monotonic() + msg["busy_s"]
        while time.monotonic() < end:
            pass
        return {"busy": True}
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"sum": float(t)}
