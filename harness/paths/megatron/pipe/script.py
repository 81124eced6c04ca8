"""Standalone torchrun scripts for ``megatron.pp.stock`` and
``megatron.vpp.stock`` findings.

The script needs torch and megatron-core only and runs what each rank of
the path runs (``pipe``): the case cut into stages as the path cuts it
(``pipe.stage_specs``), each stage spelled out as an ``nn.Module`` class
(``source.stage_source``) inside ``pipe.MegatronStage`` and tied with
``pipe.tie`` (both their own source: the one tensor across each boundary,
the shared weight on the first and last stage set up as megatron's
``LanguageModule`` sets up a tied embedding), chunk ``c`` of rank ``r`` at
stage ``c * 2 + r``, each chunk in megatron-core's
``DistributedDataParallel`` with the case's ``DistributedDataParallelConfig``
(``data.ddp_config``) and one ``TransformerConfig`` whose p2p and schedule
fields are ``data.model_config``'s (``batch_p2p_comm`` among them), both as
JSON data. Every step is one iteration: ``zero_grad_buffer()`` and then
megatron's own ``forward_backward_pipelining_without_interleaving`` (one
chunk a rank) or ``..._with_interleaving`` over the step's microbatches,
ending in ``finalize_model_grads``; on a CPU rank under the family's patches
(``cpu.REPLACEMENTS`` and ``cpu.CudaFactoriesOnCpu``, their own source).

After each iteration every rank compares, with float64 eager autograd: the
``main_grad`` of each parameter it holds (``rank.buffer_grads``, its own
source; the shared weight on both ranks, each copy against the sum of both
uses), the first stage's input grads and the last stage's outputs per
microbatch, as the path's facts are. A raise where eager ran is a
divergence. Rank 0 prints the verdict (``loopback.VERDICT``); exit status 1
when they differ.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

from harness.case.spec import Case
from harness.materialize.names import attribute
from harness.materialize.source import checked, forward_source, function_helpers, schedule_data, stage_source
from harness.materialize.tensors import Built
from harness.paths import loopback
from harness.paths.base import Repro
from harness.paths.megatron.cpu import REPLACEMENTS, CudaFactoriesOnCpu, is_cuda
from harness.paths.megatron.data import ddp_config, knobs, model_config
from harness.paths.megatron.pipe.rank import (STAGES, MegatronStage, PeerFailed, agreed, boundary_shapes, boundary_width,
                                         shared_params, stage_specs, tie)
from harness.paths.megatron.rank import buffer_grads, gathered
from harness.paths.megatron.script import RAISED


@dataclass(frozen=True)
class Pipe:
    """What the script needs of a megatron pipeline path (``Repro.family``)."""

    chunks: int  # model chunks a rank (1: megatron.pp's 1F1B; 2: megatron.vpp's interleaved schedule)


def script(case: Case, machinery: Repro, title: str) -> str:
    """Written from the checked case only (corpus files come from strangers): its values as literals, the
    configs as JSON text, and the path's own pieces as their source, so the script runs what the ranks run."""
    case = checked(case)
    chunks = machinery.family.chunks
    specs = stage_specs(case, chunks)
    stages = [stage_source(case, s) + "\n\n" for s in specs]
    return "\n".join([_header(case, chunks, len(specs)), *function_helpers(case), "", *_data(case, title, chunks),
                      "", "", forward_source(case), "", "", *stages,
                      f"STAGES = [{', '.join(f'Stage{s.index}' for s in specs)}]", "", "", *_pieces(), _RUNNER, ""])


def _pieces() -> list[str]:
    """The family's CPU patches and the path's stage wrapper, tie, agreement and grad reads, as source."""
    patches = [inspect.getsource(fn) + "\n" for fn in REPLACEMENTS.values()]
    patched = "CPU_PATCHES = {" + ", ".join(f"{n!r}: {fn.__name__}" for n, fn in REPLACEMENTS.items()) + "}"
    return [*patches, f"# torch.cuda's functions megatron-core calls, answered on a CPU rank\n{patched}", "", "",
            *[inspect.getsource(x) + "\n" for x in (is_cuda, CudaFactoriesOnCpu, MegatronStage, tie, PeerFailed,
                                                    agreed, gathered, buffer_grads)]]


def _data(case: Case, title: str, chunks: int) -> list[str]:
    """The case and the path's settings as constants: numbers and JSON text, never code."""
    specs = stage_specs(case, chunks)
    shared = shared_params(case, specs)
    config = json.dumps(ddp_config(case, knobs(case).distopt), sort_keys=True)
    return [
        f"TITLE = {str(title)!r}",
        f"DDP_CONFIG = json.loads({config!r})  # every chunk's DistributedDataParallelConfig",
        f"MODEL_CONFIG = json.loads({json.dumps(model_config(case, chunks), sort_keys=True)!r})  # TransformerConfig's",
        f"PIPELINE, CHUNKS = {STAGES}, {chunks}  # ranks, and model chunks a rank: stage c * PIPELINE + rank",
        f"STAGE_PARAMS = {[list(s.params) for s in specs]!r}",
        "ATTRIBUTES = {" + ", ".join(f"{p.name!r}: {attribute(p.name)!r}" for p in case.params) + "}",
        f"SHARED = {shared[0] if shared else None!r}  # on the first and the last stage: megatron's tied embedding",
        f"SHAPES = {[[] if s.index == 0 else boundary_shapes(case, s) for s in specs]!r}  # what each stage receives",
        f"WIDTH = {boundary_width(case, specs)}  # seq_length: every boundary is sent as (WIDTH, 1, 1)",
        *schedule_data(case, Built(case)),
    ]


def _header(case: Case, chunks: int, stages: int) -> str:
    schedule = "forward_backward_pipelining_" + ("without_interleaving" if chunks == 1 else "with_interleaving")
    return f'''#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64. Actual: megatron-core's {schedule}
over {stages} stage(s) on {STAGES} ranks ({chunks} model chunk(s) a rank, each in DistributedDataParallel,
DDP_CONFIG and MODEL_CONFIG below), in {case.dtype}, ending in finalize_model_grads.
Schedule: {case.schedule.steps} iteration(s) x {case.schedule.microbatches} microbatch(es); after each, every
parameter's main_grad, the first stage's input grads and the last stage's outputs compared.
Run:  {loopback.RUN.format(world_size=STAGES)}   (gloo on CPU, with CPU_PATCHES; nccl with a GPU per rank)
Exit status 1 on rank 0 when they differ.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
import traceback
from importlib.metadata import version
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
'''


_RUNNER = loopback.SOURCE + "\n\n" + loopback.VERDICT + "\n\n" + RAISED + '''

def expected():
    """Per backward, in float64: every parameter's grad summed over its iteration so far (megatron's
    zero_grad_buffer() clears it at each iteration's start), the inputs' grads and the outputs."""
    params = {n: torch.tensor(t, dtype=torch.float64).requires_grad_(n not in FROZEN) for n, t in PARAMS.items()}
    names = [n for n in params if n not in FROZEN]
    seen, acc = [], {}
    for k in range(MICROBATCHES * STEPS):
        acc = {n: None for n in params} if k % MICROBATCHES == 0 else acc
        inputs = {n: torch.tensor(t, dtype=torch.float64).requires_grad_(INPUT_GRAD[n]) for n, t in INPUTS[k].items()}
        outs = forward({**params, **inputs})
        live = [(o, c) for o, c in zip(outs, GRAD_OUTPUTS[k]) if o.requires_grad]
        wrt = names + [n for n in INPUT_NAMES if INPUT_GRAD[n]]
        got = dict(zip(wrt, torch.autograd.grad([o for o, _ in live], [params.get(n, inputs.get(n)) for n in wrt],
                                                [torch.tensor(c, dtype=torch.float64) for _, c in live],
                                                allow_unused=True))) if live and wrt else {}
        for n in names:
            if got.get(n) is not None:
                acc[n] = got[n].clone() if acc[n] is None else acc[n] + got[n]
        seen.append({"grads": dict(acc), "inputs": {n: got.get(n) for n in INPUT_NAMES},
                     "outputs": [o.detach() for o in outs]})
    return seen


def forward_step_func(device, leaves, outputs):
    """The path's forward step: the first stage takes the microbatch's inputs, the last returns the loss
    sum(output * grad_output) with each grad output times MICROBATCHES (megatron divides the loss by them)."""
    def forward_step(data_iterator, model):
        k = next(data_iterator)
        if model.module.index == 0:
            leaves[k] = [torch.tensor(INPUTS[k][n], dtype=DTYPE, device=device).requires_grad_(INPUT_GRAD[n])
                         for n in INPUT_NAMES]
            out = model(*leaves[k])
        else:
            out = model()
        if model.module.index != len(STAGES) - 1:
            return out, None
        outputs[k] = [o.detach().to("cpu", torch.float64, copy=True) for o in out]
        cots = [torch.tensor(c, dtype=DTYPE, device=device) * MICROBATCHES for c in GRAD_OUTPUTS[k]]

        def loss_func(output):
            terms = [(o * c).sum() for o, c in zip(output, cots) if o.requires_grad]
            loss = sum(terms[1:], terms[0]) if terms else torch.zeros((), dtype=DTYPE, device=device)
            if MODEL_CONFIG["calculate_per_token_loss"]:  # one token a microbatch: finalize divides by MICROBATCHES
                return loss, torch.tensor(1, dtype=torch.int), {}
            return loss, {}

        return out, loss_func

    return forward_step


def build(rank, device):
    """This rank's model chunks, every one built and tied before any is wrapped, each in its own
    DistributedDataParallel (bucketing off after the first), as the path's ranks and megatron's get_model do."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(1, PIPELINE, CHUNKS if CHUNKS > 1 else None,
                                             create_gloo_process_groups=False)
    config = TransformerConfig(num_layers=len(STAGES), hidden_size=1, num_attention_heads=1,
                               pipeline_model_parallel_size=PIPELINE, pipeline_dtype=DTYPE, **MODEL_CONFIG)
    modules = []
    for s in [c * PIPELINE + rank for c in range(CHUNKS)]:
        stage = STAGES[s]().to(device)
        first, last = s == 0, s == len(STAGES) - 1
        weights = {n: getattr(stage, ATTRIBUTES[n]) for n in STAGE_PARAMS[s]}
        modules.append(MegatronStage(stage, s, weights, first, last, SHARED if first or last else None, SHAPES[s],
                                     WIDTH))
        tie(modules[-1], first, parallel_state)
    ddps = [DistributedDataParallel(config, DistributedDataParallelConfig(**DDP_CONFIG), m, disable_bucketing=c > 0)
            for c, m in enumerate(modules)]
    if DDP_CONFIG["overlap_grad_reduce"]:  # megatron's train(): no_sync_func and grad_sync_func
        config.no_sync_func = [d.no_sync for d in ddps] if CHUNKS > 1 else ddps[0].no_sync
        config.grad_sync_func = [d.start_grad_sync for d in ddps] if CHUNKS > 1 else ddps[0].start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddps, modules


def iteration(step, ddps, forward_step, gpus):
    """One training iteration: megatron's own pipeline schedule over the step's microbatches."""
    from megatron.core.pipeline_parallel import schedules

    ks = range(step * MICROBATCHES, (step + 1) * MICROBATCHES)
    with contextlib.nullcontext() if gpus else CudaFactoriesOnCpu():
        if CHUNKS == 1:
            schedules.forward_backward_pipelining_without_interleaving(
                forward_step_func=forward_step, data_iterator=iter(ks), model=ddps, num_microbatches=MICROBATCHES,
                seq_length=WIDTH, micro_batch_size=1, forward_only=False)
        else:  # one data iterator per model chunk, as the interleaved schedule asserts
            schedules.forward_backward_pipelining_with_interleaving(
                forward_step_func=forward_step, data_iterator=[iter(ks) for _ in ddps], model=ddps,
                num_microbatches=MICROBATCHES, seq_length=WIDTH, micro_batch_size=1, forward_only=False)


def compared(rank, step, ddps, modules, leaves, outputs, want):
    """Differences after an iteration: this rank's main_grads (.grad of a frozen copy), the first stage's input
    grads (over the token count under calculate_per_token_loss, as finalize scales the buffers) and the outputs."""
    k, bad = (step + 1) * MICROBATCHES - 1, 0
    for ddp, module in zip(ddps, modules):
        grads = buffer_grads(ddp, {p: n for n, p in module.params().items()}, True)
        for n, p in module.params().items():
            bad += differs(rank, k, n, want[k]["grads"][n], grads.get(n) if p.requires_grad else p.grad, p.shape)
    tokens = MICROBATCHES if MODEL_CONFIG["calculate_per_token_loss"] else 1
    for j, args in leaves.items():
        for n, t in zip(INPUT_NAMES, args):
            bad += differs(rank, j, f"input {n}", want[j]["inputs"][n], None if t.grad is None else t.grad / tokens,
                           t.shape)
    for j, outs in outputs.items():
        for i, (a, e) in enumerate(zip(outs, want[j]["outputs"])):
            if not torch.allclose(a, e, rtol=1e-5, atol=1e-5):
                bad += 1
                print(f"rank {rank} microbatch {j}: output {i} differs\\n  expected {e.tolist()}\\n"
                      f"  actual   {a.tolist()}")
    return bad


def main():
    _gradfuzz_loopback()
    if int(os.environ["WORLD_SIZE"]) != PIPELINE:
        sys.exit(f"run with --nproc-per-node {PIPELINE}: one rank a pipeline stage (of each model chunk)")
    rank, device, gpus = start_group(PIPELINE, timeout=datetime.timedelta(minutes=2))
    if not gpus:
        for name, fn in CPU_PATCHES.items():
            setattr(torch.cuda, name, fn)
    want, bad, step = expected(), 0, -1
    try:
        ddps, modules = agreed(device, lambda: build(rank, device))
        for step in range(STEPS):
            leaves, outputs = {}, {}
            agreed(device, lambda: [d.zero_grad_buffer() for d in ddps])
            iteration(step, ddps, forward_step_func(device, leaves, outputs), gpus)
            bad += compared(rank, step, ddps, modules, leaves, outputs, want)
    except PeerFailed:
        bad += 1  # the peer raised where this rank got through: the peer prints what
    except Exception as e:  # megatron raised where eager autograd ran fine
        traceback.print_exc()
        print(f"rank {rank} iteration {step}: megatron-core raised {type(e).__name__}: {raised(e)}")
        bad += 1
    return verdict(bad, device, f"torch {torch.__version__}, megatron-core {version('megatron-core')}")
''' + loopback.ENTRY
