"""What a path saw, and how a path disagreed with the oracle.

Every path returns the same ``Observation``; one ``compare`` turns a pair
into ``Divergence``s. Tensors are float64 CPU copies taken at the moment of
observation, so later writes by the machinery under test cannot change them.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

Grads = dict[str, "torch.Tensor | None"]


def snap(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu", torch.float64, copy=True)


# Every kind of fact a path can be held to, named once. A family's
# ``Contract.blind`` names the ones its machinery cannot show, each with the
# reason; every other one it must observe (``tests/cover/test_observations.py``
# looks at what a path's Observation actually holds). The names are what a
# contract writes, the texts what a reader is told.
GRAD_VALUES = "grad values"
GRAD_NONE = "None versus zeros"
INPUT_GRAD = "input .grad"
RETAINED = "retained grads"
HOOK_KEPT = "hook-kept grads"
OPTIMIZER_STATE = "optimizer state"
PLACEMENT = "placement"
LAYOUT = "layout"
MUTATION = "mutation"
LIFETIME = "lifetime"
RECOMPUTATION = "recomputation count"
HOOK_FIRING = "hook-firing count"
RNG_STATE = "RNG state"
OBSERVATIONS: dict[str, str] = {
    GRAD_VALUES: "each parameter's .grad after every backward the machinery lets the user read",
    GRAD_NONE: "a .grad that eager leaves None is None, not a zero tensor (stateful optimizers and "
               "set_to_none logic tell them apart)",
    INPUT_GRAD: "a leaf input's .grad, or the input grad a stage hands back",
    RETAINED: "an intermediate's .grad from retain_grad",
    HOOK_KEPT: "what a parameter's register_hook / post-accumulate-grad hook saw",
    OPTIMIZER_STATE: "parameters, clipped grads and the total norm after clip_grad_norm_ and optimizer.step()",
    PLACEMENT: "a grad's DTensor placements and the collectives accumulating it issued",
    LAYOUT: "a .grad's strides against its parameter's",
    MUTATION: "inputs, grad outputs, held grads and frozen parameters nobody wrote to stay as they were",
    LIFETIME: "the forward's saved tensors are freed once its backward returns",
    RECOMPUTATION: "how many times a checkpointed region runs its forward per backward",
    HOOK_FIRING: "how many times each case tensor hook fires per backward",
    RNG_STATE: "the RNG state after the forward and backward equals eager's",
}


@dataclass
class Step:
    """Everything observed right after backward number ``k``."""

    k: int
    grads: Grads  # each parameter's .grad (accumulated), or the oracle's running sum
    # (None: not observable after this backward, e.g. mid-step in a pipeline
    # schedule, which interleaves a step's microbatches; compare skips it)
    input_grads: Grads
    outputs: list[torch.Tensor]
    retained: Grads = field(default_factory=dict)
    # What the schedule's parameter hooks saw during this backward:
    # "<param> register_hook" (the incoming grad), "<param> post_accumulate_grad_hook" (.grad after).
    seen: Grads = field(default_factory=dict)
    # After the training step that follows this backward (schedules with
    # ``clip``/``optimizer``, last microbatch of a step only): "<param>" its
    # value after the optimizer, "<param>.grad clipped", "total norm".
    after_step: Grads = field(default_factory=dict)
    # How many times each hook fired during this backward: "<node> tensor_hook"
    # (a case hook on an intermediate), "<param> <kind>" (a schedule's
    # parameter hook, kind as in Schedule.param_hooks). None: this path does
    # not count them (compare skips it).
    fired: dict[str, int] | None = None
    # How many times each checkpointed region ran its forward, keyed
    # "<region> forward" (during the forward that made this backward's
    # outputs) and "<region> backward" (during this backward: the
    # recomputation); <region> is its nodes' names joined by "+". None: the
    # path recomputes nothing (compare skips it).
    recomputed: dict[str, int] | None = None
    # ``rng_digest()`` after this backward, for cases whose forward draws
    # random numbers (every forward starts from the same seeded state). None:
    # not recorded (compare skips it).
    rng: str | None = None


def rng_digest() -> str:
    """The CPU generator's whole state (``torch.get_rng_state()``), as a short digest."""
    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


@dataclass
class Mutation:
    k: int
    what: str  # "input x0", "grad output 1", "input grad x0 of backward 0", ...
    max_abs: float


@dataclass
class Failure:
    """The path raised; ``k`` is the backward it was in (-1: before any)."""

    k: int
    type: str
    message: str


@dataclass
class Violation:
    """A broken invariant that is not a grad value: a wrong DTensor placement,
    an unexpected collective, a grad that changed under the user, a crash.

    ``kind`` becomes the Divergence kind; ``key`` (names and numbers left
    out) is what de-duplicates it.
    """

    kind: str
    k: int
    what: str
    detail: str
    key: str = ""
    # A value the path judged against a reference of its own (torchtitan.tp's
    # float64 Llama): the difference over the path's tolerance. compare keeps
    # it only above the tolerance's slack scale, so a blunted harness misses it.
    excess: float | None = None


@dataclass
class Observation:
    path: str
    steps: list[Step] = field(default_factory=list)
    mutations: list[Mutation] = field(default_factory=list)
    failure: Failure | None = None
    violations: list[Violation] = field(default_factory=list)
    # The lower type the path rounded grads to on the way ("bfloat16": an FSDP2
    # reduce_dtype, DDP's bf16 compress hook); None: the case's own dtype. The
    # comparison loosens to it (harness.compare.values.LOW_EPS).
    precision: str | None = None
    # (parameter, backward) -> what the path rounded to ``precision`` there,
    # element by element: the sum of |every rank's local grad| over the
    # ranks and the backwards since the step began, divided by the world
    # size. A reduction's rounding is a few steps of that, however much the
    # ranks' grads cancel; None: the comparison falls back to term sizes.
    rounded: dict[tuple[str, int], Any] | None = None
    # Oracle only: each backward's own parameter grads, before accumulation.
    contributions: list[Grads] = field(default_factory=list)
    # The machinery told the user (raised or warned) on a use its docs do not
    # support: never a finding, and a release that refuses is not affected
    # (``gradfuzz versions``). No steps are observed then.
    refused: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# What a finding is about, written once. ``bug``: the machinery gets a
# documented use wrong. ``misuse``: it silently accepts a use its docs do
# not support and gets it wrong (a path that drives it so says
# ``finding_class = MISUSE_CLASS``); one it raises on or warns about is no
# finding. Every record carries it (``finding_class``) and every report
# lists misuse findings apart; the gate's verdict treats both alike
# (docs/gate.md "Misuse findings").
BUG_CLASS, MISUSE_CLASS = "bug", "misuse"
FINDING_CLASSES = (BUG_CLASS, MISUSE_CLASS)


def finding_class_of(path: Any) -> str:
    """The class of every finding ``path`` makes: its optional
    ``finding_class`` member, ``bug`` without one."""
    c = getattr(path, "finding_class", BUG_CLASS)
    if c not in FINDING_CLASSES:
        raise ValueError(f"path {getattr(path, 'name', path)!r}: finding_class {c!r} is not one of {FINDING_CLASSES}")
    return c


def classify(path: Any, case: Any, divs: list["Divergence"]) -> list["Divergence"]:
    """Stamp ``path``'s class on its divergences of ``case`` (the one place a
    class is set). A misuse finding is signed by the use, named by the path's
    ``use(case)`` (``deepspeed.misuse-value-<digest of "zero_grad">``), not by
    the shape of the wrong grads: what is wrong is that use, and one use shows
    many shapes as the drawn schedule varies, so the ledger files it once."""
    cls = finding_class_of(path)
    for d in divs:
        d.finding_class = cls
        if cls == MISUSE_CLASS:
            d.signature = signature(d.path, d.kind, f"misuse {path.use(case)}")
    return divs


@dataclass
class Divergence:
    path: str
    kind: str  # "value", "error", "mutation", or a Violation's kind (e.g. "placement", "collective", "timeout", "crash")
    param: str | None
    microbatch: int | None  # backward number k over the whole schedule
    max_abs: float | None
    max_rel: float | None
    ratio: float | None
    detail: str
    signature: str = ""
    case: dict[str, Any] | None = None
    flaky: bool = False
    shape: str = ""  # the signature without the path: the same bug seen through another path
    finding_class: str = BUG_CLASS  # FINDING_CLASSES: set from the path that made it (engine.check)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Divergence":
        """Back from ``to_json`` in another process (fields it does not know are dropped)."""
        return cls(**{k: v for k, v in data.items() if k in _DIVERGENCE_FIELDS})


# The signature scheme: bump it whenever what goes into a signature changes;
# a ledger recorded under another scheme is refused (``harness.gate.ledger``).
SIGNATURE_SCHEME = 2
MAX_WORDS = 24
# Lines that are advice or a trace, not the error; and where a line's own trace or advice starts.
_NOISE = ("traceback (most recent call last)", "set torch", "you can suppress", "for even more developer context",
          "original traceback", "while executing")
_TAIL = re.compile(r"(stack trace:|please report a bug|while executing|original traceback|set torch_logs|"
                   r"set torchdynamo_verbose).*", re.IGNORECASE)
_PATHISH = re.compile(r"\S*[/\\]\S*")
_TOKEN = re.compile(r"[A-Za-z0-9_.']+")


def message_words(text: str, names: frozenset[str] = frozenset()) -> str:
    """An exception message reduced to its words: what the bug says, not where
    it ran. Stack frames and code lines (indented), file paths, addresses,
    numbers, dotted call sites and the case's own names are dropped, and only
    the first lines count, so the same error gives the same words from any
    checkout, on any machine, under any torch-internal line number."""
    lines = [_TAIL.sub("", ln) for ln in text.splitlines() if ln.strip() and not ln[:1].isspace()
             and not ln.lower().startswith(_NOISE)]
    words: list[str] = []
    for ln in [ln for ln in lines if ln.strip()][:2]:
        for tok in _TOKEN.findall(_PATHISH.sub(" ", ln)):
            tok = tok.strip("._'")
            if tok and not any(c.isdigit() for c in tok) and "." not in tok and tok not in names:
                words.append(tok.lower())
    return " ".join(words[:MAX_WORDS])


def _norm(what: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", re.sub(r"\b[wxnpbgu]\d+\b", "#", what))


def path_key(path: str) -> str:
    """The family and variant of a path (``pipeline.ZBVZeroBubble.ranks2.stock``
    -> ``pipeline.stock``): a schedule or layout is a knob of the case, not a
    different bug, and the ledger's path patterns still say where a bug lives."""
    parts = path.split(".")
    return path if len(parts) <= 2 else f"{parts[0]}.{parts[-1]}"


def signature(path: str, kind: str, what: str) -> str:
    """A de-duplication key built from what the bug is: family and variant,
    kind, and the structural ``what`` (role and coefficient pattern, violated
    invariant, or exception type and message words)."""
    key = path_key(path)
    digest = hashlib.sha1(f"{SIGNATURE_SCHEME}|{key}|{kind}|{_norm(what)}".encode()).hexdigest()[:10]
    return f"{key}-{kind}-{digest}"


def keys(path: str, kind: str, what: str) -> dict[str, str]:
    """``signature`` and ``shape`` for a Divergence: the shape leaves the path
    out, so a ledger bug filed under a path pattern (every zero-bubble
    schedule) can be recognised on a schedule its own cases never ran on."""
    shape = hashlib.sha1(f"{SIGNATURE_SCHEME}|{kind}|{_norm(what)}".encode()).hexdigest()[:10]
    return {"signature": signature(path, kind, what), "shape": f"{kind}-{shape}"}


_DIVERGENCE_FIELDS = frozenset(f.name for f in fields(Divergence))
