"""Compiled artifacts by structure, kept bounded, and the figures that show it.

Compilation costs seconds, data costs nothing: compiled artifacts are cached
by the case's *structure* (its graph without seed and schedule: params and
inputs with their shapes, nodes, outputs, hooks, retain_grad, dtype; the
dynamic paths leave the shapes out), so Hypothesis's data variations of one
structure reuse one artifact. Each structure gets its own code object
(dynamo keeps compiled code and its recompile limit per code object), the
cache holds ``CACHE_SIZE`` structures and evicts the oldest with
``reset_code``, and every ``RESET_EVERY`` new structures the whole dynamo
state is reset (``torch._dynamo.reset()``, compiled autograd's cache too),
so a long session's memory stays bounded. Each observation carries
``extra["compile"]``: whether the structure was a cache hit, how many
graphs were compiled, the seconds spent in calls that compiled and in calls
that did not, and the process's resident memory.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from harness.case.ops import draws_random
from harness.case.spec import Case
from harness.materialize.tensors import Built

CACHE_SIZE = 16  # structures whose compiled code stays alive
RESET_EVERY = 64  # new structures between full dynamo resets
# Dynamo's recompile limit while a compile path's code runs (``CompilePath.config``;
# torch's default is 8). After a graph break inside the forward's loop
# (``retain_grad``: "Tensor.retain_grad() with AOTDispatcher") dynamo skips the
# frame and compiles each node's call as a frame of its own, and every OpInfo
# node shares one such code object, guarded on its op: a structure with more
# distinct OpInfo ops than the limit ran its later ones eagerly.
RECOMPILE_LIMIT = 64


def structure_key(case: Case, shapes: bool = True) -> str:
    """The case without its data: equal keys compile to the same code.

    Seed, mode and schedule only change numbers and the loop around the
    module; ``shapes=False`` also drops every param and input shape (the
    dynamic paths reuse one artifact across sizes)."""
    params = [(p.name, p.shape if shapes else None, p.requires_grad) for p in case.params]
    inputs = [(x.name, x.shape if shapes else None, x.requires_grad) for x in case.inputs]
    data = case.to_json()
    key = [params, inputs, data["nodes"], data["outputs"], data.get("hooks", []),
           data.get("retain_grad", []), case.dtype]
    if draws_random(case):
        # One artifact per seed, as when the compiled forward seeded the RNG
        # itself (dynamo baked that seed in); the paths now seed before the
        # call, and keeping the key keeps which cases share a compile.
        key.append(("rng seed", case.seed))
    return json.dumps(key, sort_keys=True)


@dataclass
class Artifact:
    """One structure's compiled forward (and, for compiled autograd, the
    compiled function the backward is called in)."""

    key: str
    built: Built
    forward: Callable[..., Any]
    backward: Callable[..., Any] | None
    codes: list[types.CodeType]
    graphs: int = 0  # graphs compiled for it (recompilations included)


@dataclass
class Stats:
    """Per-path totals over a session (``obs.extra["compile"]`` per case)."""

    cases: int = 0
    structures: int = 0  # cache misses: a structure compiled afresh
    hits: int = 0  # cases whose structure was already compiled
    graphs: int = 0  # backend invocations (forward graphs, recompilations, compiled-autograd graphs)
    compile_s: float = 0.0  # wall time of forward/backward calls during which something compiled
    run_s: float = 0.0  # wall time of forward/backward calls that compiled nothing
    evictions: int = 0
    resets: int = 0
    not_compiled: int = 0  # structures where dynamo compiled no graph at all (skipped frame)
    limit_fallbacks: int = 0  # frames run eagerly because a recompile limit was hit (should stay 0)
    rss_mb: float = 0.0

    def add(self, extra: dict[str, Any]) -> None:
        self.cases += 1
        self.hits += int(extra.get("hit", False))
        self.structures += int(not extra.get("hit", False))
        self.graphs += extra.get("graphs", 0)
        self.compile_s += extra.get("compile_s", 0.0)
        self.run_s += extra.get("run_s", 0.0)
        self.evictions += extra.get("evictions", 0)
        self.resets += extra.get("resets", 0)
        self.not_compiled += int(extra.get("not_compiled", False))
        self.limit_fallbacks += extra.get("limit_fallbacks", 0)
        self.rss_mb = max(self.rss_mb, extra.get("rss_mb", 0.0))

    @property
    def hit_rate(self) -> float:
        return self.hits / self.cases if self.cases else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "hit_rate": round(self.hit_rate, 4)}


def near_recompile_limit(headroom: int = 2) -> bool:
    """Is some code dynamo compiled within ``headroom`` entries of its
    recompile limit (``RECOMPILE_LIMIT``)?

    Code shared by every structure (the op table's lambdas, which dynamo
    compiles as frames of their own after a graph break) collects up to one
    cache entry per node of each structure; at the limit dynamo silently
    runs it eagerly, and the path would test eager autograd. A full reset
    before a structure that could reach it (``headroom``: its nodes) keeps
    every case compiled."""
    from torch._dynamo.convert_frame import input_codes
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    limit = max(RECOMPILE_LIMIT - headroom, 1)
    for ref in list(input_codes.seen):
        code = ref()
        if code is not None and len(_debug_get_cache_entry_list(code)) >= limit:
            return True
    return False


class _LimitWatch(logging.Handler):
    """Counts dynamo's 'hit config.recompile_limit' warnings: a frame that
    fell back to eager (the case then did not test compiled code there)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "recompile_limit" in record.getMessage():
            self.hits += 1


limit_watch = _LimitWatch()
logging.getLogger("torch._dynamo.convert_frame").addHandler(limit_watch)


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


class StructureCache:
    """Compiled artifacts by structure key, bounded, with periodic full resets."""

    def __init__(self, size: int = CACHE_SIZE, reset_every: int = RESET_EVERY) -> None:
        self.size = size
        self.reset_every = reset_every
        self.entries: OrderedDict[str, Artifact] = OrderedDict()
        self.made = 0
        self.evictions = 0
        self.resets = 0

    def get(self, key: str) -> Artifact | None:
        a = self.entries.get(key)
        if a is not None:
            self.entries.move_to_end(key)
        return a

    def put(self, a: Artifact) -> None:
        self.made += 1
        if self.reset_every and self.made % self.reset_every == 0:
            self.reset()
        while len(self.entries) >= self.size:
            _, old = self.entries.popitem(last=False)
            self.drop(old)
        self.entries[a.key] = a

    def drop(self, a: Artifact) -> None:
        from torch._C._dynamo.eval_frame import reset_code

        for code in a.codes:
            reset_code(code)
        self.entries.pop(a.key, None)
        self.evictions += 1

    def reset(self) -> None:
        """Forget everything: dynamo's caches, guards and compiled autograd's graphs."""
        self.entries.clear()
        torch._dynamo.reset()
        try:
            torch._dynamo.compiled_autograd.reset()
        except AttributeError:
            pass
        gc.collect()
        self.resets += 1
