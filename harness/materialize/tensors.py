"""Case -> concrete tensors and a forward function.

All data is drawn from generators seeded by the case, in float64, so the
oracle and every path see the same numbers (paths cast to the case dtype).
In exact mode the data are small integers: with linear ops every float32
result is exact, and any difference at all is a bug.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from harness.case.ops import OPS, draws_random
from harness.case.validate import infer_shapes
from harness.case.spec import Case, Use

INT_RANGE = 3  # exact-mode data are integers in [-INT_RANGE, INT_RANGE]
EXACT_LIMIT = 2**24  # float32 represents every integer below this exactly


def seed_global(seed: int) -> None:
    """``torch.manual_seed`` for the devices a case can run on: the CPU
    generator, and CUDA's where CUDA is there. torch.manual_seed also queues
    seeds for every other accelerator a build knows, which on a CPU build
    cost more per example than the rest of a small case's setup."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


class Built:
    """The tensors a case describes, and its forward.

    ``k`` numbers backwards over the whole schedule (step * microbatches +
    microbatch), so every backward gets its own inputs and grad outputs.
    """

    def __init__(self, case: Case) -> None:
        self.case = case
        self.shapes = infer_shapes(case)
        self.dtype = getattr(torch, case.dtype)
        # The intermediates of the last forward that ``retain_grad`` was called on.
        self.retained: dict[str, torch.Tensor] = {}
        # How many times each case hook fired ("<node> tensor_hook"), since the
        # caller last reset it: eager fires a tensor hook once per backward.
        self.fired: dict[str, int] = {}
        self.random = draws_random(case)
        # Whether ``forward`` seeds the global RNG itself. A compiled forward
        # must not: Inductor with ``fallback_random`` differentiated other
        # masks than its forward drew after a seed set inside the compiled
        # function (torch's, not the case's), so the compile paths seed
        # before they call it, as a user seeds before a step.
        self.seeds_itself = True

    def seed_rng(self) -> None:
        """Random ops (dropout) draw from the global RNG, as real models do, so
        that a recomputation which does not restore it draws other masks. Every
        forward starts from the same state, in the oracle and on every path."""
        if self.random:
            seed_global(self.case.seed * 7919 + 77)

    def count_hook(self, node: str) -> Callable[[], None]:
        def count() -> None:
            key = f"{node} tensor_hook"
            self.fired[key] = self.fired.get(key, 0) + 1

        return count

    def _draw(self, purpose: int, shape: tuple[int, ...], nonzero: bool = False) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.case.seed * 7919 + purpose)
        if self.case.exact:
            t = torch.randint(-INT_RANGE, INT_RANGE + 1, shape, generator=g).to(torch.float64)
            if nonzero:
                t = torch.where(t == 0, torch.ones_like(t), t)
            return t
        return torch.randn(shape, generator=g, dtype=torch.float64)

    def params(self) -> dict[str, torch.Tensor]:
        return {p.name: self._draw(1000 + i, p.shape) for i, p in enumerate(self.case.params)}

    def prefill(self) -> dict[str, torch.Tensor]:
        return {p.name: self._draw(2000 + i, p.shape) for i, p in enumerate(self.case.params)}

    def inputs(self, k: int) -> dict[str, torch.Tensor]:
        return {x.name: self._draw(10_000 * (k + 1) + i, x.shape) for i, x in enumerate(self.case.inputs)}

    def cotangents(self, k: int) -> list[torch.Tensor]:
        # Nonzero, so that a grad cannot hide behind a zero cotangent.
        return [
            self._draw(10_000 * (k + 1) + 500 + i, self.output_shape(u), nonzero=True)
            for i, u in enumerate(self.case.outputs)
        ]

    def output_shape(self, use: Use) -> tuple[int, ...]:
        shape = self.shapes[use.ref]
        if shape and isinstance(shape[0], tuple):
            shape = shape[use.index]
        if use.transpose:
            shape = shape[:-2] + (shape[-1], shape[-2])
        return shape  # type: ignore[return-value]

    def forward(
        self,
        values: dict[str, torch.Tensor],
        *,
        bound: bool = False,
        on_node: Callable[[str, torch.Tensor], None] | None = None,
    ) -> list[torch.Tensor]:
        """Run the SSA list over ``values`` (params and inputs by name).

        Hooks and ``retain_grad`` are installed as the case says. ``bound``
        runs the magnitude-bound network instead: nonlinearities become the
        identity, so on absolute values every result and grad bounds the
        size of the terms the real network sums.
        """
        env: dict[str, Any] = dict(values)
        self.retained = {}
        if not bound and self.seeds_itself:
            self.seed_rng()
        self.run_span(env, 0, len(self.case.nodes), bound=bound, on_node=on_node)
        return self.outputs_of(env)

    def outputs_of(self, env: dict[str, Any]) -> list[torch.Tensor]:
        return [_resolve(env, u) for u in self.case.outputs]

    def run_span(
        self,
        env: dict[str, Any],
        start: int,
        end: int,
        *,
        bound: bool = False,
        on_node: Callable[[str, torch.Tensor], None] | None = None,
        install: bool = True,
    ) -> None:
        """Run ``nodes[start:end]`` into ``env`` (a forward split into pieces,
        each run by its own module, as FSDP units are), with the case's hooks
        and ``retain_grad`` (not ``install``: a recomputation, whose tensors
        are not the ones the user hooked)."""
        hooks = {h.node: h for h in self.case.hooks}
        for node in self.case.nodes[start:end]:
            op = OPS[node.op]
            args = [_resolve(env, u) for u in node.args]
            fn = op.bound if bound and op.bound is not None else op.run
            out = fn(args, dict(node.attrs))
            if isinstance(out, list):
                out = tuple(out)
            env[node.name] = out
            if install and isinstance(out, torch.Tensor) and out.requires_grad:
                h = hooks.get(node.name)
                if h is not None:
                    out.register_hook(_hook(h.kind, abs(h.factor) if bound else h.factor, self.count_hook(node.name)))
                if node.name in self.case.retain_grad:
                    out.retain_grad()
                    self.retained[node.name] = out
            if on_node is not None:
                for i, t in enumerate(out if isinstance(out, tuple) else (out,)):
                    on_node(f"{node.name}[{i}]" if isinstance(out, tuple) else node.name, t)


def _resolve(env: dict[str, Any], use: Use) -> torch.Tensor:
    t = env[use.ref]
    if use.index is not None:
        t = t[use.index]
    return t.mT if use.transpose else t


def _hook(kind: str, factor: int, count: Callable[[], None] = lambda: None) -> Callable[[torch.Tensor], torch.Tensor | None]:
    def hook(g: torch.Tensor) -> torch.Tensor | None:
        count()
        return g * factor if kind == "scale" else None

    return hook


def magnitude_bounds(case: Case) -> dict[str, torch.Tensor]:
    """Per-element bounds on |grad| of each parameter, summed over the schedule.

    Used for exact mode (reject cases whose numbers could leave float32's
    exact-integer range) and for tolerance mode (a tolerance proportional to
    the size of the terms summed, not one global epsilon).
    """
    b = Built(case)
    params = {n: t.abs().requires_grad_() for n, t in b.params().items()}
    total = {n: torch.zeros_like(t) for n, t in params.items()}
    if case.schedule.grad_init == "prefilled":
        total = {n: t.abs() for n, t in b.prefill().items()}
    peak = max([0.0] + [float(t.detach().abs().max()) for t in params.values()])
    for k in range(case.schedule.backwards):
        inputs = {n: t.abs().requires_grad_() for n, t in b.inputs(k).items()}
        inner: list[torch.Tensor] = []
        outs = b.forward({**params, **inputs}, bound=True, on_node=lambda _, t: inner.append(t))
        cots = [c.abs() for c in b.cotangents(k)]
        for o in inner + outs + list(inputs.values()):
            peak = max(peak, float(o.detach().abs().max()) if o.numel() else 0.0)
        live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
        if not live:
            continue
        leaves = list(params.values()) + list(inputs.values()) + [t for t in inner if t.requires_grad]
        grads = torch.autograd.grad([o for o, _ in live], leaves, [c for _, c in live], allow_unused=True)
        for (n, _), g in zip(params.items(), grads):
            if g is not None:
                total[n] = total[n] + g
        for g in grads:
            if g is not None and g.numel():
                peak = max(peak, float(g.abs().max()))
    for t in total.values():
        if t.numel():
            peak = max(peak, float(t.max()))
    total["__peak__"] = torch.tensor(peak)
    return total
