"""The one place the megatron family tells megatron-core it runs on a CPU.

megatron-core 0.16.1 allocates its contiguous grad buffers (and, with the
distributed optimizer, its parameter buffers) on
``torch.cuda.current_device()``; on a CPU build that call raises. Nothing
else the family reaches asks for CUDA once ``average_in_collective`` is off
(gloo has no AVG reduction): the barrier that names ``device_ids`` and the
``torch.cuda.current_stream`` / ``Stream`` calls sit behind options the
family does not set (SHARP, several distributed-optimizer instances).

The patch is applied around one case on a rank (``on_cpu``) and undone
after it, so the other families sharing the pool's ranks see torch as
installed; ``PATCHED`` names every attribute it replaces, and
``tests/cover/test_megatron.py`` checks that it replaces only those and
that eager grads are bitwise the same under it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

PATCHED = ("current_device",)


def _cpu_device() -> str:
    """What megatron passes as ``device=``: the CPU, where the ranks' tensors are."""
    return "cpu"


@contextlib.contextmanager
def on_cpu(device: torch.device) -> Iterator[None]:
    """``torch.cuda.current_device`` answering "cpu" while megatron runs on a CPU rank."""
    if device.type != "cpu":
        yield
        return
    saved: dict[str, Any] = {name: getattr(torch.cuda, name) for name in PATCHED}
    torch.cuda.current_device = _cpu_device
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
