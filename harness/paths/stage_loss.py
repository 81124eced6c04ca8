"""The loss a pipeline schedule is driven with, shared by every family that
runs one (the pipeline family, and the pipeline-over-data-parallel mesh).

A schedule's loss function sees one microbatch at a time and only what the
last stage returned and its target row; the case's backward is a
vector-Jacobian product with drawn grad outputs. So the target row carries
the microbatch's number and its grad outputs, flattened, and the loss is
their inner product with the outputs: its backward is exactly that VJP."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from harness.case.spec import Case
from harness.materialize.tensors import Built


def vjp_loss(case: Case, built: Built, seen: dict[int, list[Any]]) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss function; what it was handed goes into ``seen`` by microbatch
    (the real call comes after any metadata inference, which it overwrites)."""
    from harness.observation import snap

    shapes = [built.output_shape(u) for u in case.outputs]
    sizes = [math.prod(s) for s in shapes]

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        outs = output if isinstance(output, (tuple, list)) else (output,)
        row = target.reshape(-1)
        k = int(row[0])
        seen[k] = [snap(o) for o in outs]
        cots, at = [], 1
        for shape, size in zip(shapes, sizes):
            cots.append(row[at:at + size].reshape(shape))
            at += size
        terms = [(o * c).sum() for o, c in zip(outs, cots) if o.requires_grad]
        if not terms:
            raise ValueError("no output of the last stage requires grad")
        return sum(terms[1:], terms[0])

    return loss_fn


def target_rows(cotangents: Callable[[int], list[torch.Tensor]], ks: range) -> torch.Tensor:
    """The last stage's target: per microbatch ``k``, its number and the grad
    outputs ``cotangents(k)`` gives, flattened (float64: a number is exact)."""
    rows = [torch.cat([torch.tensor([float(k)], dtype=torch.float64), *(c.reshape(-1) for c in cotangents(k))])
            for k in ks]
    return torch.stack(rows)
