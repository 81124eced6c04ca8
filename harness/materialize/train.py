"""The training step of a schedule: ``clip_grad_norm_`` then an optimizer step.

One implementation for the oracle and every path, so they cannot disagree
about what the step means; each applies it to its own tensors (the oracle
to float64 leaves with the grads it summed itself, ``run_schedule`` to its
parameters, the DTensor ranks to DTensor parameters whose grads may still
be Partial). The oracle always uses the for-loop implementation; paths use
the one the case names (torch's default, for-loop, foreach or fused).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from harness.materialize import workarounds
from harness.case.spec import Case
from harness.case.training import OPTIMIZERS

class Trainer:
    """Holds the optimizer (its state lives across steps) for one run of one case."""

    def __init__(self, case: Case, params: dict[str, torch.Tensor], oracle: bool = False,
                 step_with: Callable[[Any, dict[str, torch.Tensor]], None] | None = None,
                 clip_with: Callable[..., torch.Tensor] | None = None) -> None:
        """``step_with(optimizer, params)`` and ``clip_with`` (the signature of
        ``clip_grad_norm_``), when given, replace ``optimizer.step()`` and
        ``clip_grad_norm_``: a fixed reference's workarounds."""
        s = case.schedule
        self.case = case
        self.params = params
        self.step_with = step_with
        self.clip_with = clip_with or torch.nn.utils.clip_grad_norm_
        self.clip = s.clip
        self.max_norm = s.max_norm
        impl = "for_loop" if oracle else workarounds.optimizer_impl(s.optimizer_impl)
        self.foreach = {"foreach": True, "for_loop": False}.get(impl)
        self.optimizer = None
        trainable = [p for p in params.values() if p.requires_grad]
        if s.optimizer and trainable:
            cls_name, extra = OPTIMIZERS[s.optimizer]
            kwargs: dict[str, Any] = {"lr": s.lr, **extra}
            if impl == "fused":
                kwargs["fused"] = True
            elif impl:
                kwargs["foreach"] = impl == "foreach"
            self.optimizer = getattr(torch.optim, cls_name)(trainable, **kwargs)

    def step(self, snap: Callable[[torch.Tensor], Any]) -> dict[str, Any]:
        """Clip, then step; returns ``snap`` of what the user could look at,
        each taken right when it is final: the total norm and the clipped
        grads after clipping, each parameter and its ``.grad`` after the
        optimizer (which must leave ``.grad`` as it found it)."""
        seen: dict[str, Any] = {}
        held = {n: p.grad for n, p in self.params.items()}  # the .grad objects the user holds
        with_grad = [p for p in self.params.values() if p.grad is not None]
        if self.clip and with_grad:
            kwargs = {} if self.foreach is None else {"foreach": self.foreach}
            total = self.clip_with(with_grad, self.max_norm, norm_type=float(self.clip), **kwargs)
            seen["total norm"] = snap(total)
            for n, p in self.params.items():
                if p.grad is not None:
                    seen[f"{n}.grad clipped"] = snap(p.grad)
        if self.optimizer is not None:
            if self.step_with is not None:
                self.step_with(self.optimizer, self.params)
            else:
                self.optimizer.step()
            for n, p in self.params.items():
                if p.requires_grad:
                    seen[n] = snap(p)
                    seen[f"{n}.grad after optimizer.step()"] = None if p.grad is None else snap(p.grad)
        # Clipping and optimizers work on .grad in place: a step that swaps in
        # another tensor leaves the user's reference stale though every value
        # is right. Compared as a number (eager: 0) so every path and rank loop
        # that steps through here is held to it.
        for n, p in self.params.items():
            if held[n] is not None:
                seen[f"{n}.grad object replaced by the step (1 = yes)"] = snap(
                    torch.tensor(float(p.grad is not held[n]), dtype=torch.float64))
        return seen
