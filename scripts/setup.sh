#!/usr/bin/env bash
# Sets up a machine to build, test and run mps_ext from this checkout:
# clang (the CPU Metal executor compiles Metal shaders with it), the pinned
# torch, the package itself, built in place (editable), and the CPU Metal
# executor (executor/, a package of its own that the tests install as
# mps_ext's backend of CPU tensors; users do not need it).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname)" = "Linux" ] && ! command -v clang++-19 >/dev/null && ! command -v clang++ >/dev/null; then
  SUDO=""
  if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq clang-19 >/dev/null
fi

# Pin torch: an unpinned or ranged torch pulls the newest build, with several
# GB of CUDA packages on Linux.
python -m pip install -q "torch==${MPS_EXT_TORCH:-2.13.0}" numpy pytest pybind11 ninja setuptools wheel
# The test extra (pyproject.toml) pins the model libraries the tests run;
# MPS_EXT_TEST_HOOKS=1 builds the op layer's test hooks into mps_ext._C
# (tools/build_config.py): a user's build has none.
MPS_EXT_TEST_HOOKS=1 python -m pip install -q --no-build-isolation -e ".[test]"
# After mps_ext: the executor compiles against this checkout's csrc/ headers
# and registers with its mps_ext._C at run time.
python -m pip install -q --no-build-isolation -e executor
