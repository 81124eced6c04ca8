"""What every rank of ``megatron.pp.*`` runs: megatron-core's non-interleaved
1F1B schedule over two pipeline stages, one per rank, with the weight both
stages use shared the way megatron shares its word embedding and output layer;
and of ``megatron.vpp.*``: its interleaved schedule over four virtual stages,
two model chunks per rank (chunk ``c`` of rank ``r`` is stage ``2c + r``), the
shared weight on the first and the last stage (rank 0's first chunk, rank 1's
last), each chunk its own ``DistributedDataParallel`` and one config for all.

Setup (``parallel_state.initialize_model_parallel(1, 2)`` over the pool's two
ranks: pipeline size 2, data-parallel size 1, the embedding group the first
and last stage):

- the case's nodes are cut at ``family.megatron.cut`` into two stages
  (``harness.materialize.stages.cut``); rank ``r`` holds stage ``r`` as a
  ``StageModule`` with its own copy of every parameter it uses (and the
  first stage every parameter no node uses, ``stage_specs``);
- ``MegatronStage`` gives that module what megatron's schedule and
  ``finalize_model_grads`` look up on a model chunk: ``pre_process`` /
  ``post_process``, ``set_input_tensor``, ``model_type``,
  ``share_embeddings_and_output_weights`` and
  ``shared_embedding_or_output_weight()``;
- the weight used by both stages is set up as
  ``LanguageModule.setup_embeddings_and_output_layer`` sets up a tied
  embedding with pipeline size > 1: the first stage's copy is marked
  ``shared_embedding``; the last stage's is zeroed, marked ``shared`` and
  ``shared_embedding``, and the two are all-reduced over the embedding group
  so both start from the first stage's values;
- each stage is wrapped in megatron's ``DistributedDataParallel`` with the
  case's DDP knobs (``distopt``: the distributed optimizer's buckets, which
  give the ``shared_embedding`` weight a bucket of its own), and the model config gets what megatron's ``train()``
  sets: ``finalize_model_grads_func``, and with ``overlap_grad_reduce``
  ``no_sync_func`` and (``align_grad_reduce``, its default)
  ``grad_sync_func``.

Each step of the case is one training iteration: ``zero_grad_buffer()``, then
``forward_backward_pipelining_without_interleaving`` itself over the step's
microbatches (under ``cpu.on_cpu`` and ``cpu.cuda_factories_on_cpu``, the
family's one documented CPU patch), which ends in ``finalize_model_grads``:
its ``_allreduce_word_embedding_grads`` sums the two copies' ``main_grad``.

What crosses the cut: megatron's p2p sends one tensor of shape
``(seq_length, micro_batch_size, hidden_size)`` per microbatch and runs a
non-last stage's backward from the first output only. So the first stage
returns every value the second uses, flattened and concatenated into one
``(n, 1, 1)`` tensor (``seq_length=n``, micro batch 1, hidden size 1), and
the second splits it back into those values: the way a megatron model
hands one hidden state across a stage boundary. The received tensor starts
with a zero ``.grad``: ``backward_step`` sends back ``x.grad``, which autograd
leaves None when no value of the boundary reaches the loss, and then no grad
is sent and the first stage waits for ever (a megatron model always consumes
its hidden state); zero plus what arrives is what arrives.

The loss is ``sum((output * grad_output).sum())`` with each grad output
times the number of microbatches, since megatron divides every microbatch's
loss by that number (exact mode needs it a power of two). With
``calculate_per_token_loss`` (``family.megatron.per_token``) the loss
function reports one token per microbatch instead: the schedule leaves the
loss alone, and ``finalize_model_grads`` broadcasts the token count from the
last stage over the pipeline group and scales every grad buffer by one over
it (computed in float32, so only power-of-two microbatch counts are drawn).
The first stage's input grads lie outside megatron's grad buffers, so the
rank divides them by the token count itself, as finalize does to the buffers.

Facts, after each iteration (grads are observable only then: the schedule
interleaves the microbatches): every parameter's ``main_grad`` (or ``.grad``
for a frozen one) from the rank that holds it, and the shared weight's from
both ranks, each its own copy (Replicate: the copies must agree, and each
must be the oracle's grad, the sum over both uses); per microbatch, the
first stage's input grads and the last stage's outputs. The ranks exchange
their facts (``all_gather_object``), so every rank reports the same record.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from harness.case.spec import Case, Use
from harness.materialize.stages import StageModule, StageSpec, cut
from harness.materialize.tensors import Built
from harness.objects import load_object
from harness.paths.megatron.cpu import cuda_factories_on_cpu, on_cpu
from harness.paths.megatron.data import ddp_config, knobs, model_config
from harness.paths.megatron.rank import STOCK, _parallel_state, _raised_at, main_grads
from harness.paths.rankfacts import encode, first_line, rank_failure
from harness.workers.host import Rank

STAGES = 2  # pipeline ranks; with virtual chunks each rank holds CHUNKS of the stages


def stage_specs(case: Case, chunks: int = 1) -> list[StageSpec]:
    """The case cut at ``family.megatron.cut`` (``cuts`` with virtual chunks:
    ``STAGES * chunks`` stages); a parameter no node uses is held by the
    first stage (a model's unused parameter lives in some chunk, and
    megatron's DDP keeps a grad buffer slice for it all the same)."""
    k = knobs(case)
    specs = cut(case, (k.cut,) if chunks == 1 else k.cuts)
    held = {n for s in specs for n in s.params}
    if all(p.name in held for p in case.params):
        return specs
    mine = set(specs[0].params) | {p.name for p in case.params if p.name not in held}
    return [replace(specs[0], params=tuple(p.name for p in case.params if p.name in mine)), *specs[1:]]


def shared_params(case: Case, specs: list[StageSpec]) -> list[str]:
    """Parameters the first and the last stage both use: each holds a copy."""
    both = set(specs[0].params) & set(specs[-1].params)
    return [p.name for p in case.params if p.name in both]


def held_apart(case: Case, specs: list[StageSpec]) -> dict[str, list[int]]:
    """Parameters held by more than one stage, and by which."""
    out = {p.name: [s.index for s in specs if p.name in s.params] for p in case.params}
    return {n: at for n, at in out.items() if len(at) > 1}


def rank_stages(rank: int, chunks: int) -> list[int]:
    """The stages a rank holds, by model chunk: megatron's virtual pipeline
    puts chunk ``c`` of rank ``r`` at stage ``c * STAGES + r``."""
    return [c * STAGES + rank for c in range(chunks)]


def boundary_width(case: Case, specs: list[StageSpec]) -> int:
    """Elements of the widest boundary: megatron's p2p sends one shape,
    ``(seq_length, micro_batch_size, hidden_size)``, across every boundary of
    the schedule, so narrower ones are padded to it (as sequences are)."""
    return max(sum(math.prod(s) for s in boundary_shapes(case, spec)) for spec in specs[1:])


def boundary_shapes(case: Case, spec: StageSpec) -> list[tuple[int, ...]]:
    """The shapes of the values a (non-first) stage receives, in its input order."""
    built = Built(case)
    return [tuple(built.output_shape(Use(v.ref, index=v.index))) for v in spec.inputs]


class MegatronStage(torch.nn.Module):
    """One pipeline stage as megatron's schedule and ``finalize_model_grads``
    see a model chunk (the attributes ``LanguageModule`` has)."""

    def __init__(self, stage: torch.nn.Module, index: int, weights: dict[str, torch.nn.Parameter], first: bool,
                 last: bool, shared: str | None, shapes: list[tuple[int, ...]], width: int = 0) -> None:
        """``stage`` runs stage ``index`` and holds ``weights`` (by case name): any module, so the standalone
        script wraps its spelled-out stages in this same source."""
        from megatron.core.enums import ModelType

        super().__init__()
        self.stage = stage
        self.index = index
        self.weights = weights
        self.width = width
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process, self.post_process = first, last
        self.shared = shared
        self.share_embeddings_and_output_weights = shared is not None
        self.shapes = shapes
        self.input_tensor: torch.Tensor | None = None

    def params(self) -> dict[str, torch.nn.Parameter]:
        return self.weights

    def set_input_tensor(self, tensors: Any) -> None:
        self.input_tensor = tensors[0] if isinstance(tensors, (list, tuple)) else tensors

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter | None:
        return self.weights[self.shared] if self.shared else None

    def forward(self, *inputs: torch.Tensor) -> Any:
        if not self.pre_process:
            x = self.input_tensor
            assert x is not None, "a non-first stage ran without set_input_tensor"
            if x.requires_grad and x.is_leaf and x.grad is None:
                x.grad = torch.zeros_like(x)  # backward_step sends x.grad: never None, or the sender waits for ever
            flat, at, inputs = x.reshape(-1), 0, ()
            for shape in self.shapes:
                n = math.prod(shape)
                inputs += (flat[at:at + n].view(shape),)
                at += n
        outs = self.stage(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if self.post_process:
            return outs
        flat = [o.reshape(-1, 1, 1) for o in outs]
        pad = self.width - sum(f.shape[0] for f in flat)
        if pad > 0:  # a narrower boundary than the schedule's one shape
            flat.append(torch.zeros(pad, 1, 1, dtype=flat[0].dtype, device=flat[0].device))
        return torch.cat(flat)  # a new tensor, never a view


def tie(module: MegatronStage, first: bool, ps: Any) -> None:
    """``LanguageModule.setup_embeddings_and_output_layer`` with pipeline size > 1. (The standalone script runs
    this source.)"""
    weight = module.shared_embedding_or_output_weight()
    if weight is None:
        return
    weight.is_embedding_or_output_parameter = True
    if first:
        weight.shared_embedding = True
    else:
        weight.data.fill_(0)
        weight.shared = True
        weight.shared_embedding = True
    dist.all_reduce(weight.data, group=ps.get_embedding_group())


def _build(case: Case, built: Built, specs: list[StageSpec], ctx: Rank, fault: Any,
           chunks: int) -> tuple[list[Any], Any, list[MegatronStage]]:
    """This rank's model chunks, each in its own ``DistributedDataParallel``
    sharing one config, as megatron's ``get_model`` builds them (bucketing
    off for every chunk after the first, ``disable_bucketing``: "we might
    not want to break up model parameters into buckets for model chunks after
    the first in the interleaved schedule", distributed_data_parallel.py)."""
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.transformer import TransformerConfig

    ps = _parallel_state(STAGES, chunks if chunks > 1 else None)
    k = knobs(case)
    shared = shared_params(case, specs)
    width = boundary_width(case, specs)
    config = TransformerConfig(num_layers=len(specs), hidden_size=1, num_attention_heads=1,
                               pipeline_model_parallel_size=STAGES, pipeline_dtype=built.dtype,
                               **model_config(case, chunks))
    modules = []
    for s in rank_stages(ctx.rank, chunks):  # every chunk built and tied before any is wrapped, as get_model does
        first, last = s == 0, s == len(specs) - 1
        stage = StageModule(case, specs[s], built.params(), ctx.device)
        module = MegatronStage(stage, s, stage.weights, first, last, shared[0] if shared and (first or last) else None,
                               [] if first else boundary_shapes(case, specs[s]), width)
        tie(module, first, ps)
        modules.append(module)
    ddps = [DistributedDataParallel(config, DistributedDataParallelConfig(**ddp_config(case, k.distopt)), module,
                                    disable_bucketing=chunk > 0) for chunk, module in enumerate(modules)]
    if k.overlap:  # megatron's train(): _update_model_config_funcs, align_grad_reduce on
        config.no_sync_func = [d.no_sync for d in ddps] if chunks > 1 else ddps[0].no_sync
        config.grad_sync_func = [d.start_grad_sync for d in ddps] if chunks > 1 else ddps[0].start_grad_sync
    finalize = finalize_model_grads
    if fault is not None and hasattr(fault, "finalize"):
        finalize = fault.finalize(finalize)
    config.finalize_model_grads_func = finalize
    return ddps, config, modules


def _forward_step(case: Case, built: Built, ctx: Rank, stages: int, leaves: dict, outputs: dict) -> Any:
    M = case.schedule.microbatches
    dev, dtype = ctx.device, built.dtype
    per_token = knobs(case).per_token

    def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
        k = next(data_iterator)
        index = model.module.index  # the model chunk's stage
        first, last = index == 0, index == stages - 1
        if first:
            drawn = built.inputs(k)
            args = [drawn[x.name].to(dev, dtype).requires_grad_(x.requires_grad) for x in case.inputs]
            leaves[k] = args
            out = model(*args)
        else:
            out = model()
        if not last:
            return out, None
        outputs[k] = [o.detach().to("cpu", torch.float64, copy=True) for o in out]
        cots = [c.to(dev, dtype) * M for c in built.cotangents(k)]

        def loss_func(output: Any) -> tuple[torch.Tensor, dict]:
            terms = [(o * c).sum() for o, c in zip(output, cots) if o.requires_grad]
            loss = sum(terms[1:], terms[0]) if terms else torch.zeros((), dtype=dtype, device=dev)
            if per_token:  # one token per microbatch: finalize_model_grads divides by M
                return loss, torch.tensor(1, dtype=torch.int), {}
            return loss, {}

        return out, loss_func

    return forward_step


def _local(case: Case, ddps: list[Any], modules: list[MegatronStage]) -> dict[str, Any]:
    """This rank's grads: ``main_grad`` of its trainable copies, ``.grad`` of
    frozen ones (a rank holds each parameter in one chunk at most)."""
    out = {}
    for ddp, module in zip(ddps, modules):
        main = main_grads(ddp, True)  # after finalize; under the distributed optimizer, its shards gathered
        for n, p in module.params().items():
            g = main.get(n) if p.requires_grad else p.grad
            out[n] = None if g is None else g.detach().to("cpu", torch.float64, copy=True)
    return out


def _records(case: Case, step: int, mine: dict[str, Any], facts: list[dict[str, Any]],
             shared: list[str]) -> list[dict[str, Any]]:
    """The step's microbatches as every rank reports them: one rank's facts put together from all ranks'."""
    M = case.schedule.microbatches
    grads = {}
    for p in case.params:
        if p.name in shared:
            grads[p.name] = encode(mine["grads"].get(p.name), "R")  # this rank's own copy
        else:
            held = [f["grads"][p.name] for f in facts if p.name in f["grads"]]
            grads[p.name] = encode(held[0] if held else None, "R")
    first, last = facts[0], facts[-1]
    recs = []
    for j in range(M):
        k = step * M + j
        recs.append({"k": k, "observable": j == M - 1, "grads": grads if j == M - 1 else {},
                     "input_grads": {x.name: encode(first["input_grads"][k].get(x.name), "R") for x in case.inputs},
                     "outputs": [encode(o, "R") for o in last["outputs"][k]], "retained": {}})
    return recs


class PeerFailed(Exception):
    """Another rank raised at the same point: this rank stops there too."""


def agreed(device: torch.device, fn: Any) -> Any:
    """``fn()`` on every rank, then the ranks agree whether all of them got
    through: a rank that raised re-raises, a rank whose peer raised stops
    (``PeerFailed``) instead of waiting for ever in the schedule's first
    p2p recv or a collective. Without it a raise at an iteration's start (the
    known unused-parameter assert in ``zero_grad_buffer``) left the peer
    blocked until the pool gave up on it: 9 s per case, minutes per shrink
    (0.02 s with it). (The standalone script runs this source.)"""
    err: Exception | None = None
    value = None
    try:
        value = fn()
    except Exception as e:
        err = e
    flag = torch.tensor([0.0 if err is None else 1.0], device=device)
    dist.all_reduce(flag)
    if err is not None:
        raise err
    if float(flag.item()) > 0:
        raise PeerFailed()
    return value


def run_case(ctx: Rank, case: Case, impl: str, chunks: int = 1) -> dict[str, Any]:
    """One case on this rank, ``chunks`` model chunks of it (1: megatron's
    1F1B schedule; more: its interleaved schedule). It never raises: the
    parent judges a failure next to its peers'."""
    from megatron.core.pipeline_parallel.schedules import (forward_backward_pipelining_with_interleaving,
                                                           forward_backward_pipelining_without_interleaving)

    built = Built(case)
    out: dict[str, Any] = {"rank": ctx.rank, "steps": [], "failure": None}
    M = case.schedule.microbatches
    k = -1
    try:
        specs = stage_specs(case, chunks)
        if len(specs) != STAGES * chunks or ctx.world_size != STAGES:
            raise ValueError(f"megatron.{'pp' if chunks == 1 else 'vpp'} runs {STAGES * chunks} stages on {STAGES} "
                             f"ranks, got {len(specs)} stages on {ctx.world_size} ranks")
        shared = shared_params(case, specs)
        n = boundary_width(case, specs)
        with on_cpu(ctx.device):
            fault = agreed(ctx.device, lambda: load_object(impl, "megatron impl") if impl != STOCK else None)
            ddps, config, modules = agreed(ctx.device, lambda: _build(case, built, specs, ctx, fault, chunks))
            for step in range(case.schedule.steps):
                k = step * M
                leaves: dict[int, list[torch.Tensor]] = {}
                outputs: dict[int, list[torch.Tensor]] = {}
                agreed(ctx.device, lambda: [d.zero_grad_buffer() for d in ddps])
                forward_step = _forward_step(case, built, ctx, len(specs), leaves, outputs)
                with cuda_factories_on_cpu(ctx.device):
                    if chunks == 1:
                        forward_backward_pipelining_without_interleaving(
                            forward_step_func=forward_step, data_iterator=iter(range(step * M, (step + 1) * M)),
                            model=ddps, num_microbatches=M, seq_length=n, micro_batch_size=1, forward_only=False)
                    else:  # one data iterator per model chunk, as the interleaved schedule asserts
                        forward_backward_pipelining_with_interleaving(
                            forward_step_func=forward_step,
                            data_iterator=[iter(range(step * M, (step + 1) * M)) for _ in ddps],
                            model=ddps, num_microbatches=M, seq_length=n, micro_batch_size=1, forward_only=False)
                k = step * M + M - 1
                # Under calculate_per_token_loss finalize_model_grads scales megatron's grad buffers by one
                # over the tokens (M); an input's grad is outside them, so it is scaled here the same way.
                tokens = M if knobs(case).per_token else 1
                mine = {"grads": _local(case, ddps, modules),
                        "input_grads": {i: {x.name: None if t.grad is None else
                                            t.grad.detach().to("cpu", torch.float64, copy=True) / tokens
                                            for x, t in zip(case.inputs, args)} for i, args in leaves.items()},
                        "outputs": outputs}
                facts: list[Any] = [None] * ctx.world_size
                dist.all_gather_object(facts, mine)
                out["steps"] += _records(case, step, mine, facts, shared)
    except PeerFailed:
        pass  # the rank that raised reports it; this one reports what it saw until then
    except Exception as e:  # a rank that raises reports it; the parent judges
        out["failure"] = rank_failure(k, e, first_line(e) or _raised_at(e))
    return out


def handle(ctx: Rank, msg: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank (a ``call`` message from ``harness.paths.megatron.paths``)."""
    return run_case(ctx, Case.loads(msg["case"]), msg["impl"], int(msg.get("chunks", 1)))


def finalize_module() -> Any:
    """``megatron.core.distributed.finalize_model_grads`` the module (its package exports the function by that name)."""
    return importlib.import_module("megatron.core.distributed.finalize_model_grads")
