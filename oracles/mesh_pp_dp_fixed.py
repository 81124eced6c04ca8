"""Pipeline x data parallel on a ("pp", "dp") mesh, right by construction:
the reference the ``mesh.pp_dp.fixed`` path holds to the oracle.

What the composition promises a user, after every ``schedule.step()``:
each parameter's ``.grad`` is what it was before the step plus the mean
over the "dp" replicas of the grad each replica's microbatches gave it
(a tied parameter's copies, one per stage, summing to its grad), and each
replica's first stage holds its own input grads, the last its outputs.
This reference keeps only that promise, with plain tensors and plain
point-to-point calls and collectives on the mesh's own sub-groups: every
rank runs its own stage (an ``nn.Module`` from
``harness.materialize.stages``) microbatch by microbatch, forward then
backward, sending the activations that cross the cut to the next stage's
rank in its "pp" group and their grads back (``dist.send`` / ``dist.recv``
of contiguous tensors whose shapes both ranks know from the case); the
step's grads are kept apart from what ``.grad`` held, and after the last
microbatch each is all-reduced (sum) over "dp" and divided by the dp size,
in one fixed order on every rank, then added into ``.grad``. No DDP, no
FSDP2, no PipelineStage or schedule.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist


class Reference:
    def __init__(self, mesh: Any) -> None:
        self.pp_group = mesh.get_group("pp")
        self.dp_group = mesh.get_group("dp")
        self.pp_rank = dist.get_rank(self.pp_group)
        self.dp_size = dist.get_world_size(self.dp_group)
        self.stages = dist.get_world_size(self.pp_group)

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.pp_group, stage)

    def step(self, module: torch.nn.Module, microbatches: list[tuple[list[torch.Tensor], Callable[..., Any]]],
             shapes: list[tuple[int, ...]], needs_grad: list[bool], dtype: torch.dtype,
             device: Any) -> tuple[list[tuple[torch.Tensor, ...]], dict[str, torch.Tensor | None]]:
        """One step: each microbatch forward and backward through this rank's
        stage, in order. ``microbatches``: per microbatch, the first stage's
        inputs and the last stage's loss (called with the stage's outputs).
        ``shapes`` / ``needs_grad``: the values that cross the cut (the last
        stage's inputs), which of them carry a grad back. Returns the outputs
        of each microbatch (on the last stage; ``()`` elsewhere) and the
        step's grad of each parameter (``module.weights``), summed here out of
        each microbatch's fresh ``.grad`` (no accumulation into a ``.grad``
        that may alias another: AccumulateGrad keeps a non-contiguous
        incoming grad as it is); ``.grad`` is left as it was. Hand the grads
        to ``reduce_grads``."""
        first, last = self.pp_rank == 0, self.pp_rank == self.stages - 1
        weights = dict(module.weights)  # type: ignore[operator]
        before = {n: p.grad for n, p in weights.items()}
        acc: dict[str, torch.Tensor | None] = {n: None for n in weights}
        seen = []
        for inputs, loss_fn in microbatches:
            for p in weights.values():
                p.grad = None
            args = inputs if first else self._receive(shapes, needs_grad, dtype, device)
            outs = module(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            if last:
                seen.append(outs)
                loss = loss_fn(outs)
                if loss is not None:
                    loss.backward()
            else:
                self._hand_on(outs, shapes, needs_grad, dtype, device)
                seen.append(())
            if not first:
                self._send_back(args, needs_grad)
            _take_grads(weights, acc)
        for n, p in weights.items():
            p.grad = before[n]
        return seen, acc

    def _receive(self, shapes: list[tuple[int, ...]], needs_grad: list[bool], dtype: torch.dtype,
                 device: Any) -> list[torch.Tensor]:
        """The values crossing the cut, from the previous stage's rank."""
        args = []
        for shape, need in zip(shapes, needs_grad):
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, self._peer(self.pp_rank - 1), group=self.pp_group)
            args.append(t.requires_grad_(need))
        return args

    def _hand_on(self, outs: tuple[torch.Tensor, ...], shapes: list[tuple[int, ...]], needs_grad: list[bool],
                 dtype: torch.dtype, device: Any) -> None:
        """Send this stage's outputs on, take their grads back, run its backward."""
        for t in outs:
            if t.dtype != dtype:
                raise TypeError(f"a value crossing the cut is {t.dtype}, the reference sends {dtype}")
            dist.send(t.detach().contiguous(), self._peer(self.pp_rank + 1), group=self.pp_group)
        grads = []
        for t, shape, need in zip(outs, shapes, needs_grad):
            if need:
                g = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(g, self._peer(self.pp_rank + 1), group=self.pp_group)
                grads.append((t, g))
        live = [(t, g) for t, g in grads if t.requires_grad]
        if live:
            torch.autograd.backward([t for t, _ in live], [g for _, g in live])

    def _send_back(self, args: list[torch.Tensor], needs_grad: list[bool]) -> None:
        """The grads of the values that crossed the cut, to the previous stage (zeros where none arrived)."""
        for t, need in zip(args, needs_grad):
            if need:
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                dist.send(g.detach().contiguous(), self._peer(self.pp_rank - 1), group=self.pp_group)

    def reduce_grads(self, step_grads: dict[str, torch.Tensor | None], params: dict[str, torch.Tensor]) -> None:
        """Each grad of the step averaged over "dp", added into its parameter's ``.grad``."""
        for n in sorted(step_grads):  # the same order on every rank of a dp group; the same names have grads
            g = step_grads[n]
            if g is None:
                continue
            g = g.detach().clone()
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.dp_group)
            g.div_(self.dp_size)
            p = params[n]
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


def _take_grads(weights: dict[str, torch.Tensor], acc: dict[str, torch.Tensor | None]) -> None:
    """A microbatch's fresh grads, added out of place into the step's; ``.grad`` cleared."""
    for n, p in weights.items():
        if p.grad is not None:
            g = p.grad.detach().clone()
            acc[n] = g if acc[n] is None else acc[n] + g
        p.grad = None
