"""``compile.*``: ``torch.compile`` on the CPU, held to the eager oracle.

The backward of a compiled module is a different program from eager's:

- ``compile.aot_eager``: ``backend="aot_eager"``, AOTAutograd's joint
  forward/backward trace, partition and alias handling, run without code
  generation (a finding here is not Inductor's);
- ``compile.inductor``: the default backend (Inductor's C++ code generation on
  CPU; it needs a C++ compiler, ``g++``, on PATH);
- ``compile.autograd``: compiled autograd, switched on the way torch
  documents it (``torch._dynamo.config.compiled_autograd = True``; the
  backward is called inside a compiled function, so the engine's whole
  backward including hooks and AccumulateGrad is captured and compiled), with
  a compiled forward; ``compile.autograd.eager_forward`` keeps the forward
  eager and compiles only the backward;
- ``compile.dynamic.symbolic``: ``dynamic=True``; before the case's own
  microbatches the compiled function runs one forward and backward at another
  batch size (leading dim of every input + 1, on copies of the parameters),
  so the grads checked come from an artifact compiled for other shapes;
  ``compile.dynamic.recompile``: the same with ``dynamic=False``, so the
  case's own size goes through a guard failure and a recompilation.

Everything else comes from the shared schedule loop: accumulation into
``.grad`` (None, zeros or prefilled), tensor hooks on intermediates, parameter
hooks, ``retain_grad``, tied and transposed uses, view outputs, custom
autograd Functions, clip and optimizer steps.

Compiled artifacts are cached by the case's structure (``cache``), so
Hypothesis's data variations of one structure reuse one compile; each
observation carries ``extra["compile"]``, the cache's figures for the case.

The paths run in a child process (``IsolatedPath``): a compiler that
segfaults is a ``crash`` finding, one that hangs past the timeout a
``timeout`` finding; a compiler error on a valid case is an ``error``
finding (the loop reports what raised where eager did not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import types
from typing import Any, Callable

import torch

from harness.materialize.schedule import run_schedule
from harness.materialize.tensors import Built
from harness.case.spec import Case, SpecError
from harness.case.validate import infer_shapes
from harness.observation import Grads, Observation
from harness.paths.base import Availability, Options, Repro
from harness.paths.engine_rules import off_its_devices
from harness.paths.compile.cache import (RECOMPILE_LIMIT, Artifact, Stats, StructureCache, limit_watch,
                                         near_recompile_limit, rss_mb, structure_key)
from harness.paths.compile.flavors import CONTRACT, FLAVORS, Flavor
from harness.paths.compile.machinery import machinery
from harness.paths.workarounds import IN_PROCESS
from harness.workers.isolation import IsolatedPath, overlap_procs, progress

COMPILE_TIMEOUT = 300.0  # seconds for one case in the child; past it: a timeout finding


def other_size(case: Case) -> Case | None:
    """The case with the leading dim of every 2-d+ input one larger, if the
    case's shape rules allow it (None otherwise: no warm-up at another size)."""
    inputs = tuple(dataclasses.replace(x, shape=(x.shape[0] + 1,) + x.shape[1:]) if len(x.shape) >= 2 else x
                   for x in case.inputs)
    if inputs == case.inputs:
        return None
    variant = dataclasses.replace(case, inputs=inputs)
    try:
        infer_shapes(variant)
    except (SpecError, ValueError, KeyError, IndexError):
        return None
    return variant


def _fresh_function(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own, so dynamo's per-code cache (and
    its recompile limit) is this structure's alone and can be dropped alone."""
    code = fn.__code__.replace(co_name=label)
    fresh = types.FunctionType(code, fn.__globals__, label, fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    return fresh


def _backward_body(outs: list[torch.Tensor], cots: list[torch.Tensor]) -> None:
    torch.autograd.backward(outs, cots)


class CompileFailed(RuntimeError):
    """A backend raised while compiling: the finding names the backend's own exception."""


def _compile_failure(e: Exception) -> Exception:
    """``BackendCompilerFailed`` says only "backend='x' raised:" on its first
    line, so every compiler error would share one signature; name the
    exception the backend raised and its first line instead."""
    inner = getattr(e, "inner_exception", None)
    if inner is None or type(e).__name__ != "BackendCompilerFailed":
        return e
    text = next((ln.strip() for ln in str(inner).splitlines() if ln.strip()), "")
    return CompileFailed(f"the backend failed to compile: {type(inner).__name__}: {text}")


class CompilePath:
    """One ``Flavor`` of ``torch.compile`` behind the path protocol (in-process;
    ``paths()`` wraps it in a child process)."""

    def __init__(self, flavor: Flavor, backend: Callable[..., Any] | None = None, name: str | None = None) -> None:
        self.flavor = flavor
        self.name = name or flavor.name
        self.contract = flavor.contract
        self._backend_override = backend  # a callable backend (the canary) instead of flavor.backend
        self.cache = StructureCache()
        self.stats = Stats()
        self._graphs = 0  # backend invocations so far (the counting wrapper below)
        self._backend: Callable[..., Any] | None = None

    # --- protocol ---------------------------------------------------------

    def availability(self) -> Availability:
        if not hasattr(torch, "compile"):
            return Availability(False, f"torch {torch.__version__} has no torch.compile")
        if self.flavor.device != "cpu":
            if not torch.cuda.is_available():
                return Availability(False, f"needs CUDA: torch {torch.__version__} sees no CUDA device")
            from torch.utils._triton import has_triton

            if not has_triton():
                return Availability(False, "Inductor on CUDA needs Triton, which is not installed")
            return Availability(True, self.flavor.describe())
        if self.flavor.backend == "inductor" and self._backend_override is None:
            from shutil import which

            cxx = os.environ.get("CXX") or "g++"
            if which(cxx) is None:
                return Availability(False, f"Inductor on CPU needs a C++ compiler: {cxx!r} is not on PATH "
                                           "(Debian: apt-get install g++; or set CXX)")
        return Availability(True, self.flavor.describe())

    def supports(self, case: Case) -> str | None:
        return off_its_devices(case, self.flavor.device)

    def run(self, case: Case) -> Observation:
        r = _Run(self, case)
        obs = run_schedule(case, self.name, r.backward, forward=r.forward, device=self.flavor.device,
                           observe=CONTRACT.observe())
        obs.extra["compile"] = r.extra()
        self.stats.add(obs.extra["compile"])
        if obs.extra["compile"]["limit_fallbacks"]:
            self.cache.reset()  # some shared frame runs eagerly from now on: start afresh
        return obs

    def close(self) -> None:
        self.cache.reset()

    def repro(self, case: Case) -> Repro:
        """The machinery for ``harness.repro``: the case's forward through
        ``torch.compile`` as this flavour calls it (the canary's backend has
        no standalone form: its scripts use ``aot_eager``)."""
        f = self.flavor
        return machinery(f, f.backend if self._backend_override is None else "aot_eager")

    # --- compilation ------------------------------------------------------

    def backend(self) -> Callable[..., Any]:
        """The backend, wrapped to count graphs (each call compiles one)."""
        if self._backend is None:
            inner = self._backend_override or torch._dynamo.lookup_backend(self.flavor.backend)

            def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
                self._graphs += 1
                return inner(gm, example_inputs)

            # dynamo names the backend in its errors by this name
            counting.__name__ = getattr(inner, "__name__", None) or str(self.flavor.backend)
            self._backend = counting
        return self._backend

    def config(self) -> contextlib.ExitStack:
        """The settings every call of this flavour's compiled code runs under
        (graphs compile lazily, inside those calls): compiled autograd on or
        off, the recompile limit (``cache.RECOMPILE_LIMIT``), and for
        Inductor ``fallback_random``. Inductor otherwise lowers
        ``torch.rand`` to its own generator, which draws other numbers than
        eager's from the same seed (documented: the flag exists to make them
        match), so every dropout case would differ in its mask, not in its
        autograd; with it, the mask comes from eager's ``aten.rand`` and the
        rest of the graph is still Inductor's code."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch._dynamo.config.patch(compiled_autograd=self.flavor.compiled_autograd,
                                                       recompile_limit=RECOMPILE_LIMIT))
        if self.flavor.backend == "inductor" and self._backend_override is None:
            from torch._inductor import config as inductor_config

            stack.enter_context(inductor_config.patch(fallback_random=True))
        return stack

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        # compiled autograd is bound when torch.compile() is called, not when the result runs
        with torch._dynamo.config.patch(compiled_autograd=self.flavor.compiled_autograd):
            return torch.compile(fn, backend=self.backend(), dynamic=self.flavor.dynamic)

    def artifact(self, case: Case) -> tuple[Artifact, bool]:
        key = structure_key(case, shapes=not self.flavor.other_size_first)
        if near_recompile_limit(len(case.nodes) + 2):
            self.cache.reset()
        a = self.cache.get(key)
        if a is not None:
            return a, True
        built = Built(case)  # structure only: its forward reads nodes, outputs, hooks, retain_grad
        built.seeds_itself = False  # the case's RNG is seeded before the compiled call (``_Run.forward``)
        label = f"gradfuzz_structure_{self.cache.made}"
        # Built.forward with a code object of this structure's own too: after a graph
        # break dynamo compiles the rest of it as a frame of its own (and its resume
        # functions), and those caches must not fill up across structures.
        own_forward = _fresh_function(Built.forward, label + "_body")

        def case_forward(values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            return own_forward(built, values)

        codes = [own_forward.__code__]
        fwd: Callable[..., Any] = case_forward
        if self.flavor.compile_forward:
            f = _fresh_function(case_forward, label)
            codes.append(f.__code__)
            fwd = self.compile(f)
        bwd = None
        if self.flavor.compiled_autograd:
            b = _fresh_function(_backward_body, label + "_backward")
            codes.append(b.__code__)
            bwd = self.compile(b)
        a = Artifact(key, built, fwd, bwd, codes)
        self.cache.put(a)
        return a, False


class _Run:
    """One case on one compile path: the forward and backward seams of run_schedule."""

    def __init__(self, path: CompilePath, case: Case) -> None:
        self.path = path
        self.case = case
        self.evictions0, self.resets0 = path.cache.evictions, path.cache.resets
        self.artifact, self.hit = path.artifact(case)
        self.graphs0 = path._graphs
        self.limit0 = limit_watch.hits
        self.compile_s = 0.0
        self.run_s = 0.0
        self.k = 0
        self.warmed = False
        self.warm_size: tuple[int, ...] | None = None

    def _timed(self, fn: Callable[[], Any]) -> Any:
        before = self.path._graphs
        t = time.perf_counter()
        try:
            return fn()
        except Exception as e:
            named = _compile_failure(e)
            if named is e:
                raise
            raise named from e
        finally:
            dt = time.perf_counter() - t
            if self.path._graphs != before:
                self.compile_s += dt
                self.artifact.graphs += self.path._graphs - before
            else:
                self.run_s += dt

    def _config(self) -> contextlib.ExitStack:
        return self.path.config()

    def forward(self, built: Built, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        progress(self.k)
        if self.path.flavor.other_size_first and not self.warmed:
            self.warmed = True
            self._warm_up(built)
        with self._config():
            built.seed_rng()
            outs = self._timed(lambda: self.artifact.forward(values))
        built.retained = dict(self.artifact.built.retained)  # retain_grad happened on the structure's Built
        self.built = built  # the case hooks count on the structure's Built: backward hands the counts over
        return list(outs)

    def backward(self, outs, cots, inputs, params) -> Grads:
        live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
        self.artifact.built.fired = {}
        if live:
            os_, cs = [o for o, _ in live], [c for _, c in live]
            bwd = self.artifact.backward
            with self._config():
                if bwd is not None:
                    self._timed(lambda: bwd(os_, cs))
                else:
                    self._timed(lambda: torch.autograd.backward(os_, cs))
        self.built.fired.update(self.artifact.built.fired)  # what run_schedule reads as this backward's fires
        self.k += 1
        return {n: t.grad for n, t in inputs.items()}

    def _warm_up(self, built: Built) -> None:
        """One forward and backward at another batch size on copies of the
        parameters: the artifact the case then runs was compiled for other shapes."""
        variant = other_size(self.case)
        if variant is None:
            return
        vb = Built(variant)
        self.warm_size = tuple(variant.inputs[0].shape) if variant.inputs else None
        dev = self.path.flavor.device
        params = {n: torch.nn.Parameter(t.to(dev, built.dtype), requires_grad=p.requires_grad)
                  for (n, t), p in zip(vb.params().items(), variant.params)}
        inputs = {x.name: t.to(dev, built.dtype).requires_grad_(x.requires_grad)
                  for (n, t), x in zip(vb.inputs(0).items(), variant.inputs)}
        with self._config():
            vb.seed_rng()
            outs = self._timed(lambda: self.artifact.forward({**params, **inputs}))
            live = [(o, torch.ones_like(o)) for o in outs if o.requires_grad]
            if live:
                os_, cs = [o for o, _ in live], [c for _, c in live]
                bwd = self.artifact.backward
                self._timed(lambda: bwd(os_, cs) if bwd is not None else torch.autograd.backward(os_, cs))

    def extra(self) -> dict[str, Any]:
        graphs = self.path._graphs - self.graphs0
        return {
            "hit": self.hit,
            "graphs": graphs,
            "compile_s": round(self.compile_s, 6),
            "run_s": round(self.run_s, 6),
            "evictions": self.path.cache.evictions - self.evictions0,
            "resets": self.path.cache.resets - self.resets0,
            "not_compiled": not self.hit and graphs == 0,
            "limit_fallbacks": limit_watch.hits - self.limit0,
            "warm_size": self.warm_size,
            "rss_mb": round(rss_mb(), 1),
        }


class Flavors:
    """The child's side of a compile worker: the flavour each case names,
    built on first use, each with its own structure cache."""

    name = "compile.worker"
    contract = CONTRACT

    def __init__(self) -> None:
        self.paths: dict[str, CompilePath] = {}

    def availability(self) -> Availability:
        return Availability(True)

    def supports(self, case: Case) -> str | None:
        return None

    def path(self, name: str) -> CompilePath:
        if name not in self.paths:
            self.paths[name] = make(name)
        return self.paths[name]

    def run_on(self, name: str, case: Case) -> Observation:
        return self.path(name).run(case)

    def run(self, case: Case) -> Observation:
        raise TypeError("the compile worker runs a case on a named flavour (run_on)")


class FlavorWorker(IsolatedPath):
    """A child process for compile flavours, told the flavour with each case
    (``paths`` gives each flavour its own). A crash or a timeout restarts
    it, and its caches with it."""

    def __init__(self, timeout: float = COMPILE_TIMEOUT,
                 recipe: tuple[str, dict[str, Any]] = ("harness.paths.compile.paths:Flavors", {})) -> None:
        super().__init__(recipe, timeout=timeout)
        self._flavor = ""

    def _message(self, case: Case, path_name: str | None = None) -> tuple:
        return super()._message(case, self._flavor)

    def submit_on(self, name: str, case: Case) -> None:
        """Start ``case`` on flavour ``name`` (``IsolatedPath.submit``)."""
        self._flavor = name
        self.submit(case, name)

    def run_on(self, name: str, case: Case) -> Observation:
        self._flavor = name
        obs = self.run(case, name)
        obs.path = name  # a crash or timeout observation is made here, under the worker's name
        return obs


class IsolatedCompilePath:
    """A compile flavour run in a worker process, with the child's per-case
    compile figures summed here (``stats``)."""

    # The gate's outside workarounds go to the worker with each case (IsolatedPath._message).
    workarounds = IN_PROCESS
    def __init__(self, name: str, worker: FlavorWorker, overlaps: bool = False) -> None:
        self.overlaps = overlaps  # the engine may start a case on every flavour before reading any (``submit``)
        self.local = make(name)
        self.name = name
        self.cost = FLAVORS[name].cost  # its rank among the flavours (``harness.paths.heaviness``)
        self.contract = self.local.contract
        self.worker = worker
        self.stats = Stats()

    @property
    def restarts(self) -> int:
        return self.worker.restarts

    def availability(self) -> Availability:
        return self.local.availability()

    def supports(self, case: Case) -> str | None:
        return self.local.supports(case)

    def repro(self, case: Case) -> Repro:
        return self.local.repro(case)

    def submit(self, case: Case) -> None:
        self.worker.submit_on(self.name, case)

    def run(self, case: Case) -> Observation:
        obs = self.worker.run_on(self.name, case)
        if "compile" in obs.extra:
            self.stats.add(obs.extra["compile"])
        return obs

    def start_soon(self) -> None:
        self.worker.start_soon()

    def close(self) -> None:
        self.worker.close()  # the next run starts a fresh one


def make(name: str) -> CompilePath:
    """The recipe the child builds: ``harness.paths.compile.paths:make``."""
    return CompilePath(FLAVORS[name])


def paths(options: Options) -> list:
    """The registry's factory: every compile flavour in a worker process of
    its own. One child shared by the flavours hid a bug: on seed 0,
    ``compile.autograd`` raised in fake-tensor tracing on its 4th case when
    it ran alone and passed in the shared child, where the other flavours'
    process-wide compile caches had already traced that graph. A flavour's
    verdict must not depend on which other flavours ran before it, and with
    a child each the cases of one flavour also run side by side with the
    others' where cores are spare (``overlap_procs``)."""
    timeout = max(float(options.timeout), COMPILE_TIMEOUT)
    overlap = overlap_procs(len(FLAVORS)) > 1
    return [IsolatedCompilePath(n, FlavorWorker(timeout=timeout), overlaps=overlap) for n in FLAVORS]
