"""The example database that outlives a run.

Hypothesis's own backends, chosen by ``--db``:

- a directory (default ``.gradfuzz/examples``): ``DirectoryBasedExampleDatabase``;
  a failure found yesterday is tried first today;
- ``redis://HOST:PORT/N``: ``hypothesis.extra.redis.RedisExampleDatabase``,
  shared by every machine of one campaign (needs the ``redis`` package,
  ``pip install gradfuzz[redis]``);
- ``none``: no database (a cold start, as the detection statistics want).

Every fuzz target uses a stable key (``gradfuzz:<target>``), not a digest
of our source, so an upgrade of gradfuzz does not orphan the database.

With Redis, findings are also appended to the campaign's finding log
(``harness.artifacts.campaign``).
"""

from __future__ import annotations

import os
from typing import Iterable

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from harness.artifacts.campaign import DatabaseError, redis_client

__all__ = ["DEFAULT_DIR", "DatabaseError", "MaskingDatabase", "open_database"]

DEFAULT_DIR = os.path.join(".gradfuzz", "examples")


def open_database(spec: str | None) -> ExampleDatabase | None:
    """``--db`` -> a Hypothesis database (None for ``none``)."""
    if spec is None or spec == "":
        spec = DEFAULT_DIR
    if spec.lower() == "none":
        return None
    if spec.startswith("redis://") or spec.startswith("rediss://") or spec.startswith("unix://"):
        from hypothesis.extra.redis import RedisExampleDatabase

        return RedisExampleDatabase(redis_client(spec), key_prefix=b"gradfuzz-example:")
    if "://" in spec:
        raise DatabaseError(f"--db {spec}: expected a directory, redis://HOST:PORT/N, or none")
    return DirectoryBasedExampleDatabase(spec)


class MaskingDatabase(ExampleDatabase):
    """Hypothesis deletes a saved example that no longer fails. A session
    also makes saved examples pass on purpose: once a signature is known,
    later rounds look for something else. Deletes and moves right after such
    a masked example are dropped, so it stays saved for the next session."""

    def __init__(self, inner: ExampleDatabase) -> None:
        super().__init__()
        self.inner = inner
        self.masked = False

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(key, value)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        return self.inner.fetch(key)

    def delete(self, key: bytes, value: bytes) -> None:
        if not self.masked:
            self.inner.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        if not self.masked:
            self.inner.move(src, dest, value)

    def __repr__(self) -> str:
        return f"MaskingDatabase({self.inner!r})"
