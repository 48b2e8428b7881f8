#!/usr/bin/env bash
# Test-only packages that cannot be ordinary dependencies, for the Python in $PYTHON (default:
# the active `python`), at the versions constraints/cpu.txt pins for it:
#   Megatron-Bridge without its own requirements (they pull GPU-only packages; its pure-Python
#   ones come with the test extra). Tests import it through scalevec_testing/.
#   Transformer Engine's pure-Python wheel (no core library, no compiled extension) at the
#   version the Python's megatron-core accepts, beside the venv in .te_python/pyX.Y, where only
#   scalevec_testing/te_stub.py looks for it (nothing else imports it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" -m pip install -q --no-deps -c constraints/cpu.txt megatron-bridge
dir=".te_python/py$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
rm -rf "$dir"
"$PY" -m pip install -q --no-deps --target "$dir" -c constraints/cpu.txt transformer-engine einops
