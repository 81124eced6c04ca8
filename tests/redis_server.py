"""A real ``redis-server`` (the Debian package) on 127.0.0.1, started and stopped by a test."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from typing import Iterator

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_server(tmp_path) -> Iterator[str]:
    """Yields ``redis://127.0.0.1:PORT/0``; the server is gone afterwards."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; .ci/run installs it)")
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {port}")
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
