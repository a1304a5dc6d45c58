"""Builds jaxlm's native CPU kernels (`jaxlm/kernels/csrc`, C++17) against the XLA FFI headers
that ship with jaxlib (a build requirement). The extension is optional: where it does not
compile, jaxlm installs without it and `jaxlm.ops` runs XLA's products."""

from pathlib import Path

from setuptools import Extension, setup

CSRC = Path("jaxlm") / "kernels" / "csrc"


def _extensions() -> list[Extension]:
    try:
        import jaxlib
    except ImportError:
        return []
    return [
        Extension(
            "jaxlm.kernels._native",
            sources=[str(p) for p in sorted(CSRC.glob("*.cc"))],
            include_dirs=[str(Path(jaxlib.__file__).parent / "include")],
            depends=[str(CSRC / "common.h")],
            # No fused multiply-adds contracted from the rounding of activations, which must
            # round as `jaxlm.ops` rounds them for XLA, in every path's build (GCC contracts
            # C++ wherever the target has them).
            extra_compile_args=["-std=c++17", "-O3", "-g0", "-ffp-contract=off"],
            language="c++",
            optional=True,
        )
    ]


setup(ext_modules=_extensions())
