"""The compiled kernels of ``gbv/engine/_host_kernels.c`` at an earlier commit, for before/after
measurements in one process (``bench_host_forward_ab.py --switch kernels-before``,
``bench_host_kernels.py --before``): swap them in with ``gbv.engine.host_kernels._host_kernels = module``."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sysconfig
import tempfile


def kernels_at(revision: str):
    """The compiled kernels of ``gbv/engine/_host_kernels.c`` at ``revision``, built with gcc (Python's
    CFLAGS and -O3, as setup.py builds the extension) as the module ``_host_kernels_before``. Functions
    the older file lacks are taken from the installed build (``rms``, which the engine calls since the
    thirty-fifth session), so that the engine's calls still resolve when it is swapped in."""
    source = subprocess.run(["git", "show", f"{revision}:gbv/engine/_host_kernels.c"], check=True,
                            capture_output=True, text=True).stdout
    return kernels_from_source(source, "_host_kernels_before")


def kernels_from_source(source: str, name: str):
    """The kernels of the C text ``source`` (a version of ``gbv/engine/_host_kernels.c``), built as
    :func:`kernels_at` builds them, as the module ``name``."""
    folder = tempfile.mkdtemp(prefix="gbv-kernels-")
    path = os.path.join(folder, name + ".c")
    with open(path, "w") as handle:
        handle.write(source)
    library = os.path.join(folder, name + sysconfig.get_config_var("EXT_SUFFIX"))
    flags = (sysconfig.get_config_var("CFLAGS") or "").split()  # what setup.py's build uses, then -O3
    subprocess.run(["gcc", *flags, "-O3", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
                    f"-DPyInit__host_kernels=PyInit_{name}", path, "-o", library], check=True)
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from gbv.engine import host_kernels  # (the installed build, imported here: the caller's path is set up)

    for attribute in dir(host_kernels._host_kernels):
        if not attribute.startswith("_") and not hasattr(module, attribute):
            setattr(module, attribute, getattr(host_kernels._host_kernels, attribute))
    return module
