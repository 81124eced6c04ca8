"""How often the model parts (issue 14) turn up in the cases fuzz draws.

Draws cases the way ``gradfuzz fuzz`` does for one selection of paths: the
same targets (``harness.engine.session.plan``: paths grouped by contract
flags), the same strategy (``Target.strategy()``, its ``supports`` filter
included), the same Hypothesis seeds (``seed * 100_003 + shard * SHARD_STRIDE
+ round``) and rounds of 200 examples, default mode (both). The one
difference from a fuzz run: no case is checked, so no round ends early on a
finding and the stream is the one a run that finds nothing would draw.

Cases do not record the blocks they were built from, so blocks are counted
two ways:

* drawn: the block builders (``harness.generate.BUILDERS``) are wrapped
  while drawing; a block counts when its builder added a node (a builder
  that declines, e.g. ``norm`` in exact mode or a block over the exact
  budget, leaves the case unchanged and is counted apart as "declined");
* inferred: from the finished case's ops alone (``_infer``), as a reader of
  a saved case would have to; the table prints how often the two agree.

    PYTHONPATH=. python benchmarks/draw_stats.py --paths eager,split --cases 1000 --seed 0
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, seed as hseed, settings

import harness.generate as gen
from harness.case.spec import Case
from harness.engine.session import plan
from harness.engine.target import SHARD_STRIDE
from harness.paths import Options, close_paths, resolve

NEW_OPS = ("gelu", "silu", "softmax", "log_softmax", "layer_norm", "rms_norm", "embedding", "embedding+padding_idx",
           "cross_entropy", "sdpa", "sdpa+causal", "add_", "expand", "index_select", "gather", "scatter_add",
           "index_add")
BLOCKS = ("embed", "head", "norm", "attention", "mlp", "index", "expand", "dropout", "inplace")
CHUNK = 200  # examples per Hypothesis round, as TargetRun's default chunk


def _op_names(case: Case) -> list[str]:
    names = []
    for n in case.nodes:
        attrs = dict(n.attrs)
        names.append(n.op)
        if n.op == "embedding" and "padding_idx" in attrs:
            names.append("embedding+padding_idx")
        if n.op == "sdpa" and attrs.get("causal"):
            names.append("sdpa+causal")
    return names


def _infer(case: Case) -> Counter:
    """Model blocks from op patterns: what each builder leaves behind.

    embed: an embedding node; head: a matmul with an embedding-shaped
    (D + 1, D) parameter used transposed; attention: an sdpa node (its
    pre-norm is not a norm block); norm: a layer_norm/rms_norm that does not
    feed an attention (its result is not a matmul operand of the q/k/v
    projections that meet in an sdpa); mlp: gelu/silu; index: index_select,
    gather, scatter_add, index_add; expand: an expand node; dropout: a
    dropout node; inplace: relu_, mul_ or add_.
    """
    ops = Counter(n.op for n in case.nodes)
    shapes = {p.name: p.shape for p in case.params}
    dim = case.inputs[0].shape[-1]
    out = Counter()
    out["embed"] = ops["embedding"]
    out["head"] = sum(1 for n in case.nodes if n.op == "matmul" and len(n.args) > 1 and n.args[1].transpose
                      and shapes.get(n.args[1].ref) == (dim + 1, dim))
    out["attention"] = ops["sdpa"]
    out["norm"] = ops["layer_norm"] + ops["rms_norm"] - ops["sdpa"]
    out["mlp"] = ops["gelu"] + ops["silu"]
    out["index"] = ops["index_select"] + ops["gather"] + ops["scatter_add"] + ops["index_add"]
    out["expand"] = ops["expand"]
    out["dropout"] = ops["dropout"]
    out["inplace"] = ops["relu_"] + ops["mul_"] + ops["add_"]
    return out


class _Recorder:
    """Wraps the block builders; ``take()`` hands back the blocks of the last
    case built (Hypothesis runs the test body right after the draw, so the
    last ``interpret`` before the body built the case it receives)."""

    def __init__(self) -> None:
        self.current: list[tuple[str, bool]] = []
        self._saved = dict(gen.BUILDERS)
        self._interpret = gen.interpret

    def __enter__(self) -> "_Recorder":
        def wrap(name: str, build: Any) -> Any:
            def recorded(b: Any, h: str, block: str, slot: int, variant: int) -> str:
                before = (len(b.nodes), len(b.hooks), len(b.retain))
                out = build(b, h, block, slot, variant)
                self.current.append((block, (len(b.nodes), len(b.hooks), len(b.retain)) != before))
                return out
            return recorded

        for name, build in self._saved.items():
            gen.BUILDERS[name] = wrap(name, build)

        def interpret(*a: Any, **k: Any) -> Case:
            self.current = []
            return self._interpret(*a, **k)

        gen.interpret = interpret
        return self

    def __exit__(self, *exc: Any) -> None:
        gen.BUILDERS.update(self._saved)
        gen.interpret = self._interpret

    def take(self) -> list[tuple[str, bool]]:
        got, self.current = self.current, []
        return got


def draw(paths: str, n: int, seed: int) -> list[tuple[Case, list[tuple[str, bool]]]]:
    ps = resolve(paths, Options())
    try:
        targets = plan(ps, exact=None, seed=seed)
        if len(targets) != 1:
            raise SystemExit(f"{paths}: {len(targets)} targets (case distributions); pick paths that share one")
        target = targets[0]
        out: list[tuple[Case, list[tuple[str, bool]]]] = []
        with _Recorder() as rec:
            rnd = 0
            while len(out) < n:
                budget = min(CHUNK, n - len(out))
                before = len(out)

                @settings(max_examples=budget, database=None, deadline=None, verbosity=Verbosity.quiet,
                          suppress_health_check=list(HealthCheck), phases=(Phase.generate,))
                @hseed(target.seed * 100_003 + target.shard * SHARD_STRIDE + rnd)
                @given(target.strategy())
                def one_round(case: Case) -> None:
                    out.append((case, rec.take()))

                one_round()
                rnd += 1
                if len(out) == before:
                    break
        return out[:n]
    finally:
        close_paths(ps)


def table(paths: str, drawn: list[tuple[Case, list[tuple[str, bool]]]], seed: int) -> str:
    n = len(drawn)
    exact = sum(c.exact for c, _ in drawn)
    op_cases, op_total = Counter(), Counter()
    blk_cases, blk_total, blk_declined, blk_inferred_cases = Counter(), Counter(), Counter(), Counter()
    agree = Counter()
    any_model = 0
    for case, blocks in drawn:
        names = _op_names(case)
        op_total.update(names)
        op_cases.update(set(names))
        took = Counter(b for b, effective in blocks if effective)
        blk_total.update(took)
        blk_cases.update(set(took))
        blk_declined.update(b for b, effective in blocks if not effective)
        inferred = _infer(case)
        blk_inferred_cases.update({b for b in BLOCKS if inferred[b] > 0})
        for b in BLOCKS:
            agree[b] += inferred[b] == took[b]
        any_model += any(took[b] for b in BLOCKS)
    lines = [f"### `{paths}`: {n} cases, seed {seed}, mode both ({exact} exact, {n - exact} tolerance)", "",
             f"Cases with at least one model block: {any_model} of {n} ({100 * any_model / n:.1f}%).", "",
             "| op | cases containing | % of cases | occurrences |", "|---|---:|---:|---:|"]
    for op in NEW_OPS:
        lines.append(f"| {op} | {op_cases[op]} | {100 * op_cases[op] / n:.1f} | {op_total[op]} |")
    lines += ["", "| block | cases containing (drawn) | % of cases | occurrences | declined draws | "
              "cases (inferred from ops) | per-case counts agree |", "|---|---:|---:|---:|---:|---:|---:|"]
    for b in BLOCKS:
        lines.append(f"| {b} | {blk_cases[b]} | {100 * blk_cases[b] / n:.1f} | {blk_total[b]} | {blk_declined[b]} "
                     f"| {blk_inferred_cases[b]} | {agree[b]}/{n} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", action="append", help="a path selection sharing one case distribution "
                    "(repeatable; default eager,split)")
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the tables (markdown) here")
    args = ap.parse_args()
    parts = []
    for paths in args.paths or ["eager,split"]:
        parts.append(table(paths, draw(paths, args.cases, args.seed), args.seed))
        print(parts[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Model parts in drawn cases (benchmarks/draw_stats.py)\n\n" + "\n".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
