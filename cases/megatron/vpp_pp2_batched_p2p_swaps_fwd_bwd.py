#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64. Actual: megatron-core's forward_backward_pipelining_with_interleaving
over 4 stage(s) on 2 ranks (2 model chunk(s) a rank, each in DistributedDataParallel,
DDP_CONFIG and MODEL_CONFIG below), in float32, ending in finalize_model_grads.
Schedule: 1 iteration(s) x 4 microbatch(es); after each, every
parameter's main_grad, the first stage's input grads and the last stage's outputs compared.
Run:  torchrun --master-addr 127.0.0.1 --nproc-per-node 2 THIS_FILE   (gloo on CPU, with CPU_PATCHES; nccl with a GPU per rank)
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


TITLE = "megatron interleaved schedule, pipeline size 2, batched p2p: a stage's activation and grad sent to its one peer arrive swapped"
DDP_CONFIG = json.loads('{"average_in_collective": false, "bucket_size": null, "check_for_nan_in_grad": false, "grad_reduce_in_fp32": false, "overlap_grad_reduce": false, "use_distributed_optimizer": false}')  # every chunk's DistributedDataParallelConfig
MODEL_CONFIG = json.loads('{"batch_p2p_comm": true, "calculate_per_token_loss": false, "deallocate_pipeline_outputs": false, "microbatch_group_size_per_vp_stage": null, "overlap_p2p_comm": false, "virtual_pipeline_model_parallel_size": 2}')  # TransformerConfig's
PIPELINE, CHUNKS = 2, 2  # ranks, and model chunks a rank: stage c * PIPELINE + rank
STAGE_PARAMS = [['g0'], [], [], []]
ATTRIBUTES = {'g0': 'p_g0'}
SHARED = None  # on the first and the last stage: megatron's tied embedding
SHAPES = [[], [(2, 3), (2, 3)], [(2, 3)], [(6,)]]  # what each stage receives
WIDTH = 12  # seq_length: every boundary is sent as (WIDTH, 1, 1)
DTYPE = torch.float32
PARAMS = {'g0': [[3.0, -3.0, -1.0]]}
FROZEN = set()
PREFILL = None
GRAD_INIT, MICROBATCHES, STEPS, ZERO_GRAD = 'none', 4, 1, 'set_to_none'
CLIP, MAX_NORM = '', 1.0
INPUT_NAMES = ['x0']
INPUT_GRAD = {'x0': True}
INPUTS = [  # one dict per backward
    {'x0': [[0.0, 3.0, 3.0], [0.0, -1.0, -3.0]]},
    {'x0': [[0.0, 3.0, 0.0], [-3.0, 0.0, -3.0]]},
    {'x0': [[3.0, 2.0, 2.0], [1.0, 1.0, 1.0]]},
    {'x0': [[-2.0, -3.0, 0.0], [-1.0, 1.0, -2.0]]},
]
GRAD_OUTPUTS = [  # the grad of each output, one list per backward
    [[[1.0, 1.0, 1.0], [1.0, -3.0, 1.0]]],
    [[[-1.0, -3.0, 1.0], [1.0, 1.0, -1.0]]],
    [[[3.0, -1.0, 1.0], [-1.0, 3.0, 3.0]]],
    [[[1.0, 3.0, 1.0], [2.0, 1.0, 1.0]]],
]


def forward(v):
    p_n0 = v['g0'].expand((2, 3))
    p_n1 = v['x0'] * p_n0
    p_n2 = p_n1.reshape((6,))
    p_n3 = p_n2.reshape((2, 3))
    return [p_n3]


class Stage0(torch.nn.Module):
    """Stage 0: receives x0."""

    def __init__(self):
        super().__init__()
        self.p_g0 = torch.nn.Parameter(torch.tensor(PARAMS['g0'], dtype=DTYPE), requires_grad='g0' not in FROZEN)

    def forward(self, a0):
        p_n0 = self.p_g0.expand((2, 3))
        return (a0, p_n0)


class Stage1(torch.nn.Module):
    """Stage 1: receives x0, n0."""

    def __init__(self):
        super().__init__()

    def forward(self, a0, a1):
        p_n1 = a0 * a1
        return p_n1


class Stage2(torch.nn.Module):
    """Stage 2: receives n1."""

    def __init__(self):
        super().__init__()

    def forward(self, a0):
        p_n2 = a0.reshape((6,))
        return p_n2


class Stage3(torch.nn.Module):
    """Stage 3: receives n2."""

    def __init__(self):
        super().__init__()

    def forward(self, a0):
        p_n3 = a0.reshape((2, 3))
        return p_n3


STAGES = [Stage0, Stage1, Stage2, Stage3]


def _cpu_device() -> str:
    """What megatron passes as ``device=``: the CPU, where the ranks' tensors are."""
    return "cpu"


def _synchronize(device: Any = None) -> None:
    """Nothing to wait for on a CPU rank: its ops and gloo's waited requests have completed."""


# torch.cuda's functions megatron-core calls, answered on a CPU rank
CPU_PATCHES = {'current_device': _cpu_device, 'synchronize': _synchronize}


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


def gathered(buffer: Any) -> torch.Tensor:
    """A grad buffer as the distributed optimizer sees it: every bucket's
    reduced shard from the rank that owns it. (The standalone script runs this source.)"""
    out = buffer.grad_data.clone()
    group = buffer.data_parallel_group
    world = group.size()
    for bucket in buffer.buckets:
        flat = bucket.grad_data.view(-1)
        pieces = list(flat.clone().chunk(world))
        dist.all_gather(pieces, pieces[dist.get_rank(group)].clone(), group=group)
        out[bucket.offset:bucket.offset + flat.numel()] = torch.cat(pieces)
    return out


def buffer_grads(ddp: Any, names: dict, reduced: bool) -> dict[str, torch.Tensor]:
    """Every trainable parameter's ``main_grad`` by name (``names``: parameter -> name), read from the grad
    buffers; after a distributed-optimizer reduce, its gathered shards. (The standalone script runs this source.)"""
    out = {}
    for buffer in ddp.buffers:
        full = gathered(buffer) if reduced and ddp.ddp_config.use_distributed_optimizer else buffer.grad_data
        for p, (start, end, _) in buffer.param_index_map.items():
            out[names[p]] = full[start:end].view(p.shape)
    return out


def _gradfuzz_loopback():
    """Keep this script's sockets on loopback (GRADFUZZ_REPRO_ANY_INTERFACE=1: leave them to the user)."""
    if os.environ.get("GRADFUZZ_REPRO_ANY_INTERFACE") == "1":
        return
    import socket

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if addr not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"MASTER_ADDR={addr} is not loopback: run with --master-addr 127.0.0.1, "
                 "or set GRADFUZZ_REPRO_ANY_INTERFACE=1 to run across hosts")
    lo = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if lo:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


def differs(rank, k, name, e, a, shape):
    """1 (and what differs, printed) when grad ``a`` is not eager's ``e``; None reads as zeros."""
    e = torch.zeros(shape, dtype=torch.float64) if e is None else e
    a = torch.zeros(shape, dtype=torch.float64) if a is None else a.to("cpu", torch.float64)
    if torch.allclose(a, e, rtol=1e-5, atol=1e-5 * max(1.0, float(e.abs().max()) if e.numel() else 1.0)):
        return 0
    print(f"rank {rank} backward {k}: {name}.grad differs\n  expected {e.tolist()}\n  actual   {a.tolist()}")
    return 1


def verdict(bad, device, versions):
    flag = torch.tensor([bad], device=device)
    dist.all_reduce(flag)
    if dist.get_rank() == 0:
        print(f"{versions}: {'DIVERGES' if flag.item() else 'agrees'} ({int(flag.item())} differences)")
    dist.barrier()  # no rank tears gloo down while another is still using it (an abort at exit)
    dist.destroy_process_group()
    return 1 if flag.item() else 0


def raised(e):
    """The first line of what megatron raised, or where a bare assert fired."""
    line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return line[:300] or f"assert in {frame.name} ({os.path.basename(frame.filename)}: {(frame.line or '').strip()[:120]})"


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
                print(f"rank {rank} microbatch {j}: output {i} differs\n  expected {e.tolist()}\n"
                      f"  actual   {a.tolist()}")
    return bad


def main():
    _gradfuzz_loopback()
    if int(os.environ["WORLD_SIZE"]) != PIPELINE:
        sys.exit(f"run with --nproc-per-node {PIPELINE}: one rank a pipeline stage (of each model chunk)")
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= PIPELINE
    dist.init_process_group("nccl" if gpus else "gloo", timeout=datetime.timedelta(minutes=2))
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    else:
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


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: in the interpreter's teardown gloo's threads sometimes abort
    # the process (SIGABRT, "terminate called without an active exception", even
    # after destroy_process_group), and the exit status would be the abort's.
    os._exit(code)

