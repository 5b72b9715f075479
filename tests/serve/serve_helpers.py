"""Helpers of the serve tests: a real `gbv serve` subprocess, free ports, bounded polling."""

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository root: `python -m gbv` imports this tree
START_TIMEOUT_S = 120.0
API_KEY = "test-key-123"



def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One `python -m gbv serve` process; ``url`` is its base URL (no /v1)."""

    def __init__(self, name: str, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"gbv-serve-{name}-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gbv", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.ready = False

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def wait_ready(self) -> "Server":
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready:
            if self.process.poll() is not None:
                pytest.fail(f"gbv serve exited with {self.process.returncode}:\n{self.log_text()}")
            try:
                self.ready = httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                pass
            if not self.ready:
                if time.monotonic() > deadline:
                    pytest.fail(f"gbv serve did not answer /health within {START_TIMEOUT_S} s:\n{self.log_text()}")
                time.sleep(0.25)
        return self

    def health(self) -> dict:
        response = httpx.get(f"{self.url}/health", timeout=5.0)
        assert response.status_code == 200
        return response.json()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.log.close()
        os.unlink(self.log.name)


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passed; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
