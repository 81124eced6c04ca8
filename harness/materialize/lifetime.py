"""The buffer-lifetime parts of a schedule, run inside the shared schedule loop.

Graph wrappers keep memory across backwards: static grad buffers, captured
input surfaces, a private pool. A bug there shows only when something
outlives a replay (a grad the user holds, an earlier output, a grad a hook
kept) or when the caching allocator hands freed memory to someone else.
So the schedule can hold things, watch grads through hooks, and put the
allocator under pressure between backwards; everything it holds joins the
loop's stability check (a held tensor must not change unless the user
changes it).
"""

from __future__ import annotations

import gc
from typing import Any, Callable

import torch

from harness.observation import Grads, Observation, Violation, snap
from harness.case.spec import Case

SENTINEL = 12345.0  # what pressure allocations hold; exact in every float dtype we use

# Step.seen keys: "<param> <HOOK_SEEN[kind]>"
HOOK_SEEN = {"hook": "register_hook", "hook_keep": "register_hook", "post_accumulate": "post_accumulate_grad_hook"}


class FrozenHeap:
    """Freeze what is alive before each case, so that a full collection walks
    only what the case made.

    An ``empty_cache`` event runs a full ``gc.collect()``, which walks every
    tracked object: torch, Hypothesis (its tree of every choice drawn grows
    with the run) and the resolved paths make that 0.2 s on 2 CPU cores, 95%
    of checkpoint.fixed's time. ``between_cases`` freezes everything alive
    before a case: nothing the case makes is frozen, so each collection in
    it still frees all of the case's cyclic garbage. Earlier garbage waits
    for the next thaw (a full collection every ``thaw_every`` cases, and
    on leaving). A process already frozen (a pool worker,
    ``harness.workers.isolation``) is left as it is."""

    def __init__(self, thaw_every: int = 256) -> None:
        self.thaw_every = thaw_every
        self.owned = False
        self.cases = 0

    def __enter__(self) -> "FrozenHeap":
        if not gc.get_freeze_count():
            gc.collect()
            gc.freeze()
            self.owned = True
        return self

    def between_cases(self) -> None:
        if not self.owned:
            return
        self.cases += 1
        if self.cases % self.thaw_every == 0:
            gc.unfreeze()
            gc.collect()
        gc.freeze()

    def __exit__(self, *exc: object) -> None:
        if self.owned:
            gc.unfreeze()
            self.owned = False


class Lifetime:
    """Hooks, held outputs and allocator events for one run of one case.

    ``held`` is the loop's ``_Held``: anything this class holds there is
    checked after every later backward like the user's own grads.
    """

    def __init__(self, case: Case, params: dict[str, torch.nn.Parameter], held: Any, device: str) -> None:
        self.sched = case.schedule
        self.held = held
        self.device = device
        self.dtype = getattr(torch, case.dtype)
        self.k = -1
        self.seen: Grads = {}
        self.fired: dict[str, int] = {}
        self.allocs: list[torch.Tensor] = []
        self.handles: list[Any] = []
        self.params = params

    def _register(self) -> None:
        """Hooks go on after the first forward: a graph wrapper is built (warmed
        up, captured) on its first call, and hooks belong to the training
        loop that follows, as the wrappers' docs ask."""
        for n, p in self.params.items():
            if not p.requires_grad:
                continue
            for kind in self.sched.param_hooks:
                if kind == "post_accumulate":
                    self.handles.append(p.register_post_accumulate_grad_hook(self._post(n, kind)))
                else:
                    self.handles.append(p.register_hook(self._pre(n, kind)))

    def _pre(self, n: str, kind: str) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            self._count(n, kind)
            self.seen[f"{n} {HOOK_SEEN[kind]}"] = snap(g)
            if kind == "hook_keep":
                # Keeping the tensor (not a copy) is what a logging or
                # clipping hook may do; it must not change afterwards.
                self.held.hold(f"grad the {n} hook kept in backward {self.k}", g)

        return hook

    def _post(self, n: str, kind: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self._count(n, kind)
            self.seen[f"{n} {HOOK_SEEN[kind]}"] = snap(p.grad)

        return hook

    def _count(self, n: str, kind: str) -> None:
        key = f"{n} {kind}"
        self.fired[key] = self.fired.get(key, 0) + 1

    def after_forward(self, k: int, outs: list[torch.Tensor]) -> None:
        if self.sched.retain_outputs:
            for i, o in enumerate(outs):
                self.held.hold(f"output {i} of backward {k}", o)

    def begin(self, k: int) -> None:
        if k == 0:
            self._register()
        self.k = k
        self.seen, self.fired = {}, {}

    def end(self, k: int, obs: Observation) -> Grads:
        """What the hooks saw in backward ``k``; a hook that fired more than once is a violation."""
        for key, count in sorted(self.fired.items()):
            if count > 1:
                n, kind = key.split(" ", 1)
                obs.violations.append(Violation(
                    "hook", k, n, f"the {HOOK_SEEN[kind]} hook on {n} fired {count} times in backward {k}; "
                    "autograd fires it once per backward", key=f"hook {kind} fired N times"))
        return dict(self.seen)

    def between(self, k: int) -> None:
        """The events scheduled after backward ``k``."""
        for e in self.sched.events:
            if e.after != k:
                continue
            if e.kind == "empty_cache":
                gc.collect()
                if self.device != "cpu" and torch.cuda.is_available():
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            elif e.kind == "alloc":
                for size in e.sizes:
                    t = torch.full((size,), SENTINEL, dtype=self.dtype, device=self.device)
                    self.allocs.append(t)
                    self.held.hold(f"allocation of {size} elements made after backward {k}", t)
            elif e.kind == "free":
                self.held.release(self.allocs)
                self.allocs = []

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.allocs = [], []
