"""A case spelled out as plain torch source, for the standalone repro scripts.

Every script template (``harness.artifacts.repro``, ``harness.paths.pipeline.script``,
``harness.paths.dtensor.script``, the DeepSpeed and megatron ones) writes the module, its data and its custom
autograd Functions the same way, from typed values only: names are the
validated identifiers of the case, numbers are literals, text goes through
``repr``.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from harness.case import functions, opcall
from harness.case.ops import OPS, draws_random
from harness.case.spec import Case, SpecError, Use
from harness.materialize.names import attribute, variable

if TYPE_CHECKING:
    from harness.materialize.stages import StageSpec


def checked(case: Case) -> Case:
    """The case as its own JSON would load: every name a validated,
    non-keyword identifier, every number a number of its type, every attribute
    one its op takes. Scripts are generated only from such values (a Case made
    in code, not read from a file, gets the same check here)."""
    return Case.from_json(case.to_json())


def factor_literal(factor: Any) -> str:
    """A hook factor as a literal, after its type check (never pasted text)."""
    if isinstance(factor, bool) or not isinstance(factor, int):
        raise SpecError("hooks.factor", f"expected an integer, got {factor!r}")
    return repr(int(factor))


def _ref(use: Use, nodes: set[str]) -> str:
    s = variable(use.ref) if use.ref in nodes else f"v[{use.ref!r}]"
    if use.index is not None:
        s = f"{s}[{use.index}]"
    return f"{s}.mT" if use.transpose else s


def forward_source(case: Case) -> str:
    nodes = {n.name for n in case.nodes}
    hooks = {h.node: h for h in case.hooks}
    lines = ["def forward(v):"]
    if draws_random(case):  # as Built.seed_rng: every forward draws the same masks
        # A compiled forward is called unseeded, the RNG seeded before the call (``RNG_SEED``).
        lines = [f"RNG_SEED = {case.seed * 7919 + 77}", "", "", "def forward(v, seeded=True):",
                 "    if seeded:", "        torch.manual_seed(RNG_SEED)"]
    for n in case.nodes:
        args = [_ref(u, nodes) for u in n.args]
        name = variable(n.name)
        lines.append(f"    {name} = {OPS[n.op].source(args, dict(n.attrs))}")
        h = hooks.get(n.name)
        if h is not None:
            lines += hook_lines(name, h.kind, h.factor, "    ")
        if n.name in case.retain_grad:
            lines.append(f"    if {name}.requires_grad:")
            lines.append(f"        {name}.retain_grad()")
    outs = ", ".join(_ref(u, nodes) for u in case.outputs)
    lines.append(f"    return [{outs}]")
    return "\n".join(lines)


def hook_lines(name: str, kind: str, factor: Any, indent: str) -> list[str]:
    """The hook a case registers on the node held in ``name``, as source lines."""
    body = f"lambda g: g * {factor_literal(factor)}" if kind == "scale" else "lambda g: None"
    return [f"{indent}if {name}.requires_grad:", f"{indent}    {name}.register_hook({body})  # a {kind} hook"]


def stage_source(case: Case, spec: StageSpec) -> str:
    """One stage as a plain nn.Module class (the pipeline and DeepSpeed pipe
    scripts): its parameters from PARAMS, its inputs positional as ``a0``, ``a1``..."""
    args = [f"a{i}" for i in range(len(spec.inputs))]
    received = {(v.ref, v.index): a for v, a in zip(spec.inputs, args)}
    local = {n.name for n in spec.nodes}
    hooks = {h.node: h for h in case.hooks}

    def ref(u: Use) -> str:
        if u.ref in spec.params:
            s = f"self.{attribute(u.ref)}"
        elif u.ref in local:
            s = variable(u.ref) if u.index is None else f"{variable(u.ref)}[{u.index}]"
        else:
            s = received[(u.ref, u.index)]
        return f"{s}.mT" if u.transpose else s

    lines = [f"class Stage{spec.index}(torch.nn.Module):",
             f'    """Stage {spec.index}: receives {", ".join(v.label for v in spec.inputs) or "nothing"}."""',
             "",
             "    def __init__(self):",
             "        super().__init__()"]
    for n in spec.params:
        lines.append(f"        self.{attribute(n)} = torch.nn.Parameter(torch.tensor(PARAMS[{n!r}], dtype=DTYPE), "
                     f"requires_grad={n!r} not in FROZEN)")
    lines += ["", f"    def forward(self{''.join(', ' + a for a in args)}):"]
    for n in spec.nodes:
        lines.append(f"        {variable(n.name)} = {OPS[n.op].source([ref(u) for u in n.args], dict(n.attrs))}")
        h = hooks.get(n.name)
        if h is not None:
            lines += hook_lines(variable(n.name), h.kind, h.factor, "        ")
    outs = [ref(u) for u in spec.outputs]
    lines.append(f"        return {outs[0] if len(outs) == 1 else '(' + ', '.join(outs) + ')'}")
    return "\n".join(lines)


def literal(t: Any) -> str:
    return repr(t.tolist())


def function_helpers(case: Case) -> list[str]:
    """Source of the custom autograd Functions the case uses."""
    used = {n.op for n in case.nodes}
    out = [inspect.getsource(fn) for op, fn in _FUNCTIONS.items() if op in used]
    if "opinfo" in used:  # the very function the harness runs, with the constant it reads
        out.append(f"MOVE = {opcall.MOVE!r}\n\n\n" + inspect.getsource(opcall.opinfo_recipe) + "\n\n"
                   + inspect.getsource(opcall.opinfo_node))
    if any(n.op == "opinfo" and n.attr("place") is not None for n in case.nodes):  # on a mesh: how it places
        out.append(f"PARTIAL = {opcall.PARTIAL!r}\n\n\n" + inspect.getsource(opcall.opinfo_on_mesh))
    return out


_FUNCTIONS = {"layout_matmul": functions.LayoutMatmul, "pair": functions.Pair, "passthrough": functions.PassThrough}


def schedule_data(case: Case, built: Any) -> list[str]:
    """The constants ``EAGER_WINDOWS`` reads: parameters, inputs and grad
    outputs per backward, and the schedule's accumulation rules."""
    sched = case.schedule
    return [
        f"DTYPE = torch.{case.dtype}",
        "PARAMS = {" + ", ".join(f"{p.name!r}: {literal(built.params()[p.name])}" for p in case.params) + "}",
        "FROZEN = " + repr({p.name for p in case.params if not p.requires_grad} or set()),
        "PREFILL = " + ("{" + ", ".join(f"{n!r}: {literal(t)}" for n, t in built.prefill().items()) + "}"
                        if sched.grad_init == "prefilled" else "None"),
        f"GRAD_INIT, MICROBATCHES, STEPS, ZERO_GRAD = {sched.grad_init!r}, {sched.microbatches}, {sched.steps}, "
        f"{sched.zero_grad!r}",
        f"CLIP, MAX_NORM = {sched.clip!r}, {sched.max_norm!r}",
        "INPUT_NAMES = " + repr([x.name for x in case.inputs]),
        "INPUT_GRAD = " + repr({x.name: x.requires_grad for x in case.inputs}),
        "INPUTS = [  # one dict per backward",
        *["    {" + ", ".join(f"{n!r}: {literal(t)}" for n, t in built.inputs(k).items()) + "},"
          for k in range(sched.backwards)],
        "]",
        "GRAD_OUTPUTS = [  # the grad of each output, one list per backward",
        *["    [" + ", ".join(literal(c) for c in built.cotangents(k)) + "]," for k in range(sched.backwards)],
        "]",
    ]


# The float64 eager expectation of a script whose machinery runs on ranks:
# every .grad after every backward, accumulated out of place, zeroed where a
# step starts, clipped where a window ends (schedule_data's constants).
EAGER_WINDOWS = '''def start(k):
    return k and k % MICROBATCHES == 0 and ZERO_GRAD != "keep"


def expected():
    params = {n: torch.tensor(t, dtype=torch.float64).requires_grad_(n not in FROZEN) for n, t in PARAMS.items()}
    acc = {n: None for n in params}
    if GRAD_INIT != "none":
        acc = {n: (torch.zeros_like(params[n]) if GRAD_INIT == "zero" else torch.tensor(PREFILL[n], dtype=torch.float64))
               if n not in FROZEN else None for n in params}
    seen = []
    for k in range(MICROBATCHES * STEPS):
        if start(k):
            acc = {n: None if ZERO_GRAD == "set_to_none" or g is None else torch.zeros_like(g) for n, g in acc.items()}
        inputs = {n: torch.tensor(t, dtype=torch.float64).requires_grad_(INPUT_GRAD[n]) for n, t in INPUTS[k].items()}
        cots = [torch.tensor(c, dtype=torch.float64) for c in GRAD_OUTPUTS[k]]
        live = [(o, c) for o, c in zip(forward({**params, **inputs}), cots) if o.requires_grad]
        names = [n for n in params if n not in FROZEN]
        if live and names:
            grads = torch.autograd.grad([o for o, _ in live], [params[n] for n in names], [c for _, c in live],
                                        allow_unused=True)
            for n, g in zip(names, grads):
                if g is not None:
                    acc[n] = g.clone() if acc[n] is None else acc[n] + g  # autograd.grad may hand back views of one buffer
        if CLIP and (k + 1) % MICROBATCHES == 0:
            leaves = [torch.zeros_like(params[n]) for n in acc if acc[n] is not None]
            for leaf, g in zip(leaves, [g for g in acc.values() if g is not None]):
                leaf.grad = g
            torch.nn.utils.clip_grad_norm_(leaves, MAX_NORM, norm_type=float(CLIP), foreach=False)
        seen.append({n: None if g is None else g.clone() for n, g in acc.items()})
    return seen
'''


# The case's module in a ranked script (DDP, FSDP2, DeepSpeed): parameters
# under PREFIX + name (a case name may be an attribute of nn.Module), the
# forward over the script's constants.
CASE_MODULE = '''class Module(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        for n, t in PARAMS.items():  # under PREFIX + n, never n itself: it may be "cuda"
            self.register_parameter(PREFIX + n, torch.nn.Parameter(torch.tensor(t, dtype=DTYPE, device=device),
                                                                   requires_grad=n not in FROZEN))

    def weights(self):
        return {n: getattr(self, PREFIX + n) for n in PARAMS}

    def forward(self, *inputs):
        return tuple(forward({**self.weights(), **dict(zip(INPUT_NAMES, inputs))}))
'''
