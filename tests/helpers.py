"""Small builders shared by the tests."""

from __future__ import annotations

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
