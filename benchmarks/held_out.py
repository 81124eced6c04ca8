"""Held-out mutants of the fixed references: a grad off by one part in a
thousand, or one term of a sum left out.

mutmut's operators flip signs and constants: order-one bugs that exact mode
kills at once. The bugs tolerance mode exists for are small: a grad scaled by
1 +- 1e-3 (a rounding done twice, a mean over a window one short), a sum that
misses one of its terms. These mutants are written by hand, one line each,
and written out in the ``--mutants`` form of ``benchmarks/mutation.py``,
which fuzzes them in this tree or an older one (``--tree``):

    python benchmarks/held_out.py --export held.json --file oracles/split_fixed.py
    python benchmarks/mutation.py --mutants held.json --file oracles/split_fixed.py \\
        --paths split.fixed --examples 200 --jobs 1
"""

from __future__ import annotations

import argparse
import json

# file -> (the line as it stands, stripped) -> its variants
VARIANTS = {
    "oracles/split_fixed.py": {
        "t.grad = g.detach().clone(memory_format=torch.contiguous_format)": (
            "t.grad = g.detach().clone(memory_format=torch.contiguous_format) * (1 + 1e-3)",
            "t.grad = g.detach().clone(memory_format=torch.contiguous_format) * (1 - 1e-3)",
        ),
        "t.grad += g": ("t.grad += g * (1 + 1e-3)", "t.grad += 0 * g"),
    },
    "oracles/checkpoint_fixed.py": {
        "return self.recomputed[i]": ("return self.recomputed[i] * (1 + 1e-3)",
                                      "return self.recomputed[i] * (1 - 1e-3)"),
    },
    "oracles/ddp_fixed.py": {
        "grad.div_(self.world)": ("grad.div_(self.world * (1 + 1e-3))", "grad.div_(self.world * (1 - 1e-3))"),
        "dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)": ("grad.mul_(self.world)",),
    },
}


def mutants(file: str) -> list[tuple[str, str]]:
    """(one-line diff, full mutated source) for each variant of ``file``."""
    with open(file) as fh:
        lines = fh.read().split("\n")
    out = []
    for i, line in enumerate(lines):
        for variant in VARIANTS[file].get(line.strip(), ()):
            indent = line[:len(line) - len(line.lstrip())]
            src = "\n".join([*lines[:i], indent + variant, *lines[i + 1:]])
            out.append((f"- {line.strip()} | + {variant}", src))
    missing = set(VARIANTS[file]) - {ln.strip() for ln in lines}
    if missing:
        raise SystemExit(f"{file}: no line reads {sorted(missing)}: update VARIANTS to the file as it stands")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", required=True, choices=sorted(VARIANTS))
    ap.add_argument("--export", required=True, help="the --mutants file for benchmarks/mutation.py")
    args = ap.parse_args()
    listed = mutants(args.file)
    with open(args.export, "w") as fh:
        json.dump({"file": args.file, "mutants": listed}, fh)
    print(f"{len(listed)} held-out mutants of {args.file} -> {args.export}")


if __name__ == "__main__":
    main()
