"""What every rank-based family reports of a tensor, and how it splits data
among ranks: tensors as facts (placements, local values, layouts) that
``harness.paths.assemble`` turns back into one observation, and the shares
and shards each rank starts from. Shared by the DTensor and data-parallel
families (and any family whose ranks hold DTensors), so the facts and their
reading are written once."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def code(placements: Any) -> str:
    """Placements as a short stable string: "R", "P", "P(avg)", "S0"; "," between mesh dims."""
    out = []
    for p in placements:
        if isinstance(p, Replicate):
            out.append("R")
        elif isinstance(p, Partial):
            op = getattr(p, "reduce_op", "sum")
            out.append("P" if op == "sum" else f"P({op})")
        elif type(p) is Shard:
            out.append(f"S{p.dim}")
        else:
            out.append(repr(p))
    return ",".join(out)


def shard_piece(full: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's piece of ``full`` under Shard(dim): torch.chunk's split, empty past the end."""
    pieces = torch.chunk(full, world_size, dim)
    if rank < len(pieces):
        return pieces[rank].contiguous()
    return full.narrow(dim, 0, 0).contiguous()


def share(full: torch.Tensor, rank: int, world_size: int, seed: int, exact: bool) -> torch.Tensor:
    """This rank's share of ``full``: random shares that sum to it.

    Exact mode: small integers, so every share and every rank's grad stays
    exact. Tolerance mode: each element split by random positive fractions,
    so no share is larger than the whole and the terms a rank sums stay
    within the bounds the tolerance was computed for.
    """
    if world_size == 1:
        return full.clone()
    g = torch.Generator().manual_seed(seed)
    if exact:
        parts = [torch.randint(-1, 2, full.shape, generator=g).to(torch.float64) for _ in range(world_size - 1)]
    else:
        weights = torch.rand((world_size,) + tuple(full.shape), generator=g, dtype=torch.float64) + 0.25
        parts = [full * (w / weights.sum(0)) for w in weights[1:]]
    if rank == 0:
        return full - sum(parts)
    return parts[rank - 1]


def encode(t: Any, plain: str) -> dict[str, Any] | None:
    """A tensor as facts: placements, this rank's local values (float64, CPU), global shape.

    ``plain`` is the placement a plain tensor stands for (local mode: outputs
    are the same on every rank, "R"; grads of inputs and intermediates are
    this rank's share, "P").
    """
    if t is None:
        return None
    if isinstance(t, DTensor):
        local = t.to_local()
        return {"pl": code(t.placements), "local": local.detach().to("cpu", torch.float64, copy=True),
                "shape": tuple(t.shape), "stride": tuple(t.stride())}
    return {"pl": plain, "local": t.detach().to("cpu", torch.float64, copy=True), "shape": tuple(t.shape),
            "stride": tuple(t.stride()), "plain": True}


def layout_facts(p: Any) -> dict[str, Any]:
    """A parameter's and its grad's strides, local and declared global: eager
    gives a grad its parameter's layout, and a DTensor grad declares a global
    stride its local shards must agree with."""
    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t
    g = p.grad
    mine = local(p)
    # A grad placed otherwise than its parameter (Partial, Replicate) has
    # another local shape: then it is held to the contiguous layout of its own.
    want = mine.stride() if local(g).shape == mine.shape else torch.empty(local(g).shape).stride()
    return {"shape": tuple(local(g).shape), "grad": tuple(local(g).stride()), "param": tuple(want),
            "grad_global": tuple(g.stride()), "param_global": tuple(p.stride()), "global_shape": tuple(p.shape)}


def first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:300]


def rank_failure(k: int, e: BaseException, message: str | None = None) -> dict[str, Any]:
    """What a rank reports when backward ``k`` raised (call it inside the
    ``except``): the parent judges it beside its peers' (``assemble``)."""
    import traceback

    return {"k": k, "type": type(e).__name__, "message": first_line(e) if message is None else message,
            "traceback": traceback.format_exc()[-4000:]}


def rank_data(case: Any, built: Any, k: int, ctx: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Backward ``k``'s inputs, the same on every rank, and this rank's grad
    outputs: its share scaled by the world size, so the wrappers' average
    over ranks is the case's grad."""
    dev, ws = ctx.device, ctx.world_size
    drawn = built.inputs(k)
    inputs = [drawn[x.name].to(dev, built.dtype).requires_grad_(x.requires_grad) for x in case.inputs]
    cots = [c.to(dev, built.dtype) for c in rank_cotangents(case, built.cotangents(k), k, ctx.rank, ws)]
    return inputs, cots


def rank_cotangents(case: Any, cots: list[torch.Tensor], k: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """Rank ``rank``'s grad outputs at backward ``k``: its share of the case's, times the world size."""
    return [world_size * share(c, rank, world_size, case.seed * 7919 + 50_000 + 97 * k + i, case.exact)
            for i, c in enumerate(cots)]


def rounded_by_reduction(case: Any, world_size: int) -> dict[tuple[str, int], torch.Tensor]:
    """(parameter, backward) -> the sum over ranks of |each rank's local grad|
    (float64, accumulated as the wrapper accumulates its reduced grads:
    since the step began, or since the first backward where ``zero_grad``
    keeps them), over the world size: what
    a wrapper that reduces in a lower type rounds, element by element. The
    ranks' local grads cancel in the average, so the rounding can be many
    times the averaged grad itself; this is its true scale, not a bound
    over every term of the case."""
    from harness.materialize.schedule import starts_step
    from oracles.eager import observe

    ranks = [observe(case, lambda k, cots, r=r: rank_cotangents(case, cots, k, r, world_size))
             for r in range(world_size)]
    out: dict[tuple[str, int], torch.Tensor] = {}
    running: dict[str, torch.Tensor] = {}
    for k in range(len(ranks[0].contributions)):
        if starts_step(case, k) and case.schedule.zero_grad != "keep":
            running = {}
        for name in ranks[0].contributions[k]:
            parts = [o.contributions[k][name] for o in ranks if o.contributions[k][name] is not None]
            if parts:
                here = sum(p.abs() for p in parts) / world_size
                running[name] = here if name not in running else running[name] + here
            if name in running:
                out[(name, k)] = running[name]
    return out
