"""A new bug next to a known one: found through ``split.twin``, not through stock.

The installed torch's ``torch/distributed/pipelining/_backward.py`` is copied
with one deliberate second bug: at the second accumulation it "releases" the
first microbatch's grad buffer with ``zero_()``, unless that buffer is still
the live ``.grad``. Where the first ``dw`` is autograd's own tensor that is
harmless; where it is the caller's grad output passed through, it writes
into the caller's tensor. That is exactly where the known bug
``split-adopts-aliased-grad`` (``weight.grad = dw``) fires, and there the
buffer *is* the live ``.grad`` (the known bug adopted it), so on stock the
second bug never shows: the known bug hides it. Fix the known bug (the twin
clones what stock adopted) and the second bug writes into the caller's
grad output: what a torch release fixing the first bug would expose.

For each seed, from a cold start, the copy is fuzzed as ``split.stock`` and
as ``split.twin`` (stock with the known bug worked around). A finding counts
as the second bug only when it is causal: the same case on the unmodified
implementation (stock, or the unmodified twin) does not show that
divergence's shape. Prints examples to detection per seed, before (stock
alone) and after (the twin):

    python benchmarks/second_bug.py --seeds 0,1,2,3,4 --examples 1000
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import sys
import tempfile

MODULE = "gf_second_bug_backward"
KNOWN = "                        weight.grad = dw\n                    else:\n                        weight.grad += dw\n"
SECOND = ("                        weight.grad = dw\n"
          "                        weight._first_dw = dw\n"
          "                    else:\n                        weight.grad += dw\n"
          "                        first = weight.__dict__.pop('_first_dw', None)\n"
          "                        if first is not None and first is not weight.grad:\n"
          "                            first.zero_()  # the second bug: 'release' the first microbatch's buffer\n")


def write_fork(directory: str) -> str:
    spec = importlib.util.find_spec("torch.distributed.pipelining._backward")
    assert spec is not None and spec.origin is not None
    with open(spec.origin) as f:
        source = f.read()
    if KNOWN not in source:
        raise SystemExit(f"{spec.origin} no longer has the adoption code this demo patches "
                         "(split-adopts-aliased-grad fixed?): the demonstration needs the known bug present")
    with open(os.path.join(directory, f"{MODULE}.py"), "w") as f:
        # The copy lives outside the package: its relative imports become absolute.
        f.write(re.sub(r"^(\s*)from \.", r"\1from torch.distributed.pipelining.", source.replace(KNOWN, SECOND, 1),
                       flags=re.MULTILINE))
    return MODULE


def detect(twin: bool, seed: int, examples: int) -> tuple[int | None, int, str]:
    """(examples at the first causal finding of the second bug or None, findings seen, its detail)."""
    from harness.engine.check import check
    from harness.engine.result import Result
    from harness.engine.target import Target, TargetRun
    from harness.paths.split import STOCK, SplitPath

    name = "split.twin" if twin else "split.stock"
    fork = SplitPath(name, MODULE, stock_contract=True, twin=twin)
    base = SplitPath(name, STOCK, stock_contract=True, twin=twin)
    findings = TargetRun(Target([fork], seed=seed), Result(), examples=examples).run()
    for f in findings:
        base_shapes = {d.shape for d in check(f.case, base)}
        new = [d for d in f.divergences if d.shape not in base_shapes]
        if new:
            return f.examples, len(findings), new[0].detail
    return None, len(findings), ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--examples", type=int, default=1000, help="budget per seed and side (cold start each)")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="gf-second-bug-")
    sys.path.insert(0, d)
    write_fork(d)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: dict[str, list[int | None]] = {"before (split.stock)": [], "after (split.twin)": []}
    for seed in seeds:
        for label, twin in (("before (split.stock)", False), ("after (split.twin)", True)):
            at, n, detail = detect(twin, seed, args.examples)
            rows[label].append(at)
            print(f"seed {seed} {label}: " + (f"second bug after {at} examples ({n} finding(s)): {detail[:140]}"
                                               if at is not None else f"not found in {args.examples} examples "
                                               f"({n} finding(s), each explained by unmodified stock)"), flush=True)
    for label, hits in rows.items():
        got = [h for h in hits if h is not None]
        print(f"{label}: found on {len(got)}/{len(hits)} seeds"
              + (f", examples to detection median {statistics.median(got):g}, max {max(got)}" if got else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
