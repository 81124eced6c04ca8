"""Build the op table of the installed torch from its OpInfo database.

``python -m harness.case.optable_build`` writes ``optables/torch-X.Y.json``.
It needs ``expecttest`` (``pip install 'gradfuzz[opinfo]'``) and takes a few
minutes; a run never needs it, since the table is shipped.

Every (op, variant, sample) is screened before it is kept, because a false
finding is the worst thing the harness can report. A sample is kept only if
the node it makes (``harness.case.opcall``) is deterministic, finite, has a
grad that is not zero, agrees with central finite differences in float64
(no kink or jump near the sample), and computes in float32 within a
sixteenth of the tolerance the harness allows (``compare.values``: 128
float32 steps per unit of term size), measured against the node's own
magnitude bound. The Jacobian's row and column sums and the largest output,
times four, are stored with the sample: the bound network reads them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from typing import Any, Iterator

import torch

from harness.case import opinfo
from harness.case.opcall import MOVE, opinfo_node

MAX_SAMPLES = 2  # kept per op variant
TRIED = 10  # samples tried per op variant
SAFETY = 4.0  # on the measured Jacobian sums and output size
SCREEN_SLACK = 8  # float32 steps per unit of bound allowed in the screen (the harness allows 128)
LARGEST = 1e6  # on an output or a Jacobian sum: past it a tolerance would judge little
SHAPES = ((3, 4), (2, 3), (1, 2))  # the h shapes the screen runs (cases draw B in 1..3, D in 2..4)
VARIES = 4.0  # the Jacobian's largest row sum may change this much between the screen's points


def _points() -> list[torch.Tensor]:
    """Where the screen measures: random h of each shape, and h saturating the
    move at both ends (x = s - MOVE and s + MOVE), where a steep op is steepest."""
    random = [torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) * 3
              for i, shape in enumerate(SHAPES)]
    return random + [torch.full(SHAPES[0], 10.0, dtype=torch.float64), torch.full(SHAPES[0], -10.0, dtype=torch.float64)]


# Ops not drawn, by why. A grad that follows an order (the largest, the
# median, a pool's pick) goes elsewhere when float32 rounding reorders a
# near-tie; a value that jumps (frac, remainder) jumps at another input
# when float32 rounds across the jump. Either would be a false finding on
# a path that is right.
ORDER = ("sort", "argsort", "msort", "topk", "kthvalue", "median", "nanmedian", "mode", "max", "min", "amax",
         "amin", "aminmax", "cummax", "cummin", "quantile", "nanquantile", "masked.amax", "masked.amin",
         "masked.argmax", "masked.argmin", "index_reduce.amax", "index_reduce.amin", "scatter_reduce.amax",
         "scatter_reduce.amin", "nn.functional.max_pool", "nn.functional.adaptive_max_pool",
         "nn.functional.fractional_max_pool", "nn.functional.max_unpool", "max_pool", "nn.functional.multi_margin_loss")
JUMPS = ("frac", "remainder", "fmod", "floor_divide", "round", "nn.functional.threshold", "nn.functional.hardshrink",
         "heaviside", "nn.functional.rrelu")


def excluded(op: Any) -> str:
    """Why an op is never drawn ("" if it may be)."""
    full = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    for why, names in (("its grad follows an order float32 can flip", ORDER),
                       ("its value jumps where float32 can round across", JUMPS)):
        if any(full == n or full.startswith(n + ".") or (n.endswith("pool") and full.startswith(n)) for n in names):
            return why
    return ""


def op_db() -> list:
    try:
        from torch.testing._internal.common_methods_invocations import op_db as db
    except ImportError as e:
        raise SystemExit(f"building the op table imports torch's OpInfo database, which needs expecttest: {e}; "
                         "pip install 'gradfuzz[opinfo]'") from None
    return db


def variants(op: Any) -> Iterator[tuple[str, str, bool]]:
    """(table key, dotted callable, whether the callable is OpInfo's own) for
    each variant whose callable resolves by name. OpInfo wraps some ops in a
    lambda (dropout, rrelu: to fix an argument); the function of the op's
    name is then tried too, and kept only for random ops, which nothing else
    can draw."""
    base = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    dotted = f"torch.{op.name}"
    if _resolves(dotted, op.op):
        yield base, dotted, True
    elif callable(_named(dotted)):
        yield base, dotted, False
    for kind, fn in (("method", op.method_variant), ("inplace", op.inplace_variant)):
        name = getattr(fn, "__name__", None)
        if name and _resolves(f"Tensor.{name}", fn):
            yield f"{base}:{kind}", f"Tensor.{name}", True


def _named(dotted: str) -> Any:
    try:
        return opinfo._resolve(dotted)
    except AttributeError:
        return None


def _resolves(dotted: str, fn: Any) -> bool:
    try:
        return fn is not None and opinfo._resolve(dotted) is fn
    except AttributeError:
        return False


def encode(v: Any, seed: int) -> Any:
    """A sample argument as call data, or raise ValueError when it has no plain form."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError("a non-finite number")
        return v
    if isinstance(v, torch.Tensor):
        if v.layout != torch.strided or v.is_complex():
            raise ValueError(f"a {v.layout} or complex tensor")
        if v.is_floating_point():
            if v.numel() == 0 or v.numel() > opinfo.MAX_RECIPE_NUMEL or not bool(v.isfinite().all()):
                raise ValueError("an empty, large or non-finite float tensor")
            low, high = float(v.min()), float(v.max())
            if high - low > 4 * MOVE:  # the case moves values by up to MOVE: stay inside what OpInfo drew
                low, high = low + MOVE, high - MOVE
            return ["T", list(v.shape), seed, low, high]
        name = str(v.dtype).removeprefix("torch.")
        if name not in opinfo.VALUE_DTYPES or v.numel() > opinfo.MAX_VALUE_NUMEL:
            raise ValueError(f"a {name} tensor of {v.numel()} elements")
        return ["I", name, list(v.shape), [int(x) for x in v.reshape(-1).tolist()]]
    if isinstance(v, (list, tuple, torch.Size)):
        return ["U", [encode(x, seed + 1 + i) for i, x in enumerate(v)]]
    raise ValueError(f"a {type(v).__name__}")


def call_of(sample: Any, seed: int) -> list | None:
    """The sample as a call (bound left at zero), or None where it has no plain form."""
    if not isinstance(sample.input, torch.Tensor) or not sample.input.is_floating_point() \
            or sample.input.layout != torch.strided:
        return None
    try:
        inp = encode(sample.input, seed)
        args = [encode(a, seed + 100 + i) for i, a in enumerate(sample.args)]
        kwargs = [[k, encode(a, seed + 200 + i)] for i, (k, a) in enumerate(sorted(sample.kwargs.items()))]
    except (ValueError, RuntimeError):
        return None
    return ["C", inp, args, kwargs, [0.0, 0.0, 0.0, 0]]


def screen(fn: Any, call: tuple) -> tuple[float, float, float, int] | str:
    """The sample's bound (vmax, jrow, jcol, n_out), or why it is not kept."""
    measured = []
    for h in _points():
        got = _measure(fn, call, h)
        if isinstance(got, str):
            return got
        measured.append(got)
    vmax, jrow, jcol = (max(m[i] for m in measured) for i in range(3))
    n_out = measured[-1][3]
    if jrow > VARIES * min(m[1] for m in measured):
        return f"its grad changes by more than {VARIES:g}x over the move (a bound from a few points would not hold)"
    if jrow == 0.0:
        return "its grad is zero"
    if max(vmax, jrow, jcol) > LARGEST:
        return f"its values or grads exceed {LARGEST:g}"
    bound = (SAFETY * vmax, SAFETY * jrow, SAFETY * jcol, n_out)
    full = ("C",) + tuple(call[1:4]) + (bound,)
    for h in [p.flip(-1) for p in _points()]:  # other points than the measured ones, the ends included
        why = _float32_agrees(fn, full, h)
        if why:
            return why
    return bound


def _measure(fn: Any, call: tuple, h: torch.Tensor) -> tuple[float, float, float, int] | str:
    torch.manual_seed(1)
    a = opinfo_node(h, fn, call).detach()
    if not bool(a.isfinite().all()):
        return "its output is not finite"
    torch.manual_seed(2)
    if not torch.equal(a, opinfo_node(h, fn, call).detach()):
        return "it is random"
    x, resized = _moved_input(fn, call, h)
    if resized:
        return "it resizes its input in place (eager's legacy resize, which vmap and others do not follow)"
    kept: dict = {}  # constants cached as a run caches them: an op that writes to one carries state
    keep = lambda key, make: kept.setdefault(key, make())  # noqa: E731
    first = opinfo_node(h, fn, call, keep).detach()
    before = {k: v.clone() for k, v in kept.items()}
    if not torch.equal(first, opinfo_node(h, fn, call, keep).detach()) \
            or any(not torch.equal(before[k], kept[k]) for k in before):
        return "it writes to its arguments (state carried from one call to the next)"
    f = lambda xx: opinfo_node(None, fn, call, x=xx)  # noqa: E731
    try:
        jac = torch.autograd.functional.jacobian(f, x.requires_grad_())
    except Exception as e:  # an op whose backward raises is not kept
        return f"its backward raises {type(e).__name__}"
    out = f(x.detach())
    jac = jac.reshape(out.numel(), -1)
    if out.numel() == 0 or not bool(jac.isfinite().all()):
        return "no float output or a non-finite Jacobian"
    v = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    eps = 1e-6
    fd = (f((x + eps * v).detach()) - f((x - eps * v).detach())) / (2 * eps)
    if not torch.allclose(fd, jac @ v.reshape(-1), rtol=1e-5, atol=1e-7 * (1 + float(jac.abs().max()))):
        return "its grad disagrees with finite differences (a kink or jump near the sample)"
    return (float(out.abs().max()), float(jac.abs().sum(1).max()), float(jac.abs().sum(0).max()), out.numel())


def _moved_input(fn: Any, call: tuple, h: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The input the node hands the op for ``h`` (taken from the node itself,
    so the screen measures where a run evaluates), and whether the op
    resized it in place."""
    seen: list[tuple[torch.Tensor, bool]] = []

    def spy(x: torch.Tensor, *a: Any, **k: Any) -> Any:
        before = x.detach().clone()
        out = fn(x, *a, **k)
        seen.append((before, tuple(x.shape) != tuple(before.shape)))
        return out

    opinfo_node(h, spy, call)
    return seen[0]


def _float32_agrees(fn: Any, call: tuple, h: torch.Tensor) -> str:
    """"" when the node's float32 value and grad are within SCREEN_SLACK steps
    per unit of its magnitude bound of the float64 ones, else why not."""
    g = torch.randn(h.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    res = {}
    for dt in (torch.float64, torch.float32):
        hh = h.to(dt).requires_grad_()
        y = opinfo_node(hh, fn, call)
        (gh,) = torch.autograd.grad(y, hh, g.to(dt))
        res[dt] = (y.detach().double(), gh.double())
    hb = h.abs().requires_grad_()
    yb = opinfo.bound([hb], {"call": call})
    (gb,) = torch.autograd.grad(yb, hb, g.abs())
    step = SCREEN_SLACK * 2.0**-23
    if not bool(((res[torch.float32][0] - res[torch.float64][0]).abs() <= step * yb.detach() + 1e-30).all()):
        return "its float32 value is off by more than the screen allows"
    if not bool(((res[torch.float32][1] - res[torch.float64][1]).abs() <= step * gb + 1e-30).all()):
        return "its float32 grad is off by more than the screen allows"
    return ""


def mesh_places(fn: Any, call: tuple) -> list[int]:
    """The placements of the op's input (-1 Replicate, d Shard(d)) under which
    the node runs on DTensors on a one-rank mesh with the plain node's value
    and grad (float64): the ones a DTensor case may draw. A missing sharding
    strategy or a refusal shows on one rank already; a placement that runs
    here and fails on more ranks is a finding of the DTensor family."""
    h = _points()[0]
    g = torch.randn(h.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    hp = h.clone().requires_grad_()
    want = opinfo_node(hp, fn, call)
    (want_g,) = torch.autograd.grad(want, hp, g)
    ndim = len(call[1][1])
    ok = []
    for place in [-1] + list(range(min(ndim, opinfo.MAX_PLACES))):
        try:
            got, got_g = _on_one_rank(fn, call, h, g, place)
        except Exception:  # no strategy, a mixed-operand refusal, a redistribution DTensor refuses
            continue
        if torch.allclose(got, want.detach(), rtol=1e-9, atol=1e-12) and torch.allclose(got_g, want_g, rtol=1e-9, atol=1e-12):
            ok.append(place)
    return ok


def _on_one_rank(fn: Any, call: tuple, h: torch.Tensor, g: torch.Tensor, place: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    hp = h.clone().requires_grad_()
    hd = DTensor.from_local(hp, mesh, [Replicate()], run_check=False)
    out = opinfo_node(hd, fn, call, place=place).to_local()
    (gh,) = torch.autograd.grad(out, hp, g)
    return out.detach(), gh


def add_places(table: dict[str, Any], log: Any = sys.stderr) -> None:
    """Each kept sample's DTensor placements (``mesh_places``), in place."""
    for key, e in table["ops"].items():
        fn = opinfo._resolve(e["fn"])
        e["places"] = [mesh_places(fn, opinfo.decode_call(c, key)) for c in e["samples"]]
    runs = sum(bool(p) for e in table["ops"].values() for p in e["places"])
    print(f"{runs} of {sum(len(e['places']) for e in table['ops'].values())} samples run under DTensor", file=log)


def build(limit: int | None = None, log: Any = sys.stderr, only_random: dict | None = None) -> dict[str, Any]:
    """The table; given ``only_random`` (a table's ops), only the random op
    variants it lacks."""
    ops: dict[str, Any] = {}
    refused: dict[str, int] = {}
    for op in op_db()[:limit]:
        if not op.supports_autograd or torch.float64 not in op.supported_dtypes("cpu"):
            continue
        if excluded(op):
            refused[excluded(op)] = refused.get(excluded(op), 0) + 1
            continue
        for key, dotted, own in variants(op):
            if only_random is not None and (random_key(key) in only_random or key in only_random):
                continue  # a variant the table has: its samples were deterministic
            plain, random = _samples(op, key, dotted, refused)
            if plain and own and only_random is None:
                ops[key] = {"fn": dotted, "samples": plain}
            if random:
                ops[random_key(key)] = {"fn": dotted, "samples": random, "random": True}
        print(f"{op.name}: {len(ops)} ops kept so far", file=log, flush=True)
    table = {"torch": torch.__version__, "ops": ops, "refused": dict(sorted(refused.items()))}
    add_places(table, log)
    return table


RANDOM_SEED = 1234  # the screen's state of the global RNG before each call of a random op


def seeded(fn: Any) -> Any:
    """``fn`` from one state of the global RNG on every call: a random op
    screened as the function of its input that one forward of a case runs
    (every forward of a case starts from the same state, on every path)."""
    def call(*a: Any, **k: Any) -> Any:
        torch.manual_seed(RANDOM_SEED)
        return fn(*a, **k)
    return call


def _screened(fn: Any, call: tuple) -> tuple[tuple | str, bool]:
    """The screen's verdict, and whether the sample is a random op's (kept
    only when it passes the whole screen from one RNG state)."""
    try:
        got = screen(fn, call)
        if got == "it is random":
            return screen(seeded(fn), call), True
    except Exception as e:
        got = f"it raises {type(e).__name__}"
    return got, False


def _samples(op: Any, key: str, dotted: str, refused: dict[str, int]) -> tuple[list, list]:
    """The op variant's kept samples, at most MAX_SAMPLES of each kind:
    deterministic ones, and a random op's screened from one RNG state."""
    fn = opinfo._resolve(dotted)
    torch.manual_seed(0)
    kept: tuple[list, list] = ([], [])
    try:
        samples = list(op.sample_inputs("cpu", torch.float64, requires_grad=True))[:TRIED]
    except Exception:
        refused["its samples raise"] = refused.get("its samples raise", 0) + 1
        return kept
    for j, sample in enumerate(samples):
        if all(len(k) == MAX_SAMPLES for k in kept):
            break
        call = call_of(sample, zlib.crc32(f"{key}/{j}".encode()) & 0x7FFFFFFF)
        got, is_random = _verdict(fn, call, key)
        if isinstance(got, str):
            refused[got] = refused.get(got, 0) + 1
            continue
        call[4] = list(got)
        if len(kept[is_random]) < MAX_SAMPLES:
            kept[is_random].append(call)
    return kept


def _verdict(fn: Any, call: list | None, key: str) -> tuple[tuple | str, bool]:
    """``_screened`` of a sample's call, or why it has none to screen."""
    if call is None:
        return "an argument with no plain form", False
    try:
        return _screened(fn, opinfo.decode_call(call, key))
    except Exception as e:  # the call form refuses a value
        return f"it raises {type(e).__name__}", False


def random_key(key: str) -> str:
    """The table key of an op variant's random samples: ``.random`` before any ``:method``/``:inplace``."""
    base, colon, kind = key.partition(":")
    return f"{base}.random{colon}{kind}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=None, help="read only the first N OpInfos (a quick try)")
    p.add_argument("--out", default=str(opinfo.table_path()))
    p.add_argument("--random-only", action="store_true",
                   help="add to the table at --out the random op variants it lacks (screened from one RNG state)")
    p.add_argument("--places-only", action="store_true",
                   help="keep the table at --out as it is and screen its samples' DTensor placements again")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    if a.places_only or a.random_only:
        with open(a.out) as f:
            table = json.load(f)
        if a.random_only:
            table["ops"].update(build(a.limit, only_random=table["ops"])["ops"])
        add_places(table)
    else:
        table = build(a.limit)
    with open(a.out, "w") as f:
        json.dump(table, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"{len(table['ops'])} ops in {a.out} ({time.monotonic() - t0:.0f} s); refused: {table['refused']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
