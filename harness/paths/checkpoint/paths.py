"""``checkpoint.*``: activation checkpointing, regions recomputed in backward.

Regions come from the case's cut points (the family's ``Regions``, drawn
by ``data.checkpoint_regions``): the cuts split
the node list into segments, the even segments (0, 2, ...) are checkpointed
regions and the odd ones run plainly. No cut makes the whole module one
region; one cut puts the first half in a region and the second half outside
it, so a tied weight is used inside and outside. A region takes as arguments
the values defined before it that it uses (case inputs, earlier nodes; one
per result of a multi-output node) and returns the values it defines that
are used after it. Parameters are closed over, as an ``nn.Module``'s are: the
way ``checkpoint(self.block, x)`` is called in real models.

The region's forward is the case's own forward (hooks registered and
``retain_grad`` called on each intermediate that requires grad), so a
recomputation registers hooks again, as a module's forward would;
``retain_grad`` results are read from the tensors the user's forward made
(the first evaluation of each node per forward). Every observation rule of
``run_schedule`` applies: grads after every backward, input grads, outputs,
mutations, parameter hooks, how often every hook fired and the RNG state
after each backward. Each forward also counts how often every checkpointed
region runs its forward, in the forward and in the backward
(``Step.recomputed``; compared in ``harness.compare.recompute``).

Paths (one stock variant per set of options, so a finding names the option):

- ``checkpoint.fixed``: ``oracles.checkpoint_fixed`` (the reference);
- ``checkpoint.reentrant.stock``: ``checkpoint(fn, *args, use_reentrant=True)``;
- ``checkpoint.nonreentrant.stock``: ``use_reentrant=False`` with torch's
  defaults (``preserve_rng_state=True``, ``determinism_check="default"``,
  early stop on);
- ``checkpoint.nonreentrant.lax.stock``: the other way of each
  (``preserve_rng_state=False``, ``determinism_check="none"``,
  ``early_stop=False``);
- ``checkpoint.nonreentrant.offload.stock``: defaults, with the whole forward
  under ``torch.autograd.graph.save_on_cpu()`` (ambient saved-tensor hooks
  around the checkpoint call);
- ``checkpoint.selective.stock``: ``create_selective_checkpoint_contexts``
  saving matmuls (``aten.mm``, ``aten.bmm``, ``aten.addmm``) and preferring to
  recompute everything else; ``checkpoint.selective.inverse.stock`` the
  reverse (matmuls recomputed, everything else saved);
- ``checkpoint.sequential.stock``: ``checkpoint_sequential`` over one block
  per node (the carried state a dict of live values), non-reentrant, with
  ``len(cuts) + 2`` segments (at most one per node); torch runs the last
  segment plainly.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from harness.paths.workarounds import IN_PROCESS
from harness.materialize.tensors import Built
from harness.observation import LIFETIME, Grads, Observation
from harness.case.ops import OPS, node_inplace, node_random
from harness.materialize.schedule import run_schedule
from harness.generate import Draw
from harness.paths.base import PLAIN_GRADS, Availability, Contract, Options, Repro
from harness.paths.checkpoint.data import region_cuts
from harness.paths.checkpoint.data import REGIONS
from harness.case.spec import Case, Node, Use
from harness.materialize.stages import bounds, requires_grad

Key = tuple[str, "int | None"]
# wrap(fn, args) -> fn's outputs, run through one checkpoint implementation
Wrap = Callable[[Callable[..., Any], list[torch.Tensor]], Any]


@dataclass(frozen=True)
class CheckpointContract(Contract):
    """Fuzzing draws region cuts (``Regions``), dropout and in-place ops,
    frozen parameters and parameter hooks for these paths."""

    draws: tuple[Draw, ...] = (REGIONS,)
    lifetime_schedules: bool = True
    model_parts: bool = True
    # Every checkpoint path accumulates through ``.backward()``: where plain
    # ``.backward()`` already disagrees with the oracle (AccumulateGrad adopting
    # a view as ``.grad``: ledger accumulategrad-steals-views) the difference
    # is AccumulateGrad's, reported by eager.accumulate, not the recomputation's.
    judged_against: str = "eager.accumulate"
    blind: tuple[tuple[str, str], ...] = (
        PLAIN_GRADS,
        (LIFETIME, "not watched yet: graph_freed is off, so a recomputed graph kept alive goes unseen"))


@dataclass(frozen=True)
class Region:
    start: int
    end: int
    recomputed: bool
    inputs: tuple[Key, ...]  # values defined before it that it uses
    outputs: tuple[Key, ...]  # values it defines that are used after it


def regions(case: Case) -> list[Region]:
    """The segments of ``case`` between its cuts; even ones are recomputed."""
    params = {p.name for p in case.params}
    defined = {x.name: -1 for x in case.inputs}
    defined.update({n.name: i for i, n in enumerate(case.nodes)})
    uses: list[tuple[int, Key]] = []
    for i, node in enumerate(case.nodes):
        uses += [(i, (u.ref, u.index)) for u in node.args if u.ref not in params]
    uses += [(len(case.nodes), (u.ref, u.index)) for u in case.outputs if u.ref not in params]
    out = []
    for j, (a, b) in enumerate(bounds(case, region_cuts(case))):
        ins = sorted({k for at, k in uses if a <= at < b and defined[k[0]] < a}, key=_order(defined))
        outs = sorted({k for at, k in uses if at >= b and a <= defined[k[0]] < b}, key=_order(defined))
        out.append(Region(a, b, j % 2 == 0, tuple(ins), tuple(outs)))
    return out


def _order(defined: dict[str, int]) -> Callable[[Key], tuple[int, str, int]]:
    return lambda k: (defined[k[0]], k[0], -1 if k[1] is None else k[1])


class _Forward:
    """The case's forward, region by region, one instance per run."""

    def __init__(self, case: Case, wrap: Wrap | None, sequential: bool = False, ambient: Callable[[], Any] | None = None) -> None:
        self.case = case
        self.wrap = wrap
        self.sequential = sequential
        self.ambient = ambient
        self.regions = regions(case)
        self.hooks = {h.node: h for h in case.hooks}
        self.evaluated: set[str] = set()
        # Forward k's entry: how often each checkpointed region ran its
        # forward in forward k and in backward k (``Step.recomputed``). A
        # region is labelled by its first and last node ("n0..n3").
        self.counts: list[dict[str, int]] = []
        self.forwarding = False
        names = [n.name for n in case.nodes]
        spans = _sequential_spans(len(names), _segments(case)) if sequential else \
            [(r.start, r.end) for r in self.regions if r.recomputed] if wrap is not None else []
        self.labels = {a: names[a] if b - a == 1 else f"{names[a]}..{names[b - 1]}" for a, b in spans}

    def __call__(self, built: Built, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        built.retained = {}
        built.seed_rng()
        self.evaluated = set()
        self.counts.append({f"{label} {phase}": 0 for label in self.labels.values() for phase in ("forward", "backward")})
        env: dict[Key, torch.Tensor] = {(n, None): t for n, t in values.items()}
        self.forwarding = True
        try:
            if self.ambient is not None:
                with self.ambient():
                    return self._forward(built, values, env)
            return self._forward(built, values, env)
        finally:
            self.forwarding = False

    def _ran(self, start: int) -> None:
        """The region starting at node ``start`` runs its forward (in the forward, or recomputed in the backward)."""
        label = self.labels.get(start)
        if label is not None:
            key = f"{label} {'forward' if self.forwarding else 'backward'}"
            self.counts[-1][key] = self.counts[-1].get(key, 0) + 1

    def _forward(self, built: Built, values: dict[str, torch.Tensor], env: dict[Key, torch.Tensor]) -> list[torch.Tensor]:
        if self.sequential:
            env = self._sequential(built, values, env)
        else:
            for r in self.regions:
                nodes = self.case.nodes[r.start:r.end]
                if not r.recomputed or self.wrap is None:
                    self._run(built, nodes, values, env)
                    continue
                fn = self._region_fn(built, nodes, values, r)
                got = self.wrap(fn, [env[k] for k in r.inputs])
                got = got if isinstance(got, (tuple, list)) else (got,)
                if len(got) != len(r.outputs):
                    raise RuntimeError(f"checkpointed region {r.start}..{r.end} returned {len(got)} values, expected {len(r.outputs)}")
                env.update(zip(r.outputs, got))
        return [_get(env, u) for u in self.case.outputs]

    def _region_fn(self, built: Built, nodes: tuple[Node, ...], values: dict[str, torch.Tensor], r: Region) -> Callable[..., tuple[torch.Tensor, ...]]:
        def fn(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            self._ran(r.start)
            local: dict[Key, torch.Tensor] = dict(zip(r.inputs, args))
            self._run(built, nodes, values, local)
            return tuple(local[k] for k in r.outputs)

        return fn

    def _sequential(self, built: Built, values: dict[str, torch.Tensor], env: dict[Key, torch.Tensor]) -> dict[Key, torch.Tensor]:
        from torch.utils.checkpoint import checkpoint_sequential

        nodes = self.case.nodes
        inputs = {x.name for x in self.case.inputs}
        state = {k: t for k, t in env.items() if k[0] in inputs}

        def block(i: int, node: Node) -> Callable[[dict[Key, torch.Tensor]], dict[Key, torch.Tensor]]:
            def run(state: dict[Key, torch.Tensor]) -> dict[Key, torch.Tensor]:
                self._ran(i)  # counts where a checkpointed segment starts (its first block always reruns)
                local = dict(state)
                self._run(built, (node,), values, local)
                return local

            return run

        state = checkpoint_sequential([block(i, n) for i, n in enumerate(nodes)], _segments(self.case), state,
                                      use_reentrant=False)
        env.update(state)
        return env

    def _run(self, built: Built, nodes: tuple[Node, ...], values: dict[str, torch.Tensor], env: dict[Key, torch.Tensor]) -> None:
        """Nodes over ``env`` (keys (name, index)); parameters from ``values``."""
        for node in nodes:
            args = [_get(env, u, values) for u in node.args]
            out = OPS[node.op].run(args, dict(node.attrs))
            if isinstance(out, (list, tuple)):
                env.update({(node.name, i): t for i, t in enumerate(out)})
                continue
            env[(node.name, None)] = out
            first = node.name not in self.evaluated
            self.evaluated.add(node.name)
            if out.requires_grad:
                h = self.hooks.get(node.name)
                if h is not None:
                    out.register_hook(_case_hook(h.kind, h.factor, built.count_hook(node.name)))
                if node.name in self.case.retain_grad:
                    out.retain_grad()
                    if first:  # the user's tensor; a recomputation's copy is not theirs
                        built.retained[node.name] = out


def _segments(case: Case) -> int:
    """How many segments ``checkpoint.sequential.stock`` asks for: one per cut plus two, at most one per node."""
    return max(1, min(len(case.nodes), len(region_cuts(case)) + 2))


def _sequential_spans(n: int, segments: int) -> list[tuple[int, int]]:
    """The blocks ``checkpoint_sequential(functions, segments)`` checkpoints:
    ``len(functions) // segments`` per segment, every segment but the last
    ("the last chunk has to be non-volatile", torch's own comment), which
    takes the rest and runs plainly."""
    size = n // segments
    if size == 0:
        return []
    return [(start, start + size) for start in range(0, size * (segments - 1), size)]


def _case_hook(kind: str, factor: int, count: Callable[[], None]) -> Callable[[torch.Tensor], torch.Tensor | None]:
    def hook(g: torch.Tensor) -> torch.Tensor | None:
        count()
        return g * factor if kind == "scale" else None

    return hook


def _get(env: dict[Key, torch.Tensor], u: Use, values: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    if values is not None and u.ref in values and (u.ref, None) not in env:
        t = values[u.ref]
    else:
        t = env[(u.ref, u.index)]
    return t.mT if u.transpose else t


def _backward(outs, cots, inputs, params) -> Grads:
    live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    if live:
        torch.autograd.backward([o for o, _ in live], [c for _, c in live])
    return {n: t.grad for n, t in inputs.items()}


# --- the implementations -------------------------------------------------------


def _fixed(fn: Callable[..., Any], args: list[torch.Tensor]) -> Any:
    from oracles.checkpoint_fixed import checkpoint

    return checkpoint(fn, *args)


def _stock(**kwargs: Any) -> Wrap:
    def wrap(fn: Callable[..., Any], args: list[torch.Tensor]) -> Any:
        from torch.utils.checkpoint import checkpoint

        with warnings.catch_warnings():
            # Reentrant warns for a region without grad inputs even when it
            # uses nothing trainable; the contract excludes the cases where it matters.
            warnings.filterwarnings("ignore", "None of the inputs have requires_grad", UserWarning)
            return checkpoint(fn, *args, **kwargs)

    return wrap


MATMULS = ("mm", "bmm", "addmm", "matmul")


def _selective(save_matmuls: bool) -> Wrap:
    def wrap(fn: Callable[..., Any], args: list[torch.Tensor]) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

        def policy(ctx: Any, op: Any, *a: Any, **k: Any) -> Any:
            is_mm = getattr(op, "__name__", "").split(".")[0] in MATMULS
            if is_mm == save_matmuls:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return checkpoint(fn, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, policy))

    return wrap


def _dropout_in_region(case: Case) -> bool:
    return any(node_random(n) for r in regions(case) if r.recomputed for n in case.nodes[r.start:r.end])


class CheckpointPath:
    """One checkpoint implementation over the case's regions.

    ``rules`` are the stock contract's exclusions, each a function of the
    case returning why it is outside (or None).
    """
    workarounds = IN_PROCESS

    def __init__(self, name: str, wrap: Wrap | None, *, sequential: bool = False,
                 ambient: Callable[[], Any] | None = None,
                 rules: tuple[Callable[[Case], str | None], ...] = (), source: str = "") -> None:
        self.name = name
        self.wrap = wrap
        self.sequential = sequential
        self.ambient = ambient
        self.rules = rules
        self.source = source
        self.contract = CheckpointContract()

    def availability(self) -> Availability:
        try:
            import torch.utils.checkpoint as tc
        except ImportError as e:  # pragma: no cover - every torch we support has it
            return Availability(False, f"torch.utils.checkpoint: {e}")
        if "selective" in self.name and not hasattr(tc, "create_selective_checkpoint_contexts"):
            return Availability(False, f"torch {torch.__version__} has no create_selective_checkpoint_contexts")
        return Availability(True, self.source)

    def supports(self, case: Case) -> str | None:
        for rule in self.rules:
            why = rule(case)
            if why:
                return why
        return None

    def run(self, case: Case) -> Observation:
        forward = _Forward(case, self.wrap, self.sequential, self.ambient)
        obs = run_schedule(case, self.name, _backward, forward, observe=self.contract.observe())
        for step, counts in zip(obs.steps, forward.counts):
            step.recomputed = counts
        return obs

    def repro(self, case: Case) -> Repro:
        """No standalone script yet: the regions, the wrappers and their
        contexts would have to be written out as source."""
        return Repro(template="none", why=f"{self.name} ({self.source}) has no standalone script yet: "
                     "replay the corpus file with gradfuzz")


# --- contracts ---------------------------------------------------------------------


def _reentrant_no_grad_input(case: Case) -> str | None:
    need = requires_grad(case)
    trainable = {p.name for p in case.params if p.requires_grad}
    for r in regions(case):
        if not r.recomputed:
            continue
        uses = {u.ref for n in case.nodes[r.start:r.end] for u in n.args}
        if uses & trainable and not any(need[k[0]] for k in r.inputs):
            return ("a region uses trainable parameters but none of its inputs requires grad: "
                    "torch documents that reentrant checkpoint then gives the region no gradients "
                    "('At least one input and output must have requires_grad=True for the reentrant variant')")
    return None


def _reentrant_retain_grad(case: Case) -> str | None:
    for r in regions(case):
        if r.recomputed and any(n.name in case.retain_grad for n in case.nodes[r.start:r.end]):
            return ("retain_grad on an intermediate inside a region: reentrant checkpoint runs the forward "
                    "under no_grad (documented), so the user's tensor never gets a grad")
    return None


def _reentrant_hooked_param_shared(case: Case) -> str | None:
    """Reentrant checkpoint runs one inner backward per region, each with its
    own AccumulateGrad run for a closed-over parameter."""
    if not case.schedule.param_hooks:
        return None
    hooked = {p.name for p in case.params if p.requires_grad}
    units: list[set[str]] = []
    outside: set[str] = {u.ref for u in case.outputs}
    for r in regions(case):
        refs = {u.ref for n in case.nodes[r.start:r.end] for u in n.args}
        if r.recomputed:
            units.append(refs)
        else:
            outside |= refs
    units.append(outside)
    for name in sorted(hooked):
        if sum(name in refs for refs in units) > 1:
            return ("a parameter with hooks is used in a region and elsewhere: reentrant checkpoint runs a "
                    "backward per region, so its hooks fire once per region (pytorch/pytorch#81296, closed: "
                    "use use_reentrant=False)")
    return None


def _sac_cache_mutated(case: Case) -> str | None:
    for r in regions(case):
        if r.recomputed and any(node_inplace(n) for n in case.nodes[r.start:r.end]):
            return ("an in-place op inside a region whose input SAC caches: selective checkpoint refuses a "
                    "mutated cache entry (allow_cache_entry_mutation=False, documented)")
    return None


def _no_rng(case: Case) -> str | None:
    if _dropout_in_region(case):
        return ("a random op (dropout) inside a region with preserve_rng_state=False: the documented opt-out of "
                "restoring RNG")
    return None


def paths(_options: Options | None = None) -> list[CheckpointPath]:
    from torch.autograd.graph import save_on_cpu

    return [
        CheckpointPath("checkpoint.fixed", _fixed, source="oracles.checkpoint_fixed"),
        CheckpointPath("checkpoint.reentrant.stock", _stock(use_reentrant=True, preserve_rng_state=True),
                       rules=(_reentrant_no_grad_input, _reentrant_retain_grad, _reentrant_hooked_param_shared),
                       source="torch.utils.checkpoint.checkpoint(use_reentrant=True)"),
        CheckpointPath("checkpoint.nonreentrant.stock", _stock(use_reentrant=False),
                       source="torch.utils.checkpoint.checkpoint(use_reentrant=False)"),
        CheckpointPath("checkpoint.nonreentrant.lax.stock",
                       _stock(use_reentrant=False, preserve_rng_state=False, determinism_check="none", early_stop=False),
                       rules=(_no_rng,),
                       source="checkpoint(use_reentrant=False, preserve_rng_state=False, determinism_check='none', early_stop=False)"),
        CheckpointPath("checkpoint.nonreentrant.offload.stock", _stock(use_reentrant=False),
                       ambient=lambda: save_on_cpu(pin_memory=False),
                       source="checkpoint(use_reentrant=False) under save_on_cpu()"),
        CheckpointPath("checkpoint.selective.stock", _selective(save_matmuls=True),
                       source="create_selective_checkpoint_contexts: save matmuls, recompute the rest"),
        CheckpointPath("checkpoint.selective.inverse.stock", _selective(save_matmuls=False), rules=(_sac_cache_mutated,),
                       source="create_selective_checkpoint_contexts: recompute matmuls, save the rest"),
        CheckpointPath("checkpoint.sequential.stock", None, sequential=True,
                       source="torch.utils.checkpoint.checkpoint_sequential(use_reentrant=False)"),
    ]


# --- the canary's wrapper (harness.paths.checkpoint.canaries) ---------------------------


def forgets_rng(fn: Callable[..., Any], args: list[torch.Tensor]) -> Any:
    """The fixed recomputation without its RNG restore: dropout redraws its mask."""
    from oracles.checkpoint_fixed import checkpoint

    return checkpoint(fn, *args, preserve_rng_state=False)
