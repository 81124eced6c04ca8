"""What every path on the worker pool's process group shares.

The DTensor and data-parallel paths differ in what a rank runs and what is
judged; where their group comes from, when it can exist and how many ranks
it has are one rule, kept here so a third process-group family (and a fix
to the rule) touches one place.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from harness.paths.base import Availability

# The groups, their ranks (process ids) and the rank modules that ran their warm-up once.
_WARM: set[tuple[int, tuple[int, ...], str]] = set()


def warm_once(group: Any, module: str, timeout: float) -> None:
    """A ``warm`` call to ``module`` on every rank of ``group``, once per
    group and its ranks, outside any case's time limit: what a stack does
    the first time in a process (a C++ op built, a package stack imported)
    can take minutes under load, and counted in the first case it read as a
    hang. Ranks restarted after a hang have other process ids: warmed again."""
    key = (id(group), tuple(group.pids), module)
    if key in _WARM:
        return
    group.request({"op": "call", "module": module, "warm": True}, timeout)
    _WARM.add(key)


class PooledPath:
    """A path whose ranks are ``harness.workers.pool``'s (or torchrun's) processes."""

    def __init__(self, name: str, world_size: int = 2, timeout: float = 10.0, backend: str | None = None) -> None:
        self.name = name
        self.world_size = world_size
        self.timeout = timeout
        self.backend = backend

    @property
    def group(self) -> Any:
        from harness.workers import pool

        return pool.group(self.world_size, self.backend)

    def group_availability(self) -> Availability:
        """Can the group start here; its reason names the launcher, backend and world size."""
        import torch.distributed as dist

        if not dist.is_available():
            return Availability(False, "torch was built without torch.distributed")
        from harness.workers import pool

        if pool.torchrun_env():
            g = self.group
            return Availability(True, f"torchrun group, {g.backend}, world size {g.world_size}")
        backend = self.backend_name()
        if backend == "gloo" and not dist.is_gloo_available():
            return Availability(False, "torch.distributed has no gloo backend")
        if backend == "nccl" and not dist.is_nccl_available():
            return Availability(False, "torch.distributed has no nccl backend (a CPU build?)")
        if backend == "nccl" and torch.cuda.device_count() < self.world_size:
            return Availability(False, f"nccl needs {self.world_size} GPUs, found {torch.cuda.device_count()}")
        return Availability(True, f"worker pool, {backend}, world size {self.world_size}")

    def backend_name(self) -> str:
        from harness.workers import pool

        return self.backend or pool.backend_for(self.world_size)

    def _world(self) -> int:
        """The ranks a case runs on: torchrun's when launched by it, else the pool's."""
        from harness.workers import pool

        return int(os.environ["WORLD_SIZE"]) if pool.torchrun_env() else self.world_size

    def close(self) -> None:
        from harness.workers import pool

        pool.close_group(self.world_size, self.backend)
