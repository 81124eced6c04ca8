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


def fused_off_its_devices(case: Case, device: str) -> str | None:
    """A fused optimizer step on a device its documentation leaves out: torch
    2.11 documents Adagrad's fused implementation as "CPU only" (2.13: "CPU
    and CUDA") and raises "`fused=True` requires all the params to be floating
    point Tensors of supported devices" on a CUDA parameter. Read from the
    installed torch's own docstring, so the rule follows the version."""
    s = case.schedule
    if s.optimizer != "adagrad" or s.optimizer_impl != "fused" or device == "cpu":
        return None
    import torch

    if "(CPU only)" in (torch.optim.Adagrad.__doc__ or ""):
        return (f"fused Adagrad on {device}: torch {torch.__version__} documents its fused implementation as "
                f"CPU only (torch.optim.Adagrad, 'fused')")
    return None


def off_its_devices(case: Case, device: str) -> str | None:
    """What a path on ``device`` cannot run of this case: a fused step its
    docs leave out there, or an OpInfo op off the CPU. The op table is
    screened on the CPU, where its samples are known to be in their domain
    and float32-stable; on CUDA, ops differ in what they may do (an index
    argument that must stay on the CPU, a host copy inside a graph capture,
    TF32 convolutions), and an unscreened op there would report the
    device's behaviour as the machinery's."""
    if reason := fused_off_its_devices(case, device):
        return reason
    if device != "cpu" and any(n.op == "opinfo" for n in case.nodes):
        return (f"OpInfo ops on {device}: the op table is screened on the CPU only "
                f"(python -m harness.case.optable_build); a {device} run would judge unscreened ops")
    return None
