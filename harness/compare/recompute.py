"""What a recomputation must leave as eager leaves it: how often each
checkpointed region runs, and the RNG state after the call.

A checkpointed region runs its forward once in the forward and is re-invoked
in the backward "as needed for gradient computation" (``torch.utils.checkpoint``):
at most once per backward, and exactly once when that backward reads a
tensor the region saved (the recomputation exists to produce it). Whether it
does is a fact of eager autograd, not of the machinery: ``saved_and_read``
runs the case's forward once more in float64, node by node under saved-tensor
hooks that tag each saved tensor with its node, and notes which tags the
backward unpacks. Reentrant checkpoint recomputes a region whose output gets
a grad even when it saved nothing (it "always recomputes function in its
entirety"); that second run is allowed, a third is not.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.case.spec import Case
from harness.materialize.tensors import Built
from harness.observation import Divergence, Observation, keys


def saved_and_read(case: Case, k: int = 0) -> frozenset[str] | None:
    """The nodes some of whose saved tensors eager's backward ``k`` reads
    (None: eager could not be run this way; no verdict then)."""
    built = Built(case)
    read: set[str] = set()

    def tagger(name: str) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(lambda t: (name, t), lambda box: read.add(box[0]) or box[1])

    try:
        params = {n: t.requires_grad_(p.requires_grad) for (n, t), p in zip(built.params().items(), case.params)}
        inputs = {x.name: t.requires_grad_(x.requires_grad) for x, t in zip(case.inputs, built.inputs(k).values())}
        env: dict[str, Any] = {**params, **inputs}
        built.seed_rng()
        for i, node in enumerate(case.nodes):
            with tagger(node.name):
                built.run_span(env, i, i + 1, install=False)
        live = [(o, c) for o, c in zip(built.outputs_of(env), built.cotangents(k)) if o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [c for _, c in live])
    except Exception:  # a verdict needs eager's answer; without one, say nothing
        return None
    return frozenset(read)


def region_nodes(case: Case, label: str) -> list[str]:
    """``"n2..n5"`` (or ``"n3"``): the case's nodes from the first to the last, in order."""
    names = [n.name for n in case.nodes]
    first, _, last = label.partition("..")
    if first not in names or (last or first) not in names:
        return []
    return names[names.index(first):names.index(last or first) + 1]


def recomputations(case: Case, obs: Observation) -> list[Divergence]:
    """Each checkpointed region runs once in the forward and once more in a
    backward that reads what it saved; never twice in either, never skipped."""
    found: list[Divergence] = []
    done: set[str] = set()
    read: frozenset[str] | None = None
    asked = False
    for step in obs.steps:
        if step.recomputed is None:
            continue
        k = step.k
        for key, count in sorted(step.recomputed.items()):
            label, _, phase = key.rpartition(" ")
            if phase == "forward":
                if count == 1 or key in done:
                    continue
                done.add(key)
                found.append(_divergence(
                    obs.path, label, k, count,
                    f"checkpointed region {label} ran its forward {count} times in forward {k}; it runs once there "
                    f"(the recomputation belongs to the backward)", "region ran N times in the forward"))
                continue
            if count > 1 and key not in done:
                done.add(key)
                found.append(_divergence(
                    obs.path, label, k, count,
                    f"checkpointed region {label} was recomputed {count} times during backward {k}; a checkpoint "
                    f"re-invokes a region at most once per backward (torch.utils.checkpoint: recomputed by "
                    f"re-invoking the function in the backward pass as needed)", "region recomputed N times"))
            elif count == 0 and f"{label} never" not in done:
                if not asked:
                    read, asked = saved_and_read(case, k), True
                nodes = region_nodes(case, label)
                needed = sorted(set(nodes) & read) if read is not None else []
                if needed:
                    done.add(f"{label} never")
                    found.append(_divergence(
                        obs.path, label, k, 0,
                        f"checkpointed region {label} was not recomputed during backward {k}, yet that backward "
                        f"reads tensors its node{'s' if len(needed) > 1 else ''} {', '.join(needed)} saved in "
                        f"eager: the path kept the region's activations (checkpointing saved no memory) instead "
                        f"of re-invoking the region", "region not recomputed"))
    return found


def _divergence(path: str, label: str, k: int, count: int, detail: str, what: str) -> Divergence:
    return Divergence(path, "recompute", label, k, None, None, float(count), detail, **keys(path, "recompute", what))


def rng_states(oracle: Observation, obs: Observation) -> list[Divergence]:
    """The CPU RNG state after each backward equals eager's (every forward
    starts from the same seeded state): checkpoint's ``preserve_rng_state``
    restores the state for the recomputation and hands the caller's stream
    back where the forward left it. Once per run, at the first backward."""
    for o_step, p_step in zip(oracle.steps, obs.steps):
        if o_step.rng is None and p_step.rng is not None:
            # Both record it exactly when the case draws random numbers: an
            # oracle without it is broken, and comparing nothing would pass.
            raise RuntimeError(f"the oracle recorded no RNG state after backward {p_step.k} where {obs.path} did: "
                               "a harness bug (oracles/eager.py), not a finding")
        if o_step.rng is None or p_step.rng is None or o_step.rng == p_step.rng:
            continue
        return [Divergence(
            obs.path, "rng", None, p_step.k, None, None, None,
            f"the CPU RNG state after backward {p_step.k} differs from eager's (both forwards start from the same "
            f"seed): the path drew random numbers eager does not, or left the generator where a recomputation "
            f"put it instead of where the forward did (torch.get_rng_state() digest {p_step.rng}, eager "
            f"{o_step.rng})", **keys(obs.path, "rng", "rng state after backward differs"))]
    return []
