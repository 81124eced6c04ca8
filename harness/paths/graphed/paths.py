"""``graphed.*``: the case's module through a CUDA-graph wrapper.

- ``graphed.stock``: ``torch.cuda.make_graphed_callables`` (or any callable
  with its signature, ``--graphed-impl MODULE:ATTR``, so a team can put its
  own graph wrapper behind the same checks);
- ``graphed.fixed``: ``oracles.graphed_fixed`` (owned grads and outputs,
  input surface held strongly);
- ``graphed.compile``: ``torch.compile(mode="reduce-overhead")``, whose
  CUDA-graph trees are a second wrapper nobody here wrote.

Each case builds one module (the case's parameters are its parameters, the
case's inputs its positional args), graphs it on the first microbatch's
inputs, and trains it through the shared schedule loop: every backward's
grads are observed, every tensor the user holds must stay as it was, and
the schedule may put the allocator under pressure between backwards.
Real CUDA graphs need CUDA: without it these paths are unavailable (and
say why), never passed. They run in a child process (``IsolatedPath``), so
a wrapper that segfaults costs one finding, not the session.

On a CPU-only machine the same class runs graph stand-ins (``device="cpu"``
with an ``impl`` that replays on the CPU; see tests/standins.py).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from harness.materialize.names import PREFIX, attribute
from harness.materialize.tensors import Built
from harness.workers.isolation import IsolatedPath, progress
from harness.objects import LoadError, Ref, load_object
from harness.observation import Grads, Observation
from harness.materialize.schedule import run_schedule
from harness.paths.base import Availability, Contract, Options, Repro
from harness.paths.engine_rules import off_its_devices
from harness.paths.workarounds import IN_PROCESS
from harness.case.spec import Case

STOCK = "torch.cuda:make_graphed_callables"
FIXED = "oracles.graphed_fixed:make_graphed_callables"
COMPILE = "compile"  # torch.compile(module, mode="reduce-overhead")

OUTPUTS_REUSED = (
    "holds an earlier microbatch's outputs across the next forward: this wrapper returns outputs "
    "in static graph buffers that the next replay reuses"
)


def load_impl(spec: str) -> Any:
    """``MODULE:ATTR`` -> a ``make_graphed_callables``-like callable."""
    return load_object(spec, "graphed implementation", require_attr=True,
                       check=lambda obj: None if callable(obj) else "is not callable")


class CaseModule(torch.nn.Module):
    """The case as an ``nn.Module``: its parameters, its inputs as positional args."""

    def __init__(self, built: Built, params: dict[str, torch.nn.Parameter], input_names: list[str]) -> None:
        super().__init__()
        for n, p in params.items():
            self.register_parameter(attribute(n), p)
        self._built = built
        self._param_names = list(params)
        self._input_names = list(input_names)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = {n: getattr(self, attribute(n)) for n in self._param_names}
        values.update(zip(self._input_names, xs))
        return tuple(self._built.forward(values))


def _eager_backward(outs, cots, inputs, params) -> Grads:
    live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    if live:
        torch.autograd.backward([o for o, _ in live], [c for _, c in live])
    return {n: t.grad for n, t in inputs.items()}


class _Run:
    """One case on one graphed path: graphs the module on first use, times the rest."""

    def __init__(self, path: "GraphedPath", case: Case) -> None:
        self.path = path
        self.names = [x.name for x in case.inputs]
        self.fn: Any = None
        self.k = 0
        self.t0 = 0.0
        self.build_s: float | None = None
        self.backwards_s: list[float] = []

    def _sync(self) -> None:
        if self.path.device != "cpu":
            torch.cuda.synchronize()

    def forward(self, built: Built, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        progress(self.k)
        self._sync()
        t = time.perf_counter()
        if self.fn is None:
            params = {p.name: values[p.name] for p in built.case.params}
            module = CaseModule(built, params, self.names)
            self.fn = self.path.wrap(module, [values[n] for n in self.names])
            self._sync()
            self.build_s = time.perf_counter() - t
            t = time.perf_counter()
        self.t0 = t
        outs = self.fn(*[values[n] for n in self.names])
        return list(outs) if isinstance(outs, (tuple, list)) else [outs]

    def backward(self, outs, cots, inputs, params) -> Grads:
        grads = _eager_backward(outs, cots, inputs, params)
        self._sync()
        self.backwards_s.append(time.perf_counter() - self.t0)
        self.k += 1
        return grads

    def close(self) -> None:
        fn, self.fn = self.fn, None
        if isinstance(fn, torch.nn.Module):
            fn.__dict__.pop("forward", None)  # wrappers install a forward that closes over the module: a cycle
        if self.path.impl_spec == COMPILE:
            torch._dynamo.reset()
        gc.collect(1)  # the young cycles a wrapper leaves; a full collection costs 0.1 s a case


class GraphedPath:
    """One graph wrapper behind the path protocol, run in-process.

    Its parameters are made by the shared schedule loop, so the gate's
    in-process workarounds reach them (``workarounds``): clone-grads hooks
    each parameter, and AccumulateGrad then adopts a clone, never a buffer
    a graph replay overwrites.

    ``owned_outputs``: the wrapper promises that an output survives the next
    forward (the fixed one clones them); stock wrappers do not, so cases
    that hold outputs are outside their contract.

    Bitwise equality with eager: in exact mode every value is an integer
    float32 holds exactly, so the comparison with the oracle is bit for bit.
    In tolerance mode it is not demanded: a static grad buffer keeps its
    output's layout (``empty_like`` of a transposed output), and the same
    matmul on another layout rounds differently (seen on the CPU stand-in:
    4.8e-7 on ``(x @ w @ w).mT``), which is not a bug.
    """

    workarounds = IN_PROCESS

    def __init__(self, name: str, impl: str = STOCK, device: str = "cuda", owned_outputs: bool = False,
                 warmups: int | None = None) -> None:
        self.name = name
        # None: the wrapper's own default (stock's 3, as users call it). The fixed
        # reference takes 1: a warm-up only initialises lazy state (cuBLAS handles,
        # the autograd device thread) before capture, and every case captures anew.
        self.warmups = warmups
        self.impl_spec = impl
        self.device = device
        self.owned_outputs = owned_outputs
        self.contract = Contract(retained_grads=False, lifetime_schedules=True, gap_cases=True, model_parts=True,
                                 random_ops=False)

    def availability(self) -> Availability:
        if self.device != "cpu":
            if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
                return Availability(False, f"needs CUDA: torch {torch.__version__} is a CPU-only build")
            if not torch.cuda.is_available():
                return Availability(False, f"needs CUDA: torch {torch.__version__} sees no CUDA device")
        if self.impl_spec == COMPILE:
            try:
                from torch.utils._triton import has_triton
            except ImportError:
                has_triton = None
            if self.device != "cpu" and (has_triton is None or not has_triton()):
                return Availability(False, "torch.compile(mode='reduce-overhead') needs Triton, which is not installed")
            return Availability(True, f"torch.compile(mode='reduce-overhead') on {self.device}")
        try:
            load_impl(self.impl_spec)
        except LoadError as e:
            return Availability(False, str(e))
        return Availability(True, f"{self.impl_spec} on {self.device}")

    def supports(self, case: Case) -> str | None:
        if case.schedule.retain_outputs and not self.owned_outputs:
            return OUTPUTS_REUSED
        if reason := off_its_devices(case, self.device):
            return reason
        from harness.case.ops import draws_random

        if draws_random(case):
            return ("dropout inside a captured graph: each replay draws a fresh mask from the graph-safe RNG "
                    "(as it must), which cannot match the case's seeded mask")
        if self.impl_spec == COMPILE and case.retain_grad:
            # The loop reads retained intermediates' .grad, which no graphed path
            # promises (Contract.retained_grads is False); under CUDA-graph trees
            # that read itself raises on an overwritten output.
            return "retain_grad on an intermediate inside the compiled region"
        return None

    def wrap(self, module: torch.nn.Module, xs: list[torch.Tensor]) -> Any:
        if self.impl_spec == COMPILE:
            torch._dynamo.reset()
            return torch.compile(module, mode="reduce-overhead", dynamic=False)
        impl = load_impl(self.impl_spec)
        # The sample args: copies of the first microbatch's inputs, requires_grad as theirs.
        sample = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in xs)
        more = {} if self.warmups is None else {"num_warmup_iters": self.warmups}
        return impl(module, sample, allow_unused_input=True, **more)

    def run(self, case: Case) -> Observation:
        r = _Run(self, case)
        try:
            obs = run_schedule(case, self.name, r.backward, forward=r.forward, device=self.device,
                               observe=self.contract.observe())
        finally:
            r.close()
        obs.extra["build_s"] = r.build_s
        obs.extra["backwards_s"] = r.backwards_s
        return obs

    def repro(self, case: Case) -> Repro:
        if self.impl_spec == COMPILE:
            imports = ""
            make = 'torch.compile(module, mode="reduce-overhead", dynamic=False)'
            what = 'torch.compile(mode="reduce-overhead")'
        else:
            imports = Ref.parse(self.impl_spec).import_line("graph_wrapper")
            make = "graph_wrapper(module, sample, allow_unused_input=True)"
            what = self.impl_spec
        body = (
            "    live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]\n"
            "    if live:\n"
            "        torch.autograd.backward([o for o, _ in live], [c for _, c in live])\n"
        )
        forward_machinery = f'''DEVICE = {self.device!r}


class CaseModule(torch.nn.Module):
    """The module above as an nn.Module: PARAMS are its parameters, the inputs its args."""

    def __init__(self, params):
        super().__init__()
        for n, p in params.items():
            self.register_parameter({PREFIX!r} + n, p)  # never the name itself: it may be "cuda"

    def forward(self, *xs):
        v = {{n: getattr(self, {PREFIX!r} + n) for n in PARAMS}}
        v.update(zip(INPUT_GRAD, xs))
        return tuple(forward(v))


_wrapped = []


def machinery_forward(v):
    """The forward under test: {what}, built on the first microbatch's inputs."""
    if not _wrapped:
        module = CaseModule({{n: v[n] for n in PARAMS}})
        sample = tuple(v[n].detach().clone().requires_grad_(v[n].requires_grad) for n in INPUT_GRAD)
        _wrapped.append({make})
    return list(_wrapped[0](*[v[n] for n in INPUT_GRAD]))
'''
        return Repro(imports=imports, backward=body, forward=forward_machinery)


def stock(impl: str | None = None) -> GraphedPath:
    return GraphedPath("graphed.stock", impl or STOCK)


def fixed() -> GraphedPath:
    return GraphedPath("graphed.fixed", FIXED, owned_outputs=True, warmups=1)


def compiled() -> GraphedPath:
    return GraphedPath("graphed.compile", COMPILE)


def paths(options: Options) -> list:
    """The registry's factory: each graphed path in its own worker process."""
    timeout = max(float(options.timeout), 60.0)
    impl = options.impl("graphed_impl")
    return [
        IsolatedPath(("harness.paths.graphed.paths:stock", {"impl": impl}), timeout=timeout),
        IsolatedPath(("harness.paths.graphed.paths:fixed", {}), timeout=timeout),
        IsolatedPath(("harness.paths.graphed.paths:compiled", {}), timeout=max(timeout, 600.0)),
    ]
