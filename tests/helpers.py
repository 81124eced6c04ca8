"""Small builders shared by the tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from harness.case.spec import Case, Input, Node, Param, Schedule, Use


def nested(microbatches: int = 1, grad_init: str = "none") -> Case:
    """The founding split-backward case: one weight nested on one path, x @ w @ w."""
    return Case(
        params=(Param("w0", (3, 3)),),
        inputs=(Input("x0", (2, 3), requires_grad=True),),
        nodes=(
            Node("n0", "matmul", (Use("x0"), Use("w0"))),
            Node("n1", "matmul", (Use("n0"), Use("w0"))),
        ),
        outputs=(Use("n1"),),
        schedule=Schedule(microbatches=microbatches, grad_init=grad_init),
    )


def torchrun_verdict(text: str, where) -> tuple[str, int]:
    """Run a generated torchrun repro script on 2 CPU ranks under ``where``:
    its last verdict line (``agrees`` / ``DIVERGES``) and exit status."""
    import os
    import subprocess
    import sys

    file = where / "repro.py"
    file.write_text(text)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--master-addr", "127.0.0.1",
                          "--nproc-per-node", "2", str(file)], capture_output=True, text=True, timeout=900,
                         cwd=where, env={**os.environ, "OMP_NUM_THREADS": "1"})
    words = [ln for ln in run.stdout.splitlines() if "agrees" in ln or "DIVERGES" in ln]
    assert words, run.stdout[-2000:] + run.stderr[-3000:]
    return words[-1], run.returncode


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` loaded as a module (benchmarks are scripts,
    not a package), registered so dataclasses can look their module up."""
    spec = importlib.util.spec_from_file_location(f"gradfuzz_bench_{name}",
                                                  Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod

