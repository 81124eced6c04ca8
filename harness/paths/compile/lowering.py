"""How Inductor handles each op of the op table: decomposed, lowered, or run as a fallback kernel.

Inductor meets an aten op in one of three ways: a decomposition rewrites it
into other aten ops before lowering (``torch._inductor.decomposition``), a
lowering turns it into Inductor's own IR (``torch._inductor.lowering.lowerings``),
or a fallback runs torch's own kernel from the generated code (explicit
``fallbacks``, or an op with neither). Bugs sit on each side: a decomposition
whose backward differs from the op's derivative formula, a lowering that
loses a stride or an alias, a fallback whose mutation or view is mishandled.
The compile family draws from each class (``strategy``), so a run meets
every kind of handling, not whichever the op table lists most.

``python -m harness.paths.compile.lowering`` writes ``lowerings/torch-X.Y.json``
for the installed torch: per op table key, the class of its forward (the aten
ops its samples dispatch, an in-place op read as its functional form, which
is what functionalization hands Inductor) and of its backward. Importing
Inductor's lowering table takes seconds, so the classes are shipped as data
like the op table itself; a torch without a file draws from the whole table
as one class.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from harness.case import opinfo
from harness.case.vocab import SpecError

TABLES = Path(__file__).parent / "lowerings"
CLASSES = ("decomposed", "lowered", "fallback")
MAX_TABLE_BYTES = 1 << 20


def table_path(version: str | None = None) -> Path:
    return TABLES / f"torch-{opinfo.version_key(version)}.json"


@lru_cache(maxsize=None)
def entries() -> dict[str, tuple[str, str]]:
    """Op table key -> (the class of its forward under Inductor, why it breaks
    dynamo's graph or ""); {} where no file is shipped."""
    path = table_path()
    if not path.is_file():
        return {}
    if path.stat().st_size > MAX_TABLE_BYTES:
        raise SpecError(str(path), f"lowering table of {path.stat().st_size} bytes; at most {MAX_TABLE_BYTES}")
    raw = json.loads(path.read_text())
    ops = raw.get("ops") if isinstance(raw, dict) else None
    if not isinstance(ops, dict):
        raise SpecError(f"{path}: ops", "expected an object of ops")
    out = {}
    for key, e in ops.items():
        c = e.get("fwd") if isinstance(e, dict) else None
        if c not in CLASSES:
            raise SpecError(f"{path}: ops.{key}.fwd", f"expected one of {CLASSES}, got {str(c)[:40]!r}")
        why = e.get("breaks", "")
        if not isinstance(why, str):
            raise SpecError(f"{path}: ops.{key}.breaks", "expected a string")
        out[key] = (c, why)
    return out


def classes() -> dict[str, str]:
    """Op table key -> the class of its forward under Inductor."""
    return {k: c for k, (c, _) in entries().items()}


@lru_cache(maxsize=None)
def pools() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The drawable ops (``opinfo.keys()``) by class, each in table order,
    less those that break dynamo's graph: one such op sends a structure's
    whole forward back to eager (a break inside the forward's loop skips the
    frame, and each node's call is then compiled apart until the recompile
    limit runs it eagerly), so the structure would test eager autograd.
    One pool ``("any", ...)`` where the installed torch has no lowering
    table. Ops the lowering table does not know (a newer op table) go with
    the lowered ones."""
    keys = opinfo.keys()
    known = entries()
    if not known:
        return (("any", keys),) if keys else ()
    keys = tuple(k for k in keys if not known.get(k, ("", ""))[1])
    by = {c: tuple(k for k in keys if known.get(k, ("lowered", ""))[0] == c) for c in CLASSES}
    return tuple((c, by[c]) for c in CLASSES if by[c])


# --- building the file ------------------------------------------------------

def _functional(op: Any) -> Any:
    """``aten.abs_.default`` -> ``aten.abs.default``: functionalization hands
    Inductor the out-of-place form of an in-place op."""
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return op
    packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(packet, op._overloadname, op) if packet is not None else op


# Bookkeeping every op's trace has (detaching, lifting a constant, aliasing,
# a grad output's ones): not how Inductor handles the op itself.
BOOKKEEPING = ("detach", "lift_fresh", "lift_fresh_copy", "alias", "ones_like", "zeros_like", "empty_like")


def _decomps() -> dict[Any, Any]:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def _classifier() -> Any:
    from torch._inductor import lowering

    def of(op: Any, decomposes: bool) -> str:
        if decomposes:
            return "decomposed"
        op = _functional(op)
        if op in lowering.fallbacks:
            return "fallback"
        if op in lowering.lowerings or getattr(op, "overloadpacket", None) in lowering.lowerings:
            return "lowered"
        return "fallback"  # no lowering: Inductor falls back to the kernel implicitly

    return of


def _summary(kinds: list[str]) -> str:
    """One class for a set of aten ops: decomposed if any is, else fallback if any is, else lowered
    (an op that dispatches nothing, a view of its input, lowers trivially)."""
    for c in ("decomposed", "fallback"):
        if c in kinds:
            return c
    return "lowered"


def dispatched(key: str, call: tuple, decomps: dict[Any, Any]) -> tuple[list[Any], list[Any]]:
    """The aten ops the op's forward and its backward dispatch for one sample
    (the node's own gather, move and fold left out), each as ``(op, decomposes)``:
    whether Inductor's decomposition of it applies to these arguments (some
    decline with NotImplemented, an ``add`` of real tensors say)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from harness.case.opcall import opinfo_node, opinfo_recipe

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[Any] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func._schema.name.split("::")[-1] not in BOOKKEEPING:
                d = decomps.get(func) or decomps.get(_functional(func))
                try:
                    applies = d is not None and d(*args, **kwargs) is not NotImplemented
                except Exception:
                    applies = d is not None
                self.ops.append((func, applies))
            return func(*args, **kwargs)

    fn = opinfo.callable_of(key)
    got: dict[str, Any] = {}

    def recorded(*a: Any, **k: Any) -> Any:
        with Record() as r:
            got["out"] = fn(*a, **k)
        got["fwd"] = r.ops
        return got["out"]

    _, inp, *_ = call
    x = opinfo_recipe(inp[1], inp[2], inp[3], inp[4], "cpu", torch.float32).requires_grad_()
    opinfo_node(None, recorded, call, x=x)
    out = got["out"]
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(t, torch.Tensor) and t.requires_grad]
    with Record() as r:
        if outs:
            torch.autograd.grad(outs, x, [torch.ones_like(t) for t in outs], allow_unused=True)
    return list(dict.fromkeys(got["fwd"])), list(dict.fromkeys(r.ops))


def _data_dependent(ops: list[Any]) -> str:
    """Why dynamo breaks the graph at one of ``ops`` ("" if it need not): an
    output whose shape or value depends on the data (``masked_select``, ``equal``)."""
    for op, _ in ops:
        tags = set(getattr(op, "tags", ()))
        if torch.Tag.dynamic_output_shape in tags:
            return f"{op}: output shape depends on the data"
        if torch.Tag.data_dependent_output in tags:
            return f"{op}: output depends on the data"
    return ""


def breaks_graph(key: str, call: tuple) -> str:
    """Why dynamo cannot trace the node whole (``fullgraph=True``, the
    ``eager`` backend: dynamo alone), "" if it can; its constants made
    outside the trace, as a case's are."""
    from harness.case.opcall import opinfo_node

    fn = opinfo.callable_of(key)
    made: dict[Any, Any] = {}

    def const(k: Any, make: Any) -> Any:
        if k not in made:
            made[k] = make()
        return made[k]

    h = torch.linspace(-2.0, 2.0, 12).reshape(3, 4)
    opinfo_node(h, fn, call, const)  # the constants, made eagerly
    torch._dynamo.reset()
    try:
        out = torch.compile(lambda t: opinfo_node(t, fn, call, const), backend="eager", fullgraph=True)(
            h.clone().requires_grad_())
        out.sum().backward()
    except Exception as ex:
        return f"{type(ex).__name__}: {str(ex).strip().splitlines()[0][:120]}"
    return ""


def build(log: Any = sys.stderr, fullgraph: bool = True) -> dict[str, Any]:
    of = _classifier()
    decomps = _decomps()
    ops: dict[str, Any] = {}
    for key, e in opinfo.table().items():
        fwd: list[Any] = []
        bwd: list[Any] = []
        breaks = ""
        for call in e["samples"]:
            try:
                f, b = dispatched(key, call, decomps)
            except Exception as ex:  # the table screened every sample: a raise here is this torch's
                print(f"{key}: {type(ex).__name__}: {str(ex)[:80]}", file=log)
                continue
            fwd += [o for o in f if o not in fwd]
            bwd += [o for o in b if o not in bwd]
            breaks = breaks or _data_dependent(f + b) or (breaks_graph(key, call) if fullgraph else "")
        fk, bk = [of(*o) for o in fwd], [of(*o) for o in bwd]
        ops[key] = {"fwd": _summary(fk), "bwd": _summary(bk), "breaks": breaks,
                    "aten": sorted({f"{o}:{k}" for (o, _), k in zip(fwd, fk)})}
        if breaks:
            print(f"{key}: breaks the graph: {breaks}", file=log, flush=True)
    counts = {c: sum(1 for v in ops.values() if v["fwd"] == c) for c in CLASSES}
    counts["breaks"] = sum(1 for v in ops.values() if v["breaks"])
    return {"torch": torch.__version__, "counts": counts, "ops": ops}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(table_path()))
    p.add_argument("--no-fullgraph", action="store_true",
                   help="skip dynamo's whole-graph trace of each sample (minutes): data-dependent ops only")
    a = p.parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)  # dynamo's notes on each sample it traces
    made = build(fullgraph=not a.no_fullgraph)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(made, indent=1, sort_keys=True) + "\n")
    print(f"{a.out}: {len(made['ops'])} ops; forward {made['counts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
