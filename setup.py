"""The compiled parts of gbv: the host forward's kernels (gbv/engine/_host_kernels.c) and the
verifiers' host-form helpers (gbv/verify/_verify_kernels.c). Everything else is in pyproject.toml.
Both extensions are optional: where they do not build (no C compiler), gbv installs without them, the
host forward uses torch's products and attention (gbv/engine/host_kernels.py says which is in use)
and the verifiers their numpy code (the same results)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gbv.engine._host_kernels",
            sources=["gbv/engine/_host_kernels.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "gbv.verify._verify_kernels",
            sources=["gbv/verify/_verify_kernels.c"],
            extra_compile_args=["-O2", "-ffp-contract=off"],
            optional=True,
        ),
    ]
)
