"""Why does compile.aot_eager mutate the caller's grad output on the 2.11 H100
machine and not on this machine's 2.11 CPU wheel? (corpus case
eager/grad_output_mutated_by_stolen_view.json; session 8)

Prints, as JSON: versions, whether CUDA is visible, the harness path's
divergences on the case, a standalone check of the same model (does b.grad
alias the first grad output, is that output written by the second
backward), and the dynamo/functorch/inductor configs, so two machines'
outputs can be diffed. Run with CUDA_VISIBLE_DEVICES= to hide the GPU.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def standalone() -> dict:
    torch._dynamo.reset()
    f = torch.compile(lambda x, b: (x + b).reshape(6).reshape(2, 3), backend="aot_eager")
    b = torch.zeros(2, 3, requires_grad=True)
    g1, g2 = torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)
    keep = g1.clone()
    f(torch.ones(2, 3, requires_grad=True), b).backward(g1)
    alias = b.grad.data_ptr() == g1.data_ptr()
    f(torch.ones(2, 3, requires_grad=True), b).backward(g2)
    return {"b.grad aliases g1 after backward 0": alias, "g1 written by backward 1": not torch.equal(g1, keep),
            "b.grad after backward 1": b.grad.tolist()}


def harness_path() -> list[str]:
    from harness.engine.runner import check
    from harness.artifacts import corpus
    from harness.paths.compile.paths import FLAVORS, CompilePath

    case = corpus.load(os.path.join(os.path.dirname(__file__), "..", "cases", "eager",
                                    "grad_output_mutated_by_stolen_view.json")).case
    import harness.paths.compile.paths as compile_mod

    seen: list[str] = []
    run = compile_mod.run_schedule

    def spy(case, name, backward, **kw):  # what each backward leaves in .grad, beside the grad outputs
        def bw(outs, cots, inputs, params):
            got = backward(outs, cots, inputs, params)
            for n, t in params.items():
                seen.append(f"{n}.grad aliases a grad output: {any(t.grad.data_ptr() == c.data_ptr() for c in cots)}; "
                            f"output strides {[o.stride() for o in outs]}, views {[o._base is not None for o in outs]}")
            return got
        return run(case, name, bw, **kw)

    compile_mod.run_schedule = spy
    try:
        found = [d.detail for d in check(case, CompilePath(FLAVORS["compile.aot_eager"]))]
    finally:
        compile_mod.run_schedule = run
    return found + seen


def configs() -> dict:
    out = {}
    for name in ("torch._dynamo.config", "torch._functorch.config", "torch._inductor.config"):
        mod = sys.modules.get(name) or __import__(name, fromlist=["x"])
        try:
            cfg = mod.get_config_copy()
        except Exception as e:  # noqa: BLE001 - a probe reports what it cannot read
            cfg = {"error": repr(e)}
        out[name] = {k: repr(v)[:200] for k, v in sorted(cfg.items())}
    return out


if __name__ == "__main__":
    print(json.dumps({"python": sys.version, "torch": torch.__version__, "cuda": torch.cuda.is_available(),
                      "standalone": standalone(), "harness": harness_path(), "configs": configs()}, indent=1))
