"""``auto``'s policies kept across processes: what one process learned (each arm's cost per iteration,
each verifier family's acceptance) is where the next one with the same pair, settings and machine
starts. Why: a policy learns by trying its arms, and a fresh process tried a dozen of them (the
multi-path arms cost several ``ar`` steps an iteration on a CPU) before settling; the first 128-token
generation of a process ran at ~0.85x the speed of the later ones on the bundled pair, and a one-off
``gbv generate`` is nothing but a first generation.

Where, from ``GBV_AUTO_CACHE``:

- ``0``: off;
- ``1``: on, in ``$XDG_CACHE_HOME/gbv/auto`` (``~/.cache/gbv/auto``);
- any other value: on, in that directory;
- unset: on in the CLI (``gbv generate``, ``gbv serve``: :func:`use_by_default`), off in the library,
  where a process usually lives long enough to learn once, and a benchmark measures the learning.

One JSON file per (target, draft, sampling settings, arms, machine): the models by name, dtype,
device and size; the machine by CPU (or GPU) model, torch threads, the compiled kernels' tiles and
gbv's version. A loaded policy weighs at most a few dozen iterations an arm
(``gbv.engine.auto._LOADED_TRIALS``), so a machine that became slower or faster is followed within a
generation. Files are written at exit, atomically (the last process to exit wins); one that does not
fit (another format, other arms, a torn write) is ignored, with a line on the ``gbv`` logger at debug
level.

Lossless as before: each choice depends only on the past, which now includes earlier processes.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import platform
import weakref
from pathlib import Path

import torch

_FORMAT = 2  # (2: the contexts of the iterations, auto._PRIOR_CONTEXT)
_LOG = logging.getLogger("gbv")
_attached: list[tuple[weakref.ref, Path, dict]] = []  # (policy, its file, its key), saved at exit
_by_default = False  # use_by_default() was called (the CLI)
_exit_hook = False


def use_by_default() -> None:
    """Keep policies across processes unless ``GBV_AUTO_CACHE`` says otherwise (the CLI calls this)."""
    global _by_default
    _by_default = True


def cache_dir() -> Path | None:
    """The directory of the policy files, or None where they are off (see the module's docstring)."""
    setting = os.environ.get("GBV_AUTO_CACHE")
    if setting is None:
        setting = "1" if _by_default else "0"
    if setting in ("", "0"):
        return None
    if setting == "1":
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "gbv" / "auto"
    return Path(setting)


def _model_id(model) -> str | None:
    """``name|dtype|device|parameters`` of a Hugging Face model; None where it has no name (a model built
    in memory: nothing ties it to another process's)."""
    if model is None:
        return "none"
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    parameters = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    if not name or not parameters:
        return None
    return f"{name}|{parameters[0].dtype}|{parameters[0].device.type}|{sum(p.numel() for p in parameters)}"


def _processor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine(target) -> dict:
    from gbv import __version__
    from gbv.engine.host_kernels import amx_products, avx512_tiles, host_kernels_unavailable, product_threads

    kernels = "off" if host_kernels_unavailable() is not None else (
        ("avx512" if avx512_tiles() else "avx2") + ("+amx" if amx_products() else ""))
    device = next(target.parameters()).device
    return {"processor": _processor(), "threads": torch.get_num_threads(), "product_threads": product_threads(),
            "kernels": kernels, "gbv": __version__,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def policy_key(target, draft, key: tuple, arms) -> dict | None:
    """What a policy's file is for, or None where it cannot be told apart from another's."""
    models = _model_id(target), _model_id(draft)
    if None in models:
        return None
    return {"format": _FORMAT, "target": models[0], "draft": models[1], "settings": repr(key),
            "arms": [arm.label for arm in arms], **_machine(target)}


def policy_file(directory: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return directory / f"policy-{digest}.json"


def attach(policy, target, draft, key: tuple) -> None:
    """Where policies are kept (:func:`cache_dir`), start ``policy`` from its file if there is one, and
    save it at exit."""
    global _exit_hook
    directory = cache_dir()
    if directory is None:
        return
    stored_key = policy_key(target, draft, key, policy.arms)
    if stored_key is None:
        return
    path = policy_file(directory, stored_key)
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved.get("key") != stored_key:
            raise ValueError("its key differs")
        policy.load_state_dict(saved["policy"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        _LOG.debug("auto: ignoring the saved policy %s (%s)", path, exc)
    _attached.append((weakref.ref(policy), path, stored_key))
    if not _exit_hook:
        atexit.register(save_all)
        _exit_hook = True


def save(policy, path: Path, key: dict) -> None:
    """Write ``policy`` to ``path`` (atomically: a reader sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as f:
        json.dump({"key": key, "policy": policy.state_dict()}, f)
    os.replace(temporary, path)


def save_all() -> None:
    """Save every attached policy that ran an iteration in this process (at exit; an error is logged,
    never raised: a full disk must not turn a finished generation into a traceback)."""
    for reference, path, key in _attached:
        policy = reference()
        if policy is None or not policy.observed():
            continue
        try:
            save(policy, path, key)
        except OSError as exc:
            _LOG.debug("auto: could not save the policy to %s (%s)", path, exc)
