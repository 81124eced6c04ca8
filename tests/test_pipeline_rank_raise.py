"""Two gloo ranks through ``pipeline.rank._run_watched``: a rank whose case
raises before ``run_case``'s own try (here: at once) must still report, or the
pair stays in the control all_reduce for ever (rank 1 flagging "running",
rank 0, done, waiting on it)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from types import SimpleNamespace

import pytest
import torch


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    from harness.paths.pipeline import rank as pr

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)

    def fake_run_case(*args):
        if rank == 1:
            raise ValueError("raised before run_case's try")
        return {"rank": rank, "steps": [], "failure": None, "mutations": []}

    pr.run_case = fake_run_case
    ctx = SimpleNamespace(rank=rank, world_size=2, device=torch.device("cpu"))
    out = pr._run_watched(ctx, ())
    q.put((rank, out["failure"] and out["failure"]["type"]))
    dist.barrier()
    dist.destroy_process_group()


def test_a_rank_raising_outside_run_case_try_does_not_hang_the_pair():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo needed")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "the ranks stayed in the control all_reduce"
    got = dict(q.get(timeout=5) for _ in range(2))
    assert got == {0: None, 1: "ValueError"}
