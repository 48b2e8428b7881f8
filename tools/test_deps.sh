#!/usr/bin/env bash
# Test-only packages that cannot be ordinary dependencies, for the Python in $PYTHON (default:
# the active `python`), at the versions constraints/cpu.txt pins for it:
#   Megatron-Bridge without its own requirements (they pull GPU-only packages; its pure-Python
#   ones come with the test extra). Tests import it through megatron_scalevec/testing/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" -m pip install -q --no-deps -c constraints/cpu.txt megatron-bridge
