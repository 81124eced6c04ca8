"""The campaign's shared finding log: a Redis list every machine appends to.

With ``--db redis://...`` each finding is also appended to the list
``gradfuzz:findings``, so ``gradfuzz merge redis://...`` can gather one
campaign's findings from every machine into one corpus.
"""

from __future__ import annotations

import json
from typing import Any

from harness.case import schema as sc
from harness.case.spec import SpecError
from harness.artifacts import corpus

FINDINGS_KEY = "gradfuzz:findings"
MAX_ITEMS = 100_000  # finds one merge reads from a campaign's log
MAX_LOG_BYTES = 256 * 2**20  # all of them together
BATCH = 64  # items fetched at a time, once their sizes are known

# The length of every item, computed by the server: nothing is sent until its size is checked.
_LENGTHS = "local r = {} for i, v in ipairs(redis.call('LRANGE', KEYS[1], 0, ARGV[1])) do r[i] = #v end return r"


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


def _items(client: Any, spec: str) -> Any:
    """The log's items, each read only after the server said how large it is
    (a log of large items once ended in a MemoryError before any check)."""
    lengths = [int(n) for n in client.eval(_LENGTHS, 1, FINDINGS_KEY, MAX_ITEMS - 1)]
    for i, n in enumerate(lengths):
        if n > sc.MAX_ITEM_BYTES:
            raise DatabaseError(f"{spec} {FINDINGS_KEY}[{i}]: {n} bytes; an item may be {sc.MAX_ITEM_BYTES}")
    if sum(lengths) > MAX_LOG_BYTES:
        raise DatabaseError(f"{spec} {FINDINGS_KEY}: {sum(lengths)} bytes in {len(lengths)} items; "
                            f"one merge reads at most {MAX_LOG_BYTES}")
    for start in range(0, len(lengths), BATCH):
        batch = client.lrange(FINDINGS_KEY, start, min(start + BATCH, len(lengths)) - 1)
        for j, raw in enumerate(batch):  # the list may have changed since: check again
            if len(raw) > sc.MAX_ITEM_BYTES:
                raise DatabaseError(f"{spec} {FINDINGS_KEY}[{start + j}]: {len(raw)} bytes; "
                                    f"an item may be {sc.MAX_ITEM_BYTES}")
            yield raw


def fetch_findings(spec: str) -> list[tuple[str, Any, str | None]]:
    """Every find in the campaign's log: (signature, corpus Entry, repro script).

    A Redis without authentication is writable by anyone who reaches it, so
    each item is checked like a file from a stranger (size, JSON, the corpus
    schema, the signature format) before anything is built; a bad item is a
    DatabaseError naming the item and the field."""
    client = redis_client(spec)
    out = []
    for i, raw in enumerate(_items(client, spec)):
        where = f"{spec} {FINDINGS_KEY}[{i}]"
        try:
            item = sc.obj(sc.parse_json(raw, "finding"), "", ("signature", "entry"), ("script",))
            sig = sc.signature(item["signature"], "signature")
            script = item.get("script")
            if script is not None:
                sc.string(script, "script", max_len=sc.MAX_ITEM_BYTES)
            data = sc.obj(item["entry"], "entry", ("case",), ("meta",))
        except SpecError as e:
            raise DatabaseError(f"{where}: {sc.message(e)}" if e.where else
                                f"{where}: expected an object with signature, entry and script") from None
        try:
            entry = corpus.from_json({"gradfuzz_corpus": corpus.CORPUS_VERSION, **data}, f"{spec}#{i}")
        except corpus.CorpusError as e:
            raise DatabaseError(f"{where}: {str(e).split(': ', 1)[1].replace('field ', 'field entry.', 1)}") from None
        out.append((sig, entry, script))
    return out
