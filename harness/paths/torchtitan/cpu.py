"""torchtitan on CPU ranks (gloo): the one place the family adapts it.

Two things stand between torchtitan's parallelize functions and a CPU rank;
both are changed here, in the rank process only (``rank.parallelize`` calls
this module; the parent never imports torchtitan):

- **The reduce op.** torchtitan turns FSDP2's gradient division off
  (``disable_fsdp_gradient_division``: ``set_gradient_divide_factor(1.0)``)
  because its loss is already divided by the global token count. With a
  factor set, FSDP2 reduce-scatters with ``ReduceOp.PREMUL_SUM(1 / factor)``,
  which NCCL has and gloo has not ("Cannot use ReduceOp.PREMUL_SUM with
  Gloo"). On gloo every FSDP module is told
  ``set_force_sum_reduction_for_comms(True)``, a public FSDP2 switch
  torchtitan itself sets for symmetric-memory runs: FSDP2 then reduces with
  ``SUM`` and divides afterwards only by a factor other than 1. ``PREMUL_SUM
  (1.0)`` and ``SUM`` give the same values bit for bit.
- **A triton import.** ``apply_compile`` imports torchtitan's attention
  module, whose MoE token dispatcher imports the expert-parallel kernels
  (``torchtitan.distributed.minimal_async_ep.kernels``), written in triton,
  which a CPU build lacks. That one module is replaced by a stand-in whose
  every kernel raises; nothing on this family's paths calls them (MoE only).

For ``torchtitan.tp`` (torchtitan's own Llama, its TP/SP plan), two more:

- **The mesh's device type.** ``ParallelDims.build_mesh`` builds its meshes
  on ``torchtitan.tools.utils.device_type``, which falls back to ``"cuda"``
  where torch has no accelerator, so on a CPU build ``distribute_tensor``
  moves every weight to CUDA and fails. ``on_cpu`` sets the name
  ``parallel_dims`` imported to ``"cpu"`` (only where torch has no
  accelerator): the meshes are the same ranks on gloo. No kernel, placement
  or collective choice reads it on the TP path.
- **The inner attention.** torchtitan 0.3's Llama flavors take FlexAttention
  (``torch.compile`` with inductor's triton kernels) or varlen attention
  (CUDA flash), and ``get_attention_config("sdpa")`` refuses SDPA for
  language models because it cannot take per-document masks. The generated
  Llama is built with ``ScaledDotProductAttention`` (``attention()``), the
  class torchtitan keeps for maskless causal attention (its graph_trainer
  tests build Llama this way): one document per sequence, ``is_causal``.
  The float64 reference is the same config, so the swap is on both sides of
  the comparison; TP shards attention by heads, which the inner attention
  never sees (``set_gqa_inner_attention_local_map`` hands it local heads).

Nothing else is patched. ``tests/cover/test_torchtitan.py`` holds every
change to "no gradient path changes".
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import torch.distributed as dist

KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def adapt(model: Any, group: Any) -> int:
    """Make a torchtitan-parallelized ``model`` reduce on ``group``: on gloo,
    SUM for PREMUL_SUM(1). Returns how many FSDP modules it changed (0 on NCCL)."""
    from torch.distributed.fsdp import FSDPModule

    if dist.get_backend(group) != "gloo":
        return 0
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_force_sum_reduction_for_comms(True)
    return len(units)


class _GpuKernel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{KERNELS}.{self.name} is a triton kernel; this CPU rank has no triton")


def without_triton() -> bool:
    """Stand in for torchtitan's triton kernels where triton is absent; True if it did."""
    if KERNELS in sys.modules or importlib.util.find_spec("triton") is not None:
        return False
    stub = types.ModuleType(KERNELS, "torchtitan's expert-parallel triton kernels, absent on CPU (gradfuzz)")

    def kernel(name: str) -> _GpuKernel:
        if name.startswith("__"):
            raise AttributeError(name)
        return _GpuKernel(name)

    stub.__getattr__ = kernel  # type: ignore[method-assign]
    sys.modules[KERNELS] = stub
    return True


def on_cpu() -> bool:
    """Build torchtitan's meshes on the CPU where torch has no accelerator; True if it changed anything."""
    import torch
    import torchtitan.distributed.parallel_dims as pd

    if torch.accelerator.is_available() or pd.device_type == "cpu":
        return False
    pd.device_type = "cpu"
    return True


def attention() -> Any:
    """The inner attention the generated Llama is built with: SDPA, causal, no masks (see above)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    return ScaledDotProductAttention.Config()
