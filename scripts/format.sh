#!/usr/bin/env bash
# Formats the repository as tests/test_lint.py checks it (tools/format.py):
# clang-format over csrc/, executor/csrc/ and kernels_metal/, and the Python lines ruff finds
# too long; then lists anything still wrong (exit status 1). --check changes
# nothing. Needs the test extra (pip install -e ".[test]"): it pins both.
set -euo pipefail
cd "$(dirname "$0")/.."
python tools/format.py "$@"
