"""`python -m flexserve.entrypoints.cli.main serve` in a subprocess for tests that kill, signal or
restart the server; its log goes to a file the assertion messages name."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A started server (healthy when the constructor returns) and an `openai` client for it."""

    def __init__(self, serve_args: list[str], log_path: str, startup_timeout: float = 180.0
                 ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flexserve.entrypoints.cli.main", "serve", "--port", str(self.port),
             *serve_args],
            stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + startup_timeout
        while True:
            assert self.process.poll() is None, f"the server exited; see {log_path}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the server did not start; see {log_path}"
            time.sleep(0.2)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
        """Signal the server (if still running), wait for it, close the log."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout)
        self.log.close()
