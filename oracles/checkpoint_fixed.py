"""A minimal activation checkpoint: forget a region's saved tensors, recompute them in backward.

``checkpoint(fn, *args)`` returns what ``fn(*args)`` returns, with the same
autograd graph as running ``fn`` plainly; only the tensors that graph saves
for backward are not kept. Each is replaced by its position in the order the
forward saved them, and the first backward that needs one reruns ``fn`` once
(RNG restored to its state before the forward, grad mode on, under a hook
that records what the rerun saves) and hands out the rerun's tensor at that
position.

Why it is shaped like this: backward runs through the *original* graph, so
everything autograd does per use site stays as in eager by construction. A
parameter used inside and outside the region (or in two regions) is one leaf
with one AccumulateGrad, reached once per use; its hooks and every tensor
hook and ``retain_grad`` fire on the original tensors, once per backward; the
rerun's own graph is never backpropagated, so hooks it registers never fire.
The only thing left to get right is that the rerun saves the same tensors in
the same order, which holds when ``fn`` is deterministic given its inputs,
the parameters it closes over and the RNG state: hence the RNG restore, and a
count check that raises (naming both counts) instead of handing out a wrong
tensor when the rerun saved a different number.

Pure torch; no early stop, no nesting inside ``fn``, no ``torch.compile``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class RecomputeMismatch(RuntimeError):
    """The rerun of a checkpointed region saved other tensors than its forward."""


def _devices(args: tuple[Any, ...]) -> list[torch.device]:
    return sorted({a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"},
                  key=lambda d: d.index or 0)


class _Region:
    """One call of ``checkpoint``: what the rerun needs, and its saved tensors once rerun."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], preserve_rng_state: bool) -> None:
        self.fn = fn
        # Inputs are kept as the forward saw them (detached views share their
        # storage, so an in-place change by the caller after the call would
        # show; torch's checkpoint has the same rule: do not mutate inputs).
        self.args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)
        self.devices = _devices(args) if preserve_rng_state else []
        self.cpu_state = torch.get_rng_state() if preserve_rng_state else None
        self.cuda_states = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.saved_count = 0
        self.recomputed: list[torch.Tensor] | None = None

    def pack(self, _t: torch.Tensor) -> int:
        self.saved_count += 1
        return self.saved_count - 1

    def unpack(self, i: int) -> torch.Tensor:
        if self.recomputed is None:
            self.recomputed = self._rerun()
        return self.recomputed[i]

    def _rerun(self) -> list[torch.Tensor]:
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.random.fork_rng(devices=self.devices, enabled=self.cpu_state is not None):
            if self.cpu_state is not None:
                torch.set_rng_state(self.cpu_state)
                for d, s in zip(self.devices, self.cuda_states):
                    torch.cuda.set_rng_state(s, d)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                self.fn(*self.args)
        if len(saved) != self.saved_count:
            raise RecomputeMismatch(
                f"checkpointed region saved {self.saved_count} tensors in forward but {len(saved)} when "
                "recomputed in backward: the region is not deterministic given its inputs and RNG state")
        return saved


def checkpoint(fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True) -> Any:
    """``fn(*args)`` whose saved activations are recomputed in backward.

    ``preserve_rng_state=False`` skips the RNG restore (only correct when
    ``fn`` draws no random numbers), as torch's flag of that name does.
    """
    region = _Region(fn, args, preserve_rng_state)
    with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack):
        return fn(*args)
