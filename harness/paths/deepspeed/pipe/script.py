"""Standalone torchrun scripts for ``deepspeed.pipe.*`` findings.

The script needs torch and DeepSpeed only, and builds what each rank of the
path builds (``piperank``): the case cut in two stages (``stages.bodies``),
each a plain ``nn.Module`` class of its own nodes, a ``TiedLayerSpec`` per
parameter both stages use (its weight appended to the activations), the
stages padded with identity layers so that the ``uniform`` partition puts
one on each rank, in a ``PipelineModule`` handed to ``deepspeed.initialize``
with the path's config (``data.pipe_config``, as data). Each step of the
case is one ``engine.train_batch`` over its microbatches; the loss is
``microbatches * sum(output * grad output)`` (the engine divides by its
accumulation steps). Grads are read with ``safe_get_full_grad`` as the
engine's optimizer is about to step (after the tied all-reduce; the engine
zeroes them before ``train_batch`` returns), each on the rank that holds
the parameter (a tied one on both), and compared with float64 eager
autograd. Rank 0 prints the verdict; exit status 1 when they differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from harness.case.spec import Case
from harness.materialize.names import PREFIX
from harness.materialize.source import (EAGER_WINDOWS, checked, forward_source, function_helpers, schedule_data,
                                        stage_source)
from harness.materialize.tensors import Built
from harness.paths import loopback
from harness.paths.base import Repro
from harness.paths.deepspeed.data import pipe_config
from harness.paths.deepspeed.pipe.stages import bodies

WORLD_SIZE = 2  # two stages, one a rank (the pipe paths' world)


@dataclass(frozen=True)
class Pipe:
    """What the script needs of a pipe path (``Repro.family``)."""

    stage: int  # ZeRO stage: 0 or 1


def script(case: Case, machinery: Repro, title: str) -> str:
    """The script's text (``Family.scripts``): the case checked first, as every template does, since corpus
    files come from strangers; the config, the tied weights and the data as literals, the stages as classes."""
    case = checked(case)
    p: Pipe = machinery.family
    stages = bodies(case)
    data = [
        f"TITLE = {str(title)!r}",
        f"PREFIX = {PREFIX!r}",
        # The config as JSON text read at run time: data, never code.
        f"CONFIG = json.loads({json.dumps(pipe_config(case, p.stage), sort_keys=True)!r})",
        f"STAGE_TIED = {[list(mine) for mine, _ in stages]!r}  # per stage: its TiedLayerSpec weights, in order",
        *schedule_data(case, Built(case)),
    ]
    classes = "\n\n\n".join(stage_source(case, body) for _, body in stages)
    return "\n".join([_header(case, p, stages), *function_helpers(case), "", *data, "", "", forward_source(case), "",
                      "", classes, "", "", f"STAGES = [{', '.join(f'Stage{b.index}' for _, b in stages)}]", "", "",
                      _RUNNER, ""])


def _header(case: Case, p: Pipe, stages: list) -> str:
    """The docstring a reader sees first: what runs, what is compared, how to run it."""
    tied = sorted({n for mine, _ in stages for n in mine})
    return f'''#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64. Actual: DeepSpeed's pipeline engine, the module cut in {len(stages)} stages
(Stage0, Stage1 below) on {WORLD_SIZE} ranks, one a rank, ZeRO stage {p.stage}, in {case.dtype} (CONFIG below);
tied across the stages with TiedLayerSpec: {", ".join(tied) or "nothing"}.
Schedule: {case.schedule.steps} step(s), each one engine.train_batch over {case.schedule.microbatches} microbatch(es);
grads read with deepspeed.utils.safe_get_full_grad as the engine's optimizer is about to step, on the rank
holding each parameter.
Run:  {loopback.RUN.format(world_size=WORLD_SIZE)}   (gloo on CPU with DS_ACCELERATOR=cpu; nccl with a GPU per rank)
Exit status 1 on rank 0 when they differ.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
'''


_RUNNER = EAGER_WINDOWS + "\n\n" + loopback.SOURCE + "\n\n" + loopback.VERDICT + '''

def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def identity(x):
    return x


class Holder(torch.nn.Module):
    """A tied parameter's copy on one stage, under the attribute TiedLayerSpec all-reduces by default (weight)."""

    def __init__(self, name):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(PARAMS[name], dtype=DTYPE), requires_grad=name not in FROZEN)
        self.weight.case_name = name


def append_weight(holder, x):
    """A tied layer's forward: the activations, then its weight (the stage's nodes take it last)."""
    return (*as_tuple(x), holder.weight)


class Body(torch.nn.Module):
    """STAGES[i] taking its inputs as the one value the engine hands a layer (a tuple when several)."""

    def __init__(self, i):
        super().__init__()
        self.stage = STAGES[i]()
        for name, p in self.stage.named_parameters():
            p.case_name = name[len(PREFIX):]

    def forward(self, x):
        return self.stage(*as_tuple(x))


def layers():
    """Each stage's tied layers then its body, padded at the front so the uniform partition cuts between them."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    stages = [[TiedLayerSpec(n, Holder, n, forward_fn=append_weight) for n in tied] + [LayerSpec(Body, i)]
              for i, tied in enumerate(STAGE_TIED)]
    width = max(len(s) for s in stages)
    return [layer for s in stages for layer in [identity] * (width - len(s)) + s]


def loss_fn(outputs, cots):
    """sum(output * grad output) times the microbatches: the engine divides the loss by its accumulation steps."""
    terms = [(o * c).sum() for o, c in zip(as_tuple(outputs), cots) if o.requires_grad]
    return MICROBATCHES * sum(terms[1:], terms[0])


def batches(ks):
    """What train_batch draws per microbatch: the inputs (for the first stage), the grad outputs as labels
    (for the last)."""
    for k in ks:
        xs = tuple(torch.tensor(INPUTS[k][n], dtype=DTYPE) for n in INPUT_NAMES)
        yield xs[0] if len(xs) == 1 else xs, tuple(torch.tensor(c, dtype=DTYPE) for c in GRAD_OUTPUTS[k])


def read_before_step(engine, grads, read):
    """Read this rank's grads as the engine settled them (tied ones all-reduced), as its optimizer is about
    to step: the engine zeroes them before train_batch returns."""
    step = engine.optimizer.step

    def reading_step(*args, **kwargs):
        grads.append({n: None if g is None else g.detach().clone() for n, g in read().items()})
        return step(*args, **kwargs)

    engine.optimizer.step = reading_step


def main():
    _gradfuzz_loopback()
    world = int(os.environ["WORLD_SIZE"])
    if world != len(STAGES):
        sys.exit(f"run on {len(STAGES)} ranks (--nproc-per-node {len(STAGES)}): one pipeline stage a rank")
    rank, device, gpus = start_group(world)
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if gpus else "cpu")  # read when deepspeed is imported
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.utils import safe_get_full_grad

    deepspeed.init_distributed()  # over the process group above
    module = PipelineModule(layers(), num_stages=len(STAGES), loss_fn=loss_fn, partition_method="uniform")
    params = {p.case_name: p for p in module.parameters() if hasattr(p, "case_name")}  # this rank's stage
    opt = torch.optim.SGD([p for p in params.values() if p.requires_grad], lr=0.0)  # weights stay put
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=CONFIG)
    grads = []
    read_before_step(engine, grads, lambda: {n: safe_get_full_grad(p) for n, p in params.items() if p.requires_grad})
    want, bad = expected(), 0
    for s in range(STEPS):
        engine.train_batch(iter(batches(range(s * MICROBATCHES, (s + 1) * MICROBATCHES))))
        k = (s + 1) * MICROBATCHES - 1  # the window's last backward
        for n, p in params.items():
            bad += differs(rank, k, n, want[k][n], grads[s].get(n), p.shape)
    return verdict(bad, device, f"torch {torch.__version__}, deepspeed {deepspeed.__version__}")
''' + loopback.ENTRY
