"""The benchmark harness runs and reports what it claims (timings themselves are not tested)."""
import os
import subprocess
import sys

import pytest

from tensorpar.bench.mlp import run_mlp_bench
from tensorpar.bench.report import mlp_table


@pytest.mark.multirank
def test_mlp_bench_rows_are_complete_and_the_variants_agree():
    rows = run_mlp_bench(sizes=((16, 64),), repeats=3)
    assert [r["pass"] for r in rows] == ["fwd", "fwd+bwd"]
    for r in rows:
        assert set(r["median_s"]) == {"tensorpar", "torch_tp", "dense_2t", "floor", "floor_parts"}
        assert all(v > 0 for v in r["median_s"].values())
        assert r["tensorpar_vs_torch_tp"] == r["median_s"]["tensorpar"] / r["median_s"]["torch_tp"]
        assert r["max_abs_diff"] <= 1e-5  # both parallel MLPs compute the dense one (float32)
    table = mlp_table(rows)
    assert table.count("\n") == 2 + len(rows) and "| 16 | 64 | fwd |" in table


@pytest.mark.parametrize("args, message", [
    (["--suite", "gpu"], "--suite 'gpu': unknown ['gpu']; valid: mlp, models"),
    (["--repeats", "1"], "--repeats 1: need at least 3 rounds for a median"),
])
def test_bench_bad_arguments(args, message):
    r = subprocess.run([sys.executable, "-m", "tensorpar", "bench", *args], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
