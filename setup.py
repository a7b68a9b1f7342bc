"""Build hook for the compiled core in native/ (metadata lives in pyproject.toml)."""
import glob
import os
import sys

from setuptools import Extension, setup

_here = os.path.dirname(os.path.abspath(__file__))


def _native_extension() -> Extension:
    # Portable flags only: no -march, so wheels run on any CPU of the target architecture.
    # reduce.c adds AVX2 clones selected at load time on x86-64 glibc (target_clones).
    sources = sorted(os.path.relpath(p, _here) for p in glob.glob(os.path.join(_here, "native", "*.c")))
    compile_args = [] if sys.platform == "win32" else ["-O3", "-std=c11", "-ftree-vectorize", "-Wall", "-pthread"]
    return Extension(
        "hpcring._native",
        sources=sources,
        include_dirs=["native"],
        depends=sorted(os.path.relpath(p, _here) for p in glob.glob(os.path.join(_here, "native", "*.h"))),
        extra_compile_args=compile_args,
        extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
    )


setup(ext_modules=[_native_extension()])
