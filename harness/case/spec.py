"""The case spec: plain, frozen, versioned data.

Everything downstream (build, every path, the oracle, the repro script) is a
pure function of a ``Case``, so a corpus file is a complete reproduction.
The JSON form is the contract with the corpus on disk: ``from_json`` accepts
exactly what ``to_json`` writes for ``SCHEMA_VERSION`` and names the field of
anything else.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from harness.case.vocab import (  # noqa: F401  (re-exported: the spec's vocabulary)
    DTYPES, EVENT_KINDS, EVENT_MAX_ELEMENTS, GRAD_INITS, HOOK_KINDS, PARAM_HOOKS, SCHEMA_VERSION,
    ZERO_GRADS, SpecError,
)
from harness.case.validate import infer_shapes
from harness import registry
from harness.case import opinfo
from harness.case import schema as sc
from harness.case.namespace import DataNamespace


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
    # with that norm type ("1", "2", "inf"); ``optimizer`` (harness.materialize.train.OPTIMIZERS)
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
    # A last pipeline stage's form: the outputs reach backward as one scalar
    # loss (sum of output x cotangent, the same grads) with no grad outputs,
    # as PipelineStage hands them to ``stage_backward_input``. Paths that
    # take grad outputs ignore it. Omitted from JSON when False.
    loss: bool = False
    # Each family's own part of the case (stage cuts, regions, wrapper
    # switches), as (family name, that family's value) pairs sorted by name;
    # written, read and validated by the family (harness.case.namespace).
    # Omitted from JSON when empty.
    family: tuple[tuple[str, Any], ...] = ()

    def data(self, name: str) -> Any:
        """Family ``name``'s part of this case, or None."""
        return dict(self.family).get(name)

    def with_data(self, name: str, value: Any) -> "Case":
        """This case with family ``name``'s part set to ``value`` (None: removed)."""
        rest = {k: v for k, v in self.family if k != name}
        if value is not None:
            rest[name] = value
        return replace(self, family=tuple(sorted(rest.items())))

    def to_json(self) -> dict[str, Any]:
        return _encode(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, data: Any) -> "Case":
        if not isinstance(data, dict):
            raise SpecError("case", f"expected a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if type(version) is int and version == 1:
            data = _from_schema_1(data)
            version = data["version"]
        if type(version) is not int or version != SCHEMA_VERSION:
            raise SpecError(
                "version",
                f"unknown case schema version {version!r}; this gradfuzz reads version "
                f"{SCHEMA_VERSION} (upgrade gradfuzz, or re-save the case with it)",
            )
        case = _decode(cls, data, "case")
        infer_shapes(case)
        for name, value in case.family:
            _namespace(name, f"family.{name}").check(case, value, f"family.{name}")
        return case

    @classmethod
    def loads(cls, text: str) -> "Case":
        return cls.from_json(sc.parse_json(text, "case"))


# --- JSON encoding: dataclasses to dicts, tuples to lists, and back -------------

# Optional fields written only when set, so cases without them keep their JSON.
_OMIT_AT_DEFAULT = {("Schedule", "events"), ("Schedule", "retain_outputs"), ("Schedule", "param_hooks"), ("Param", "placement"),
                    ("Schedule", "clip"), ("Schedule", "max_norm"), ("Schedule", "optimizer"),
                    ("Schedule", "optimizer_impl"), ("Schedule", "lr"), ("Case", "loss"),
                    ("Case", "family")}


def _encode(obj: Any) -> Any:
    if isinstance(obj, Case):
        out = _encode_fields(obj)
        if obj.family:
            out["family"] = {name: _namespace(name, f"family.{name}").encode(v) for name, v in obj.family}
        return out
    if hasattr(obj, "__dataclass_fields__"):
        return _encode_fields(obj)
    if isinstance(obj, tuple):
        return [_encode(x) for x in obj]
    return obj


def _encode_fields(obj: Any) -> dict[str, Any]:
    return {
        f.name: _encode(getattr(obj, f.name))
        for f in fields(obj)
        if f.name != "family" and ((type(obj).__name__, f.name) not in _OMIT_AT_DEFAULT or getattr(obj, f.name) != f.default)
    }


# Bounds of a case (see harness.case.schema for why every field has one).
MAX_PARAMS = MAX_INPUTS = MAX_OUTPUTS = MAX_HOOKS = 64
MAX_NODES = 256
MAX_NDIM = 6
MAX_DIM = 2**20
MAX_EVENTS = 64
MAX_SEED = 2**63 - 1
MAX_FACTOR = 2**10


def _decode(cls: type, data: Any, where: str) -> Any:
    names = {f.name: f for f in fields(cls)}
    required = [n for n, f in names.items() if f.default is MISSING and f.default_factory is MISSING]
    sc.obj(data, where, required, names)
    kwargs = {name: _decode_field(cls.__name__, name, data[name], f"{where}.{name}") for name in names if name in data}
    return cls(**kwargs)


def _shape(v: Any, where: str) -> tuple[int, ...]:
    sc.array(v, where, MAX_NDIM)
    return tuple(sc.integer(d, f"{where}[{i}]", 1, MAX_DIM) for i, d in enumerate(v))


def _attr_value(v: Any, where: str) -> Any:
    if isinstance(v, list):
        return tuple(sc.integer(d, f"{where}[{i}]", -MAX_DIM, MAX_DIM) for i, d in enumerate(sc.array(v, where, MAX_NDIM)))
    if isinstance(v, str):
        return sc.string(v, where, max_len=32)
    if v is None:
        return None
    return sc.integer(v, where, -MAX_DIM, MAX_DIM)


# An OpInfo node's attributes have their own decoders (an op key, a nested call value).
_OPINFO_ATTRS = {"fn": opinfo.check_fn, "call": opinfo.decode_call}


def _attrs(v: Any, where: str) -> tuple[tuple[str, Any], ...]:
    out = []
    for i, kv in enumerate(sc.array(v, where, 8)):
        if not isinstance(kv, list) or len(kv) != 2:
            raise SpecError(f"{where}[{i}]", f"expected a [key, value] pair, got {sc._show(kv)}")
        key = sc.string(kv[0], f"{where}[{i}][0]", max_len=32)
        out.append((key, _OPINFO_ATTRS[key](kv[1], f"{where}[{i}][1]") if key in _OPINFO_ATTRS
                    else _attr_value(kv[1], f"{where}[{i}][1]")))
    return tuple(out)


def _strings(max_items: int, max_len: int = sc.MAX_NAME) -> Any:
    return lambda v, w: tuple(sc.string(x, f"{w}[{i}]", max_len=max_len) for i, x in enumerate(sc.array(v, w, max_items)))


def _nested(cls: type, max_items: int) -> Any:
    return lambda v, w: tuple(_decode(cls, x, f"{w}[{i}]") for i, x in enumerate(sc.array(v, w, max_items)))


_str = lambda n=sc.MAX_NAME: (lambda v, w: sc.string(v, w, max_len=n))  # noqa: E731

# One checker per field: the type and the bounds of everything a case file may hold.
_FIELDS: dict[tuple[str, str], Any] = {
    ("Case", "params"): _nested(Param, MAX_PARAMS),
    ("Case", "inputs"): _nested(Input, MAX_INPUTS),
    ("Case", "nodes"): _nested(Node, MAX_NODES),
    ("Case", "outputs"): _nested(Use, MAX_OUTPUTS),
    ("Case", "hooks"): _nested(Hook, MAX_HOOKS),
    ("Case", "schedule"): lambda v, w: _decode(Schedule, v, w),
    ("Case", "retain_grad"): _strings(MAX_NODES),
    ("Case", "dtype"): lambda v, w: sc.string(v, w, choices=DTYPES),
    ("Case", "exact"): sc.boolean,
    ("Case", "seed"): lambda v, w: sc.integer(v, w, 0, MAX_SEED),
    ("Case", "version"): lambda v, w: sc.integer(v, w, SCHEMA_VERSION, SCHEMA_VERSION),
    ("Case", "loss"): sc.boolean,
    ("Case", "family"): lambda v, w: tuple(sorted(
        (k, _namespace(k, f"{w}.{k}").decode(x, f"{w}.{k}")) for k, x in sc.dict_of(v, w, lambda x, w2: x, 16).items())),
    ("Param", "name"): sc.name,
    ("Param", "shape"): _shape,
    ("Param", "requires_grad"): sc.boolean,
    ("Param", "placement"): _str(16),
    ("Input", "name"): sc.name,
    ("Input", "shape"): _shape,
    ("Input", "requires_grad"): sc.boolean,
    ("Use", "ref"): sc.name,
    ("Use", "transpose"): sc.boolean,
    ("Use", "index"): lambda v, w: None if v is None else sc.integer(v, w, 0, 63),
    ("Node", "name"): sc.name,
    ("Node", "op"): _str(32),
    ("Node", "args"): _nested(Use, 8),
    ("Node", "attrs"): _attrs,
    ("Hook", "node"): sc.name,
    ("Hook", "kind"): lambda v, w: sc.string(v, w, choices=HOOK_KINDS),
    ("Hook", "factor"): lambda v, w: sc.integer(v, w, -MAX_FACTOR, MAX_FACTOR),
    ("Event", "after"): lambda v, w: sc.integer(v, w, 0, 1024),
    ("Event", "kind"): lambda v, w: sc.string(v, w, choices=EVENT_KINDS),
    ("Event", "sizes"): lambda v, w: tuple(sc.integer(x, f"{w}[{i}]", 1, EVENT_MAX_ELEMENTS) for i, x in enumerate(sc.array(v, w, 8))),
    ("Schedule", "microbatches"): lambda v, w: sc.integer(v, w, 1, 16),
    ("Schedule", "steps"): lambda v, w: sc.integer(v, w, 1, 8),
    ("Schedule", "grad_init"): lambda v, w: sc.string(v, w, choices=GRAD_INITS),
    ("Schedule", "zero_grad"): lambda v, w: sc.string(v, w, choices=ZERO_GRADS),
    ("Schedule", "events"): _nested(Event, MAX_EVENTS),
    ("Schedule", "retain_outputs"): sc.boolean,
    ("Schedule", "param_hooks"): _strings(len(PARAM_HOOKS)),
    ("Schedule", "clip"): _str(8),
    ("Schedule", "max_norm"): lambda v, w: sc.number(v, w, 0, 1e6, lo_open=True),
    ("Schedule", "optimizer"): _str(32),
    ("Schedule", "optimizer_impl"): _str(16),
    ("Schedule", "lr"): lambda v, w: sc.number(v, w, 0, 10, lo_open=True),
}


def _decode_field(owner: str, name: str, value: Any, where: str) -> Any:
    return _FIELDS[(owner, name)](value, where)


def _namespace(name: str, where: str) -> DataNamespace:
    """The installed family that reads ``name``'s part of a case."""
    space = registry.namespace(name)
    if space is None:
        raise SpecError(where, f"no installed family {name!r} reads case data (installed: "
                        f"{', '.join(ep.name for ep in registry.listed())}); fix: install the family that wrote "
                        "this case, or remove the field")
    return space


def _from_schema_1(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 case, whose stage cuts and data-parallel switches were
    top-level fields (``stages``, ``parallel``), as schema 2: each family
    that read them takes its part from them, so every path sees what it saw."""
    top = {k: check(data.get(k, []), k) for k, check in _LEGACY.items()}
    family = {}
    for ep in registry.listed():
        space = registry.namespace(ep.name)
        value = space.from_legacy(top) if space is not None else None
        if value is not None:
            family[ep.name] = space.encode(value)
    rest = {k: v for k, v in data.items() if k not in ("stages", "parallel")}
    return {**rest, **({"family": family} if family else {}), "version": SCHEMA_VERSION}


_LEGACY: dict[str, Any] = {
    "stages": lambda v, w: tuple(sc.integer(x, f"{w}[{i}]", 0, MAX_NODES) for i, x in enumerate(sc.array(v, w, 16))),
    "parallel": lambda v, w: tuple(sc.string(x, f"{w}[{i}]", max_len=32) for i, x in enumerate(sc.array(v, w, 16))),
}
