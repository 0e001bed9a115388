"""Build of mps_ext's native extension, mps_ext._C.

On every platform it holds the op layer (csrc/ops), the CPU Metal executor
(csrc/cpu_metal) and the executor backend; on macOS also the Metal backend
(csrc/backend/metal, Objective-C++). Install with

    pip install --no-build-isolation .
"""

import glob
import os
import sys

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources():
    cpp = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    if sys.platform == "darwin":
        cpp += sorted(glob.glob("csrc/**/*.mm", recursive=True))
    return cpp


compile_args = ["-O2", "-std=c++17", "-fvisibility=hidden"]
link_args = []
if sys.platform == "darwin":
    compile_args += ["-ObjC++"] if False else []
    link_args += ["-framework", "Metal", "-framework", "Foundation"]

setup(
    packages=find_packages(include=["mps_ext", "mps_ext.*"]),
    package_data={"mps_ext.cpu_metal": ["include/*.h", "include/scan/*"]},
    ext_modules=[
        CppExtension(
            name="mps_ext._C",
            sources=sources(),
            include_dirs=[os.path.join(ROOT, "csrc"), os.path.join(ROOT, "mps_ext", "cpu_metal", "include")],
            extra_compile_args={"cxx": compile_args},
            extra_link_args=link_args,
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
