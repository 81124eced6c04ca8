"""Whether a worker's GPU can still be used after a case.

A CUDA error such as an illegal memory access is sticky: every later kernel
in the process fails with it. Left alone, one case that corrupts device
memory makes every later case in that process fail, fixed paths included
(seen on torch 2.11: an FSDP2 use-after-free, after which ddp.fixed and
fsdp2.fixed "failed" on the same ranks). Every worker that runs cases on a
GPU (the rank host, the isolated compile/graphed worker) asks this after each
case, so the case that broke the device is the one blamed and the worker is
replaced before the next.
"""

from __future__ import annotations

from typing import Any


def device_error(device: Any) -> str | None:
    """Why ``device`` can no longer be used (the error's type and first line), or None."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except Exception as e:  # torch.AcceleratorError on recent releases, RuntimeError before
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    return None
