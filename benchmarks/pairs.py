"""Pairwise coverage of drawn cases (issue 33 item 2): which pairs of case
features the first N examples of each fuzz target contain, and how many
drawn cases each path cannot take.

What is drawn: exactly what ``gradfuzz fuzz`` / the gate draws, with no
path run. The targets are ``harness.engine.session.plan`` over every
registered path (so eager and split share one target, as in the gate); the
strategy is ``Target.strategy()`` (its ``supports`` filter included), the
Hypothesis seed of round r is ``seed * 100_003 + shard * SHARD_STRIDE + r``
and a round is 200 examples (``TargetRun``'s chunk). The only difference from
a fuzz run: no case is checked, so no round ends early on a finding, and the
stream is the one a run that finds nothing draws. The filter's predicate is
wrapped so that every raw draw (also those the filter throws away) asks every
path of the target ``supports``: the out-of-contract numbers.

Features, in four classes (``features``):

* ``knob``: the families' own case data (``Case.family``: every field of
  every namespace the target draws, an absent namespace read as its
  defaults), parameter placements (DTensor, compile), and the gap cases
  (frozen / unused parameters, inputs and outputs without grad, a scalar
  loss, microbatch size 1);
* ``op``: the op classes present (``OP_CLASS``);
* ``schedule``: mode, microbatches, steps, grad_init, a transposed use, a
  tied parameter, lifetime events, held outputs;
* ``training``: optimizer, its implementation, clip norm, zero_grad variant,
  tensor hooks, parameter hooks, ``retain_grad``.

Pairs are of features of two different classes. A pair is *feasible* for a
target when some case of its reference pool contains it, where the pool is
the measured draw plus ``--reference`` more seeds' draws of the same size
(and, with ``--baseline``, every pair that file found feasible: before and
after a generator change are then measured against one denominator). A pair
that no drawn case contains is counted infeasible only by a written rule
(``RULES``: the generator or a contract excludes it, with the reason); the
rules are checked: a rule that a drawn case breaks is reported. Pairs of the
classes' observed values that neither the pool shows nor a rule excludes
are reported as ``unseen`` (so the reader sees how far "feasible" is from
the product).

    PYTHONPATH=. python benchmarks/pairs.py                       # every target, 500 examples, seed 0
    PYTHONPATH=. python benchmarks/pairs.py --targets split --examples 500 --json before.json
    PYTHONPATH=. python benchmarks/pairs.py --baseline before.json --json after.json
    PYTHONPATH=. python benchmarks/pairs.py --compare before.json after.json   # a table, one denominator
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, fields, is_dataclass
from itertools import combinations
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, Verbosity, given, seed as hseed, settings

from harness.case.spec import Case
from harness.engine.session import plan
from harness.engine.target import SHARD_STRIDE, Target
from harness.paths import Options, close_paths, families, resolve

CLASSES = ("knob", "op", "schedule", "training")
CHUNK = 200  # examples per Hypothesis round, as TargetRun's default chunk

OP_CLASS = {
    "matmul": "matmul", "layout_matmul": "custom_fn", "pair": "custom_fn", "passthrough": "custom_fn",
    "mul": "pointwise", "add": "pointwise", "relu": "activation", "tanh": "activation",
    "gelu": "gated_activation", "silu": "gated_activation", "reshape": "view", "chunk": "view", "cat": "view",
    "transpose": "view", "expand": "expand", "stack": "reduce", "sum": "reduce", "mean": "reduce",
    "layer_norm": "norm", "rms_norm": "norm", "sdpa": "attention", "softmax": "softmax", "log_softmax": "softmax",
    "cross_entropy": "loss", "embedding": "embedding", "index_select": "index", "gather": "index",
    "scatter_add": "index", "index_add": "index", "dropout": "random", "relu_": "inplace", "mul_": "inplace",
    "add_": "inplace",
}
# Op classes whose builders decline in exact mode (tolerance-only ops).
TOLERANCE_ONLY = frozenset({"norm", "attention", "gated_activation", "softmax", "loss"})


def _value(v: Any) -> str:
    if isinstance(v, bool) or isinstance(v, str) or isinstance(v, float):
        return str(v)
    if isinstance(v, int):  # buckets, cut positions: the magnitude is what matters
        return str(v) if v <= 4 else ("<=64" if v <= 64 else "big")
    return type(v).__name__


def _knob_features(name: str, value: Any) -> set[str]:
    out: set[str] = set()
    for f in fields(value):
        v = getattr(value, f.name)
        key = f"{name}.{f.name}"
        if isinstance(v, tuple):
            if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                out.add(f"{key}#={len(v)}")  # cut lists: how many cuts
            else:
                out.update(f"{key}:{x}" for x in v)
                if not v:
                    out.add(f"{key}=()")
        else:
            out.add(f"{key}={_value(v)}")
    return out


def features(case: Case, namespaces: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """The case's features by class. ``namespaces``: the family case data the
    target draws; one absent from the case counts as its defaults."""
    from harness.registry import namespace

    knob: set[str] = set()
    for name in namespaces:
        value = case.data(name)
        if value is None:
            codec = namespace(name)
            value = codec.cls() if codec is not None else None
        if value is not None and is_dataclass(value):
            knob |= _knob_features(name, value)
    knob.update(f"placement:{p.placement or 'to_local'}" for p in case.params if p.placement)
    if any(not p.requires_grad for p in case.params):
        knob.add("frozen_param")
    used = {u.ref for n in case.nodes for u in n.args} | {u.ref for u in case.outputs}
    if any(p.name not in used for p in case.params):
        knob.add("unused_param")
    if any(i.requires_grad and i.name not in used for i in case.inputs):
        knob.add("dead_input")
    if case.loss:
        knob.add("scalar_loss")
    if case.inputs and case.inputs[0].shape[0] == 1:
        knob.add("batch=1")

    op = {OP_CLASS.get(n.op, f"other:{n.op}") for n in case.nodes}

    s = case.schedule
    params = {p.name for p in case.params}
    uses = Counter(u.ref for n in case.nodes for u in n.args if u.ref in params)
    sched = {f"mode={'exact' if case.exact else 'tolerance'}", f"microbatches={s.microbatches}", f"steps={s.steps}",
             f"grad_init={s.grad_init}"}
    if any(u.transpose and u.ref in params for n in case.nodes for u in n.args):
        sched.add("transposed")
    if any(k > 1 for k in uses.values()):
        sched.add("tied")
    if s.events:
        sched.add("events")
    if s.retain_outputs:
        sched.add("retain_outputs")

    train = {f"zero_grad={s.zero_grad}"}
    if s.optimizer:
        train.add(f"optimizer={s.optimizer}")
        train.add(f"optimizer_impl={s.optimizer_impl or 'default'}")
    if s.clip:
        train.add(f"clip={s.clip}")
    train.update(f"hook={h.kind}" for h in case.hooks)
    train.update(f"param_hook={h}" for h in s.param_hooks)
    if case.retain_grad:
        train.add("retain_grad")
    return {"knob": knob, "op": op, "schedule": sched, "training": train}


Pair = tuple[str, str]  # "class:feature" strings, sorted


def pairs_of(feats: dict[str, set[str]]) -> set[Pair]:
    """Every cross-class pair of one case's features."""
    tagged = [(c, f"{c}:{x}") for c in CLASSES for x in feats[c]]
    return {tuple(sorted((a, b))) for (ca, a), (cb, b) in combinations(tagged, 2) if ca != cb}  # type: ignore[misc]


# --- rules: pairs the generator or a contract never draws ----------------------


@dataclass(frozen=True)
class Rule:
    why: str
    excludes: Callable[[str, str], bool]  # (feature a, feature b), each "class:value"

    def __call__(self, pair: Pair) -> bool:
        a, b = pair
        return self.excludes(a, b) or self.excludes(b, a)


RULES = (
    Rule("exact mode: the norm, attention, gated-MLP and head-softmax builders decline (tolerance-only ops)",
         lambda a, b: a == "schedule:mode=exact" and b.startswith("op:") and b[3:] in TOLERANCE_ONLY),
    Rule("sign-based optimizers (rprop) are drawn in exact mode only (harness.generate.draws.training_steps)",
         lambda a, b: a == "schedule:mode=tolerance" and b == "training:optimizer=rprop"),
    Rule("DTensor placements are drawn only for cases without ops that DTensor-placed parameters refuse "
         "(Op.plain_tensors: dropout, embedding, cross-entropy, index ops; and attention): the dtensor contract "
         "refuses them, and the compile paths, which draw placements too, ignore them",
         lambda a, b: a.startswith("knob:placement:") and b in ("op:random", "op:embedding", "op:loss", "op:index",
                                                                "op:attention")),
)


def excluded(pair: Pair) -> str | None:
    for r in RULES:
        if r(pair):
            return r.why
    return None


# --- drawing -------------------------------------------------------------------


@dataclass
class Drawn:
    cases: list[Case] = field(default_factory=list)
    raw: int = 0  # draws the filter saw (accepted and thrown away)
    raw_out: Counter = field(default_factory=Counter)  # path -> raw draws outside its contract
    run_out: Counter = field(default_factory=Counter)  # path -> accepted cases outside its contract
    reasons: dict[str, Counter] = field(default_factory=dict)  # path -> reason (first 90 chars) -> raw draws
    seconds: float = 0.0


def draw(target: Target, n: int) -> Drawn:
    """The first ``n`` cases the engine draws for ``target`` (no path run)."""
    got = Drawn(reasons={p.name: Counter() for p in target.paths})
    strategy = target.strategy()
    raw = strategy.wrapped_strategy.filtered_strategy if hasattr(strategy, "wrapped_strategy") else strategy
    paths = target.paths

    def keep(case: Case) -> bool:
        # The engine's predicate (any path takes it), asking every path so each one's rate is known.
        got.raw += 1
        ok = False
        for p in paths:
            why = p.supports(case)
            if why is None:
                ok = True
            else:
                got.raw_out[p.name] += 1
                got.reasons[p.name][why[:90]] += 1
        return ok

    filtered = raw.filter(keep)
    t0 = time.process_time()
    rnd = 0
    while len(got.cases) < n:
        budget = min(CHUNK, n - len(got.cases))
        before = len(got.cases)

        @settings(max_examples=budget, database=None, deadline=None, verbosity=Verbosity.quiet,
                  suppress_health_check=list(HealthCheck), phases=(Phase.generate, Phase.target, Phase.shrink))
        @hseed(target.seed * 100_003 + target.shard * SHARD_STRIDE + rnd)
        @given(filtered)
        def one_round(case: Case) -> None:
            got.cases.append(case)

        one_round()
        rnd += 1
        if len(got.cases) == before:
            break
    del got.cases[n:]
    for case in got.cases:
        for p in paths:
            if p.supports(case) is not None:
                got.run_out[p.name] += 1
    got.seconds = time.process_time() - t0
    return got


def family_of(path_name: str, prefixes: dict[str, str]) -> str:
    head = path_name.split(".")[0]
    return prefixes.get(head, head)


def measure(target: Target, n: int, reference: int, known: set[Pair] | None = None) -> dict[str, Any]:
    """One target: the coverage of its first ``n`` examples and its paths' contract waste."""
    main = draw(target, n)
    pool = [main.cases]
    seed0 = target.seed
    for k in range(1, reference + 1):
        target.seed = seed0 + k
        pool.append(draw(target, n).cases)
    target.seed = seed0
    namespaces = tuple(sorted({name for cs in pool for c in cs for name, _ in c.family}))

    def covered(cases: list[Case]) -> tuple[set[Pair], dict[str, set[str]]]:
        seen: set[Pair] = set()
        domain: dict[str, set[str]] = {c: set() for c in CLASSES}
        for case in cases:
            feats = features(case, namespaces)
            for c in CLASSES:
                domain[c] |= feats[c]
            seen |= pairs_of(feats)
        return seen, domain

    got, _ = covered(main.cases)
    witnessed: set[Pair] = set()
    domain: dict[str, set[str]] = {c: set() for c in CLASSES}
    for cs in pool:
        s, d = covered(cs)
        witnessed |= s
        for c in CLASSES:
            domain[c] |= d[c]
    broken = sorted(p for p in witnessed if excluded(p))
    feasible = {p for p in witnessed | (known or set()) if not excluded(p)}
    product = {tuple(sorted((f"{a}:{x}", f"{b}:{y}"))) for a, b in combinations(CLASSES, 2)
               for x in domain[a] for y in domain[b]}
    rule_out = {p for p in product if excluded(p)}
    unseen = product - feasible - rule_out
    by_class: dict[str, list[int]] = {}
    for p in feasible:
        key = "x".join(sorted(x.split(":")[0] for x in p))
        row = by_class.setdefault(key, [0, 0])
        row[1] += 1
        row[0] += p in got
    missing = sorted(feasible - got)
    return {
        "target": target.name,
        "paths": [p.name for p in target.paths],
        "examples": len(main.cases),
        "covered": len(got & feasible),
        "feasible": len(feasible),
        "percent": round(100 * len(got & feasible) / max(1, len(feasible)), 1),
        "by_classes": {k: v for k, v in sorted(by_class.items())},
        "domain": {c: sorted(domain[c]) for c in CLASSES},
        "rule_excluded": len(rule_out),
        "unseen": len(unseen),
        "rules_broken": [list(p) for p in broken],
        "missing": [list(p) for p in missing],
        "feasible_pairs": sorted(list(p) for p in feasible),
        "raw_draws": main.raw,
        "out_of_contract": {
            p.name: {"raw": main.raw_out[p.name], "raw_percent": round(100 * main.raw_out[p.name] / max(1, main.raw), 1),
                     "skipped": main.run_out[p.name],
                     "skipped_percent": round(100 * main.run_out[p.name] / max(1, len(main.cases)), 1),
                     "reasons": dict(main.reasons[p.name].most_common(4))}
            for p in target.paths
        },
        "cpu_seconds": round(main.seconds, 2),
    }


def compare(before: dict[str, Any], after: dict[str, Any]) -> str:
    """A markdown table of two ``--json`` runs, each target's coverage taken
    against the union of both runs' feasible pairs (one denominator)."""
    rows = ["| family | target | pairs covered at N, before | after | out of contract before -> after "
            "(raw draws % / examples skipped %) |", "|---|---|---:|---:|---|"]
    old = {r["target"]: r for r in before["targets"]}
    for a in after["targets"]:
        b = old.get(a["target"])
        fa = {tuple(p) for p in a["feasible_pairs"]}
        got_a = fa - {tuple(p) for p in a["missing"]}
        if b is None:  # a target the earlier run did not have (a path added since)
            rows.append(f"| {a['family']} | {a['target']} | (new target) | {len(got_a)}/{len(fa)} | |")
            continue
        fb = {tuple(p) for p in b["feasible_pairs"]}
        got_b = fb - {tuple(p) for p in b["missing"]}
        # Both against this file's rules: a pair a rule excludes now counts for neither run.
        union = {p for p in fa | fb if not excluded(p)}  # type: ignore[arg-type]
        got_a, got_b = got_a & union, got_b & union
        waste = "; ".join(
            f"{p} {b['out_of_contract'][p]['raw_percent']}/{b['out_of_contract'][p]['skipped_percent']} -> "
            f"{v['raw_percent']}/{v['skipped_percent']}"
            for p, v in a["out_of_contract"].items() if p in b["out_of_contract"]
            and (v["raw_percent"], v["skipped_percent"], b["out_of_contract"][p]["raw_percent"],
                 b["out_of_contract"][p]["skipped_percent"]) != (0, 0, 0, 0))
        rows.append(f"| {a['family']} | {a['target'][:48]} | {len(got_b)}/{len(union)} "
                    f"({100 * len(got_b) / len(union):.1f}%) | {len(got_a)}/{len(union)} "
                    f"({100 * len(got_a) / len(union):.1f}%) | {waste} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", type=int, default=3, help="more seeds' draws (same size) that witness feasibility")
    ap.add_argument("--targets", help="comma-separated substrings: measure only targets whose name has one")
    ap.add_argument("--baseline", help="a earlier --json: its feasible pairs join this run's (one denominator)")
    ap.add_argument("--json", help="write every number (and the pairs) here")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="print a table of two --json runs against one denominator, and exit")
    args = ap.parse_args()
    if args.compare:
        with open(args.compare[0]) as f, open(args.compare[1]) as g:
            print(compare(json.load(f), json.load(g)))
        return 0
    known: dict[str, set[Pair]] = {}
    if args.baseline:
        with open(args.baseline) as f:
            for row in json.load(f)["targets"]:
                known[row["target"]] = {tuple(p) for p in row["feasible_pairs"]}  # type: ignore[misc]
    prefixes = {pre: fam.name for fam in families() for pre in fam.prefixes}
    ps = resolve(None, Options())
    rows = []
    try:
        targets = plan(ps, exact=None, seed=args.seed)
        if args.targets:
            want = args.targets.split(",")
            targets = [t for t in targets if any(w in t.name for w in want)]
        for t in targets:
            row = measure(t, args.examples, args.reference, known.get(t.name))
            row["family"] = "+".join(sorted({family_of(p, prefixes) for p in row["paths"]}))
            rows.append(row)
            waste = ", ".join(f"{p} {v['raw_percent']}%/{v['skipped_percent']}%" for p, v in row["out_of_contract"].items())
            print(f"{row['family']:<12} {row['covered']:>5}/{row['feasible']:<5} {row['percent']:5.1f}%  "
                  f"unseen {row['unseen']:<5} broken {len(row['rules_broken'])}  [{t.name[:60]}]  "
                  f"{row['cpu_seconds']}s", flush=True)
            print(f"    out of contract (raw draws / skipped examples): {waste}", flush=True)
    finally:
        close_paths(ps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"examples": args.examples, "seed": args.seed, "reference": args.reference, "targets": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
