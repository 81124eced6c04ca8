#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64. Actual: the module under megatron-core's DistributedDataParallel,
reduce-scatter (distributed optimizer), on 2 rank(s), in float32, DDP_CONFIG below.
Schedule: 1 step(s) x 2 microbatch(es) as megatron's no-pipelining schedule
drives them; param.main_grad compared after every backward.
Run:  torchrun --master-addr 127.0.0.1 --nproc-per-node 2 THIS_FILE   (gloo on CPU, with CPU_PATCHES; nccl with a GPU per rank)
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


TITLE = "megatron distributed optimizer with overlap: a shared_embedding parameter not first in the buffer gets its main_grad in the previous bucket's padding (two micro-steps)"
PREFIX = 'p_'
DDP_CONFIG = json.loads('{"average_in_collective": false, "bucket_size": null, "check_for_nan_in_grad": false, "grad_reduce_in_fp32": false, "overlap_grad_reduce": true, "use_distributed_optimizer": true}')
SHARED = ['e4', 'w0']  # marked shared_embedding, as megatron marks a tied embedding
DTYPE = torch.float32
PARAMS = {'w0': [[-1.17204915182185, -0.39288424313877424, 0.5264794654391638], [1.1065098684809027, 0.9272747371123735, -1.7420606491853965], [-0.7699140277208829, 0.786438430050321, -1.9962516762426026]], 'w1': [[1.0075974331466206, 1.6677818125087136, -1.5393466196246277], [-0.30380924343197085, -1.3198387720754698, 2.1827758705964238], [-0.6406170876181244, -0.18715842921739573, -1.7284419783824305]], 'w2': [[0.5369338312116217, 0.948503434813587, -0.20258915000439415], [0.9552587534112702, 1.844174755488463, -0.9636752366141726], [-1.2653159933780966, -1.0969124151557998, 0.8455538368436504]], 'b3': [[-0.6141311308159167, 1.6634442010862096, -0.17041161726687715], [-0.05507370176094127, 1.9227537966046704, -1.1345159798191236]], 'e4': [[0.0671847721504961, -0.46267528686508547, 0.4393585421863212], [-0.7687769615825837, 1.0867616738987809, -1.534632733242593], [-0.4525237484538369, 0.36893785953682595, -0.9079264679652901], [-0.25781844873744897, -0.35810103240462005, 0.407193697557908]]}
FROZEN = set()
PREFILL = None
GRAD_INIT, MICROBATCHES, STEPS, ZERO_GRAD = 'none', 2, 1, 'set_to_none'
CLIP, MAX_NORM = '', 1.0
INPUT_NAMES = ['x0']
INPUT_GRAD = {'x0': True}
INPUTS = [  # one dict per backward
    {'x0': [[2.0064739765094797, 1.9534658673383687, 0.15171341775447222], [-0.42691325176738654, -0.5058797219017293, -0.772283368054093]]},
    {'x0': [[-0.18327825902617031, -0.6933469291185893, -2.16673311387655], [-0.6615334368115311, 0.739625564084815, -1.0775681593099669]]},
]
GRAD_OUTPUTS = [  # the grad of each output, one list per backward
    [[[1.9011443241904638, 0.2687694171158447, -1.3015479938865164], [-0.002156557243019393, 1.450130981503286, -0.8284369374662465]]],
    [[[-0.7813729369041318, -1.255588058492969, -1.3769893330868916], [0.24815856407479664, -1.0441522906853105, -0.10220369534059276]]],
]


def forward(v):
    p_n0 = v['x0'] @ v['w0']
    p_n1 = p_n0 @ v['w0']
    p_n2 = p_n1 @ v['w1']
    p_n3 = p_n2 @ v['w2']
    p_n4 = p_n3 + v['b3']
    p_n5 = p_n4 @ v['e4'].mT
    p_n6 = torch.log_softmax(p_n5, dim=-1)
    p_n7 = p_n6 @ v['e4']
    return [p_n7]


def _cpu_device() -> str:
    """What megatron passes as ``device=``: the CPU, where the ranks' tensors are."""
    return "cpu"

def _synchronize(device: Any = None) -> None:
    """Nothing to wait for on a CPU rank: its ops and gloo's waited requests have completed."""

# torch.cuda's functions megatron-core calls, answered on a CPU rank
CPU_PATCHES = {'current_device': _cpu_device, 'synchronize': _synchronize}

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

def start(k):
    return k and k % MICROBATCHES == 0 and ZERO_GRAD != "keep"


def expected():
    params = {n: torch.tensor(t, dtype=torch.float64).requires_grad_(n not in FROZEN) for n, t in PARAMS.items()}
    acc = {n: None for n in params}
    if GRAD_INIT != "none":
        acc = {n: (torch.zeros_like(params[n]) if GRAD_INIT == "zero" else torch.tensor(PREFILL[n], dtype=torch.float64))
               if n not in FROZEN else None for n in params}
    seen = []
    for k in range(MICROBATCHES * STEPS):
        if start(k):
            acc = {n: None if ZERO_GRAD == "set_to_none" or g is None else torch.zeros_like(g) for n, g in acc.items()}
        inputs = {n: torch.tensor(t, dtype=torch.float64).requires_grad_(INPUT_GRAD[n]) for n, t in INPUTS[k].items()}
        cots = [torch.tensor(c, dtype=torch.float64) for c in GRAD_OUTPUTS[k]]
        live = [(o, c) for o, c in zip(forward({**params, **inputs}), cots) if o.requires_grad]
        names = [n for n in params if n not in FROZEN]
        if live and names:
            grads = torch.autograd.grad([o for o, _ in live], [params[n] for n in names], [c for _, c in live],
                                        allow_unused=True)
            for n, g in zip(names, grads):
                if g is not None:
                    acc[n] = g.clone() if acc[n] is None else acc[n] + g  # autograd.grad may hand back views of one buffer
        if CLIP and (k + 1) % MICROBATCHES == 0:
            leaves = [torch.zeros_like(params[n]) for n in acc if acc[n] is not None]
            for leaf, g in zip(leaves, [g for g in acc.values() if g is not None]):
                leaf.grad = g
            torch.nn.utils.clip_grad_norm_(leaves, MAX_NORM, norm_type=float(CLIP), foreach=False)
        seen.append({n: None if g is None else g.clone() for n, g in acc.items()})
    return seen


class Module(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        for n, t in PARAMS.items():  # under PREFIX + n, never n itself: it may be "cuda"
            self.register_parameter(PREFIX + n, torch.nn.Parameter(torch.tensor(t, dtype=DTYPE, device=device),
                                                                   requires_grad=n not in FROZEN))

    def weights(self):
        return {n: getattr(self, PREFIX + n) for n in PARAMS}

    def forward(self, *inputs):
        return tuple(forward({**self.weights(), **dict(zip(INPUT_NAMES, inputs))}))


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
    if torch.allclose(a, e, rtol=1e-5, atol=1e-5):
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


def main():
    _gradfuzz_loopback()
    world = int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world
    dist.init_process_group("nccl" if gpus else "gloo", timeout=datetime.timedelta(minutes=2))
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    else:
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


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: in the interpreter's teardown gloo's threads sometimes abort
    # the process (SIGABRT, "terminate called without an active exception", even
    # after destroy_process_group), and the exit status would be the abort's.
    os._exit(code)

