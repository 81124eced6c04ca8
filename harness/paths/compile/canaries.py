"""The compile family's canary: a ``torch.compile`` backend that wraps
AOTAutograd and doubles one parameter's grad in the compiled backward,
judged against ``compile.aot_eager``."""

from __future__ import annotations

from typing import Any

import torch

from harness.paths.family import Canary
from harness.paths.compile.paths import FLAVORS, CompilePath


def scaled_grad_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """A deliberately wrong backend: AOTAutograd with no code generation (as
    ``aot_eager``), except that the compiled backward doubles the grad of the
    graph's first parameter that requires grad. The backward graph returns
    one grad per forward input, in input order, so the output at the
    parameter's position is that parameter's grad."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    idx = next((i for i, t in enumerate(example_inputs)
                if isinstance(t, torch.nn.Parameter) and t.requires_grad), None)

    def fw_compiler(g: torch.fx.GraphModule, _inputs: list[Any]) -> Any:
        return make_boxed_func(g.forward)

    def bw_compiler(g: torch.fx.GraphModule, _inputs: list[Any]) -> Any:
        run = g.forward

        def scaled(args: list[Any]) -> list[Any]:
            res = list(run(*args))
            if idx is not None and idx < len(res) and res[idx] is not None:
                res[idx] = res[idx] * 2
            return res

        scaled._boxed_call = True  # type: ignore[attr-defined]
        return scaled

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler)(gm, example_inputs)


def canary_path() -> CompilePath:
    return CompilePath(FLAVORS["compile.aot_eager"], backend=scaled_grad_backend, name="canary.compile_scaled_grad")


def canaries() -> list[Canary]:
    """A scaled grad shows on the first case with a parameter in a compiled
    graph, so a small budget suffices (and keeps a selfcheck with detection
    broken short)."""
    return [Canary("compile_scaled_grad", canary_path, "compile.aot_eager", budget=30)]
