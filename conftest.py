"""Put the repository root on sys.path and enable the CPU layer before megatron is imported."""

import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.abspath(__file__))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# The fused DNP kernels stay eager in tests (subprocesses and forked ranks inherit this):
# compiling every shape of every test would cost more than the tests themselves.
os.environ.setdefault("MEGATRON_SCALEVEC_FUSED_COMPILE", "off")

# The test-only stand-ins (scalevec_testing: TE's kernels, Bridge's GPU imports) are opted into
# explicitly; forked ranks and subprocesses inherit it.
os.environ["MEGATRON_SCALEVEC_STANDINS"] = "1"

# Transformer Engine's wheel without its compiled extension (CI installs it for the TE tests,
# which activate scalevec_testing/te_stub.py in their forked ranks) must look absent to
# megatron-core.
from scalevec_testing.te_stub import hide_unusable_te  # noqa: E402

hide_unusable_te()

from megatron_scalevec.compat.cpu import enable_cpu_compat  # noqa: E402

enable_cpu_compat()

# Each test's time budget (its call, setup and teardown apart): a test slower than this fails
# with its time, so one slow test cannot quietly push a CI leg past its 35 minutes. The suite
# prints its slowest tests at the end (pyproject.toml: --durations).
TEST_BUDGET_S = float(os.environ.get("MEGATRON_SCALEVEC_TEST_BUDGET_S", "300"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.passed and report.duration > TEST_BUDGET_S:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {report.duration:.0f} s, over the per-test "
                           f"budget of {TEST_BUDGET_S:.0f} s (MEGATRON_SCALEVEC_TEST_BUDGET_S)")
    return report


# The slowest 30 tests (setup + call + teardown) written to a file when
# MEGATRON_SCALEVEC_DURATIONS_FILE names one (.ci/run does, per leg), so growth stays visible.
_durations: dict = {}


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("MEGATRON_SCALEVEC_DURATIONS_FILE")
    if not path or not _durations:
        return
    slowest = sorted(_durations.items(), key=lambda kv: -kv[1])[:30]
    by_file: dict = {}
    for nodeid, t in _durations.items():
        by_file[nodeid.split("::")[0]] = by_file.get(nodeid.split("::")[0], 0.0) + t
    with open(path, "w") as f:
        f.write(f"# slowest 30 of {len(_durations)} tests; all together "
                f"{sum(_durations.values()):.0f} s\n")
        f.writelines(f"{t:8.1f} s  {nodeid}\n" for nodeid, t in slowest)
        f.write("# slowest 15 files\n")
        f.writelines(f"{t:8.1f} s  {name}\n"
                     for name, t in sorted(by_file.items(), key=lambda kv: -kv[1])[:15])
