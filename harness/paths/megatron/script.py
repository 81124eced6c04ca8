"""Standalone torchrun scripts for ``megatron.ddp.stock`` and
``megatron.distopt.stock`` findings.

The script needs torch and megatron-core only, and runs what each rank of
the path runs (``rank``): the case's forward as plain code inside one
``nn.Module``, ``shared_embedding`` set on its tied parameters where the
case says so, wrapped in megatron-core's ``DistributedDataParallel`` with
the case's ``DistributedDataParallelConfig`` (``data.ddp_config``, as data),
on a CPU rank with the family's patches (``cpu.REPLACEMENTS``, their own
source). The loop is the path's: ``zero_grad_buffer()`` at a window's
start, every microbatch but the last under ``no_sync()``, the loss divided
by the microbatches, ``finalize_model_grads`` after the window's last
backward. Rank 0 gets the world size times the microbatches times each
grad output and the other ranks zeros, so megatron's mean over ranks and
micro-steps is eager's sum. ``main_grad`` is read from the grad buffers
after every backward (``rank.buffer_grads``, its own source): inside a
window the ranks' mean, at a boundary every rank's reduced grad (under the
distributed optimizer, its shards gathered), each compared with float64
eager autograd. A raise where eager ran is a divergence. Rank 0 prints the
verdict; exit status 1 when they differ.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

from harness.case.spec import Case
from harness.materialize.names import PREFIX
from harness.materialize.source import CASE_MODULE, EAGER_WINDOWS, checked, forward_source, function_helpers, schedule_data
from harness.materialize.tensors import Built
from harness.paths import loopback
from harness.paths.base import Repro
from harness.paths.megatron.cpu import REPLACEMENTS
from harness.paths.megatron.data import ddp_config, knobs
from harness.paths.megatron.rank import buffer_grads, gathered, tied


@dataclass(frozen=True)
class Ddp:
    """What the script needs of a megatron DDP path (``Repro.family``)."""

    distopt: bool  # use_distributed_optimizer
    world_size: int


def script(case: Case, machinery: Repro, title: str) -> str:
    case = checked(case)
    d: Ddp = machinery.family
    config = ddp_config(case, d.distopt)
    data = [
        f"TITLE = {str(title)!r}",
        f"PREFIX = {PREFIX!r}",
        # The config as JSON text read at run time: data, never code.
        f"DDP_CONFIG = json.loads({json.dumps(config, sort_keys=True)!r})",
        f"SHARED = {sorted(tied(case)) if knobs(case).shared else []!r}  # marked shared_embedding, as megatron "
        "marks a tied embedding",
        *schedule_data(case, Built(case)),
    ]
    what = "reduce-scatter (distributed optimizer)" if d.distopt else "all-reduce"
    header = f'''#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64. Actual: the module under megatron-core's DistributedDataParallel,
{what}, on {d.world_size} rank(s), in {case.dtype}, DDP_CONFIG below.
Schedule: {case.schedule.steps} step(s) x {case.schedule.microbatches} microbatch(es) as megatron's no-pipelining schedule
drives them; param.main_grad compared after every backward.
Run:  {loopback.RUN.format(world_size=d.world_size)}   (gloo on CPU, with CPU_PATCHES; nccl with a GPU per rank)
Exit status 1 on rank 0 when they differ.
"""
import contextlib
import datetime
import json
import os
import sys
import traceback
from importlib.metadata import version
from typing import Any

import torch
import torch.distributed as dist
'''
    patches = [inspect.getsource(fn) for fn in REPLACEMENTS.values()]
    patched = "CPU_PATCHES = {" + ", ".join(f"{n!r}: {fn.__name__}" for n, fn in REPLACEMENTS.items()) + "}"
    return "\n".join([header, *function_helpers(case), "", *data, "", "", forward_source(case), "", "",
                      *patches, f"# torch.cuda's functions megatron-core calls, answered on a CPU rank\n{patched}", "",
                      inspect.getsource(gathered), inspect.getsource(buffer_grads), _RUNNER, ""])


# How a megatron script names a raise (the pipeline script's too): megatron has many bare asserts.
RAISED = '''def raised(e):
    """The first line of what megatron raised, or where a bare assert fired."""
    line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return line[:300] or f"assert in {frame.name} ({os.path.basename(frame.filename)}: {(frame.line or '').strip()[:120]})"
'''

_RUNNER = "\n\n".join([EAGER_WINDOWS, CASE_MODULE, loopback.SOURCE, loopback.VERDICT, RAISED]) + '''

def main():
    _gradfuzz_loopback()
    world = int(os.environ["WORLD_SIZE"])
    rank, device, gpus = start_group(world, timeout=datetime.timedelta(minutes=2))
    if not gpus:
        for name, fn in CPU_PATCHES.items():
            setattr(torch.cuda, name, fn)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    module = Module(device)
    params = module.weights()
    for n in SHARED:
        params[n].shared_embedding = True
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(**DDP_CONFIG), module)
    names = {p: n for n, p in params.items()}
    want, bad, k = expected(), 0, -1
    try:
        for k in range(MICROBATCHES * STEPS):
            sync = (k + 1) % MICROBATCHES == 0
            if k % MICROBATCHES == 0:
                ddp.zero_grad_buffer()
            inputs = [torch.tensor(INPUTS[k][n], dtype=DTYPE, device=device).requires_grad_(INPUT_GRAD[n]) for n in INPUT_NAMES]
            cots = [torch.tensor(c, dtype=DTYPE, device=device) * (world * MICROBATCHES if rank == 0 else 0) for c in GRAD_OUTPUTS[k]]
            with contextlib.nullcontext() if sync else ddp.no_sync():
                live = [(o, c) for o, c in zip(ddp(*inputs), cots) if o.requires_grad]
                if live:
                    (sum((o * c).sum() for o, c in live) / MICROBATCHES).backward()
            if sync:
                finalize_model_grads([ddp])
            grads = buffer_grads(ddp, names, sync)
            for n, p in params.items():
                a = grads.get(n)
                if a is not None and not sync:  # inside a window each rank holds its own sum: their mean is the grad
                    a = a.clone()
                    dist.all_reduce(a)
                    a /= world
                bad += differs(rank, k, n, want[k][n], a, p.shape)
    except Exception as e:  # megatron raised where eager autograd ran fine
        traceback.print_exc()
        print(f"rank {rank} backward {k}: megatron-core raised {type(e).__name__}: {raised(e)}")
        bad += 1
    return verdict(bad, device, f"torch {torch.__version__}, megatron-core {version('megatron-core')}")
''' + loopback.ENTRY
