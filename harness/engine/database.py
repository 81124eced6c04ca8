"""The example database that outlives a run, and the shared finding log.

Hypothesis's own backends, chosen by ``--db``:

- a directory (default ``.gradfuzz/examples``): ``DirectoryBasedExampleDatabase``;
  a failure found yesterday is tried first today;
- ``redis://HOST:PORT/N``: ``hypothesis.extra.redis.RedisExampleDatabase``,
  shared by every machine of one campaign (needs the ``redis`` package,
  ``pip install gradfuzz[redis]``);
- ``none``: no database (a cold start, as the detection statistics want).

Every fuzz target uses a stable key (``gradfuzz:<target>``), not a digest
of our source, so an upgrade of gradfuzz does not orphan the database.

With Redis, findings are also appended to a list (``gradfuzz:findings``),
so ``gradfuzz merge redis://...`` can gather one campaign's findings from
every machine into one corpus.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

DEFAULT_DIR = os.path.join(".gradfuzz", "examples")
FINDINGS_KEY = "gradfuzz:findings"


class DatabaseError(ValueError):
    """A ``--db`` that cannot be used: the CLI exits 2 with this message."""


def _redis_client(url: str) -> Any:
    try:
        import redis
    except ImportError:
        raise DatabaseError(f"--db {url}: needs the redis package (pip install 'gradfuzz[redis]')") from None
    client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
    try:
        client.ping()
    except redis.exceptions.RedisError as e:
        raise DatabaseError(f"--db {url}: cannot reach Redis ({e})") from None
    return client


def open_database(spec: str | None) -> ExampleDatabase | None:
    """``--db`` -> a Hypothesis database (None for ``none``)."""
    if spec is None or spec == "":
        spec = DEFAULT_DIR
    if spec.lower() == "none":
        return None
    if spec.startswith("redis://") or spec.startswith("rediss://") or spec.startswith("unix://"):
        from hypothesis.extra.redis import RedisExampleDatabase

        return RedisExampleDatabase(_redis_client(spec), key_prefix=b"gradfuzz-example:")
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


def publish_finding(spec: str | None, signature: str, entry_json: dict[str, Any], script: str | None) -> None:
    """Append one find to the campaign's log (Redis databases only)."""
    if not spec or not spec.startswith(("redis://", "rediss://", "unix://")):
        return
    client = _redis_client(spec)
    client.rpush(FINDINGS_KEY, json.dumps({"signature": signature, "entry": entry_json, "script": script}))


def fetch_findings(spec: str) -> list[tuple[str, Any, str | None]]:
    """Every find in the campaign's log: (signature, corpus Entry, repro script)."""
    from harness.out import corpus
    from harness.case.spec import Case

    client = _redis_client(spec)
    out = []
    for i, raw in enumerate(client.lrange(FINDINGS_KEY, 0, -1)):
        item = json.loads(raw)
        data = item["entry"]
        try:
            case = Case.from_json(data["case"])
        except Exception as e:
            raise DatabaseError(f"{spec} {FINDINGS_KEY}[{i}]: field case: {e}") from None
        out.append((item["signature"], corpus.Entry(case, data.get("meta", {}), f"{spec}#{i}"), item.get("script")))
    return out
