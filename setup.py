"""Build of mps_ext's native extension, mps_ext._C.

On every platform it holds the op layer (csrc/ops), the launch interface and
the CPU Metal executor backend (csrc/backend, csrc/cpu_metal); on macOS also
the Metal backend (csrc/backend/metal.mm, Objective-C++). The shaders of
kernels_metal/ are flattened and embedded (tools/embed_shaders.py). Install
with

    pip install --no-build-isolation .
"""

import glob
import os
import sys

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import embed_shaders  # noqa: E402

GENERATED = os.path.join("csrc", "generated", "shaders.cpp")
embed_shaders.generate(embed_shaders.Path(ROOT) / GENERATED)

sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
compile_args = ["-O2", "-std=c++17", "-fvisibility=hidden"]
link_args = []
if sys.platform == "darwin":
    sources += sorted(glob.glob("csrc/**/*.mm", recursive=True))
    compile_args += ["-fobjc-arc"]
    link_args += ["-framework", "Metal", "-framework", "Foundation"]

setup(
    packages=find_packages(include=["mps_ext", "mps_ext.*"]),
    package_data={"mps_ext.cpu_metal": ["include/*.h", "include/scan/*"]},
    ext_modules=[
        CppExtension(
            name="mps_ext._C",
            sources=sources,
            include_dirs=[
                os.path.join(ROOT, "csrc"),
                os.path.join(ROOT, "kernels_metal"),
                os.path.join(ROOT, "mps_ext", "cpu_metal", "include"),
            ],
            extra_compile_args={"cxx": compile_args},
            extra_link_args=link_args,
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
