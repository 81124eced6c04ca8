"""megatron-core's local CUDA graphs (cuda_graph_impl="local") under gradient
accumulation, against a float64 eager reference (GPU; torch and megatron-core).

The local path records each TransformerLayer's first forward and backward in
eager mode, then create_cudagraphs() (called by megatron's schedules at the end
of every forward_backward) captures one forward and one backward graph per layer
and every later call replays them. A replay copies the inputs into static
buffers, returns static output buffers, shares buffers between one layer's
output and the next layer's input, and hands the weight grads back through
autograd, so the grads land in param.grad (or, under megatron's DDP, in
param.main_grad through DDP's hook). What this checks is what a training loop
sees of that: the accumulated weight grads of each window of microbatches
(loss divided by the number of microbatches, as schedules.py does), the input
grad and the output of every microbatch, for the capture window and the
replayed windows after it, with grads zeroed between windows by set_to_none,
zero_ or DDP's zero_grad_buffer.

Drawn per configuration (fixed seed): hidden size, heads, sequence length,
micro batch size, microbatches per window (1, 2, 4), cuda_graph_warmup_steps,
cuda_graph_retain_backward_graph, cuda_graph_use_single_mempool (read by no
code in megatron-core 0.16.1, drawn to show it stays a no-op), one or two
layers, a weight shared by the two layers (tied), an explicit attention mask or
none (megatron's default causal mask), input requiring grad or not, plain
.grad or megatron DDP. The graphed layers run in float32 on the GPU; the same
weights copied into layers built with cuda_graph_impl="none" run in float32
(the rounding floor, printed as eager32) and in float64 (the reference).
megatron's local layers (ColumnParallelLinear, torch LayerNorm, the unfused
softmax) run in float64. WRONG means a relative error over max(1e-4, 100 x
eager32): float32 gives ~1e-6 on these sizes, and a lost, doubled or stale
microbatch gives errors of order 1/microbatches. A configuration megatron
refuses or crashes on is printed as ERROR and counted apart.

    python benchmarks/megatron_cudagraph_accum.py [N_CONFIGS] [SEED]   (needs CUDA, megatron-core 0.16.1)
    python benchmarks/megatron_cudagraph_accum.py --dry                (CPU: the float64/float32 eager side of 2 configs)
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback
import warnings

import torch

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
TIED = ["mlp.linear_fc1.weight", "self_attention.linear_qkv.weight", "input_layernorm.weight"]


def draw(rng: random.Random) -> dict:
    heads = rng.choice([1, 2, 4])
    layers = rng.choice([1, 2])
    return {
        "hidden": heads * rng.choice([8, 16, 32]), "heads": heads, "seq": rng.choice([4, 16, 33]),
        "mbs": rng.choice([1, 2, 4]), "micro": rng.choice([1, 2, 4]), "windows": rng.choice([2, 3]),
        "warmup": rng.choice([0, 1, 3]), "retain": rng.random() < 0.5, "single_pool": rng.random() < 0.5,
        "layers": layers, "tied": rng.choice(TIED) if layers == 2 and rng.random() < 0.5 else None,
        "mask": rng.choice(["explicit", "none"]), "x_grad": rng.random() < 0.75,
        "acc": rng.choice(["set_to_none", "zero_", "ddp"]),
    }


def setup(dry: bool) -> None:
    """torch.distributed with one rank, megatron's model-parallel groups of size 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    init = "file://" + tempfile.mktemp(prefix="mcg_")
    backend = "gloo"
    if not dry:
        torch.cuda.set_device(0)
        try:
            dist.init_process_group("nccl", init_method=init, rank=0, world_size=1)
            backend = "nccl"
        except Exception as e:  # noqa: BLE001
            print(f"nccl init failed ({type(e).__name__}: {e}); using gloo", flush=True)
            init = "file://" + tempfile.mktemp(prefix="mcg_")
    if backend == "gloo":
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if dry:  # megatron's eager layers reach for CUDA in three places; CPU stand-ins (dry only)
        import megatron.core.fusions.fused_softmax as fs
        import megatron.core.tensor_parallel.random as tr
        import megatron.core.utils as mu

        mu.GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name, mem_alloc_context=None: torch.empty(
            *shape, dtype=dtype)
        fs.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
        tr.CudaRNGStatesTracker.fork = lambda self, name="": contextlib.nullcontext()


def tconfig(cfg: dict, impl: str, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=cfg["layers"], hidden_size=cfg["hidden"], num_attention_heads=cfg["heads"],
              use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
              cuda_graph_scope=[])  # [] is the whole layer ("full" is deprecated)
    if impl == "local":
        kw.update(cuda_graph_impl="local", cuda_graph_warmup_steps=cfg["warmup"],
                  cuda_graph_retain_backward_graph=cfg["retain"], cuda_graph_use_single_mempool=cfg["single_pool"])
    return TransformerConfig(**kw)


def build(cfg: dict, impl: str, dtype: torch.dtype, dev: str, values: dict):
    """The layer stack (local spec), the tie applied, weights set to `values`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    tc = tconfig(cfg, impl, dtype)
    spec = get_gpt_layer_local_spec()
    stack = torch.nn.ModuleList([build_module(spec, config=tc, layer_number=i + 1) for i in range(cfg["layers"])])
    stack = stack.to(dev, dtype)  # torch LayerNorm ignores params_dtype
    if cfg["tied"]:
        mod, _, leaf = cfg["tied"].rpartition(".")
        setattr(stack[1].get_submodule(mod), leaf, stack[0].get_parameter(cfg["tied"]))
    with torch.no_grad():
        for n, p in stack.named_parameters():
            p.copy_(values[n])
    return stack, tc


def make_values(stack, g: torch.Generator) -> dict:
    """Unit-scale weights (megatron's init gives std 0.02 and zero biases, too small to see much)."""
    out = {}
    for n, p in stack.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64)
        if p.dim() >= 2:
            out[n] = r / p.shape[1] ** 0.5
        elif n.endswith("layernorm.weight"):
            out[n] = 1 + 0.1 * r
        else:
            out[n] = 0.1 * r
    return out


def train(stack, cfg, data, dtype, dev, mask, graphed=False, ddp=None) -> list:
    """Windows of microbatches the way forward_backward_no_pipelining runs them: forward, loss / M,
    backward, per microbatch; create_cudagraphs() after the first window. One record per window."""
    params = dict(stack.named_parameters())
    hist = []
    for w, window in enumerate(data):
        if ddp is not None:
            ddp.zero_grad_buffer()
        rec = {}
        for m, (x, probe) in enumerate(window):
            h = xin = x.to(dev, dtype, copy=True).requires_grad_(cfg["x_grad"])
            for layer in stack:
                h, _ = layer(hidden_states=h, attention_mask=mask)
            rec[f"w{w}.out{m}"] = h.detach().to("cpu", torch.float64, copy=True)  # a replay reuses its buffer
            loss = (h * probe.to(dev, dtype)).sum()
            loss /= len(window)
            loss.backward()
            if cfg["x_grad"]:
                rec[f"w{w}.dx{m}"] = xin.grad.to("cpu", torch.float64, copy=True)
        if graphed and w == 0:
            from megatron.core.transformer.cuda_graphs import create_cudagraphs

            create_cudagraphs()
        if ddp is not None:
            ddp.finish_grad_sync()
        for n, p in params.items():
            gr = p.main_grad if ddp is not None else p.grad
            gr = gr if gr is not None else torch.zeros(p.shape)
            rec[f"w{w}.{n}"] = gr.to("cpu", torch.float64, copy=True)
            if ddp is None and cfg["acc"] == "set_to_none":
                p.grad = None
            elif ddp is None and p.grad is not None:
                p.grad.zero_()
        hist.append(rec)
    return hist


def compare(ref: list, got: list) -> tuple[float, str]:
    worst, where = 0.0, ""
    for r, g in zip(ref, got):
        for k in r:
            e = float((g[k] - r[k]).norm() / r[k].norm().clamp(min=1e-12)) if k in g else float("inf")
            e = float("inf") if e != e else e
            if e > worst or not where:
                worst, where = e, k
    return worst, where


def reset_cudagraph_state() -> None:
    """Megatron keeps the record, the mempool and (before 0.19) a buffer pool in globals; each
    configuration starts clean. Only the globals the installed release has are reset."""
    from megatron.core.transformer import cuda_graphs as cg

    cg._CudagraphGlobalRecord.cudagraph_created = False
    cg._CudagraphGlobalRecord.cudagraph_record = []
    cg._CudagraphGlobalRecord.cudagraph_inference_record = []
    pool = getattr(cg, "TensorReusePool", None)
    if pool is not None:
        pool.tensor_strong_refs, pool.tensor_strong_refs_dataptrs, pool.pool = [], set(), []
    cg.CudaGraphManager.global_mempool = None
    for name in ("fwd_buffer_reuse_ref_count", "bwd_buffer_reuse_ref_count"):
        if hasattr(cg, name):
            setattr(cg, name, 0)
    cg._set_capture_end()
    cg._set_warmup_end()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.set_stream(torch.cuda.default_stream())
        torch.cuda.empty_cache()


def run(cfg: dict, seed: int, dry: bool) -> dict:
    dev = "cpu" if dry else "cuda"
    if not dry:  # the tracker CudaGraphManager asserts on; attention forks it even with dropout 0
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        reset_cudagraph_state()
        model_parallel_cuda_manual_seed(seed % 100_000 + 1, use_cudagraphable_rng=True, force_reset_rng=True)
    g = torch.Generator().manual_seed(seed)
    S, B, H = cfg["seq"], cfg["mbs"], cfg["hidden"]
    data = [[(torch.randn(S, B, H, generator=g, dtype=torch.float64),
              torch.randn(S, B, H, generator=g, dtype=torch.float64)) for _ in range(cfg["micro"])]
            for _ in range(1 + cfg["windows"])]
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
    mask = causal.to(dev) if cfg["mask"] == "explicit" else None
    values = make_values(_plain(cfg), g)
    ref64, _ = build(cfg, "none", torch.float64, dev, values)
    ref = train(ref64, cfg, data, torch.float64, dev, mask)
    e32, _ = build(cfg, "none", torch.float32, dev, values)
    floor, floor_at = compare(ref, train(e32, cfg, data, torch.float32, dev, mask))
    out = {"eager32": floor, "eager32_at": floor_at}
    if dry:
        tconfig(cfg, "local", torch.float32)  # the graphed config's fields must be accepted
        return {"verdict": "DRY", **out}
    try:
        stack, tc = build(cfg, "local", torch.float32, dev, values)
        ddp = None
        if cfg["acc"] == "ddp":
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

            ddp = DistributedDataParallel(tc, DistributedDataParallelConfig(overlap_grad_reduce=False,
                                                                            use_distributed_optimizer=False), stack)
        got = train(stack, cfg, data, torch.float32, dev, mask, graphed=True, ddp=ddp)
        runners = [len(layer.cudagraph_manager.cudagraph_runners) for layer in stack]
    except Exception as e:  # noqa: BLE001  (megatron refusing or crashing on a configuration)
        msg = (str(e).strip().splitlines() or [""])[0][:240]
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return {"verdict": "ERROR", "error": f"{type(e).__name__}: {msg}",
                "raised_at": f"{os.path.basename(tb.filename)}:{tb.lineno}", **out}
    finally:
        stack = ddp = None
        reset_cudagraph_state()
    err, at = compare(ref, got)
    wrong = err > max(1e-4, 100 * floor)
    return {"verdict": "WRONG" if wrong else "OK", "max_rel": err, "at": at, "runners": runners, **out}


def _plain(cfg: dict):
    """An untouched float64 stack, only for the parameter names and shapes."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    tc = tconfig(cfg, "none", torch.float64)
    stack = torch.nn.ModuleList([build_module(get_gpt_layer_local_spec(), config=tc, layer_number=i + 1)
                                 for i in range(cfg["layers"])])
    if cfg["tied"]:
        mod, _, leaf = cfg["tied"].rpartition(".")
        setattr(stack[1].get_submodule(mod), leaf, stack[0].get_parameter(cfg["tied"]))
    return stack


def main() -> None:
    argv = [a for a in sys.argv[1:] if a != "--dry"]
    dry = "--dry" in sys.argv
    n = 2 if dry else int(argv[0]) if argv else 100
    seed = int(argv[1]) if len(argv) > 1 else 0
    if not dry and not torch.cuda.is_available():
        sys.exit("megatron_cudagraph_accum.py: needs CUDA (megatron's local CUDA graphs); "
                 "--dry runs the CPU-side reference path only")
    import megatron.core  # noqa: F401  (fail early, naming the missing package)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    setup(dry)
    rng, counts, t0 = random.Random(seed), {"OK": 0, "WRONG": 0, "ERROR": 0, "DRY": 0}, time.monotonic()
    for i in range(n):
        cfg = draw(rng)
        if dry and i == 1:  # the dry run also builds a tied pair
            cfg.update(layers=2, tied=TIED[1])
        res = run(cfg, seed * 100_000 + i, dry)
        counts[res["verdict"]] += 1
        num = {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in res.items() if k != "verdict"}
        print(f"{i:4d} {res['verdict']:5s} {json.dumps(num)} cfg={json.dumps(cfg)}", flush=True)
    from importlib.metadata import version

    from megatron.core.transformer.cuda_graphs import HAVE_TE_GRAPHS

    print(f"megatron local cudagraph accumulation{' (dry, eager side only)' if dry else ''}: {n} configurations, "
          f"{counts['WRONG']} wrong, {counts['ERROR']} errors, {time.monotonic() - t0:.1f} s "
          f"(torch {torch.__version__}, megatron-core {version('megatron-core')}, TE graphs {HAVE_TE_GRAPHS})", flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
