"""torch's own op database as case vocabulary: the shipped op table and the ``opinfo`` node.

Importing ``torch.testing._internal.common_methods_invocations`` takes
seconds and needs ``expecttest``, so the ops are read once per torch minor
version by ``harness.case.optable_build`` and shipped as a table
(``optables/torch-X.Y.json``): per op, the callable's dotted name and a
few screened samples. A run reads the table only when it draws or checks an
``opinfo`` node. A torch version without a table draws no OpInfo node; a
case naming an op that another torch's table holds and this one's lacks
loads as data and is refused before it runs (``unavailable``), so a corpus
grown on one torch replays on another.

A node carries its op as ``fn`` (the table's key: OpInfo name, variant test
name, ``:method`` or ``:inplace``) and its arguments by value as ``call``
(``harness.case.opcall``), so a case stays plain JSON and replays without
the table's samples.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from harness.case.opcall import MOVE, PARTIAL, opinfo_node, placement_name
from harness.case.vocab import SpecError

TABLES = Path(__file__).parent / "optables"
MAX_TABLE_BYTES = 8 << 20
MAX_CALL_ITEMS = 256  # scalars and tags in one node's call value
MAX_RECIPE_NUMEL = 1024
MAX_VALUE_NUMEL = 64
MAX_PLACES = 4  # input dimensions a DTensor node may shard (placements -1 and 0..3)
# The tensor dtypes a call may name (integer and boolean constants, dtype arguments).
VALUE_DTYPES = ("int64", "int32", "bool", "uint8")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_KEY = re.compile(r"[A-Za-z0-9_.]+(:method|:inplace)?")
INPLACE = ":inplace"  # a key's suffix for the op's in-place variant


def version_key(version: str | None = None) -> str:
    """``2.13`` for ``2.13.0+cpu``: one table per minor version."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return f"{major}.{minor}"


def table_path(version: str | None = None) -> Path:
    return TABLES / f"torch-{version_key(version)}.json"


@lru_cache(maxsize=None)
def table() -> dict[str, dict[str, Any]]:
    """The op table of the installed torch ({} where none is shipped)."""
    path = table_path()
    if not path.is_file():
        return {}
    if path.stat().st_size > MAX_TABLE_BYTES:
        raise SpecError(str(path), f"op table of {path.stat().st_size} bytes; at most {MAX_TABLE_BYTES}")
    raw = json.loads(path.read_text())
    ops = raw.get("ops") if isinstance(raw, dict) else None
    if not isinstance(ops, dict):
        raise SpecError(f"{path}: ops", "expected an object of ops")
    return {key: _entry(key, e, f"{path}: ops.{key}") for key, e in ops.items()}


def _entry(key: str, e: Any, where: str) -> dict[str, Any]:
    if not isinstance(key, str) or not _KEY.fullmatch(key) or not isinstance(e, dict):
        raise SpecError(where, "expected an op key and an object")
    fn = e.get("fn")
    if not isinstance(fn, str) or not _NAME.fullmatch(fn) or not fn.startswith(("torch.", "Tensor.")):
        raise SpecError(f"{where}.fn", f"expected a dotted name under torch or Tensor, got {fn!r}")
    samples = e.get("samples")
    if not isinstance(samples, list) or not samples:
        raise SpecError(f"{where}.samples", "expected a non-empty list")
    places = e.get("places", [[]] * len(samples))
    if not isinstance(places, list) or len(places) != len(samples) or not all(
            isinstance(p, list) and len(p) <= MAX_PLACES + 1 and all(type(d) is int and -1 <= d < MAX_PLACES for d in p)
            for p in places):
        raise SpecError(f"{where}.places", f"expected one list per sample of at most {MAX_PLACES} placements "
                                           f"(-1 Replicate, d Shard(d))")
    random = e.get("random", False)
    if not isinstance(random, bool):
        raise SpecError(f"{where}.random", f"expected true or false, got {str(random)[:40]!r}")
    return {"fn": fn, "samples": tuple(decode_call(s, f"{where}.samples[{i}]") for i, s in enumerate(samples)),
            "places": tuple(tuple(p) for p in places), "random": random}


def keys() -> tuple[str, ...]:
    """The drawable ops that draw no random numbers, in table order (the draw indexes into it)."""
    return tuple(k for k, e in table().items() if not e["random"])


def draws() -> tuple[tuple[str, int], ...]:
    """Every (op key, sample number) the generator may draw as an OpInfo block."""
    return tuple((k, i) for k in keys() for i in range(len(table()[k]["samples"])))


def random_draws() -> tuple[tuple[str, int], ...]:
    """The random ops' (key, sample number): drawn where a case may draw from
    the global RNG (the dropout block), screened from one RNG state."""
    return tuple((k, i) for k, e in table().items() if e["random"] for i in range(len(e["samples"])))


def is_random(key: str) -> bool:
    e = table().get(key)
    return bool(e and e["random"])


def places(key: str, call: tuple) -> tuple[int, ...]:
    """The placements of the op's input (-1 Replicate, d Shard(d)) that ran
    under DTensor in the table's screen; () where none did or the call is
    not the table's."""
    e = table().get(key)
    for c, p in zip(e["samples"], e["places"]) if e is not None else ():
        if c == call:
            return p
    return ()


def mesh_places(key: str, call: tuple) -> tuple[int, ...]:
    """``places``, and where Replicate ran, every Partial (``opcall.PARTIAL``)
    unless the op writes into its input:
    DTensor takes a Partial input for any op, reducing it first where the op's
    strategy does not keep it, so an op that raises or goes wrong on one is
    DTensor's finding, not an op the table could not run."""
    ran = places(key, call)
    return ran + tuple(PARTIAL) if -1 in ran and not key.endswith(INPLACE) else ran


def even_places(key: str, call: tuple, ranks: int) -> tuple[int, ...]:
    """``places``, less the Shard(d) whose dimension ``ranks`` do not divide:
    what the generator draws. DTensor refuses to flatten or view an unevenly
    sharded dimension ("Cannot flatten unevenly sharded tensor ... Please
    redistribute"), which one rank's screen cannot see; a case file may
    still shard unevenly (a path runs it)."""
    shape = call[1][1]
    return tuple(p for p in mesh_places(key, call) if p < 0 or shape[p] % ranks == 0)


def mesh_refusal(case: Any) -> str | None:
    """Why a case whose parameters are DTensors cannot run one of its OpInfo
    nodes on the mesh (None: every node's placement ran in the screen)."""
    for n in case.nodes:
        if n.op != "opinfo":
            continue
        place = n.attr("place")
        place = -1 if place is None else place
        if place in PARTIAL and n.attr("fn").endswith(INPLACE):
            return (f"OpInfo op {n.attr('fn')} writes into its {placement_name(place)} input: DTensor refuses an "
                    f"in-place op that would change a placement (its message says to use the out-of-place op)")
        if place not in mesh_places(n.attr("fn"), n.attr("call")):
            return (f"OpInfo op {n.attr('fn')} with its input {placement_name(place)}: it did not run under DTensor "
                    f"in the op table's screen (no sharding strategy, or it raised); the to_local pattern takes it")
    return None


def ops_in(case: Any) -> set[str]:
    """The OpInfo ops a case applies, by table key: what a run reached."""
    return {n.attr("fn") for n in case.nodes if n.op == "opinfo"}


# An op's own notes (deprecated aliases, beta APIs) are torch speaking about
# the op the table chose, not about the run: they would fill every log.
warnings.filterwarnings("ignore", category=UserWarning, module=r"harness\.case\.opcall")
warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.functional")  # torch.lu and kin

# Callables already resolved, by key: a plain dict, because torch.compile traces
# the node's run, and tracing into the table's loader (a file stat, an
# lru_cache) broke the graph and sent the whole forward back to eager.
_CALLABLES: dict[str, Any] = {}


def callable_of(key: str) -> Any:
    """The torch callable the table names for ``key`` (checked: only table entries resolve)."""
    fn = _CALLABLES.get(key)
    if fn is None:
        fn = _CALLABLES[key] = _lookup(key)
    return fn


def _lookup(key: str) -> Any:
    entry = table().get(key)
    if entry is None:
        raise SpecError("attrs.fn", missing(key))
    return _resolve(entry["fn"])


def missing(key: str) -> str:
    """Why ``key`` names no op here."""
    return f"op {key!r} is not in the op table of torch {version_key()} ({table_path().name}: {len(table())} ops)"


@lru_cache(maxsize=None)
def elsewhere(key: str) -> tuple[str, ...]:
    """The other torch versions whose shipped table holds ``key``: a case
    naming it is valid data, grown on that torch, that runs there and not
    here (``unavailable``); a key in no table is a bad case."""
    return tuple(v for v, names in _shipped_keys().items() if key in names and v != version_key())


@lru_cache(maxsize=None)
def _shipped_keys() -> dict[str, frozenset[str]]:
    out = {}
    for path in sorted(TABLES.glob("torch-*.json")):
        if path.stat().st_size <= MAX_TABLE_BYTES:
            ops = json.loads(path.read_text()).get("ops")
            out[path.stem.removeprefix("torch-")] = frozenset(ops if isinstance(ops, dict) else ())
    return out


def unavailable(nodes: Any) -> str | None:
    """Why a case of these nodes cannot run on the installed torch: an op of
    another torch's table that this one's lacks (None: every op is here)."""
    for n in nodes:
        if n.op == "opinfo" and (key := n.attr("fn")) not in table():
            return f"{missing(key)}; the case runs on torch {', '.join(elsewhere(key))}"
    return None


def _resolve(dotted: str) -> Any:
    head, *rest = dotted.split(".")
    obj: Any = torch if head == "torch" else torch.Tensor
    for part in rest:
        obj = getattr(obj, part)
    return obj


def source_name(key: str) -> str:
    """The callable as source text: ``torch.sin``, ``torch.Tensor.sin_``."""
    fn = table()[key]["fn"]
    return fn if fn.startswith("torch.") else f"torch.{fn}"


# --- the call value ---------------------------------------------------------

def decode_call(v: Any, where: str) -> tuple:
    """A node's ``call`` from JSON (lists) to its tuple form, every part checked."""
    count = [0]
    if not isinstance(v, (list, tuple)) or len(v) != 5 or v[0] != "C":
        raise SpecError(where, "expected [\"C\", input, args, kwargs, bound]")
    _, inp, args, kwargs, bound = v
    inp = _value(inp, f"{where}[1]", count, 0)
    if not (isinstance(inp, tuple) and inp[0] == "T"):
        raise SpecError(f"{where}[1]", "the input must be a float tensor recipe [\"T\", shape, seed, low, high]")
    args = tuple(_value(a, f"{where}[2][{i}]", count, 1) for i, a in enumerate(_list(args, f"{where}[2]", 8)))
    kw = []
    for i, kv in enumerate(_list(kwargs, f"{where}[3]", 8)):
        if not isinstance(kv, (list, tuple)) or len(kv) != 2 or not isinstance(kv[0], str) \
                or not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", kv[0]):
            raise SpecError(f"{where}[3][{i}]", "expected a [name, value] pair with a lower-case identifier")
        kw.append((kv[0], _value(kv[1], f"{where}[3][{i}][1]", count, 1)))
    b = _list(bound, f"{where}[4]", 4)
    if len(b) != 4 or not all(_finite(x) and 0 <= x <= 1e12 for x in b) or not isinstance(b[3], int):
        raise SpecError(f"{where}[4]", "expected [vmax, jrow, jcol, n_out]: finite non-negative numbers, n_out an integer")
    return ("C", inp, args, tuple(kw), (float(b[0]), float(b[1]), float(b[2]), int(b[3])))


def _list(v: Any, where: str, most: int) -> list:
    if not isinstance(v, (list, tuple)) or len(v) > most:
        raise SpecError(where, f"expected a list of at most {most} items, got {str(v)[:40]!r}")
    return list(v)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _value(v: Any, where: str, count: list[int], depth: int) -> Any:
    count[0] += 1
    if count[0] > MAX_CALL_ITEMS or depth > 4:
        raise SpecError(where, f"call value too large (at most {MAX_CALL_ITEMS} items, nested 4 deep)")
    if v is None or isinstance(v, bool) or (isinstance(v, int) and abs(v) <= 2**31):
        return v
    if isinstance(v, float):
        if not math.isfinite(v) or abs(v) > 1e6:
            raise SpecError(where, f"expected a finite number of at most 1e6 in size, got {v!r}")
        return v
    if isinstance(v, str):
        if not re.fullmatch(r"[A-Za-z0-9_]{0,32}", v):
            raise SpecError(where, "expected a string of at most 32 letters, digits or underscores")
        return v
    if not isinstance(v, (list, tuple)) or not v or v[0] not in ("T", "I", "U", "D"):
        raise SpecError(where, f"expected a number, a string, null or a tagged list (T, I, U, D), got {str(v)[:40]!r}")
    return _TAGGED[v[0]](list(v), where, count, depth)


def _shape(v: Any, where: str, most: int) -> tuple[int, ...]:
    s = _list(v, where, 6)
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= most for d in s) or math.prod(s) > most:
        raise SpecError(where, f"expected a shape of at most 6 dims and {most} elements")
    return tuple(s)


def _recipe(v: list, where: str, count: list[int], depth: int) -> tuple:
    if len(v) != 5 or not (isinstance(v[2], int) and 0 <= v[2] < 2**31) or not (_finite(v[3]) and _finite(v[4])) \
            or not v[3] <= v[4] or max(abs(v[3]), abs(v[4])) > 1e4:
        raise SpecError(where, "expected [\"T\", shape, seed, low, high] with low <= high, both within 1e4")
    return ("T", _shape(v[1], f"{where}[1]", MAX_RECIPE_NUMEL), v[2], float(v[3]), float(v[4]))


def _ints(v: list, where: str, count: list[int], depth: int) -> tuple:
    if len(v) != 4 or v[1] not in VALUE_DTYPES:
        raise SpecError(where, f"expected [\"I\", dtype, shape, values], dtype one of {VALUE_DTYPES}")
    shape = _shape(v[2], f"{where}[2]", MAX_VALUE_NUMEL)
    values = _list(v[3], f"{where}[3]", MAX_VALUE_NUMEL)
    if len(values) != math.prod(shape) or not all(isinstance(x, int) and abs(x) <= 2**31 for x in values):
        raise SpecError(f"{where}[3]", f"expected {math.prod(shape)} integers for shape {list(shape)}")
    count[0] += len(values)
    return ("I", v[1], shape, tuple(values))


def _tuple(v: list, where: str, count: list[int], depth: int) -> tuple:
    if len(v) != 2:
        raise SpecError(where, "expected [\"U\", items]")
    return ("U", tuple(_value(x, f"{where}[1][{i}]", count, depth + 1) for i, x in enumerate(_list(v[1], f"{where}[1]", 16))))


def _dtype(v: list, where: str, count: list[int], depth: int) -> tuple:
    if len(v) != 2 or v[1] not in VALUE_DTYPES + ("float32", "float64"):
        raise SpecError(where, "expected [\"D\", dtype name]")
    return ("D", v[1])


_TAGGED = {"T": _recipe, "I": _ints, "U": _tuple, "D": _dtype}


# --- the op: shape, run, bound, source ---------------------------------------

def check_fn(key: Any, where: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key) or len(key) > 96:
        raise SpecError(where, f"expected an op table key, got {str(key)[:40]!r}")
    return key


def run(t: list[torch.Tensor], a: dict, const: Any = None) -> torch.Tensor:
    return opinfo_node(t[0], callable_of(a["fn"]), a["call"], const, place=a.get("place"))


def bound(t: list[torch.Tensor], a: dict) -> torch.Tensor:
    """``h + V + K (S - S.detach())``, S the sum of ``h``: the value V and the
    grad K dominate the fold's, term by term (``harness.case.opcall``)."""
    h = t[0]
    _, inp, _, _, (vmax, jrow, jcol, n_out) = a["call"]
    m = h.numel()
    n_in = max(math.prod(inp[1]), 1)
    per_out = math.ceil(n_out / m)
    k = MOVE * min(per_out * jrow, math.ceil(n_in / m) * jcol)
    s = h.sum()
    return h + vmax * per_out + k * (s - s.detach())


def source(s: list[str], a: dict) -> str:
    place = f", place={a['place']}" if a.get("place") is not None else ""
    return f"opinfo_node({s[0]}, {source_name(a['fn'])}, {a['call']!r}{place})"
