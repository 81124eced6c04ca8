"""The compile family's own draw: each drawn structure dense in OpInfo ops,
taken from each of Inductor's ways of handling an op (``Contract.draws``).

A compile path pays seconds per structure and milliseconds per case on it
(``flavors.DATA_VARIANTS`` cases share one compile), so what a 10-minute run
meets is bounded by its structures, a few hundred. The core draw puts an
OpInfo op in one block of four in tolerance mode only, and Hypothesis repeats
its choices: 400 compile draws held 233 OpInfo nodes of 50 distinct ops. So
this draw adds ``SLOTS`` ops to each structure (``INDUCTOR_SLOTS`` where
Inductor compiles it), placed after nodes of the
core case (between its tied, transposed and accumulated uses, whose grads
then flow through them), and picks each by a hash of a wide integer, so
that a repeated or small choice still lands on another op. The picks follow
``PATTERN`` over ``lowering.pools()``: ops Inductor decomposes, ops it
lowers and ops it runs as fallback kernels all come in every structure.

Everything is an ordinary draw that shrinks to "not there": a pick of 0 is
no op, so the shrinker drops the ops a finding does not need one by one; an
exact-mode case stays exact in one case of four (OpInfo ops compute in
tolerance mode only), and keeps its core blocks either way.
"""

from __future__ import annotations

import zlib
from dataclasses import replace

from hypothesis import strategies as st

from harness.case import opinfo
from harness.case.spec import Case, Node, Use
from harness.case.validate import infer_shapes
from harness.generate import Draw
from harness.paths.compile import lowering
from harness.paths.compile.judgeable import within_budget

# Ops drawn into one structure, by backend. Measured on 2.13 CPU: a structure
# of 12 OpInfo ops costs aot_eager about 5.5 CPU seconds (its trace and
# partition), 1 s more than a structure of the core draw; Inductor pays
# about 4.7 CPU seconds per op on top of its 5 (sympy simplifying each
# kernel's indexing, then g++), so its flavours take fewer per structure:
# the README gate runs each compile flavour on 20 structures.
SLOTS = 12
INDUCTOR_SLOTS = 4
# The class each slot draws from, in slot order: one of each first (so the
# Inductor flavours' four meet all three), then decomposed and lowered ops
# alike, fallback kernels (fewer ops, so fewer slots) in between.
PATTERN = ("decomposed", "lowered", "fallback", "decomposed", "lowered", "decomposed",
           "lowered", "fallback", "decomposed", "lowered", "decomposed", "lowered")
PICK = st.integers(0, 2**32 - 1)  # 0: no op
WHERE = st.integers(0, 255)
# Ops at one place applied side by side to the same tensor (their results
# summed), in groups of this width, the groups one after another: width 1 is
# a chain (a producer fused with its consumer), wider ones share an input.
WIDTH = st.sampled_from((1, 2, 3))
# An exact-mode case is turned to tolerance mode, where OpInfo ops compute,
# in three cases of four (shrinking to exact, without ops).
DENSE = st.sampled_from((False, True, True, True))


def _mix(v: int) -> int:
    """splitmix64's finalizer: neighbouring picks land on unrelated ops."""
    v = (v + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return v ^ (v >> 31)


def pick(slot: int, value: int, salt: int = 0) -> tuple[str, int] | None:
    """The (op key, sample number) that ``value`` picks in ``slot`` (None for
    0) for the flavour of ``salt`` (``salt_of``)."""
    pools = dict(lowering.pools())
    if value == 0 or not pools:
        return None
    keys = pools.get(PATTERN[slot % len(PATTERN)]) or next(iter(pools.values()))
    h = _mix(value ^ salt)
    key = keys[h % len(keys)]
    samples = opinfo.table()[key]["samples"]
    return key, (h // len(keys)) % len(samples)


def _single(shape: object) -> bool:
    return not (isinstance(shape, tuple) and shape and isinstance(shape[0], tuple))


def insert_ops(case: Case, placed: list[tuple[int, str, int]], width: int) -> Case:
    """``case`` with each (place, op key, sample) an OpInfo node after the
    ``place``-th single-result node counted from the last; ops at one place
    applied to the same tensor in groups of ``width`` (summed), the groups
    chained, and every later use of that node reading the last result."""
    if not placed:
        return case
    known = infer_shapes(case)
    spots = [n.name for n in case.nodes if _single(known[n.name])][::-1]
    if not spots:
        return case
    at: dict[str, list[tuple[str, int]]] = {}
    for where, key, i in placed:
        at.setdefault(spots[where % len(spots)], []).append((key, i))
    fresh = iter(range(len(case.nodes), 10**6))
    renamed: dict[str, str] = {}

    def use(u: Use) -> Use:
        return replace(u, ref=renamed[u.ref]) if u.ref in renamed else u

    nodes: list[Node] = []
    for node in case.nodes:
        nodes.append(replace(node, args=tuple(use(u) for u in node.args)))
        ops = at.get(node.name)
        if not ops:
            continue
        head = node.name
        for g in range(0, len(ops), width):
            outs = []
            for key, i in ops[g:g + width]:
                call = opinfo.table()[key]["samples"][i]
                nodes.append(Node(f"n{next(fresh)}", "opinfo", (Use(head),), (("call", call), ("fn", key))))
                outs.append(nodes[-1].name)
            head = outs[0]
            for o in outs[1:]:
                nodes.append(Node(f"n{next(fresh)}", "add", (Use(head), Use(o))))
                head = nodes[-1].name
        renamed[node.name] = head
    return replace(case, nodes=tuple(nodes), outputs=tuple(use(u) for u in case.outputs), exact=False)


def salt_of(flavour: str) -> int:
    """Every compile flavour draws from one seed, so the same structures, and
    Hypothesis's favourite values (0 to 3, 2**32 - 1) recur in each: without
    a salt of its own each flavour picked the same ops from them, and six
    flavours met barely more ops together than one alone."""
    return zlib.crc32(flavour.encode())


def ops_draw(flavour: str, slots: int) -> Draw:
    """The draw of ``slots`` ops per structure for ``flavour``."""
    return Draw("compile", (dense_ops,), (slots, salt_of(flavour)))


@st.composite
def dense_ops(draw, case: Case, slots: int = SLOTS, salt: int = 0) -> Case:
    """``case`` with up to ``slots`` OpInfo ops placed among its nodes (see
    the module's doc); unchanged where the installed torch has no op table."""
    if not opinfo.keys() or slots <= 0:
        return case
    if case.exact and not draw(DENSE):
        return case
    width = draw(WIDTH)
    placed = []
    for slot in range(slots):
        where, value = draw(WHERE), draw(PICK)
        op = pick(slot, value, salt)
        if op is not None:
            placed.append((where, *op))
    return insert_ops(case, placed, width)


# After the training steps (which make a case float64): see ``judgeable``.
JUDGEABLE = Draw("compile-judgeable", (within_budget,))
