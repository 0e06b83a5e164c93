"""`tensorpar run` and `tensorpar verify` end to end, through a subprocess, as a user runs them."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multirank
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def tensorpar(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tensorpar", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tensorpar.models.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {"llama": make_tiny_checkpoint(root / "llama", "llama"),
            "gpt2": make_tiny_checkpoint(root / "gpt2", "gpt2")}


def test_verify_json_agrees_at_every_layer(checkpoints):
    r = tensorpar("verify", "--model", str(checkpoints["llama"]), "--tp", "2,4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and [c["tp"] for c in out["checks"]] == [2, 4]
    for c in out["checks"]:
        names = [lay["name"] for lay in c["layers"]]
        assert names == ["embeddings", "block 0", "block 1"]
        for lay in c["layers"]:
            assert max(lay["activation_rel"], lay["activation_grad_rel"], lay["param_grad_norm_rel"]) <= 1e-5
        assert c["first_divergence"] is None
        assert abs(c["loss_split"] - c["loss_dense"]) <= 1e-5 * abs(c["loss_dense"])


def test_verify_names_the_first_diverging_layer(checkpoints):
    r = tensorpar("verify", "--model", str(checkpoints["gpt2"]), "--tp", "2", "--inject-fault", "1", "--json")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    check = out["checks"][0]
    assert not out["ok"] and check["first_divergence"] == "block 1"
    acts = {lay["name"]: lay["activation_rel"] for lay in check["layers"]}
    assert acts["block 0"] <= 1e-5 < acts["block 1"]  # the fault is invisible before its block
    assert "diverged at tp=2: block 1" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["verify", "--model", "/nonexistent/dir"], "model directory '/nonexistent/dir' does not exist"),
    (["verify", "--model", "{llama}", "--tp", "3"], "valid tp sizes: 1, 2, 4"),
    (["verify", "--model", "{llama}", "--tp", "two"], "--tp 'two' must be comma-separated integers"),
    (["verify", "--model", "{llama}", "--dtype", "int8"], "--dtype 'int8' is not supported; valid:"),
    (["verify", "--model", "{unsupported}"], "model type 't5' in"),
])
def test_errors_are_one_line_with_exit_code_2(checkpoints, tmp_path, args, message):
    bad = tmp_path / "t5"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "t5"}))
    (bad / "model.safetensors").write_bytes(b"")
    args = [a.format(llama=checkpoints["llama"], unsupported=bad) for a in args]
    r = tensorpar(*args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert r.stdout == ""
