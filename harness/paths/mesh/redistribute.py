"""A redistribution torch's DTensor before 2.13 cannot do: Shard to Partial.

``mesh.dtensor2d`` (both variants) runs the case on DTensors. On a 2-D mesh
DTensor's strategies can ask to turn a sharded operand into a Partial one:
``add`` follows the operand with the most shards (ties: more dims, then the
first) and redistributes the other to its placements, Partial included; a
matmul whose operand is already Partial on one mesh dim may pick a strategy
that wants the other operand Partial there; autograd sums grad contributions
the same way. Torch before 2.13 then raises ``redistribute from S(1) to
P(sum) not supported yet`` (``torch.distributed.tensor._redistribute``);
2.13 runs the same cases. Seen on 2.11 with ``gradfuzz fuzz --paths
mesh.dtensor2d.fixed --seed 1`` (gloo and NCCL, mesh.fixed-error-4d5d1aa689):
``x0 @ w0 + x0 @ w0.mT`` with ``w0`` placed ``S0,S1`` (``(Partial, Shard(1))``
plus ``(Shard(1), Partial)``), and ``x0 @ w0 @ w0 @ w0`` with ``w0`` ``S0,R``
(in the backward).

``shard_to_partial`` predicts it by running the case the way a rank of
``mesh.dtensor2d`` does (``rank.run_case``) as rank 0 of a fake 4-rank
process group (torch's ``fake`` backend: collectives return at once, values
are garbage, but every op's sharding strategy and every redistribution
DTensor plans are the real ones), and reporting whether that run raised this
error. The run happens in a spawned helper process, never in the harness
process: the fake group is process-wide state, and DTensor's sharding
propagation enters FakeTensorMode, after which autograd refuses to run in a
forked child ("Unable to handle autograd's threading in combination with
fork-based multiprocessing"), while the CPU worker pools fork from the harness
process. A helper that cannot start or answer predicts nothing (no refusal).
"""

from __future__ import annotations

from typing import Any

from harness.case.spec import Case

MESSAGE = ("redistribute from S", "to P(", "not supported yet")  # torch.distributed.tensor._redistribute, 2.11


def _serve(conn: Any) -> None:
    """The helper process: (case JSON, impl) in, the failure's step and message (or None) out."""
    import os

    quiet = os.open(os.devnull, os.O_WRONLY)  # the dry runs' warnings and rank logs are not the user's
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    try:
        import torch
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from harness.paths.mesh.rank import WORLD, run_case
        from harness.workers.host import Rank

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
        ctx: Any = Rank(0, WORLD, torch.device("cpu"), None)  # type: ignore[arg-type]
    except Exception:  # a torch without the fake backend: no predictions
        ctx = None
    while True:
        try:
            text, impl = conn.recv()
        except (EOFError, OSError):
            return
        answer = None
        if ctx is not None:
            try:
                failure = run_case(ctx, Case.loads(text), "dtensor2d", impl)["failure"]
                if failure and all(m in failure["message"] for m in MESSAGE):
                    answer = f"backward {failure['k']}: {failure['message']}"
            except Exception:
                answer = None
        conn.send(answer)


_HELPER: list[Any] = []  # [process, connection] once started; [None, None] where it cannot be


def shard_to_partial(case: Case, impl: str = "stock") -> str | None:
    """Whether running the case on mesh.dtensor2d (``impl``: "stock" or the
    fixed reference) makes DTensor redistribute a Shard into a Partial, by
    the installed torch's own strategies: "backward K: redistribute from
    S(1) to P(sum) not supported yet" (K the step the run had reached), or
    None."""
    import multiprocessing as mp

    if not _HELPER:
        try:
            ctx = mp.get_context("spawn")
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(there,), daemon=True, name="gradfuzz-mesh-redistribute")
            proc.start()
            there.close()
            _HELPER[:] = [proc, here]
        except Exception:
            _HELPER[:] = [None, None]
    proc, conn = _HELPER
    if proc is None:
        return None
    try:
        conn.send((case.dumps(), impl))
        if conn.poll(120.0):  # the first answer waits for torch's import in the helper
            return conn.recv()
    except (EOFError, OSError):
        pass
    _HELPER[:] = [None, None]  # a helper that died or hung predicts nothing from now on
    proc.kill()
    return None
