"""Build of the CPU Metal executor, mps_ext_executor (a package of its own,
not needed by mps_ext's users).

Its extension, mps_ext_executor._C, holds the executor's engine, its CPU
backend for mps_ext's op layer and the test hooks of that backend. It is
compiled against the product's launch interface (../csrc/backend/launch.h,
this repository) and registers with mps_ext._C at run time
(mps_ext_executor.install()): neither extension links the other. Flags and
sources come from ../tools/build_config.py, as mps_ext's own do. Installed
by ../scripts/setup.sh, after mps_ext:

    pip install --no-build-isolation -e executor
"""

import os
import re
import sys

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tools"))
import build_config  # noqa: E402


def product_version() -> str:
    """mps_ext's __version__: the executor is built from the same checkout."""
    text = open(os.path.join(REPO, "mps_ext", "__init__.py")).read()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


# setuptools wants sources relative to this directory.
sources = [os.path.relpath(p, HERE) for p in build_config.executor_sources(build_config.ROOT)]

setup(
    version=product_version(),
    packages=["mps_ext_executor"],
    package_data={"mps_ext_executor": ["include/*.h", "include/scan/*"]},
    ext_modules=[
        CppExtension(
            name="mps_ext_executor._C",
            sources=sources,
            include_dirs=[str(d) for d in build_config.executor_include_dirs(build_config.ROOT)],
            extra_compile_args={"cxx": build_config.compile_args(sys.platform)},
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
