#!/usr/bin/env bash
# The tests, as CI runs them (.ci/run): the whole suite (arguments go to its
# pytest, e.g. -m "not mac"), then, on x86-64, the tests marked
# torch_cpu_oracle (they compare with torch's CPU kernels) again with those
# kernels capped at each lower instruction set this CPU runs, so that a
# test that holds only on the machine it was written on fails here.
#
# What the caps change (torch 2.13): ATEN_CPU_CAPABILITY picks the
# vectorised kernels (softmax, sigmoid, the random normal fill, ...);
# ONEDNN_MAX_CPU_ISA oneDNN's convolution and, on a CPU with AMX, its
# _scaled_mm; MKL_ENABLE_INSTRUCTIONS MKL's BLAS and LAPACK. The AVX2 level
# runs only where the CPU has AVX-512: elsewhere it is the whole suite's.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pytest -q "$@"

[ "$(uname -m)" = x86_64 ] || exit 0

LEVELS=("default ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2")
if grep -qw avx512f /proc/cpuinfo; then
  LEVELS+=("avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2")
else
  echo "torch's CPU kernels capped at AVX2: the run above (this CPU has no AVX-512)"
fi
for level in "${LEVELS[@]}"; do
  read -r name caps <<< "$level"
  echo "torch's CPU kernels capped at ${name}: ${caps}"
  env $caps python -m pytest -q -m torch_cpu_oracle
done
