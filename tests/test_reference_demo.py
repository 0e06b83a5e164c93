"""The MLP demo (tensorpar.reference.demo) and the `tensorpar demo` sub-command."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorpar.reference.demo as demo_module
from tensorpar.cli import main
from tensorpar.reference import run_mlp_demo

ROOT = Path(__file__).resolve().parents[1]


def test_default_demo_reproduces_the_exercise_numbers():
    r = run_mlp_demo()
    assert r.equal and r.log_matches_formula
    assert r.x_shape == (2, 16, 64) and r.w1_shard_shape == (64, 64) and r.w2_shard_shape == (64, 64)
    assert [c.op for c in r.collectives] == ["all_reduce"]
    assert r.collectives[0].payload_bytes == 16_384
    assert r.bytes_sent_per_rank == (24_576,) * 4 == (r.expected_bytes_per_rank,) * 4
    assert r.weight_bytes == 2 * 64 * 256 * 8 and r.weight_bytes_per_device == r.weight_bytes // 4
    assert 0 < r.max_abs_diff <= r.max_error_bound < 1e-10
    assert r.advice.choice == "out,in"


@pytest.mark.parametrize("p, kw", [(1, {}), (2, {"batch": 1, "tokens": 3, "hidden": 5}),
                                   (8, {"hidden": 4, "ffn_mult": 2, "seed": 7}), (3, {"hidden": 6, "ffn_mult": 1})])
def test_demo_is_equal_for_other_sizes(p, kw):
    r = run_mlp_demo(p, **kw)
    assert r.equal and r.log_matches_formula and r.p == p
    assert len(r.bytes_sent_per_rank) == p


def test_a_wrong_split_is_reported(monkeypatch):
    real = demo_module.mlp_tensor_parallel

    def off_by_a_little(*args, **kwargs):
        y = real(*args, **kwargs)
        return y + 1e-9 * np.abs(y).max()

    monkeypatch.setattr(demo_module, "mlp_tensor_parallel", off_by_a_little)
    assert not run_mlp_demo().equal
    assert main(["demo"]) == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"p": 3}, "has 256 elements, which do not divide evenly into p=3"),
    ({"p": 0}, "p must be a positive integer"),
    ({"hidden": 2.5}, "hidden must be a positive integer"),
    ({"tokens": 0}, "tokens must be a positive integer"),
    ({"seed": -1}, "seed must be a non-negative integer, got -1"),
])
def test_demo_validates_its_arguments(kwargs, message):
    p = kwargs.pop("p", 4)
    with pytest.raises(ValueError, match=message):
        run_mlp_demo(p, **kwargs)


def test_cli_prints_the_demo(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "split == unsplit: yes" in out
    assert "all_reduce of (2, 16, 64) float64, N = 16,384 bytes: 24,576, 24,576, 24,576, 24,576" in out
    assert "out,in*" in out


def test_cli_json_is_one_object(capsys):
    assert main(["demo", "--json", "--p", "2", "--tokens", "4", "--hidden", "8", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    d = json.loads(out)
    assert out.count("\n") == 1
    assert d["p"] == 2 and d["x_shape"] == [2, 4, 8] and d["equal"] is True and d["log_matches_formula"]
    assert d["bytes_sent_per_rank"] == [512, 512]  # Y: 2*4*8 float64 = 512 B; 2 (p-1)/p * 512
    assert d["collectives"][0]["op"] == "all_reduce" and d["advice"]["choice"] == "out,in"


def test_cli_bad_p_is_one_line_on_stderr_and_exit_2(capsys):
    assert main(["demo", "--p", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorpar demo: error: ") and err.count("\n") == 1 and "valid p: 1, 2, 4" in err


def test_python_dash_m_tensorpar_demo_json():
    r = subprocess.run([sys.executable, "-m", "tensorpar", "demo", "--json"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes_sent_per_rank"] == [24_576] * 4
