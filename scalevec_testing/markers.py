"""Pytest markers shared by the test files, defined once here and imported where used.

Why a module and not a line per file: every TE test skips on the same condition, and CI must
turn that skip into a failure in the same way everywhere. Why not in another test file: a test
file never imports another (tests/test_import_cycles.py checks it), so helpers that several files
need live in scalevec_testing/.

``needs_megatron_lm``: skip unless ``MEGATRON_LM_ROOT`` names a Megatron-LM checkout (with
``MEGATRON_SCALEVEC_REQUIRE_MEGATRON_LM=1``, CI's, a missing one fails instead).

``needs_te``: skip unless Transformer Engine's Python is importable (its compiled extension is
stood in for by te_stub inside the forked ranks). CI (.ci/run) installs it and sets
``MEGATRON_SCALEVEC_REQUIRE_TE=1``: there a missing TE fails instead of skipping.
"""

import os

import pytest

from scalevec_testing import megatron_lm, te_stub

TE_REQUIRED = os.environ.get("MEGATRON_SCALEVEC_REQUIRE_TE") == "1"  # CI: fail, never skip
needs_te = pytest.mark.skipif(not te_stub.available() and not TE_REQUIRED,
                              reason="TE's Python not installed (.ci/run puts it in .te_python)")

_MLM_MISSING = megatron_lm.missing()
needs_megatron_lm = pytest.mark.skipif(  # CI (required): the tests run and fail, never skip
    _MLM_MISSING is not None and not megatron_lm.required(),
    reason=_MLM_MISSING or "Megatron-LM checkout present")
