"""Real `gbv serve` subprocesses on free loopback ports, shared by the serve tests.

Both servers start at the first use of any fixture below (they load at the same time), and stop at
the end of the session. Every wait is bounded.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the `serve_helpers` module

from serve_helpers import API_KEY, Server  # noqa: E402

SERVER_ARGS = {
    "main": ["--max-batch", "16", "--max-queue", "64"],
    "limited": ["--max-batch", "1", "--max-queue", "1", "--api-key", API_KEY],
}


@pytest.fixture(scope="session")
def _servers():
    servers = {name: Server(name, args) for name, args in SERVER_ARGS.items()}
    servers["pair"] = _load_pair()  # in this process while the servers start, for offline references
    yield servers
    servers.pop("pair")
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def server(_servers) -> Server:
    """The default server: batch 16, queue 64, no API key."""
    return _servers["main"].wait_ready()


@pytest.fixture(scope="session")
def limited_server(_servers) -> Server:
    """Batch 1, queue 1, API key ``API_KEY``: for 429 and 401."""
    return _servers["limited"].wait_ready()


def _load_pair():
    import torch

    import gbv

    torch.set_num_threads(1)  # as the servers (--threads 1)
    return gbv.load_pair("bundled")


@pytest.fixture(scope="session")
def pair(_servers):
    """The bundled pair in this process, for offline reference outputs."""
    return _servers["pair"]
