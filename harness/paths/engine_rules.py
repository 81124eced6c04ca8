"""Contract rules shared by families: the ones whose loop runs on worker
ranks (the lifetime rule), and those that hand the training loop to a
stack's engine (DeepSpeed, megatron-core, torchtitan). Each is written once
here, with its reason, so the families refuse alike and a change to a rule
reaches all of them."""

from __future__ import annotations

from harness.case.spec import Case
from harness.paths.base import Repro


def lifetime_schedule(case: Case) -> str | None:
    """Buffer-lifetime schedules are drawn for the graphed paths, whose static
    buffers they probe; every path whose loop runs on worker ranks refuses them."""
    s = case.schedule
    if s.events or s.retain_outputs or s.param_hooks:
        return "buffer-lifetime schedules (allocator events, held outputs, parameter hooks) are the graphed paths'"
    return None


def engine_owned(case: Case, engine: str) -> str | None:
    """What no engine-driven loop can take: buffer-lifetime schedules, and a
    model with nothing to train."""
    if reason := lifetime_schedule(case):
        return reason
    if not any(p.requires_grad for p in case.params):
        return f"every parameter is frozen: {engine} has nothing to train"
    return None


def exact_mean(case: Case, world: int, divides: str) -> str | None:
    """Exact mode compares bit for bit; an engine that averages over ranks and
    micro-steps is exact only when both counts are powers of two."""
    n = case.schedule.microbatches
    if case.exact and (world & (world - 1) or n & (n - 1)):
        return (f"exact mode needs powers of two: {divides} over the world size ({world}) and the micro-steps "
                f"({n}), which rounds otherwise")
    return None


def replay_only(name: str) -> Repro:
    """The standalone script these paths cannot write yet: say how to reproduce instead."""
    return Repro(template="none", why=f"{name} has no standalone script yet: replay the corpus file with "
                 f"`gradfuzz repro FILE --paths {name}` (it starts the ranks itself)")
