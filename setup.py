"""Build hook for the optional C codec kernels (pipeline/_ckernels.c); everything else is in setup.cfg.

The extension is optional: where no compiler or Python headers exist, the build goes on without it
and pipeline/kernels.py falls back to the numpy path, which writes the same bytes. The flags keep
float32 arithmetic exactly IEEE and unfused (no -ffast-math; -ffp-contract=off forbids turning
a multiply and an add into one FMA), so the kernel's bytes equal the numpy path's (tests/test_kernels.py).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "pipeline._ckernels", ["pipeline/_ckernels.c"], optional=True,
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-finite-math-only",
                        "-std=c11", "-Wall"],
)])
