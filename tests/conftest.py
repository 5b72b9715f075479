"""Suite-wide settings. The suite runs on every core (``python -m pytest -n auto``, pytest-xdist): each
worker then uses one torch thread, since two workers with two threads each on two cores oversubscribe
them (throughput collapses under contention: README, "Threads")."""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Where the engine's compiled host forward can run, it measures at load which CPU forward is fastest
# here (gbv.engine.lean_host.choose_cpu_forward). The suite keeps the host forward with its compiled
# products wherever it can run (GBV_HOST_FORWARD=1), so that which forward a test exercises does not
# depend on the machine or on timing; tests of the torch path set GBV_HOST_FORWARD=0, and
# tests/engine/test_forward_choice.py tests the measured choice itself.
os.environ.setdefault("GBV_HOST_FORWARD", "1")

# On CUDA a static call's shape is recorded as a graph at its fourth use (gbv.engine.static_steps.RECORD_AT);
# the suite's short decodes record at the second, so that recording and replaying are exercised (on CUDA,
# and on the CPU by tests/engine/test_static_sampling.py's stand-in). test_static_steps.py tests the default.
os.environ.setdefault("GBV_RECORD_AT", "2")

# auto's policies are not kept across processes in the suite (gbv.engine.auto_store; the CLI keeps them
# by default): a test's choices must not depend on what an earlier run learned. Tests of the store set a
# directory of their own.
os.environ["GBV_AUTO_CACHE"] = "0"
