"""The one compiled part of gbv: the host forward's kernels (gbv/engine/_host_kernels.c). Everything
else is in pyproject.toml. The extension is optional: where it does not build (no C compiler), gbv
installs without it and the host forward uses torch's products and attention
(gbv/engine/host_kernels.py says which is in use)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gbv.engine._host_kernels",
            sources=["gbv/engine/_host_kernels.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
