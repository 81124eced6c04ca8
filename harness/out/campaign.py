"""The campaign's shared finding log: a Redis list every machine appends to.

With ``--db redis://...`` each finding is also appended to the list
``gradfuzz:findings``, so ``gradfuzz merge redis://...`` can gather one
campaign's findings from every machine into one corpus.
"""

from __future__ import annotations

import json
from typing import Any

from harness.case.spec import Case
from harness.out import corpus

FINDINGS_KEY = "gradfuzz:findings"


class DatabaseError(ValueError):
    """A ``--db`` that cannot be used: the CLI exits 2 with this message."""


def redis_client(url: str) -> Any:
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


def publish_finding(spec: str | None, signature: str, entry_json: dict[str, Any], script: str | None) -> None:
    """Append one find to the campaign's log (Redis databases only)."""
    if not spec or not spec.startswith(("redis://", "rediss://", "unix://")):
        return
    client = redis_client(spec)
    client.rpush(FINDINGS_KEY, json.dumps({"signature": signature, "entry": entry_json, "script": script}))


def fetch_findings(spec: str) -> list[tuple[str, Any, str | None]]:
    """Every find in the campaign's log: (signature, corpus Entry, repro script)."""
    client = redis_client(spec)
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
