"""Build of the optional native kernels, ``pocketlm._native`` (metadata lives in pyproject.toml).

The extension is compiled from ``pocketlm/runtime/csrc/*.c`` for the baseline of the target
architecture: the AVX2 and AVX-512 kernels carry per-function target attributes and are chosen
at run time, so one build runs on any x86-64 CPU (and the portable kernels on ARM).

The extension is optional: if it cannot be compiled (no C compiler, missing Python headers),
the install still succeeds, a warning is printed, and pocketlm uses its numpy kernels.
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# build_flags.py sits next to this file; a PEP 517 build does not put this folder on sys.path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import build_flags  # noqa: E402  (the compiler flags, shared with tests/test_arm_build.py)

CSRC = os.path.join("pocketlm", "runtime", "csrc")

WARNING = """
******************************************************************************************
WARNING: the native kernels of pocketlm (pocketlm._native) could not be built:
  {error}
pocketlm is installed and works, but uses its (slower) numpy kernels.
To get the native kernels, install a C compiler (gcc or clang) and the Python development
headers, then reinstall: pip install -e .   (or pip install .)
******************************************************************************************
"""


class OptionalBuildExt(build_ext):
    """build_ext whose failure leaves the package usable without the extension."""

    def build_extensions(self):
        ctype = self.compiler.compiler_type
        for ext in self.extensions:
            if ctype == "msvc":
                ext.extra_compile_args = list(build_flags.MSVC_CFLAGS)
            else:
                ext.extra_compile_args = list(build_flags.CFLAGS)
                ext.extra_link_args = list(build_flags.LDFLAGS)
        super().build_extensions()

    def run(self):
        try:
            super().run()
        except Exception as e:  # no compiler, platform error: never fail the install
            self._warn(e)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            self._warn(e)

    @staticmethod
    def _warn(error):
        sys.stderr.write(WARNING.format(error=f"{type(error).__name__}: {error}"))
        sys.stderr.flush()


setup(
    ext_modules=[
        Extension(
            "pocketlm._native",
            sources=sorted(glob.glob(os.path.join(CSRC, "*.c"))),
            depends=sorted(glob.glob(os.path.join(CSRC, "*.h"))
                           + glob.glob(os.path.join(CSRC, "*.inc"))),
            include_dirs=[CSRC],
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
