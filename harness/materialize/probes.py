"""Fix probes: the smallest in-process change that removes exactly one known bug.

Most ledger bugs have no outside workaround (nothing a user can do short of
upgrading torch), so the gate could only call them known by their signature,
and a second bug of the same shape would pass as the first. A fix probe
gives such an entry a causal check all the same: the gate runs the case
again with the probe in force, and the row is the bug only when the probe
removes the finding at its place and nothing else changes.

A probe is never advice to a user: it patches torch inside the harness's own
process (the upstream fix applied at run time, or a patched copy of the one
torch function at fault), so reports say "fix probe" apart from "workaround".
Each probe patches one function (with every alias other torch modules
imported by name) and restores it on exit. It is written as a textual edit
of the installed torch's own source: the probe changes exactly the lines that
hold the bug and keeps whatever else this torch version does, and on a torch
whose source no longer holds those lines it refuses to run (``Unavailable``)
instead of testing something else.

The gate reaches a probe through ``harness.materialize.workarounds.in_force``
exactly as it reaches a workaround: in this process, and in the worker and
rank processes whose messages carry ``in_force_now()``.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, ContextManager, Iterator

KIND = "fix probe"


class Unavailable(RuntimeError):
    """The probe cannot be applied to the torch installed here (its lines are not there)."""


@dataclass(frozen=True)
class Edit:
    """``old`` -> ``new`` in the source of ``module.function`` (``old`` must occur exactly once)."""

    module: str
    function: str  # a module-level function, or ``Class.method``
    changes: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Probe:
    name: str
    effect: str  # one sentence: what the probe changes, shown in reports beside "known"
    edits: tuple[Edit, ...] = ()
    # A probe that is not a source edit: a function returning a context manager.
    custom: Callable[[], ContextManager[None]] | None = None

    def patch(self) -> ContextManager[None]:
        return self.custom() if self.custom is not None else _edits_in_force(self.edits)


_CACHE: dict[Edit, Any] = {}
_LOCK = threading.RLock()


def _target(edit: Edit) -> tuple[Any, str, Any]:
    """(owner, attribute name, current object) of the edited function."""
    owner: Any = importlib.import_module(edit.module)
    *outer, name = edit.function.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name, inspect.getattr_static(owner, name)


def _rewritten(edit: Edit) -> Any:
    """The edited copy of the function, compiled once per process against its module's globals."""
    if edit in _CACHE:
        return _CACHE[edit]
    owner, name, current = _target(edit)
    fn = current.__func__ if isinstance(current, (staticmethod, classmethod)) else current
    src = inspect.getsource(fn)  # edited as the file indents it, then dedented (a method's lines)
    for old, new in edit.changes:
        n = src.count(old)
        if n != 1:
            raise Unavailable(f"{edit.module}.{edit.function} on this torch does not hold the lines this probe "
                              f"changes exactly once ({n} times: {old.strip()[:80]!r})")
        src = src.replace(old, new)
    src = textwrap.dedent(src)
    module = sys.modules[fn.__module__]
    scope = dict(module.__dict__)
    code = compile(src, f"<fix probe of {edit.module}.{edit.function}>", "exec")
    exec(code, scope)  # noqa: S102 - torch's own source with the probe's lines changed
    made = scope[fn.__name__]
    made.__qualname__ = fn.__qualname__
    if isinstance(current, staticmethod):
        made = staticmethod(made)
    elif isinstance(current, classmethod):
        made = classmethod(made)
    _CACHE[edit] = (current, made)
    return _CACHE[edit]


def _aliases(module: str, obj: Any) -> list[tuple[ModuleType, str]]:
    """Every torch module attribute that is ``obj`` (``from ._backward import
    stage_backward_weight`` binds a second name the schedule calls)."""
    root = module.split(".")[0]
    out = []
    for m in list(sys.modules.values()):
        if not isinstance(m, ModuleType) or not getattr(m, "__name__", "").startswith(root):
            continue
        for k, v in list(getattr(m, "__dict__", {}).items()):
            if v is obj:
                out.append((m, k))
    return out


@contextmanager
def _swapped(owner: Any, name: str, new: Any, extra: list[tuple[Any, str]]) -> Iterator[None]:
    old = inspect.getattr_static(owner, name)
    places = [(owner, name)] + [x for x in extra if not (x[0] is owner and x[1] == name)]
    saved = [(o, k, inspect.getattr_static(o, k)) for o, k in places]
    for o, k in places:
        setattr(o, k, new)
    try:
        yield
    finally:
        for o, k, v in saved:
            setattr(o, k, v)
        assert inspect.getattr_static(owner, name) is old


@contextmanager
def _edits_in_force(edits: tuple[Edit, ...]) -> Iterator[None]:
    with _LOCK, ExitStack() as stack:
        for edit in edits:
            owner, name, _ = _target(edit)
            current, made = _rewritten(edit)
            extra = _aliases(edit.module, current) if isinstance(owner, ModuleType) else []
            stack.enter_context(_swapped(owner, name, made, extra))
        yield


# --- the probes -----------------------------------------------------------------------

_BACKWARD = "torch.distributed.pipelining._backward"

PROBES: dict[str, Probe] = {p.name: p for p in (
    Probe("split-clamp-every-intermediate",
          "stage_backward_weight clamps the grad of every captured intermediate to the one the input pass saved, "
          "not only when there are several (a tensor hook on it then runs once)",
          (Edit(_BACKWARD, "stage_backward_weight",
                (("if len(param_group[\"intermediates\"]) > 1:", "if True:"),)),)),
    Probe("split-param-groups-apart",
          "get_param_groups points every intermediate of a merged group at the merged group (no parameter left in "
          "two groups), and stage_backward_weight keeps the graph until the last group's pass (groups sharing a "
          "region of the graph no longer find it freed)",
          (Edit(_BACKWARD, "stage_backward_weight",
                (("                    retain_graph=retain_graph,\n",
                  "                    retain_graph=retain_graph or param_group is not param_groups[-1],\n"),)),
           Edit(_BACKWARD, "get_param_groups",
                (("                param_group = existing\n",
                  "                param_group = existing\n"
                  "                for node in existing[\"intermediates\"]:\n"
                  "                    param_groups[node] = existing\n"),)),)),
    Probe("split-group-unreached-weights",
          "stage_backward_input puts the weights that no weight group holds (their graph never meets a stage input "
          "that needs grad) in one more group, run from the stage outputs with their grads, and "
          "stage_backward_weight runs that group",
          (Edit(_BACKWARD, "stage_backward_input",
                (("        # drop output side graph state we no longer need\n",
                  "        _grouped = set().union(*(g[\"params\"] for g in param_groups))\n"
                  "        _left = [w for w in weight_grad_fns if w not in _grouped]\n"
                  "        _outs = [(GradientEdge(o.grad_fn, o.output_nr), g)\n"
                  "                 for o, g in zip(valid_outputs, valid_output_grads) if o.grad_fn is not None]\n"
                  "        if _left and _outs:\n"
                  "            param_groups.append({\"params\": set(_left), \"outputs\": _outs})\n"
                  "        # drop output side graph state we no longer need\n"),)),
           Edit(_BACKWARD, "stage_backward_weight",
                (("    for param_group in param_groups:\n",
                  "    for param_group in param_groups:\n"
                  "        if \"outputs\" in param_group:\n"
                  "            _edges, _grads = zip(*param_group.pop(\"outputs\"))\n"
                  "            _params = list(param_group[\"params\"])\n"
                  "            _dws = torch.autograd.grad(list(_edges), tuple(GradientEdge(w, 0) for w in _params),\n"
                  "                                       grad_outputs=list(_grads), retain_graph=retain_graph,\n"
                  "                                       allow_unused=True)\n"
                  "            for grad_acc, dw in zip(_params, _dws):\n"
                  "                weight, index = grad_acc_to_weight[grad_acc]\n"
                  "                if dw is None:\n"
                  "                    continue\n"
                  "                if weight.grad is None:\n"
                  "                    weight.grad = dw\n"
                  "                else:\n"
                  "                    weight.grad += dw\n"
                  "            continue\n"),)),)),
    Probe("split-detach-no-views",
          "stage_backward_input leaves a stage output that is a view attached instead of detaching it in place "
          "(which autograd refuses for views)",
          (Edit(_BACKWARD, "stage_backward_input",
                (("            t.detach_()\n", "            if not t._is_view():\n                t.detach_()\n"),)),)),
    Probe("split-keep-outputs-attached",
          "stage_backward_input (and a last stage's backward_one_chunk) no longer detach the stage outputs in place, "
          "so an output saved for the backward of another output is still there in the weight pass",
          (Edit(_BACKWARD, "stage_backward_input",
                (("            t.detach_()\n", "            pass\n"),)),
           Edit("torch.distributed.pipelining.stage", "_PipelineStageBase.backward_one_chunk",
                (("                    t.detach_()\n", "                    pass\n"),)))),
    Probe("split-grad-like-param",
          "stage_backward_weight lays a weight grad it adopts out like the weight (as AccumulateGrad does) when "
          "autograd computed it with other strides (an expanded grad too, whose adoption is "
          "split-adopts-aliased-grad's: where a case shows both, the probe cannot tell them apart)",
          (Edit(_BACKWARD, "stage_backward_weight",
                (("                        weight.grad = dw\n",
                  "                        weight.grad = (dw if dw.stride() == weight.stride()\n"
                  "                                       else torch.empty_like(weight).copy_(dw))\n"),)),)),
)}


def available(name: str) -> str | None:
    """None when probe ``name`` can be applied to the torch here, else why not."""
    probe = PROBES[name]
    if probe.custom is not None:
        return None
    try:
        for edit in probe.edits:
            _rewritten(edit)
    except (Unavailable, ImportError, AttributeError, OSError, TypeError) as e:
        return str(e)
    return None


def patch(name: str) -> ContextManager[None]:
    """Probe ``name`` in force for what runs inside (Unavailable where it cannot be applied)."""
    return PROBES[name].patch()
