"""Standalone torchrun scripts for DDP and FSDP2 findings.

The script needs only torch: the case's forward as plain code inside one
``nn.Module``, wrapped in ``DistributedDataParallel`` or ``fully_shard`` with
the case's switches; rank 0 gets the world size times each grad output and
the other ranks zeros, so the average both wrappers take is eager's grad.
After each accumulation window's last backward (and ``clip_grad_norm_``
where the case clips) every ``.grad`` is compared with float64 eager
autograd: DDP's on every rank, FSDP2's through ``full_tensor()``. Rank 0
prints the verdict; exit status 1 when they differ.

Cases the script cannot spell (units, checkpointed blocks, optimizer steps)
keep the ``none`` template: their script says to replay the corpus file.
"""

from __future__ import annotations

from harness.materialize.names import PREFIX
from harness.materialize.tensors import Built
from harness.case.spec import Case
from harness.paths import loopback
from harness.materialize.source import CASE_MODULE, EAGER_WINDOWS, checked, forward_source, function_helpers, schedule_data
from harness.paths.base import Repro
from harness.paths.parallel.data import switches
from harness.paths.parallel.paths import SCRIPTED


def script(case: Case, machinery: Repro, title: str) -> str:
    case = checked(case)
    b = Built(case)
    sched = case.schedule
    kind, world_size = machinery.family.kind, machinery.family.world_size  # "ddp" or "fsdp2"
    data = [
        f"TITLE = {str(title)!r}",
        f"KIND = {kind!r}",
        f"PREFIX = {PREFIX!r}",
        f"OPTIONS = {sorted(set(switches(case).options) & SCRIPTED)!r}",
        *schedule_data(case, b),
    ]
    header = f'''#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64. Actual: the module under {'DistributedDataParallel' if kind == 'ddp' else 'fully_shard'}
on {world_size} rank(s), in {case.dtype}, switches in OPTIONS.
Schedule: {sched.steps} step(s) x {sched.microbatches} microbatch(es), .grad starts {sched.grad_init!r},
zero_grad between steps: {sched.zero_grad!r}; grads compared after each window's last backward.
Run:  {loopback.RUN.format(world_size=world_size)}   (gloo on CPU; nccl with a GPU per rank; loopback only unless GRADFUZZ_REPRO_ANY_INTERFACE=1)
Exit status 1 on rank 0 when they differ.
"""
import contextlib
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
'''
    return "\n".join([header, *function_helpers(case), "", *data, "", "", forward_source(case), "", "", _RUNNER, ""])


_RUNNER = EAGER_WINDOWS + "\n\n" + CASE_MODULE + "\n\n" + loopback.SOURCE + '''

def main():
    _gradfuzz_loopback()
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    module = Module(device)
    if KIND == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(
            module, device_ids=[rank] if device.type == "cuda" else None,
            bucket_cap_mb=1e-6 if "small_buckets" in OPTIONS else 25,
            gradient_as_bucket_view="bucket_view" in OPTIONS, static_graph="static_graph" in OPTIONS,
            find_unused_parameters="find_unused" in OPTIONS)
        if "hook_allreduce" in OPTIONS:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif "hook_builtin" in OPTIONS:
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    else:
        from torch.distributed.fsdp import fully_shard
        reshard = False if "keep_unsharded" in OPTIONS else 1 if "reshard_int" in OPTIONS else True
        model = fully_shard(module, mesh=init_device_mesh(device.type, (world,)), reshard_after_forward=reshard)
    params = module.weights()
    if GRAD_INIT != "none":
        for n, p in params.items():
            if n not in FROZEN:
                full = torch.zeros(p.shape, dtype=DTYPE) if GRAD_INIT == "zero" else torch.tensor(PREFILL[n], dtype=DTYPE)
                full = full.to(device)
                p.grad = (DTensor.from_local(torch.chunk(full, world)[rank] if rank < len(torch.chunk(full, world))
                                             else full[:0], p.device_mesh, p.placements, shape=full.shape, stride=full.stride())
                          if isinstance(p, DTensor) else full)
    want, bad = expected(), 0
    for k in range(MICROBATCHES * STEPS):
        if start(k):
            model.zero_grad(set_to_none=ZERO_GRAD == "set_to_none")
        sync = "no_sync" not in OPTIONS or (k + 1) % MICROBATCHES == 0
        inputs = [torch.tensor(INPUTS[k][n], dtype=DTYPE, device=device).requires_grad_(INPUT_GRAD[n]) for n in INPUT_NAMES]
        cots = [torch.tensor(c, dtype=DTYPE, device=device) * (world if rank == 0 else 0) for c in GRAD_OUTPUTS[k]]
        if KIND == "ddp":
            window = contextlib.nullcontext() if sync else model.no_sync()
        else:
            model.set_requires_gradient_sync(sync)
            if "no_reshard_after_backward" in OPTIONS:
                model.set_reshard_after_backward(sync)
            window = contextlib.nullcontext()
        with window:
            live = [(o, c) for o, c in zip(model(*inputs), cots) if o.requires_grad]
            if live:
                torch.autograd.backward([o for o, _ in live], [c for _, c in live])
        if not sync:
            continue
        if CLIP:
            torch.nn.utils.clip_grad_norm_([p for p in params.values() if p.grad is not None], MAX_NORM,
                                           norm_type=float(CLIP))
        for n, p in params.items():
            e, g = want[k][n], p.grad
            a = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g).to("cpu", torch.float64)
            same = (e is None and a is None) or (e is not None and a is not None and torch.allclose(a, e, rtol=1e-5, atol=1e-5))
            if not same:
                bad += 1
                print(f"rank {rank} backward {k}: {n}.grad differs\\n  expected {None if e is None else e.tolist()}"
                      f"\\n  actual   {None if a is None else a.tolist()}")
    flag = torch.tensor([bad], device=device)
    dist.all_reduce(flag)
    if rank == 0:
        print(f"torch {torch.__version__}: {'DIVERGES' if flag.item() else 'agrees'} ({int(flag.item())} differences)")
    del model, params  # DDP's reducer joins its threads here, not in a destructor at exit (an abort there)
    gc.collect()
    dist.barrier()  # no rank tears gloo down while another is still using it (an abort at exit)
    dist.destroy_process_group()
    return 1 if flag.item() else 0
''' + loopback.ENTRY
