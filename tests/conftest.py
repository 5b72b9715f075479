"""Suite-wide settings. The suite runs on every core (``python -m pytest -n auto``, pytest-xdist): each
worker then uses one torch thread, since two workers with two threads each on two cores oversubscribe
them (throughput collapses under contention: README, "Threads")."""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
