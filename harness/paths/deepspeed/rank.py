"""What every rank of the deepspeed paths runs.

Each rank builds the case's module, hands it to ``deepspeed.initialize``
with the case's accumulation and knobs (``data.config``) and an SGD at
learning rate 0 (so parameters stay put and every step compares the same
weights), and drives it as users do: ``engine(*inputs)``, ``engine.backward``
of the scalar loss ``sum(output * grad output)``, ``engine.step()`` after
every micro-step. Every rank's grad output is its share scaled by the world
size and the loss by the accumulation steps, so DeepSpeed's mean over
ranks and over micro-steps is exactly the oracle's sum (linearity; exact
mode shares are integers and both factors powers of two). At each
accumulation boundary the full grads are read with DeepSpeed's public
accessor, ``deepspeed.utils.safe_get_full_grad``.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

from harness.case.spec import Case
from harness.materialize.tensors import Built
from harness.materialize.units import CaseModule
from harness.objects import load_object
from harness.paths.deepspeed.data import config
from harness.paths.rankfacts import encode, first_line, rank_data
from harness.workers.host import Rank

STOCK = "stock"


def _deepspeed(ctx: Rank) -> Any:
    """DeepSpeed on this rank: the one place it is told where it runs. Its
    accelerator is chosen at import, from ``DS_ACCELERATOR``; it reads the
    rank from the launcher's variables, which the pool's ranks (started by
    gradfuzz, not a launcher) set here."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if ctx.device.type == "cpu" else "cuda")
    _clear_stale_build_locks()
    for var, value in (("RANK", ctx.rank), ("LOCAL_RANK", ctx.rank), ("WORLD_SIZE", ctx.world_size),
                       ("LOCAL_WORLD_SIZE", ctx.world_size)):
        os.environ.setdefault(var, str(value))
    import deepspeed

    return deepspeed


STALE_LOCK_S = 900.0  # a first compile takes tens of seconds; a lock this old outlived the process that took it


def _clear_stale_build_locks() -> None:
    """torch's extension builder waits forever on the lock file of a build
    whose process was killed (an interrupted first start), so every later
    DeepSpeed run would hang: a lock older than any build is removed."""
    import time

    from torch.utils.cpp_extension import _get_build_directory

    try:
        lock = os.path.join(_get_build_directory("deepspeed_shm_comm", verbose=False), "lock")
        if time.time() - os.stat(lock).st_mtime > STALE_LOCK_S:
            os.remove(lock)
    except (OSError, AttributeError):
        pass  # no lock (the usual case), or a torch without this helper: nothing to clear


def _engine(case: Case, built: Built, stage: int, ctx: Rank) -> Any:
    deepspeed = _deepspeed(ctx)
    module = CaseModule(built, built.params(), ctx.device, built.dtype)
    trainable = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.0)
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=config(case, stage, 1))
    return engine


def _facts(case: Case, built: Built, k: int, engine: Any, boundary: bool, inputs: list[torch.Tensor],
           outs: list[torch.Tensor]) -> dict[str, Any]:
    """What micro-step ``k`` left that the user can read. Inside a window a
    ZeRO stage keeps its own partial state, so grads are read at boundaries."""
    from deepspeed.utils import safe_get_full_grad

    grads = {n: encode(safe_get_full_grad(p), "R") for n, p in engine.module.params().items()} if boundary else {}
    return {"k": k, "sync": boundary, "observable": boundary, "grads": grads,
            "input_grads": {x.name: encode(t.grad, "P(avg)") for x, t in zip(case.inputs, inputs)},
            "outputs": [encode(o, "R") for o in outs],
            "retained": {n: encode(t.grad, "P(avg)") for n, t in built.retained.items()}}


def run_case(ctx: Rank, case: Case, stage: int, impl: str) -> dict[str, Any]:
    """One case on this rank. It never raises: the parent judges a failure next to its peers'."""
    built = Built(case)
    out: dict[str, Any] = {"rank": ctx.rank, "steps": [], "failure": None}
    k = -1
    try:
        fault = load_object(impl, "deepspeed impl") if impl != STOCK else None
        engine = _engine(case, built, stage, ctx)
        gas = case.schedule.microbatches
        for k in range(case.schedule.backwards):
            inputs, cots = rank_data(case, built, k, ctx)
            outs = engine(*inputs)
            live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
            if fault is not None:
                fault.before_backward(engine, k % gas)
            if live:
                engine.backward(sum((o * c).sum() for o, c in live) * gas)
            out["steps"].append(_facts(case, built, k, engine, k % gas == gas - 1, inputs, outs))
            engine.step()
    except Exception as e:  # a rank that raises reports it; the parent judges
        out["failure"] = {"k": k, "type": type(e).__name__, "message": first_line(e),
                          "traceback": traceback.format_exc()[-4000:]}
    return out


def handle(ctx: Rank, msg: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank (a ``call`` message from ``harness.paths.deepspeed.path``),
    or the warm-up before the first: DeepSpeed's communication started once,
    which builds its op (``path._warm``)."""
    if msg.get("warm"):
        _deepspeed(ctx).comm.init_distributed()
        return {"rank": ctx.rank, "warm": True}
    return run_case(ctx, Case.loads(msg["case"]), int(msg["stage"]), msg["impl"])
