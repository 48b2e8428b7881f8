"""tools/gpu_check.sh's vs-shared table (no GPU needed: it is text in, text out): columns found
by header name, peak ratios from the "peak ratio" column, time against shared's median."""

import os
import re
import subprocess

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "tools", "gpu_check.sh")
_TABLE = """baseline: stock median step 100.0 ms
| variant | params | +params | step ms | spread | time/stock | time/shared | ± vs stock | act MiB \
| act/stock | act/shared | state ratio | fold % | faults | peak ratio |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| stock | 1 | 0 | 100.0 | ±1% | 1.000 | 0.909 | ±0 | 9.0 | 1.000 | 1.1 | 1.0 | 0 | 0 | 1.000 |
| shared | 1 | 0 | 110.0 | ±1% | 1.100 | 1.000 | ±0 | 8.0 | 0.889 | 1.0 | 1.0 | 0 | 0 | 0.950 |
| unified | 1 | 0 | 121.0 | ±1% | 1.210 | 1.100 | ±0 | 7.0 | 0.778 | 0.875 | 1.0 | 0 | 0 | 0.900 |
"""


def test_vs_shared_reads_columns_by_name():
    text = open(_SCRIPT).read()
    func = re.search(r"^vs_shared\(\) \{.*?^\}$", text, re.S | re.M).group(0)
    out = subprocess.run(["bash", "-c", func + "\nvs_shared"], input=_TABLE, text=True,
                         capture_output=True, check=True).stdout
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in out.splitlines() if r.startswith("| ") and "variant" not in r}
    assert out.splitlines()[0] == "baseline: stock median step 100.0 ms"
    assert rows["unified"] == ["121.0", "1.210", "1.100", "0.900", "0.947"], rows
    assert rows["stock"] == ["100.0", "1.000", "0.909", "1.000", "1.053"], rows
