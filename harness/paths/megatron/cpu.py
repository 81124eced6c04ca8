"""The one place the megatron family tells megatron-core it runs on a CPU.

megatron-core 0.16.1 allocates its contiguous grad buffers (and, with the
distributed optimizer, its parameter buffers) on
``torch.cuda.current_device()``; on a CPU build that call raises. Nothing
else the DDP paths reach asks for CUDA once ``average_in_collective`` is
off (gloo has no AVG reduction): the barrier that names ``device_ids`` and
the ``torch.cuda.current_stream`` / ``Stream`` calls sit behind options the
family does not set (SHARP, several distributed-optimizer instances).

The pipeline schedule (``megatron.pp.*``) asks for two more things:

- ``torch.cuda.synchronize()`` after every batched p2p exchange
  (``P2PCommunicator._communicate`` with ``batch_p2p_comm`` and
  ``batch_p2p_sync``, both megatron's defaults). On a CPU rank it is a
  no-op: gloo's ``wait()`` has returned, and nothing is queued on a stream.
- ``torch.zeros([], dtype=torch.int, device="cuda")``, the token counter
  ``forward_backward_pipelining_without_interleaving`` allocates with a
  literal device (read only under ``calculate_per_token_loss``, which the
  family leaves off). ``cuda_factories_on_cpu`` is a ``TorchFunctionMode``
  that rewrites ``device="cuda"`` to the CPU in torch's tensor constructors
  (the functions ``torch.set_default_device`` redirects,
  ``torch.utils._device._device_constructors()``) and passes every other
  call through unchanged; the family holds it around the schedule call only.

The patches are applied around one case on a rank (``on_cpu``) and undone
after it, so the other families sharing the pool's ranks see torch as
installed; ``PATCHED`` names every attribute it replaces, and
``tests/cover/test_megatron.py`` checks that it replaces only those, that
the mode moves only constructors' CUDA devices, and that eager grads are
bitwise the same under both.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

PATCHED = ("current_device", "synchronize")


def _cpu_device() -> str:
    """What megatron passes as ``device=``: the CPU, where the ranks' tensors are."""
    return "cpu"


def _synchronize(device: Any = None) -> None:
    """Nothing to wait for on a CPU rank: its ops and gloo's waited requests have completed."""


REPLACEMENTS = {"current_device": _cpu_device, "synchronize": _synchronize}


@contextlib.contextmanager
def on_cpu(device: torch.device) -> Iterator[None]:
    """``torch.cuda.current_device`` answering "cpu" (and ``synchronize`` a
    no-op) while megatron runs on a CPU rank."""
    if device.type != "cpu":
        yield
        return
    saved: dict[str, Any] = {name: getattr(torch.cuda, name) for name in PATCHED}
    for name in PATCHED:
        setattr(torch.cuda, name, REPLACEMENTS[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


def is_cuda(device: Any) -> bool:
    """``device=`` as megatron spells it (a ``torch.device`` or a string such as "cuda:0") names CUDA."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


class CudaFactoriesOnCpu(TorchFunctionMode):
    """Tensor constructors asked for ``device="cuda"`` build on the CPU; every other call as called.
    (The pipeline's standalone script runs this source.)"""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils._device import _device_constructors

        self.constructors = _device_constructors()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self.constructors and is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_factories_on_cpu(device: torch.device) -> Iterator[None]:
    """Tensor constructors asked for ``device="cuda"`` build on the CPU, on a CPU rank only."""
    if device.type != "cpu":
        yield
        return
    with CudaFactoriesOnCpu():
        yield
