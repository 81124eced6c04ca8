"""What every rank of the pipeline paths runs.

A rank gets a case as its JSON spec, the schedule's name and which stage
class to use (``stock``: torch's ``PipelineStage``; otherwise
``MODULE:ATTR`` of a subclass, such as ``oracles.pipeline_fixed:FixedPipelineStage``).
It builds the stages this rank holds, the schedule over them, and runs the
case's steps through ``schedule.step()`` as a user would:

- the first stage's inputs are the case's per-microbatch inputs stacked on
  dim 0 (the schedule splits them back into exactly those microbatches);
- the loss is ``sum((output * grad_output).sum())`` over the case's
  outputs, so its backward is the case's vector-Jacobian product; the
  target carries the microbatch number and that microbatch's grad outputs
  (flattened), since a loss function sees one microbatch at a time;
- ``scale_grads=False``: the loss is a sum, as the schedules document.

It reports raw facts, by step: every parameter copy's ``.grad`` after each
``step()``, the grad of each stacked input (per microbatch, by rows), what
the loss function was handed, tensors the user holds that changed, and the
exception if one was raised. Judging is the parent's job
(``harness.paths.pipeline.paths``).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import os
import threading
import time
from typing import Any

import torch

from harness.materialize import workarounds
from harness.objects import load_object
from harness.materialize.schedule import Held, first_line, starts_step, zero_grad
from harness.materialize.tensors import Built
from harness.observation import snap
from harness.case.spec import Case
from harness.materialize.stages import StageModule, StageSpec, cut, examples_of
from harness.paths.pipeline.data import stage_cuts
from harness.paths.pipeline.inflight import watched
from harness.paths.stage_loss import target_rows, vjp_loss

STOCK = "stock"
MAX_MICROBATCHES = 4  # layouts are probed up to this many microbatches


_READING = threading.Lock()


def schedule_names() -> list[str]:
    """The training schedules torch's pipelining package exports, read from
    its ``__all__`` without importing it: the import costs as much as torch
    itself, and listing paths (``gradfuzz paths``, ``--help``, a gate over
    other families) needs only the names. ``discover`` imports the classes
    where a pipeline path runs.

    Read once per process, under a lock: a rank starts each case's thread
    while the last case's thread may still be starting, and ``ast.parse``
    in two threads at once raises a spurious ``SystemError`` ("AST
    constructor recursion depth mismatch") on CPython 3.11, whose AST depth
    counter is module state shared by threads: the case would report it as
    the path's error."""
    with _READING:
        return list(_read_schedule_names())


@functools.cache
def _read_schedule_names() -> tuple[str, ...]:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return ()
    init = os.path.join(os.path.dirname(spec.origin), "distributed", "pipelining", "__init__.py")
    try:
        with open(init, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return ()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            try:
                names = ast.literal_eval(node.value)
            except ValueError:
                return ()
            return tuple(n[len("Schedule"):] for n in names if isinstance(n, str) and n.startswith("Schedule")
                         and "ForwardOnly" not in n)
    return ()


def discover() -> dict[str, type]:
    """Every training schedule the installed torch exports, by short name
    (``ScheduleZBVZeroBubble`` -> ``ZBVZeroBubble``): the names
    ``schedule_names`` reads, each a concrete schedule class once imported."""
    try:
        import torch.distributed.pipelining as pp
        from torch.distributed.pipelining import schedules as sched_mod
    except Exception:  # no torch.distributed, or a build without pipelining
        return {}
    base = getattr(sched_mod, "_PipelineSchedule", None)
    found = {}
    for name in schedule_names():
        cls = getattr(pp, f"Schedule{name}", None)
        if inspect.isclass(cls) and base is not None and issubclass(cls, base) and not inspect.isabstract(cls):
            found[name] = cls
    return found


def single_stage(cls: type) -> bool:
    """Schedules that take one stage per rank (``PipelineScheduleSingle``)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return issubclass(cls, PipelineScheduleSingle)


def stage_class(impl: str) -> type:
    from torch.distributed.pipelining import PipelineStage

    if impl == STOCK:
        return PipelineStage
    return load_object(impl, "stage class", default_attr="PipelineStage", check=lambda obj: None if (
        inspect.isclass(obj) and issubclass(obj, PipelineStage)) else "is not a PipelineStage subclass")


def _make_schedule(cls: type, stages: list[Any], microbatches: int, loss_fn: Any) -> Any:
    if single_stage(cls):
        if len(stages) != 1:
            raise ValueError(f"{cls.__name__} takes one stage per rank")
        return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, microbatches, loss_fn=loss_fn, scale_grads=False)


class _Probe(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def probe(world_size: int, device: torch.device = torch.device("cpu")) -> dict[str, Any]:
    """Which (stages, microbatches) each schedule accepts with this many
    ranks, and where it puts each stage: found by constructing it (no
    communication happens in a constructor), not from a table, so a torch
    that relaxes or adds a constraint is followed. Needs the process group."""
    import torch.distributed as dist

    rank = dist.get_rank()
    layouts: dict[str, list[tuple[int, int]]] = {}
    placement: dict[str, dict[int, list[int]]] = {}
    reasons: dict[str, str] = {}
    for name, cls in discover().items():
        ok: list[tuple[int, int]] = []
        where: dict[int, list[int]] = {}
        for per_rank in range(1, 5):
            n = per_rank * world_size
            if n > 4 or (per_rank > 1 and single_stage(cls)):
                continue
            mine = [i for i in range(n) if i % world_size == rank]  # looped placement; the schedule may say otherwise
            for m in range(1, MAX_MICROBATCHES + 1):
                try:
                    from torch.distributed.pipelining import PipelineStage

                    stages = [PipelineStage(_Probe().to(device), i, n, device) for i in mine]
                    s = _make_schedule(cls, stages, m, lambda o, t: o.sum())
                except Exception as e:  # the schedule's own constraint (ValueError, AssertionError)
                    reasons.setdefault(name, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                    continue
                ok.append((n, m))
                mapping = getattr(s, "stage_index_to_group_rank", None) or {i: i % world_size for i in range(n)}
                where[n] = [int(mapping[i]) for i in range(n)]
        layouts[name] = ok
        placement[name] = where
    return {"layouts": layouts, "placement": placement, "reasons": reasons}


# Point-to-point calls of torch.distributed: on a group of one, any of them
# can only address this rank itself.
P2P_CALLS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list"})


def same_rank_p2p(device: torch.device = torch.device("cpu"), impl: str = STOCK,
                  group: Any = None) -> dict[str, Any]:
    """Whether each multi-stage schedule runs two stages held by one rank,
    with the stage class ``impl``: one step of the smallest such layout
    (stages 0 and 1 on this rank), on ``group``, a group of this rank alone
    with the backend the cases' point-to-point group has (None: the default
    group, which is that group in one process).

    ``self_send``: schedule -> the error, where the step raised inside a
    torch.distributed point-to-point call. On a group of one its peer can
    only be this rank: the runtime sent between its own two stages through
    the process group, which gloo cannot do (it has no pair to itself).
    torch 2.11's ``PipelineScheduleMulti._initialize_stages`` does this: it
    batches every local stage's ``_get_init_p2p_neighbors_ops()`` (a send
    and a recv to each neighbour stage's rank, same rank or not); 2.13 warms
    up only neighbours on other ranks, and so does
    ``oracles.pipeline_fixed.FixedPipelineStage`` on either. ``works``: the
    schedules whose step ran. A step that fails any other way is in neither:
    that is for the cases to find, not a limit of the layout."""
    import traceback

    Stage = stage_class(impl)
    works: list[str] = []
    self_send: dict[str, str] = {}
    for name, cls in discover().items():
        if single_stage(cls):
            continue
        for m in range(1, MAX_MICROBATCHES + 1):
            try:
                s = _make_schedule(cls, [Stage(_Probe().to(device), i, 2, device, group=group) for i in (0, 1)], m,
                                   lambda o, t: o.sum())
                break
            except Exception:  # the schedule's own constraint
                continue
        else:
            continue  # takes no two stages on one rank
        try:
            s.step(torch.ones(m, 1, device=device), target=torch.zeros(m, 1, device=device), return_outputs=False)
            works.append(name)
        except Exception as e:
            if any(f.name in P2P_CALLS and f.filename.endswith("distributed_c10d.py")
                   for f in traceback.extract_tb(e.__traceback__)):
                self_send[name] = f"{type(e).__name__}: {first_line(e)}"
    return {"works": works, "self_send": self_send}


def _own_group(ctx: Any) -> Any:
    """A group of this rank alone, with the backend of the cases' p2p group
    (``_group``): what a rank's two stages would talk over. Every rank makes
    one (``new_subgroups`` is collective). None in one process: the default
    group is the cases' group there."""
    import torch.distributed as dist

    if ctx.world_size == 1:
        return None
    if _pp.get("own") is None:
        backend = "gloo" if ctx.device.type == "cpu" else None
        _pp["own"], _ = dist.new_subgroups(group_size=1, backend=backend)
    return _pp["own"]


def _start_grads(case: Case, built: Built, specs: list[StageSpec], modules: list[StageModule],
                 device: torch.device) -> None:
    """A parameter's grad_init applies to its first copy; further copies (a
    weight tied across stages) start empty, or zero: their sum over copies
    is then the one ``.grad`` the case starts from."""
    owner = {}
    for s in specs:
        for n in s.params:
            owner.setdefault(n, s.index)
    init = case.schedule.grad_init
    prefill = built.prefill() if init == "prefilled" else {}
    for mod in modules:
        for n, p in mod.weights.items():
            if not p.requires_grad or init == "none":
                continue
            if init == "prefilled" and owner[n] == mod.spec.index:
                p.grad = prefill[n].to(device, built.dtype)
            else:
                p.grad = torch.zeros_like(p)


def _stacked_inputs(case: Case, built: Built, ks: range, step_no: int, held: Held,
                    device: torch.device) -> list[torch.Tensor]:
    """The first stage's inputs: the step's microbatches stacked on dim 0,
    which the schedule splits back into exactly those microbatches."""
    drawn = [built.inputs(k) for k in ks]
    args = []
    for x in case.inputs:
        t = torch.cat([d[x.name] for d in drawn]).to(device, built.dtype).requires_grad_(x.requires_grad)
        held.hold(f"input {x.name} of step {step_no}", t)
        args.append(t)
    return args


def _target(built: Built, ks: range, step_no: int, held: Held, device: torch.device) -> torch.Tensor:
    """The last stage's target: per microbatch, its number and its grad outputs (``stage_loss``)."""
    target = target_rows(built.cotangents, ks).to(device, built.dtype)
    held.hold(f"target of step {step_no}", target)
    return target


def _record(case: Case, step_no: int, ks: range, params: list[tuple[int, str, Any]], args: list[torch.Tensor],
            seen: dict[int, list[torch.Tensor | None]], first: bool, last: bool) -> dict[str, Any]:
    """What the user can see once ``step()`` returns: grads of every parameter
    copy, and per microbatch (by rows) the input grads and the loss's inputs."""
    rec: dict[str, Any] = {"step": step_no, "grads": [(idx, n, snap(p.grad)) for idx, n, p in params]}
    if first:
        rec["input_grads"] = {
            x.name: None if t.grad is None else [snap(c) for c in t.grad.chunk(len(ks))]
            for x, t in zip(case.inputs, args)
        }
    if last:
        rec["outputs"] = {k: seen.get(k) for k in ks}
    return rec


def _stages(case: Case, built: Built, specs: list[StageSpec], mine: list[StageSpec], Stage: type,
            device: torch.device, group: Any) -> tuple[list[StageModule], list[Any]]:
    """This rank's stage modules (their parameters as the case starts them,
    with the workarounds in force) and the pipeline stages around them, built
    with example activations where the stage class or a workaround asks."""
    values = built.params()
    modules = [StageModule(case, s, values, device) for s in mine]
    for mod in modules:
        workarounds.on_params(mod.weights)
    _start_grads(case, built, specs, modules, device)
    examples = examples_of(built, specs, device) if workarounds.stage_example_args(
        getattr(Stage, "takes_example_args", False)) else {}
    stages = [Stage(mod, mod.spec.index, len(specs), device, group=group, **examples.get(mod.spec.index, {}))
              for mod in modules]
    return modules, stages


def run_case(rank: int, world_size: int, case: Case, schedule: str, impl: str, placement: list[int],
             device: torch.device = torch.device("cpu"), group: Any = None) -> dict[str, Any]:
    """One case on this rank, every step through ``schedule.step()`` as a user
    would. It never raises: the parent judges a failure next to its peers'."""
    built = Built(case)
    sched = case.schedule
    M = sched.microbatches
    out: dict[str, Any] = {"rank": rank, "steps": [], "failure": None, "mutations": [], "inflight": []}
    specs = cut(case, stage_cuts(case))
    mine = [s for s in specs if placement[s.index] == rank]
    first = any(s.index == 0 for s in mine)
    last = any(s.index == len(specs) - 1 for s in mine)
    step_no = -1
    try:
        cls = discover()[schedule]
        modules, stages = _stages(case, built, specs, mine, stage_class(impl), device, group)
        seen: dict[int, list[torch.Tensor | None]] = {}
        schedule_obj = _make_schedule(cls, stages, M, vjp_loss(case, built, seen))
        held = Held()
        params = [(mod.spec.index, n, p) for mod in modules for n, p in mod.weights.items()]
        for idx, n, p in params:
            held.hold(f"parameter {n} (stage {idx})", p)
            held.hold(f"{n}.grad (stage {idx}) before step 0", p.grad, owner=lambda p=p: p.grad)
        reported: set[str] = set()
        for step_no in range(sched.steps):
            ks = range(step_no * M, (step_no + 1) * M)
            if starts_step(case, step_no * M):
                zero_grad((p for _, _, p in params), sched.zero_grad)
                held.refresh()
            args = _stacked_inputs(case, built, ks, step_no, held, device) if first else []
            kwargs = {"target": _target(built, ks, step_no, held, device)} if last else {}
            seen.clear()
            with watched(stages) as written:
                schedule_obj.step(*args, return_outputs=False, **kwargs)
            out["inflight"] += [(step_no, w) for w in written]
            for m in held.check(step_no):
                if m.what not in reported:
                    reported.add(m.what)
                    out["mutations"].append(m)
            out["steps"].append(_record(case, step_no, ks, params, args, seen, first, last))
            for idx, n, p in params:
                held.hold(f"{n}.grad (stage {idx}) after step {step_no}", p.grad, owner=lambda p=p: p.grad)
            for x, t in zip(case.inputs, args):
                held.hold(f"grad of input {x.name} from step {step_no}", t.grad)
    except Exception as e:  # a rank that raises reports it; the parent judges
        import traceback

        message = first_line(e)
        out["failure"] = {"step": step_no, "type": type(e).__name__, "message": message,
                          "traceback": traceback.format_exc()[-4000:],
                          # a peer's failure seen from here: a recv that timed out
                          "waited": "Timed out waiting" in message or "timed out" in message.lower()}
    return out


# The schedules' point-to-point traffic runs on a group of its own, with a
# short timeout: when one rank raises mid-schedule, its peers wait on a
# recv that never comes. With the group's timeout they raise too (a
# "waited" failure) and every rank replies, so the pool is not torn down.
# A group that saw a failure may hold unmatched messages; it is replaced
# before the next case (all ranks agree through the default group).
_pp: dict[str, Any] = {"group": None, "dirty": True, "threads": [], "retired": []}


def _control(ctx: Any) -> Any:
    """The group the ranks' main threads agree over (who is done, who failed):
    gloo with CPU tensors, whatever the pool's backend. On NCCL the agreement
    would queue on the GPU stream behind the case thread's sends and receives,
    and the ranks would wait on each other for ever."""
    import torch.distributed as dist

    if ctx.device.type == "cpu":
        return None  # the default group is gloo already
    if _pp.get("control") is None:
        _pp["control"] = dist.new_group(backend="gloo")
    return _pp["control"]


def _group(ctx: Any, timeout_s: float) -> Any:
    import torch.distributed as dist
    from datetime import timedelta

    if ctx.world_size == 1:
        return None
    flag = torch.tensor([1.0 if _pp["dirty"] else 0.0])
    dist.all_reduce(flag, group=_control(ctx))
    if float(flag.item()) > 0:
        # A replaced group may still have a case thread blocked in it (until
        # its timeout): destroy it only once its threads have ended.
        if _pp["group"] is not None:
            _pp["retired"].append((_pp["group"], _pp["threads"]))
        _pp["threads"] = []
        keep = []
        for old, threads in _pp["retired"]:
            # On NCCL a communicator is never destroyed here: destroying one whose
            # peer rank still waits in it blocks this rank while the peer builds
            # the next group (seen on 2 GPUs). It lives until the pool restarts.
            if any(t.is_alive() for t in threads) or ctx.device.type != "cpu":
                keep.append((old, threads))
                continue
            try:
                dist.destroy_process_group(old)
            except Exception:
                pass
        _pp["retired"] = keep
        backend = "gloo" if ctx.device.type == "cpu" else None
        _pp["group"] = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        _pp["dirty"] = False
    return _pp["group"]


def handle(ctx: Any, msg: dict[str, Any]) -> dict[str, Any]:
    """A pool message (``harness.workers.host``'s ``call`` op) for this module."""
    if msg.get("what") == "probe":
        return probe(ctx.world_size, ctx.device)
    if msg.get("what") == "same_rank":
        return same_rank_p2p(ctx.device, msg.get("impl", STOCK), _own_group(ctx))
    group = _group(ctx, msg.get("wait", 3.0))
    if msg.get("what") == "warm":
        return _warm(ctx, group)
    args = (ctx.rank, ctx.world_size, Case.loads(msg["case"]), msg["schedule"], msg["impl"], msg["placement"],
            ctx.device, group)
    out = run_case(*args) if ctx.world_size == 1 else _run_watched(ctx, args)
    if out["failure"] is not None:
        _pp["dirty"] = True
    return out


ABORT_JOIN_S = 2.0  # seconds for an aborted p2p group to let its case thread go


def free_p2p(ctx: Any, group: Any, thread: Any) -> bool:
    """After a failed case on NCCL: abort the case's p2p group, so the sends
    and receives its peer never matched leave the GPU, and the case thread
    blocked behind them ends. Without it they spin there, every CUDA sync of
    this rank waits on them (the host's device check after the case hung in
    ``torch.cuda.synchronize``), and the next case's ``new_group`` queues
    behind them: the ranks had to be replaced after every failing case, a
    restart per shrink step. True when the thread ended, so the ranks can
    go on: the group is replaced before the next case (``_group``). On gloo
    the group's own timeout ends the thread, as before."""
    import os
    import threading

    if ctx.device.type != "cuda" or group is None or os.environ.get("GRADFUZZ_NCCL_ABORT", "1") == "0":
        return False

    def abort() -> None:
        try:
            group._get_backend(ctx.device).abort()
        except Exception:  # an older backend without abort: the pool replaces the ranks
            pass

    # abort() bounds its own wait on NCCL; a thread still, so a stuck one cannot hold this rank.
    worker = threading.Thread(target=abort, name="gradfuzz-p2p-abort", daemon=True)
    worker.start()
    worker.join(ABORT_JOIN_S)
    thread.join(ABORT_JOIN_S)
    return not worker.is_alive() and not thread.is_alive()


def _warm(ctx: Any, group: Any) -> dict[str, Any]:
    """One all-reduce and one send and receive between neighbours on the p2p
    group: NCCL builds its communicators on first use (``path._warm``)."""
    import torch.distributed as dist

    if group is None:
        return {"warm": False}
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t, group=group)
    back = torch.zeros(1, device=ctx.device)
    nxt, prev = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt, group), dist.P2POp(dist.irecv, back, prev, group)]):
        work.wait()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return {"warm": float(back.item()) == ctx.world_size}


POLL_S = 0.02


def _run_watched(ctx: Any, args: tuple) -> dict[str, Any]:
    """Run the case in a thread; the ranks' main threads agree, every few
    milliseconds over the default group, whether every rank is done or one
    has failed. A rank whose peer failed stops waiting for it at once
    (its thread stays blocked on the old p2p group until that group's
    timeout, then ends; the group is replaced before the next case)."""
    import contextvars
    import threading

    import torch.distributed as dist

    box: dict[str, Any] = {}

    def work() -> None:
        # Whatever happens, this rank's thread reports: a thread that died
        # without an answer (run_case raising before its own try, or a
        # BaseException) left this rank flagging "running" for ever, and its
        # peer, done, waited on it in the control all_reduce: both hung there.
        try:
            if ctx.device.type == "cuda":
                torch.cuda.set_device(ctx.device)  # the current device is per thread
            box["out"] = run_case(*args)
        except BaseException as e:
            box["out"] = {"rank": ctx.rank, "steps": [], "mutations": [], "failure": {
                "step": -1, "type": type(e).__name__, "message": first_line(e), "waited": False}}

    # The thread runs in a copy of this context: the gate's workaround in force here reaches run_case.
    t = threading.Thread(target=contextvars.copy_context().run, args=(work,), name="gradfuzz-pipeline-case", daemon=True)
    _pp["threads"].append(t)
    t.start()
    while True:
        t.join(POLL_S)
        out = box.get("out")
        failed = out is not None and out["failure"] is not None
        running = out is None
        flags = torch.tensor([1.0 if failed else 0.0, 1.0 if running else 0.0])
        dist.all_reduce(flags, group=_control(ctx))
        if float(flags[0]) > 0 or float(flags[1]) == 0:
            break
    if out is None:  # a peer failed while this rank waited for it
        out = {"rank": ctx.rank, "steps": [], "mutations": [], "failure": {
            "step": -1, "type": "PeerFailed", "message": "stopped waiting: another rank raised", "waited": True}}
    if float(flags[0]) > 0 and ctx.device.type == "cuda":
        t0 = time.monotonic()
        out["p2p_freed"] = free_p2p(ctx, args[-1] if args else None, t)
        out["p2p_seconds"] = round(time.monotonic() - t0, 3)  # what freeing cost (harness.workers.trace)
    return out
