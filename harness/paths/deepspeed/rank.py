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

import contextlib
import functools
import os
from typing import Any, Iterator

import torch

from harness.case.spec import Case
from harness.materialize.tensors import Built
from harness.materialize.units import CaseModule
from harness.objects import load_object
from harness.paths.deepspeed.data import ONE_STEP_A_WINDOW, config, config_gas, knobs
from harness.paths.rankfacts import encode, rank_data, rank_failure
from harness.workers.host import Rank

STOCK = "stock"
# How the loop around the engine accumulates, each as DeepSpeed documents it:
# ``auto``: engine.step() after every micro-step, the engine counts the window
# (gradient_accumulation_steps); ``manual``: set_gradient_accumulation_boundary
# before each micro-step, one step() per window (its docstring's example);
# ``nosync``: gradient_accumulation_steps 1, every backward but a window's
# last under engine.no_sync() (stages 0 and 1), the loss a plain sum;
# ``torch``: ``loss.backward()`` where ``auto`` calls engine.backward(loss),
# the PyTorch-style backward DeepSpeed 0.18 made an API (deepspeedai/DeepSpeed#7665;
# ZeRO 1 to 3: ZeRO 0 raises and says to call engine.backward).
AUTO, MANUAL, NOSYNC, TORCH = "auto", "manual", "nosync", "torch"
DRIVES = (AUTO, MANUAL, NOSYNC, TORCH)
MID_WINDOW = (0, 1)  # the ZeRO stages that keep each rank's own sum in .grad between micro-steps


def _deepspeed(ctx: Rank) -> Any:
    """DeepSpeed on this rank: the one place it is told where it runs. Its
    accelerator is chosen at import, from ``DS_ACCELERATOR``; it reads the
    rank from the launcher's variables, which the pool's ranks (started by
    gradfuzz, not a launcher) set here."""
    _prepare(ctx.device.type, ctx.rank, ctx.world_size)
    import deepspeed

    return deepspeed


@functools.cache
def _prepare(device_type: str, rank: int, world_size: int) -> None:
    """The environment DeepSpeed reads, set once per rank process (not per case)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device_type == "cpu" else "cuda")
    _own_extensions_dir()
    _clear_stale_build_locks()
    for var, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world_size),
                       ("LOCAL_WORLD_SIZE", world_size)):
        os.environ.setdefault(var, str(value))


def _own_extensions_dir() -> None:
    """One build of DeepSpeed's ops per release: torch's extension cache is
    keyed by the op's name only, so a ``gradfuzz versions`` session of
    another release rebuilt ``deepspeed_shm_comm`` under ranks of this one,
    which then loaded a module without the functions they call (a false
    AttributeError at start). Unless the user chose a directory."""
    from importlib.metadata import version

    from torch.utils.cpp_extension import get_default_build_root

    os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                          os.path.join(get_default_build_root(), f"deepspeed-{version('deepspeed')}"))


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


def _engine(case: Case, built: Built, stage: int, ctx: Rank, gas: int) -> tuple[Any, Any, list[int]]:
    """The engine, the optimizer ``deepspeed.initialize`` returned beside it
    (what a user's loop holds), and the count of the optimizer's real steps.
    Under fp16 the SGD steps at learning rate 1 (its update is the grad it
    was given; ``_step`` reads it and puts the weights back)."""
    deepspeed = _deepspeed(ctx)
    module = CaseModule(built, built.params(), ctx.device, built.dtype)
    trainable = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=1.0 if knobs(case).fp16 else 0.0)
    engine, returned, *_ = deepspeed.initialize(model=module, optimizer=opt, config=config(case, stage, 1, gas))
    return engine, returned, _count_steps(opt)


def _count_steps(opt: torch.optim.Optimizer) -> list[int]:
    """How many times the optimizer the user handed DeepSpeed really stepped
    (every ZeRO stage's optimizer ends in its ``step``): a loop whose engine
    skips the step a window ends with trains on nothing, whatever the grads
    read before it say."""
    count = [0]
    step = opt.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return step(*args, **kwargs)

    opt.step = counted  # type: ignore[method-assign]
    return count


def _facts(case: Case, built: Built, k: int, engine: Any, stage: int, boundary: bool, inputs: list[torch.Tensor],
           outs: list[torch.Tensor], mid_window: bool) -> dict[str, Any]:
    """What micro-step ``k`` left that the user can read. At a boundary the
    reduced grads (``safe_get_full_grad``, the same on every rank). Inside a
    window stages 0 and 1 leave each rank's own running sum in ``.grad``
    (their mean is the grad so far); stages 2 and 3 keep partial state of
    their own, so there grads are read at boundaries only."""
    from deepspeed.utils import safe_get_full_grad

    params = engine.module.params()
    if boundary:
        grads = {n: encode(safe_get_full_grad(p), "R") for n, p in params.items()}
    else:
        grads = {n: encode(p.grad, "P(avg)") for n, p in params.items()} if mid_window else {}
    return {"k": k, "sync": boundary, "observable": boundary or mid_window, "grads": grads,
            "input_grads": {x.name: encode(t.grad, "P(avg)") for x, t in zip(case.inputs, inputs)},
            "outputs": [encode(o, "R") for o in outs],
            "retained": {n: encode(t.grad, "P(avg)") for n, t in built.retained.items()}}


def run_case(ctx: Rank, case: Case, stage: int, impl: str, drive: str = AUTO) -> dict[str, Any]:
    """One case on this rank, driven as ``drive`` says (``DRIVES``), or, when
    the case draws one, as its misuse says (``data.MISUSES``). It never
    raises: the parent judges a failure next to its peers'. A misuse that
    DeepSpeed raises on, or warns about, is ``refused`` (the user was told):
    no steps are reported."""
    built = Built(case)
    out: dict[str, Any] = {"rank": ctx.rank, "steps": [], "failure": None}
    k = -1
    misuse = knobs(case).misuse
    try:
        fault = load_object(impl, "deepspeed impl") if impl != STOCK else None
        gas = case.schedule.microbatches
        fp16 = knobs(case).fp16
        low = torch.bfloat16 if knobs(case).bf16 else torch.float16 if fp16 else None
        # Under bf16 the engine accumulates into fp32 buffers of its own and
        # .grad is not the running sum: grads are read at boundaries only.
        # A misuse is judged by the grads the window ends with (what the
        # optimizer steps on), not by .grad on the way, which the loop's own
        # calls may move (gas1_manual: every backward is the engine's boundary).
        mid_window = stage in MID_WINDOW and low is None and not misuse
        scale = config_gas(case, drive == NOSYNC)  # the engine divides by its accumulation steps
        engine, returned, stepped = _engine(case, built, stage, ctx, scale)
        with _told() as told:
            for k in range(case.schedule.backwards):
                boundary = k % gas == gas - 1
                _before_micro_step(engine, returned, drive, misuse, boundary)
                inputs, cots = _in_low(*rank_data(case, built, k, ctx), low)
                loss_scale = float(engine.optimizer.loss_scale) if fp16 else 1.0  # changes only in step()
                outs = engine(*inputs)
                live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
                if fault is not None:
                    fault.before_backward(engine, k % gas)
                if live:
                    _backward(engine, sum((o * c).sum() for o, c in live) * scale, drive, misuse, boundary)
                overflowed = fp16 and _unscale(inputs, built, loss_scale)
                out["steps"].append(_step_facts(case, built, k, engine, stage, boundary, inputs, outs, mid_window,
                                                misuse, ctx.device))
                if overflowed:
                    out["steps"][-1]["input_overflow"] = True
                if boundary or drive in (AUTO, TORCH) and misuse not in ONE_STEP_A_WINDOW:
                    _step(engine, out["steps"][-1] if fp16 and boundary else None)
                out["steps"][-1].update(optimizer_steps=stepped[0], skipped=int(getattr(engine, "skipped_steps", 0)))
        if misuse and told:
            out.update(steps=[], refused=f"warned: {told[0]}")
    except Exception as e:  # a rank that raises reports it; the parent judges
        if misuse:
            out.update(steps=[], refused=f"raised {type(e).__name__}: {str(e)[:300]}", left_early=True)
        else:
            out["failure"] = rank_failure(k, e)
    return out


def _before_micro_step(engine: Any, returned: Any, drive: str, misuse: str, boundary: bool) -> None:
    """What the loop does before a micro-step's forward: the manual drive
    says whether it ends a window; a zero_grad misuse clears the grads."""
    if drive == MANUAL:
        engine.set_gradient_accumulation_boundary(boundary)
    if misuse == "zero_grad":
        engine.zero_grad()
    elif misuse == "optimizer_zero_grad":
        returned.zero_grad()


def _in_low(inputs: list[torch.Tensor], cots: list[torch.Tensor],
            low: torch.dtype | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The user feeds a bf16 (fp16) module bf16 (fp16) data."""
    if low is None:
        return inputs, cots
    return [x.detach().to(low).requires_grad_(x.requires_grad) for x in inputs], [c.to(low) for c in cots]


def _unscale(inputs: list[torch.Tensor], built: Built, loss_scale: float) -> bool:
    """What a user of fp16 reads as an input's (a retained) grad: .grad
    over the loss scale the engine multiplied the loss by (a power of two:
    exact in fp16). True where one overflowed: the scale is chosen for the
    parameters' grads (DeepSpeed checks only those), so an input's scaled
    grad can pass fp16's largest value while every step is right."""
    overflowed = False
    for t in [*inputs, *built.retained.values()]:
        if t.grad is not None:
            t.grad.div_(loss_scale)
            overflowed = overflowed or not bool(torch.isfinite(t.grad).all())
    return overflowed


def _step(engine: Any, facts: dict[str, Any] | None) -> None:
    """``engine.step()``; with ``facts`` (an fp16 window's end), what the
    step applied is that window's grads: the fp32 master weights' change
    under SGD at learning rate 1, so a loss scale not undone, or undone by
    another scale, shows in the training and not only in an accessor whose
    convention differs by stage. The weights are put back after it (as the
    learning rate 0 of the other paths keeps them), so every window is
    judged at the case's weights. A step DeepSpeed skipped for overflow
    applied nothing: its window is marked and judged on nothing."""
    if facts is None:
        engine.step()
        return
    params = {n: p for n, p in engine.module.params().items() if p.requires_grad}
    own = _fp32_of(engine)  # the optimizer's groups: the same before and after the step
    before, kept = _masters(own, params), {n: p.detach().clone() for n, p in params.items()}
    skipped = engine.skipped_steps
    engine.step()
    if engine.skipped_steps > skipped:
        facts.update(overflow=True, observable=False)
        return
    after = _masters(own, params)
    facts["grads"] = {n: encode(before[n] - after[n], "R") if n in params else encode(None, "R")
                      for n in engine.module.params()}
    _put_back(own, params, before, kept)


def _fp32_of(engine: Any) -> dict[int, torch.Tensor]:
    """ZeRO 0's fp16 optimizer keeps one fp32 master per parameter (``fp32_groups``)."""
    opt, out = engine.optimizer, {}
    for low, high in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", [])):
        out.update({id(a): b for a, b in zip(low, high)})
    return out


def _masters(own: dict[int, torch.Tensor], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each trainable parameter's fp32 master weight: ZeRO 0's own
    (``_fp32_of``), else DeepSpeed's ``safe_get_full_fp32_param`` (ZeRO 1
    and 2; a collective, which every rank reaches in the same order)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in params.items():
        t = own.get(id(p))
        t = safe_get_full_fp32_param(p) if t is None else t
        out[n] = t.detach().reshape(p.shape).clone()
    return out


def _put_back(own: dict[int, torch.Tensor], params: dict[str, torch.Tensor], masters: dict[str, torch.Tensor],
              kept: dict[str, torch.Tensor]) -> None:
    from deepspeed.utils import safe_set_full_fp32_param

    with torch.no_grad():
        for n, p in params.items():
            if id(p) in own:
                own[id(p)].copy_(masters[n].reshape(own[id(p)].shape))
            else:
                safe_set_full_fp32_param(p, masters[n])
            p.copy_(kept[n])


def _backward(engine: Any, loss: torch.Tensor, drive: str, misuse: str, boundary: bool) -> None:
    """One micro-step's backward as the drive (or the drawn misuse) calls it."""
    if drive == TORCH:
        loss.backward()  # the engine's output hooks divide by its accumulation steps
    elif misuse == "backward_twice":
        engine.backward(loss / 2, retain_graph=True)
        engine.backward(loss / 2)
    else:
        with engine.no_sync() if drive == NOSYNC and not boundary else contextlib.nullcontext():
            engine.backward(loss)


def _step_facts(case: Case, built: Built, k: int, engine: Any, stage: int, boundary: bool, inputs: list,
                outs: Any, mid_window: bool, misuse: str, device: torch.device) -> dict[str, Any]:
    """What this rank sees after backward ``k``. Under a misuse,
    safe_get_full_grad may refuse the read (ZeRO 2 after a step() the engine
    did not count as a boundary): that is not the loop's doing, so the grads
    are out of sight here and the step count still shows.

    The ranks decide that together, before any of them reads: DeepSpeed
    refuses on the ranks that hold a slice of the parameter and sends the
    others straight into the read's all_reduce, so a rank that caught its
    refusal alone walked on and left its peer in that all_reduce (a hang
    the pool timed out after the path's 60 s, restarting the ranks, or, a
    window later, a collective paired with the wrong one and a gloo error
    taken for DeepSpeed's refusal)."""
    if misuse and boundary:
        mine = _read_refused(engine.module.params())
        if not _every_rank_can(mine is None, device):
            facts = _facts(case, built, k, engine, stage, False, inputs, outs, False)
            facts["unreadable"] = mine or "another rank's safe_get_full_grad refuses the read"
            return facts
    try:
        return _facts(case, built, k, engine, stage, boundary, inputs, outs, mid_window)
    except Exception as e:
        if not misuse:
            raise
        facts = _facts(case, built, k, engine, stage, False, inputs, outs, False)
        facts["unreadable"] = f"{type(e).__name__}: {e}"[:300]
        return facts


def _read_refused(params: dict[str, torch.nn.Parameter]) -> str | None:
    """Why ``safe_get_full_grad`` would raise on this rank, found without
    a collective: it takes the path ``safe_get_full_grad`` takes (DeepSpeed
    0.19.8, utils/tensor_fragment.py) and asks this rank's slice for its
    grad fragment, the one call of that path that raises before the
    all_reduce ("Gradients are only available immediately after backward
    and before engine step"). None: every read can go ahead here."""
    for name, p in params.items():
        mapping = getattr(p, "_hp_mapping", None)
        flat = getattr(p, "_hp_grad", None) is not None or p.grad is None and not hasattr(p, "ds_id")
        if mapping is None or not flat:
            continue  # no slice here (its read goes straight to the all_reduce), or .grad / ZeRO 3's own read
        try:
            mapping.get_lp_grad_fragment(p._index_in_param_group)
        except Exception as e:
            return f"{name}: {type(e).__name__}: {e}"[:300]
    return None


def _every_rank_can(here: bool, device: torch.device) -> bool:
    """True on every rank when ``here`` is true on every rank (one small
    all_reduce, which every rank reaches at the same micro-step)."""
    import torch.distributed as dist

    flag = torch.tensor([0 if here else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


NOT_ABOUT_THE_LOOP = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


@contextlib.contextmanager
def _told() -> Iterator[list[str]]:
    """What DeepSpeed warned about while the loop ran (after ``initialize``,
    whose start-up notices say nothing about the loop): its logger's WARNING
    and above, and Python warnings but deprecations (torch's
    ``all_gather_into_tensor`` notice at every ZeRO 1-3 step says nothing
    about how the loop drives the engine)."""
    import logging
    import warnings

    from deepspeed.utils import logger

    told: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            told.append(record.getMessage()[:300])

    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            yield told
        told.extend(str(w.message)[:300] for w in seen if not issubclass(w.category, NOT_ABOUT_THE_LOOP))
    finally:
        logger.removeHandler(handler)


def handle(ctx: Rank, msg: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank (a ``call`` message from ``harness.paths.deepspeed.paths``),
    or the warm-up before the first: DeepSpeed's communication started once,
    which builds its op (``path._warm``)."""
    if msg.get("warm"):
        _deepspeed(ctx).comm.init_distributed()
        return {"rank": ctx.rank, "warm": True}
    return run_case(ctx, Case.loads(msg["case"]), int(msg["stage"]), msg["impl"], msg.get("drive", AUTO))
