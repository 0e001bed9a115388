"""Build of mps_ext's native extension, mps_ext._C.

On every platform it holds the op layer (csrc/ops) and the launch interface
(csrc/backend); on macOS also the Metal backend (csrc/backend/metal.mm,
Objective-C++). The shaders of kernels_metal/ are flattened and embedded
(tools/embed_shaders.py). The CPU Metal executor, which runs the kernels on
CPU tensors in tests, is a package of its own (executor/, installed by
scripts/setup.sh) and nothing of it is built or shipped here. Install with

    pip install --no-build-isolation .

The torch requirement is every supported release (tools/build_config.py);
with MPS_EXT_PIN_TORCH=1 (the release workflow) the wheel is for the torch
installed now: its requirement names that minor release only and its
version carries it ("0.1.0+torch2.13"), docs/dev/release.md.
"""

import os
import sys

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import build_config  # noqa: E402
import embed_shaders  # noqa: E402

embed_shaders.generate(build_config.ROOT / build_config.GENERATED)
# Relative paths, as setuptools wants them; no -std flag (tools/build_config.py).
sources = [str(p.relative_to(build_config.ROOT)) for p in build_config.sources(build_config.ROOT, sys.platform)]
pinned_to = torch.__version__ if os.environ.get(build_config.PIN_TORCH_ENV) == "1" else None

setup(
    install_requires=[build_config.torch_requirement(pinned_to), "numpy"],
    # The local version label goes on through egg_info's tag_build: the
    # version itself is mps_ext.__version__ (pyproject.toml), which a
    # version= given here would not override.
    options={"egg_info": {"tag_build": build_config.local_version(pinned_to)}} if pinned_to else {},
    packages=find_packages(include=["mps_ext", "mps_ext.*"]),
    ext_modules=[
        CppExtension(
            name="mps_ext._C",
            sources=sources,
            include_dirs=[str(d) for d in build_config.include_dirs(build_config.ROOT)],
            extra_compile_args={"cxx": build_config.compile_args(sys.platform)},
            extra_link_args=build_config.link_args(sys.platform),
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
