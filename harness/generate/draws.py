"""What is drawn around the core case: training's gaps, buffer lifetimes,
training steps and mesh placements, and ``Draw``, the way a family adds its
own knobs. Each strategy shrinks to "not there", so a failure that does not
need it is reported without it."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from hypothesis import strategies as st

from harness.case.ops import draws_random
from harness.case.spec import PARAM_HOOKS, Case, Event, Input, Node, Param, Schedule, Use
from harness.case.vocab import GRAD_INITS, ZERO_GRADS

# A switch on in one case of eight, shrinking to off. Not st.integers(0, 7) == 7:
# Hypothesis favours the ends of a range, which made a "one in eight" switch
# come on in 11 of 41 drawn cases.
ONE_IN_EIGHT = st.sampled_from((False,) * 7 + (True,))
# A training step in three cases of four, shrinking to none.
TRAIN = st.sampled_from((False, True, True, True))


@dataclass(frozen=True)
class Draw:
    """A family's own knobs, drawn after the core case (stage cuts, regions,
    wrapper switches): each of ``steps``, called as ``step(case, *args)``, is
    a strategy of the case with some set, drawn in turn. ``blocks`` are extra
    block kinds the family wants in the core case (they come only to its
    paths, so other paths' case distributions, and their saved examples, stay
    as they were). Two contracts with equal draws share one case stream."""

    name: str
    steps: tuple[Callable[..., Any], ...] = field(compare=False, repr=False)
    args: tuple = ()
    blocks: tuple[str, ...] = ()


# Pressure allocations: the CUDA caching allocator's small blocks (512 B
# granules in 2 MiB segments) and large ones, so freed graph-surface memory
# gets handed to someone else.
PRESSURE_SIZES = (4, 6, 12, 128, 4096, 2**16, 2**18, 2**20)


@st.composite
def gap_cases(draw, case: Case) -> Case:
    """What real training has and the founding blocks never build: frozen
    parameters beside trainable ones (fine-tuning, LoRA), a parameter that
    never reaches the outputs, an input that requires grad and reaches none,
    inputs that need no grad before the ones that do, an output that needs no
    grad beside ones that do, and a last stage's scalar loss. Each is one draw that shrinks to "not there"."""
    frozen = draw(st.lists(st.integers(0, 4), min_size=len(case.params), max_size=len(case.params)))
    params = [replace(p, requires_grad=False) if f == 4 else p for p, f in zip(case.params, frozen)]
    if draw(st.integers(0, 3)) == 3:
        params.append(Param(f"u{len(params)}", params[0].shape))  # unused: no node reads it
    inputs, nodes, outputs = list(case.inputs), list(case.nodes), list(case.outputs)
    no_grad_out = draw(st.integers(0, 3))  # 1: appended, 2: first
    if no_grad_out in (1, 2):
        x = next((i.name for i in inputs if not i.requires_grad), None)
        if x is None:
            x = f"x{len(inputs)}"
            inputs.append(Input(x, inputs[0].shape, requires_grad=False))
        nodes.append(Node(f"n{len(nodes)}", "relu", (Use(x),)))
        use = Use(nodes[-1].name)
        outputs = outputs + [use] if no_grad_out == 1 else [use] + outputs
    if draw(st.integers(0, 4)) == 4:  # an input that requires grad and reaches no output
        inputs.append(Input(f"x{len(inputs)}", inputs[0].shape, requires_grad=True))
    if draw(st.integers(0, 2)) == 2:  # inputs that need no grad first
        inputs = sorted(inputs, key=lambda i: i.requires_grad)
    loss = draw(st.integers(0, 3)) == 3
    return replace(case, params=tuple(params), inputs=tuple(inputs), nodes=tuple(nodes),
                   outputs=tuple(outputs), loss=loss)


@st.composite
def training_steps(draw, case: Case) -> Case:
    """Past backward, where a DTensor grad is used: clip_grad_norm_ (a norm
    type) and an optimizer step (an implementation) after each step's last
    microbatch. Such cases run in float64, where optimizer arithmetic can be
    held to a tight relative tolerance. Shrinks to no training step."""
    from harness.case.training import CLIP_NORMS, FUSED, OPTIMIZERS, SIGN_BASED

    # Three cases in four train (shrinking to none): each of the 14 optimizers
    # then comes in about one case in twenty, so its pairs with the other
    # features turn up within a few hundred (benchmarks/pairs.py).
    if not draw(TRAIN):
        return case
    clip = draw(st.sampled_from(("",) + CLIP_NORMS))
    names = [n for n in OPTIMIZERS if case.exact or n not in SIGN_BASED]
    optimizer = draw(st.sampled_from(["", *names]))
    impls = ("", "for_loop", "foreach") + (("fused",) if optimizer in FUSED else ())
    impl = draw(st.sampled_from(impls)) if optimizer else ""
    if not clip and not optimizer:
        return case
    schedule = replace(case.schedule, clip=clip, max_norm=draw(st.sampled_from((1.0, 10.0))),
                       optimizer=optimizer, optimizer_impl=impl, lr=draw(st.sampled_from((0.1, 0.01))))
    return replace(case, schedule=schedule, dtype="float64")


@st.composite
def dtensor_placements(draw, case: Case) -> Case:
    """Where each parameter lives on the mesh: all through ``to_local`` with
    Partial grads (the seed's pattern, what this shrinks to), or each one a
    Replicate or Shard(d) DTensor used as one, or (a weight used only as
    ``h @ w``) a tensor-parallel style. A case with an op that builds a plain
    index or mask tensor (``Op.plain_tensors``) or an attention keeps the
    to_local pattern: DTensor-placed parameters refuse those (the dtensor
    contract), and with the pair targets' rare ops such placements were a
    third of what the dtensor target drew and threw away."""
    from harness.case import opinfo
    from harness.case.ops import OPS

    if any(OPS[n.op].plain_tensors or n.op == "sdpa" for n in case.nodes):
        return case
    ops = [n for n in case.nodes if n.op == "opinfo"]
    if any(not opinfo.even_places(n.attr("fn"), n.attr("call"), 2) for n in ops):
        return case  # an OpInfo op that did not run under DTensor in the table's screen
    if not draw(st.booleans()):
        return case
    params = tuple(
        replace(p, placement=draw(st.sampled_from(
            ("replicate",) + tuple(f"shard{d}" for d in range(len(p.shape)))
            + (("colwise", "rowwise") if tp_eligible(case, p.name) else ()))))
        for p in case.params
    )
    # Each OpInfo op's input on the mesh: Replicate or Shard(d), as the screen ran it, even on two ranks.
    places = {n.name: draw(st.sampled_from(opinfo.even_places(n.attr("fn"), n.attr("call"), 2))) for n in ops}
    nodes = tuple(replace(n, attrs=n.attrs + (("place", places[n.name]),)) if n.name in places else n
                  for n in case.nodes)
    return replace(case, params=params, nodes=nodes)


def tp_eligible(case: Case, name: str) -> bool:
    """Can ``name`` run as an nn.Linear under a tensor-parallel style? Only
    when every use is the plain right operand of a matmul (``h @ w``)."""
    uses = [(node, i, u) for node in case.nodes for i, u in enumerate(node.args) if u.ref == name]
    return bool(uses) and all(node.op == "matmul" and i == 1 and not u.transpose for node, i, u in uses) \
        and not any(u.ref == name for u in case.outputs)


@st.composite
def lifetime_schedules(draw, schedule: Schedule) -> Schedule:
    """``schedule`` plus events between its backwards, held outputs and hooks.

    Everything shrinks away (no events, nothing held, no hooks), so a
    failure that does not need them is reported without them.
    """
    between = schedule.backwards - 1
    events: list[Event] = []
    if between > 0:
        for after, kind, sizes in draw(st.lists(
            st.tuples(st.integers(0, between - 1), st.sampled_from(("alloc", "empty_cache", "free")),
                      st.lists(st.sampled_from(PRESSURE_SIZES), min_size=1, max_size=3)),
            max_size=4,
        )):
            events.append(Event(after, kind, tuple(sizes) if kind == "alloc" else ()))
    events.sort(key=lambda e: e.after)
    retain_outputs = draw(st.integers(0, 3)) == 3
    hooks = draw(st.lists(st.sampled_from(PARAM_HOOKS), unique=True, max_size=2))
    return replace(schedule, events=tuple(events), retain_outputs=retain_outputs, param_hooks=tuple(hooks))


# Parameter placements on a mesh, then maybe a training step: the DTensor and compile paths.
PLACEMENTS = Draw("placements", (dtensor_placements, training_steps))


_OFFSETS = st.integers(1, 2**16)


@functools.lru_cache(maxsize=None)
def _own_first(own: str, choices: tuple[str, ...]) -> Any:
    return st.sampled_from((own,) + tuple(c for c in choices if c != own))


@st.composite
def data_variants(draw: Any, case: Case, k: int) -> tuple[Case, ...]:
    """``case`` and ``k - 1`` cases of its graph with other data: each its own
    seed (other parameter and input values), grad state before the first
    backward and ``zero_grad`` mode. The graph, the schedule's length and its
    lifetime events stay, so a machinery that compiles per structure reuses
    one compile for all of them. A case that draws random numbers keeps its
    seed (its compiled forward seeds the RNG with the constant it was built
    with). Each variant shrinks towards the next seed and the drawn case's
    grad state."""
    keep_seed = draws_random(case)
    out = [case]
    for _ in range(k - 1):
        seed = case.seed if keep_seed else (case.seed + draw(_OFFSETS)) % (2**16 + 1)
        schedule = replace(case.schedule, grad_init=draw(_own_first(case.schedule.grad_init, GRAD_INITS)),
                           zero_grad=draw(_own_first(case.schedule.zero_grad, ZERO_GRADS)))
        out.append(replace(case, seed=seed, schedule=schedule))
    return tuple(out)
