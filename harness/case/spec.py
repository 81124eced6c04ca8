"""The case spec: plain, frozen, versioned data.

Everything downstream (build, every path, the oracle, the repro script) is a
pure function of a ``Case``, so a corpus file is a complete reproduction.
The JSON form is the contract with the corpus on disk: ``from_json`` accepts
exactly what ``to_json`` writes for ``SCHEMA_VERSION`` and names the field of
anything else.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from harness.case.vocab import (  # noqa: F401  (re-exported: the spec's vocabulary)
    DTYPES, EVENT_KINDS, EVENT_MAX_ELEMENTS, GRAD_INITS, HOOK_KINDS, PARAM_HOOKS, SCHEMA_VERSION, ZERO_GRADS, SpecError,
)
from harness.case.validate import infer_shapes


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    requires_grad: bool = True
    # How the DTensor paths place this parameter (other paths ignore it):
    # "" or "partial": Replicate, used through to_local(grad_placements=[Partial()]);
    # "replicate": a Replicate DTensor used as one; "shardD": Shard(D);
    # "colwise"/"rowwise": a weight used only as ``h @ w``, run as an
    # nn.Linear through parallelize_module with that tensor-parallel style.
    placement: str = ""


@dataclass(frozen=True)
class Input:
    name: str
    shape: tuple[int, ...]
    requires_grad: bool = False


@dataclass(frozen=True)
class Use:
    """One operand: a parameter, an input or an earlier node.

    ``index`` picks one result of a multi-output node; ``transpose`` swaps the
    last two dims at this use only, so one weight can be used plain at one
    site and transposed at another (the tied-projection pattern).
    """

    ref: str
    transpose: bool = False
    index: int | None = None


@dataclass(frozen=True)
class Node:
    name: str
    op: str
    args: tuple[Use, ...]
    attrs: tuple[tuple[str, Any], ...] = ()

    def attr(self, key: str, default: Any = None) -> Any:
        return dict(self.attrs).get(key, default)


@dataclass(frozen=True)
class Hook:
    """A tensor hook on an intermediate node.

    ``scale`` returns ``grad * factor`` (a hook that replaces the grad);
    ``observe`` returns None. Both must fire exactly once per backward.
    """

    node: str
    kind: str = "observe"
    factor: int = 1


@dataclass(frozen=True)
class Event:
    """Something the training loop does between backwards, after backward ``after``.

    ``empty_cache``: a garbage collection and ``torch.cuda.empty_cache()``;
    ``alloc``: tensors of ``sizes`` elements, filled with a sentinel and held
    (they must keep it: a write through a stale pointer shows up here);
    ``free``: drop the tensors earlier ``alloc`` events made. Allocator
    pressure is what turns a graph wrapper's dangling pointer into wrong
    values or a crash.
    """

    after: int
    kind: str
    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Schedule:
    """Gradient accumulation: ``steps`` x ``microbatches`` backwards.

    Grads accumulate over the microbatches of a step; between steps the
    grads are reset as ``zero_grad`` says (``keep`` accumulates across
    steps too). ``grad_init`` is the state of every ``.grad`` before the first
    backward.
    """

    microbatches: int = 1
    steps: int = 1
    grad_init: str = "none"
    zero_grad: str = "set_to_none"
    # Buffer lifetime (optional, omitted from JSON at their defaults):
    # ``events`` between backwards; ``retain_outputs`` holds every forward's
    # outputs to the end (they must not change); ``param_hooks`` observes each
    # parameter's grad with ``register_hook`` ("hook": a copy, "hook_keep":
    # the tensor itself, held) and ``register_post_accumulate_grad_hook``.
    events: tuple[Event, ...] = ()
    retain_outputs: bool = False
    param_hooks: tuple[str, ...] = ()
    # A training step after each step's last backward (optional, omitted from
    # JSON at their defaults): ``clip`` runs clip_grad_norm_ to ``max_norm``
    # with that norm type ("1", "2", "inf"); ``optimizer`` (harness.build.train.OPTIMIZERS)
    # then steps with ``lr``, in ``optimizer_impl`` "" (torch's choice),
    # "for_loop", "foreach" or "fused". Parameters are compared after it.
    clip: str = ""
    max_norm: float = 1.0
    optimizer: str = ""
    optimizer_impl: str = ""
    lr: float = 0.1

    @property
    def backwards(self) -> int:
        return self.microbatches * self.steps


@dataclass(frozen=True)
class Case:
    params: tuple[Param, ...]
    inputs: tuple[Input, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[Use, ...]
    schedule: Schedule = field(default_factory=Schedule)
    hooks: tuple[Hook, ...] = ()
    retain_grad: tuple[str, ...] = ()
    dtype: str = "float32"
    exact: bool = True
    seed: int = 0
    version: int = SCHEMA_VERSION
    # Pipeline stage cuts (harness.build.stages): each is a position in ``nodes``
    # where a new stage starts; () is one stage. Omitted from JSON when empty.
    stages: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return _encode(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, data: Any) -> "Case":
        if not isinstance(data, dict):
            raise SpecError("case", f"expected a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version != SCHEMA_VERSION:
            raise SpecError(
                "version",
                f"unknown case schema version {version!r}; this gradfuzz reads version "
                f"{SCHEMA_VERSION} (upgrade gradfuzz, or re-save the case with it)",
            )
        case = _decode(cls, data, "case")
        infer_shapes(case)
        return case

    @classmethod
    def loads(cls, text: str) -> "Case":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError("json", f"not valid JSON: {e}") from None
        return cls.from_json(data)


# --- JSON encoding: dataclasses to dicts, tuples to lists, and back -------------

_NESTED = {
    ("Case", "params"): Param,
    ("Case", "inputs"): Input,
    ("Case", "nodes"): Node,
    ("Case", "outputs"): Use,
    ("Case", "hooks"): Hook,
    ("Case", "schedule"): Schedule,
    ("Node", "args"): Use,
    ("Schedule", "events"): Event,
}
# Optional fields written only when set, so cases without them keep their JSON.
_OMIT_AT_DEFAULT = {("Schedule", "events"), ("Schedule", "retain_outputs"), ("Schedule", "param_hooks"), ("Param", "placement"),
                    ("Schedule", "clip"), ("Schedule", "max_norm"), ("Schedule", "optimizer"),
                    ("Schedule", "optimizer_impl"), ("Schedule", "lr"), ("Case", "stages")}


def _encode(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return {
            f.name: _encode(getattr(obj, f.name))
            for f in fields(obj)
            if (type(obj).__name__, f.name) not in _OMIT_AT_DEFAULT or getattr(obj, f.name) != f.default
        }
    if isinstance(obj, tuple):
        return [_encode(x) for x in obj]
    return obj


def _decode(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise SpecError(where, f"expected an object, got {type(data).__name__}")
    names = {f.name: f for f in fields(cls)}
    unknown = set(data) - set(names)
    if unknown:
        raise SpecError(f"{where}.{sorted(unknown)[0]}", "unknown field")
    kwargs = {}
    for name, f in names.items():
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise SpecError(f"{where}.{name}", "missing field")
            continue
        kwargs[name] = _decode_field(cls.__name__, name, data[name], f"{where}.{name}")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise SpecError(where, str(e)) from None


def _decode_field(owner: str, name: str, value: Any, where: str) -> Any:
    nested = _NESTED.get((owner, name))
    if nested is Schedule:
        return _decode(Schedule, value, where)
    if nested is not None:
        if not isinstance(value, list):
            raise SpecError(where, f"expected a list, got {type(value).__name__}")
        return tuple(_decode(nested, v, f"{where}[{i}]") for i, v in enumerate(value))
    if name == "shape":
        if not isinstance(value, list) or not all(isinstance(d, int) and d > 0 for d in value):
            raise SpecError(where, f"expected a list of positive ints, got {value!r}")
        return tuple(value)
    if name == "attrs":
        if not isinstance(value, list) or not all(
            isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str) for kv in value
        ):
            raise SpecError(where, f"expected a list of [key, value] pairs, got {value!r}")
        return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in value)
    if name == "sizes":
        if not isinstance(value, list) or not all(isinstance(d, int) and d > 0 for d in value):
            raise SpecError(where, f"expected a list of positive ints, got {value!r}")
        return tuple(value)
    if name == "param_hooks":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise SpecError(where, f"expected a list of hook kinds, got {value!r}")
        return tuple(value)
    if name == "stages":
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise SpecError(where, f"expected a list of node positions, got {value!r}")
        return tuple(value)
    if name == "retain_grad":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise SpecError(where, f"expected a list of node names, got {value!r}")
        return tuple(value)
    return value

