"""Standalone torchrun scripts for DTensor findings.

The script needs only torch: it spells the module out, makes every parameter
a DTensor on a device mesh of all ranks as the harness does (a Replicate
parameter used through ``to_local(grad_placements=[Partial()])`` for the
seed's pattern, or the case's own placement), feeds each rank its share of
every grad output, runs the case's microbatches, and compares each
``.grad`` (``full_tensor()``) with float64 eager autograd after every
backward. Where a Partial grad was handed to ``AccumulateGrad``, ``.grad``
must still be Partial. Rank 0 prints the verdict; exit status 1 when they
differ.
"""

from __future__ import annotations

from harness.materialize.tensors import Built
from harness.case.spec import Case
from harness.objects import Ref
from harness.paths import loopback
from harness.materialize.source import EAGER_WINDOWS, checked, forward_source, function_helpers, schedule_data
from harness.paths.base import Repro


def script(case: Case, machinery: Repro, title: str) -> str:
    case = checked(case)
    b = Built(case)
    sched = case.schedule
    local = all(p.placement in ("", "partial") for p in case.params)
    impl, world_size = machinery.family.impl, machinery.family.world_size
    impl_import = "" if impl in ("", "stock") else Ref.parse(impl).import_line("layout_impl")
    data = [
        f"TITLE = {str(title)!r}",
        "PLACEMENT = " + repr({p.name: p.placement for p in case.params}),
        f"LOCAL = {local!r}  # every parameter Replicate, used through to_local(grad_placements=[Partial()])",
        *schedule_data(case, b),
    ]
    header = f'''#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64, summed out of place. Actual: DTensor
parameters on {world_size} rank(s), grad-layout handling {impl or 'stock'!r}, in {case.dtype}.
Schedule: {sched.steps} step(s) x {sched.microbatches} microbatch(es), .grad starts as None,
zero_grad between steps: {sched.zero_grad!r}.
Run:  {loopback.RUN.format(world_size=world_size)}   (gloo on CPU; nccl with a GPU per rank; loopback only unless GRADFUZZ_REPRO_ANY_INTERFACE=1)
Exit status 1 on rank 0 when they differ.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
{impl_import}
'''
    return "\n".join([header, *function_helpers(case), "", *data, "", "", forward_source(case), "", "",
                      _RUNNER.replace("%INSTALL%", "layout_impl.install(params, mesh)" if impl_import else "pass"), ""])


_RUNNER = '''def placement(name):
    code = PLACEMENT[name]
    if code.startswith("shard"):
        return Shard(int(code[5:]))
    return Replicate()


''' + EAGER_WINDOWS + '''

''' + loopback.SOURCE + '''

def main():
    _gradfuzz_loopback()
    dist.init_process_group("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"]) else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    params = {}
    for n, t in PARAMS.items():
        full = torch.tensor(t, dtype=DTYPE, device=device)
        params[n] = torch.nn.Parameter(distribute_tensor(full, mesh, [Replicate() if LOCAL else placement(n)]),
                                       requires_grad=n not in FROZEN)
    %INSTALL%
    want, bad = expected(), 0
    for k in range(MICROBATCHES * STEPS):
        if start(k):
            for p in params.values():
                if ZERO_GRAD == "set_to_none":
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
        inputs = {n: torch.tensor(t, dtype=DTYPE, device=device).requires_grad_(INPUT_GRAD[n]) for n, t in INPUTS[k].items()}
        cots = [torch.tensor(c, dtype=DTYPE, device=device) for c in GRAD_OUTPUTS[k]]
        if LOCAL:  # rank 0 holds each grad output, the others zeros: the Partial grads sum to eager's
            values = {n: p.to_local(grad_placements=[Partial()]) for n, p in params.items()}
            cots = [c if rank == 0 else torch.zeros_like(c) for c in cots]
        else:
            values = dict(params)
            inputs = {n: distribute_tensor(t.detach(), mesh, [Replicate()]).requires_grad_(t.requires_grad) for n, t in inputs.items()}
            cots = [distribute_tensor(c, mesh, [Replicate()]) for c in cots]
        outs = forward({**values, **inputs})
        live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [c for _, c in live])
        for n, p in params.items():
            e, g = want[k][n], p.grad
            a = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g).to("cpu", torch.float64)
            same = (e is None and a is None) or (e is not None and a is not None and torch.allclose(a, e, rtol=1e-5, atol=1e-5))
            if not same:
                bad += 1
                if rank == 0:
                    print(f"backward {k}: {n}.grad differs\\n  expected {None if e is None else e.tolist()}\\n  actual   {None if a is None else a.tolist()}")
            if LOCAL and isinstance(g, DTensor) and not any(pl.is_partial() for pl in g.placements):
                bad += 1
                if rank == 0:
                    print(f"backward {k}: {n}.grad is {g.placements}, expected Partial: the grads reached AccumulateGrad as Partial")
    if rank == 0:
        print(f"torch {torch.__version__}: {'DIVERGES' if bad else 'agrees'} ({bad} differences)")
    dist.barrier()  # no rank tears gloo down while another is still using it (an abort at exit)
    dist.destroy_process_group()
    return 1 if bad else 0
''' + loopback.ENTRY
