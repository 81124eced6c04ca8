"""What every rank of ``torchtitan.tp.stock`` runs: torchtitan's own Llama
under its tensor-parallel plan, beside float64 and float32 eager runs of the
same model.

The generated Llama config (``data.Knobs``) becomes a ``Llama3Model.Config``
built from torchtitan's own config helpers (``make_gqa_config``,
``make_ffn_config``, ``compute_ffn_hidden_dim``). Its sharding comes from
torchtitan: ``update_from_config`` with a ``ParallelismConfig`` (TP degree
2, the case's ``enable_sequence_parallel``) runs ``set_llama3_sharding_config``,
and ``parallelize_llama`` applies it (``model.parallelize``: colwise
wqkv/w1/w3 and lm_head, rowwise wo/w2, the vocab-parallel embedding, SP
norms) and then ``apply_fsdp_to_decoder`` on its one-rank FSDP mesh, as the
trainer does. The weights are loaded after ``init_states`` (which re-ties a
tied embedding and head) the way a checkpoint is, from full tensors drawn
from the case's seed.

Training is ``Trainer.train_step``'s: grads zeroed at each step, the step's
valid tokens (labels other than ``IGNORE_INDEX``) counted over all its
microbatches, one forward and ``loss.backward()`` per microbatch with
torchtitan's ``CrossEntropyLoss`` (sum over tokens / global valid tokens;
with a vocab-sharded output it is the loss-parallel cross entropy).

Loss parallel "off": torchtitan 0.3 has no switch for it (0.2's
``disable_loss_parallel`` is gone; the lm_head always emits ``Shard(-1)``).
Off is 0.2's plan for it written in 0.3's terms, set from outside as a user
would: the lm_head's ``out_dst_shardings`` is Replicate (0.2's
``output_layouts=Replicate()``) and the loss takes its local tensor (0.2's
``use_local_output=True``).

After every micro-step every parameter's grad is read as ``full_tensor()``
and held to the float64 run's accumulated grad, with a tolerance scaled by
how far the same model in float32 eager lands from float64 (``_tolerance``).
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import types
from functools import partial
from typing import Any

import torch

from harness.case.spec import Case
from harness.objects import load_object
from harness.paths.rankfacts import rank_failure
from harness.paths.torchtitan import cpu
from harness.paths.torchtitan.data import Knobs, knobs
from harness.workers.host import Rank

STOCK = "stock"
IGNORE_INDEX = -100
_dims: dict[int, Any] = {}


def llama_config(k: Knobs) -> Any:
    """The generated Llama as torchtitan's ``Llama3Model.Config``. Inits are
    placeholders: the weights are loaded after building (``weights``)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    dim, eps = k.heads * k.head_dim, 10.0 ** -k.eps_exp
    init = {"weight": partial(torch.nn.init.normal_, std=0.02)}
    one = {"weight": torch.nn.init.ones_}
    hidden = compute_ffn_hidden_dim(dim, multiple_of=k.multiple_of)
    layers = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=one),
        ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=one),
        attention=make_gqa_config(dim=dim, n_heads=k.heads, n_kv_heads=k.kv_heads, wqkv_param_init=init,
                                  wo_param_init=init, inner_attention=cpu.attention(), fuse_qkv=True,
                                  rope=ComplexRoPE.Config(dim=k.head_dim, max_seq_len=max(k.seq, 2), theta=10000.0)),
        feed_forward=make_ffn_config(dim=dim, hidden_dim=hidden, w1_param_init=init, w2w3_param_init=init))
        for _ in range(k.n_layers)]
    return Llama3Model.Config(
        dim=dim, vocab_size=k.vocab, layers=layers, enable_weight_tying=k.tie,
        tok_embeddings=Embedding.Config(num_embeddings=k.vocab, embedding_dim=dim, param_init=init),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=one),
        lm_head=Linear.Config(in_features=dim, out_features=k.vocab, param_init=init))


def weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Full float64 weights for ``model``'s parameters (a tied weight once), drawn
    from ``seed``: linear weights at 1/sqrt(fan-in), norm weights near one, so
    activations stay O(1) and a norm's grad differs per element."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if p.dim() == 1:
            out[name] = 1 + 0.25 * torch.randn(p.shape, generator=g, dtype=torch.float64)
        else:
            out[name] = torch.randn(p.shape, generator=g, dtype=torch.float64) / p.shape[-1] ** 0.5
    return out


def batches(case: Case, k: Knobs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every backward's (tokens, labels), the same on every rank (TP ranks share a batch)."""
    g = torch.Generator().manual_seed(k.seed + 1)
    out = []
    for _ in range(case.schedule.backwards):
        x = torch.randint(0, k.vocab, (k.batch, k.seq), generator=g)
        y = torch.randint(0, k.vocab, (k.batch, k.seq), generator=g)
        for b in range(k.batch):
            y[b, torch.randperm(k.seq, generator=g)[:k.ignored]] = IGNORE_INDEX
        out.append((x, y))
    return out


def step_tokens(case: Case, data: list, j: int) -> torch.Tensor:
    """The valid tokens of the step backward ``j`` is in, as ``train_step`` counts them (int64)."""
    gas = case.schedule.microbatches
    first = j - j % gas
    return sum(((y != IGNORE_INDEX).sum() for _, y in data[first:first + gas]), torch.tensor(0, dtype=torch.int64))


def _parallel_dims(world: int, parallelism: Any) -> Any:
    """torchtitan's ``ParallelDims`` for TP over the whole group, built once per
    rank process (its meshes are new process groups)."""
    from torchtitan.distributed import ParallelDims

    if world not in _dims:
        dims = ParallelDims.from_config(parallelism, world)
        dims.build_mesh()
        _dims[world] = dims
    return _dims[world]


def parallelize(model: Any, config: Any, ctx: Rank, k: Knobs) -> Any:
    """``parallelize_llama`` as the trainer calls it, TP over every rank, no AC,
    no compile (so no async TP), float32 params and reductions. Returns the ParallelDims."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama

    par = ParallelismConfig(tensor_parallel_degree=ctx.world_size, data_parallel_shard_degree=1,
                            enable_sequence_parallel=k.sp, spmd_backend="partial_dtensor")
    dims = _parallel_dims(ctx.world_size, par)
    parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32",
                                                                         mixed_precision_reduce="float32"),
                      parallelism=par, compile_config=CompileConfig(enable=False, enable_async_tensor_parallel=False),
                      ac_config=None, dump_folder=tempfile.gettempdir())
    cpu.adapt(model, ctx.mesh.get_group())
    return dims


def sharded_config(k: Knobs, world: int) -> Any:
    """The config with torchtitan's sharding filled in (``update_from_config``),
    and loss parallel off written as 0.2's plan had it (see the module docstring)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common.decoder_sharding import dense_activation_placement
    import spmd_types as spmd

    config = llama_config(k)
    par = ParallelismConfig(tensor_parallel_degree=world, enable_sequence_parallel=k.sp, spmd_backend="partial_dtensor")
    config.update_from_config(config=types.SimpleNamespace(parallelism=par))
    if not k.loss_parallel:
        out = config.lm_head.sharding_config
        config.lm_head.sharding_config = dataclasses.replace(
            out, out_dst_shardings=dense_activation_placement(tp=spmd.R))
    return config


def load(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy full weights into a (TP-sharded) model, as a checkpoint load would."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            t = full[name].to(p.dtype)
            p.copy_(distribute_tensor(t, p.device_mesh, p.placements) if isinstance(p, DTensor) else t)


def eager(config: Any, full: dict[str, torch.Tensor], dtype: torch.dtype, case: Case,
          data: list) -> list[dict[str, torch.Tensor]]:
    """The same Llama unparallelized in ``dtype``: each micro-step's accumulated
    grads (zeroed at each step), accumulated out of place from
    ``torch.autograd.grad`` in torchtitan's loss convention."""
    model = config.build()
    model.init_states()  # the RoPE cache is a buffer init_states computes
    # .double()/.float() cast floating tensors only; .to(dtype) would also
    # cast the complex RoPE cache to real, dropping its imaginary part.
    model = model.double() if dtype == torch.float64 else model.float()
    load(model, full)
    params = dict(model.named_parameters())
    acc: dict[str, torch.Tensor] = {}
    out = []
    for j, (x, y) in enumerate(data):
        if j % case.schedule.microbatches == 0:
            acc = {}
        pred = model(x)
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1), y.flatten(0, 1), reduction="sum",
                                                 ignore_index=IGNORE_INDEX) / step_tokens(case, data, j)
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for n, g in zip(params, grads):
            if g is not None:
                acc[n] = g.detach().to(torch.float64) if n not in acc else acc[n] + g.detach().to(torch.float64)
        out.append(dict(acc))
    return out


def _tolerance(e32: float, scale: float, top: float) -> float:
    """How far a float32 TP grad may sit from float64: 16x the float32 eager
    run's own error on that tensor (TP reorders the same sums), plus 5e-4 of
    the tensor's largest entry and 1e-5 of the step's largest grad (a tensor
    whose float32 error happened to be near zero, or whose entries cancel).
    The closest agreeing grad seen in 60 drawn cases was a tied embedding
    grad (3 layers, one valid token) 2e-5 of its largest entry off, 6x the
    float32 eager error. A missing reduction or a grad counted twice is off
    by O(the grad): the canary's norm grads by 30-80%."""
    return 16 * e32 + 5e-4 * scale + 1e-5 * top


def _role(name: str) -> str:
    """A parameter's name without its layer number: what a signature keeps."""
    return re.sub(r"\.\d+\.", ".", name)


def compare(j: int, got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor],
            f32: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Micro-step ``j``'s grads against float64; one violation per parameter that differs."""
    top = max((float(t.abs().max()) for t in want.values()), default=0.0)
    found = []
    for name, a in got.items():
        e = want.get(name)
        if a is None or e is None:
            if (a is None) != (e is None):
                found.append({"k": j, "what": name, "key": f"grad None {_role(name)}",
                              "detail": f"{name}.grad is {'None' if a is None else 'a tensor'} on torchtitan TP "
                                        f"after backward {j}, {'None' if e is None else 'a tensor'} in float64 eager"})
            continue
        diff = float((a - e).abs().max())
        scale = float(e.abs().max())
        tol = _tolerance(float((f32[name] - e).abs().max()), scale, top)
        if diff > tol:
            ratio = float((a * e).sum() / (e * e).sum()) if scale else float("nan")
            found.append({"k": j, "what": name, "key": f"grad {_role(name)}", "max_abs": diff, "excess": diff / tol,
                          "detail": f"{name}.grad after backward {j}: max abs diff {diff:.3g} from float64 eager "
                                    f"(largest entry {scale:.3g}, tolerance {tol:.3g}); least-squares ratio "
                                    f"actual/expected {ratio:.4g}"})
    return found


def run_case(ctx: Rank, case: Case, impl: str) -> dict[str, Any]:
    """One case on this rank. It never raises: the parent judges a failure next to its peers'."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {"rank": ctx.rank, "violations": [], "failure": None, "steps": 0, "margin": 0.0}
    j = -1
    backend = None
    try:
        cpu.without_triton()
        cpu.on_cpu()
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.distributed import utils as dist_utils

        backend = dist_utils.get_spmd_backend()
        dist_utils.set_spmd_backend("partial_dtensor")
        k = knobs(case)
        fault = load_object(impl, "torchtitan impl") if impl != STOCK else None
        model, dims, full = _parallel_model(ctx, k, fault, out["violations"])
        data = batches(case, k)
        want = eager(llama_config(k), full, torch.float64, case, data)
        f32 = eager(llama_config(k), full, torch.float32, case, data)
        loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=k.vocab))
        context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)
        params = dict(model.named_parameters())
        for j, (x, y) in enumerate(data):
            if j % case.schedule.microbatches == 0:
                model.zero_grad(set_to_none=True)
                tokens = step_tokens(case, data, j)
            with context():
                pred = model(x)
                if not k.loss_parallel and isinstance(pred, DTensor):
                    pred = pred.to_local()
                loss, _ = loss_fn(pred, y, tokens)
                loss.backward()
            got = _full_grads(params)
            out["violations"] += compare(j, got, want[j], f32[j])
            out["margin"] = max(out["margin"], _margin(got, want[j], f32[j]))
            out["steps"] += 1
    except Exception as e:  # a rank that raises reports it; the parent judges
        out["failure"] = rank_failure(j, e)
    finally:
        if backend is not None:
            from torchtitan.distributed import utils as dist_utils

            dist_utils.set_spmd_backend(backend)
    return out


def _parallel_model(ctx: Rank, k: Any, fault: Any, violations: list[dict[str, Any]]) -> tuple[Any, Any, dict]:
    """torchtitan's Llama for the knobs, parallelized as the trainer does and
    loaded with the case's weights (``full``, what the eager runs load too);
    a tie parallelize lost goes to ``violations``."""
    config = sharded_config(k, ctx.world_size)
    model = config.build()
    if fault is not None and hasattr(fault, "before_parallelize"):
        fault.before_parallelize(model, k)
    dims = parallelize(model, config, ctx, k)
    model.init_states()  # as the trainer does after parallelize: re-ties a tied embedding and head
    if k.tie and model.tok_embeddings.weight is not model.lm_head.weight:
        violations.append({"k": -1, "what": "tok_embeddings.weight", "key": "weight tying lost",
                           "detail": "enable_weight_tying: tok_embeddings.weight is not lm_head.weight "
                                     "after parallelize_llama and init_states"})
    full = weights(llama_config(k).build(), k.seed)
    load(model, full)
    if fault is not None and hasattr(fault, "after_parallelize"):
        fault.after_parallelize(model, k)
    return model, dims, full


def _full_grads(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor | None]:
    """Every parameter's whole grad in float64 (a DTensor's gathered), None where it has none."""
    from torch.distributed.tensor import DTensor

    return {n: None if p.grad is None else
            (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().to(torch.float64)
            for n, p in params.items()}


def _margin(got: dict[str, Any], want: dict[str, torch.Tensor], f32: dict[str, torch.Tensor]) -> float:
    """The largest diff / tolerance over the parameters that agree: how close agreement came to a finding."""
    top = max((float(t.abs().max()) for t in want.values()), default=0.0)
    worst = 0.0
    for n, a in got.items():
        if a is None or n not in want:
            continue
        e = want[n]
        tol = _tolerance(float((f32[n] - e).abs().max()), float(e.abs().max()), top)
        d = float((a - e).abs().max())
        if d <= tol and tol > 0:
            worst = max(worst, d / tol)
    return worst


def handle(ctx: Rank, msg: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank (a ``call`` message from ``harness.paths.torchtitan.tp.paths``)."""
    return run_case(ctx, Case.loads(msg["case"]), msg["impl"])
