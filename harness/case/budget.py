"""What a case really builds, estimated from its shapes before anything exists.

Counting elements was not enough: an 860-byte file whose one node cut a
parameter into a million one-element chunks asked for 4 MB of elements and
built 3.3 GB of tensor objects and autograd nodes, and a 963-byte file with
one large parameter was within the element budget but wrote a 45 MB repro
script. So the estimate charges each field for everything a run makes of it:
every tensor object (a view costs an object and a grad node however few
elements it has), the float64 oracle beside the path, one copy per rank of
the worker pool, a parameter's copy per pipeline stage, the activations a
checkpointed region saves and recomputes, and every element a repro script
spells out as a literal. A case over either limit is refused with the field
that costs most, the estimate and the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from harness.case.vocab import SpecError

CASE_MEMORY_BUDGET = 256 * 2**20  # bytes a case may build, every process together
MAX_SCRIPT_BYTES = 4 * 2**20  # a repro script's size
MAX_TENSORS = 4096  # tensor objects one forward makes (a generated case makes a few dozen)

# Measured on torch 2.13 CPU: 2**20 one-element chunk views of one parameter,
# replayed on eager.accumulate, peaked at 1.1 GB, so about 1 KiB an object.
TENSOR_BYTES = 1024
ORACLE_ITEM = 8  # the oracle runs in float64
RANKS = 2  # the worker pool's ranks each build the whole case
STAGE_COPIES = 4  # a weight tied across pipeline stages has a copy in each (MAX_STAGES)
RECOMPUTE = 2  # a checkpointed region holds what it saved and what it recomputes
LITERAL_BYTES = 24  # one element in a script: "-0.12345678901234567, "
ITEMSIZE = {"float32": 4, "float64": 8}


@dataclass(frozen=True)
class Charge:
    """What one field of a case costs: bytes in memory, bytes of script."""

    field: str
    memory: int
    script: int


def numel(shape: Any) -> int:
    """Elements of a shape, or of every result of a multi-output node."""
    if shape and isinstance(shape[0], tuple):
        return sum(math.prod(s) for s in shape)
    return math.prod(shape)


def results(shape: Any) -> int:
    """Tensor objects a value is: one, or one per result."""
    return len(shape) if shape and isinstance(shape[0], tuple) else 1


def charges(case: Any, known: dict[str, Any]) -> list[Charge]:
    """Every field's cost; the sum is the case's."""
    item, backwards = ITEMSIZE.get(case.dtype, 8), case.schedule.backwards
    prefilled = case.schedule.grad_init == "prefilled"
    out = []
    for i, p in enumerate(case.params):  # value, grad, accumulator; a copy per rank and stage
        n = math.prod(p.shape)
        out.append(Charge(f"params[{i}].shape", n * 3 * (ORACLE_ITEM + item * RANKS * STAGE_COPIES),
                          n * LITERAL_BYTES * (2 if prefilled else 1)))
    for i, x in enumerate(case.inputs):  # a fresh input per backward, and its grad
        n = math.prod(x.shape) * backwards
        out.append(Charge(f"inputs[{i}].shape", n * 2 * (ORACLE_ITEM + item * RANKS), n * LITERAL_BYTES))
    for i, node in enumerate(case.nodes):  # every backward's values and grads held, recomputed ones too
        shape = known[node.name]
        elems = numel(shape) * 2 * (ORACLE_ITEM + item * RANKS * RECOMPUTE)
        objects = results(shape) * 2 * TENSOR_BYTES * (1 + RANKS * RECOMPUTE)
        out.append(Charge(f"nodes[{i}]", (elems + objects) * backwards, 0))
    for i, u in enumerate(case.outputs):  # a grad output per backward
        n = numel(known[u.ref]) // (results(known[u.ref]) if u.index is not None else 1) * backwards
        out.append(Charge(f"outputs[{i}]", n * (ORACLE_ITEM + item * RANKS), n * LITERAL_BYTES))
    events = sum(sum(e.sizes) for e in case.schedule.events)
    out.append(Charge("schedule.events", events * item * RANKS, 0))
    return out


def check(case: Any, known: dict[str, Any]) -> int:
    """Bytes the case builds; a SpecError naming the costliest field above either limit."""
    bill = charges(case, known)
    memory, script = sum(c.memory for c in bill), sum(c.script for c in bill)
    if memory > CASE_MEMORY_BUDGET:
        worst = max(bill, key=lambda c: c.memory)
        raise SpecError(worst.field, f"the case would build about {_mib(memory)} MiB ({_mib(worst.memory)} MiB for this "
                                     f"field: values, grads, tensor objects, the float64 oracle, {RANKS} ranks); "
                                     f"a case may build {_mib(CASE_MEMORY_BUDGET)} MiB: make it smaller")
    if script > MAX_SCRIPT_BYTES:
        worst = max(bill, key=lambda c: c.script)
        raise SpecError(worst.field, f"its repro script would be about {_mib(script)} MiB of literals "
                                     f"({_mib(worst.script)} MiB for this field); a script may be "
                                     f"{_mib(MAX_SCRIPT_BYTES)} MiB: make it smaller")
    return memory


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}" if n >= 2**20 else f"{n / 2**20:.2f}"
