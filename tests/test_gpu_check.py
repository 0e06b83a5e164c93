"""tools/gpu_check.py, the one command a GPU host runs: here on the host (``--device cpu``), its
verdicts from made-up rank results, a check run against a wrong reference, and the calibrate
check against stand-in commands."""
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
LINE = re.compile(r"^(PASS|FAIL|SKIP) (\w+): (.+) \((\d+\.\d) s\)$")


def _load(name: str):
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))  # gpu_check imports gpu_check_paths from beside it
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check")


@pytest.mark.multirank
def test_every_path_passes_on_the_host_in_one_launch():
    """Every launched check, PASS, one line each in the documented form, one launch of 2 ranks.
    (calibrate's run is its own command's to test; its check is tested below with stand-ins.)"""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, str(TOOLS / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--skip", "calibrate"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    seconds = time.perf_counter() - t0
    lines = done.stdout.strip().splitlines()
    verdicts = [LINE.match(line) for line in lines[:-1]]
    assert all(verdicts), done.stdout + done.stderr
    assert [m.group(2) for m in verdicts] == list(gpu_check.LAUNCHED), done.stdout
    assert [m.group(1) for m in verdicts] == ["PASS"] * len(gpu_check.LAUNCHED), done.stdout
    assert lines[-1].startswith(f"gpu_check: {len(gpu_check.LAUNCHED)} checks, {len(gpu_check.LAUNCHED)} PASS, 0 FAIL")
    assert done.returncode == 0, done.stdout + done.stderr
    assert seconds < 120, seconds  # measured ~15 s on the 2 shared cores; the bound is the hang guard


def _ranks(*statuses, detail="ok"):
    return [{"rank": r, "status": s, "detail": f"{detail} {r}", "seconds": 1.0 + r} for r, s in enumerate(statuses)]


def test_a_check_passes_only_when_every_rank_passed():
    assert gpu_check.verdict("x", _ranks("PASS", "PASS"), 2) == gpu_check.Verdict("PASS", "x", "ok 0", 2.0)
    v = gpu_check.verdict("x", _ranks("PASS", "FAIL", "FAIL"), 3)
    assert (v.status, v.detail) == ("FAIL", "rank 1: ok 1")
    v = gpu_check.verdict("x", _ranks("PASS"), 2, error="RankFailedError: rank 1 died", seconds=9.0)
    assert (v.status, v.detail, v.seconds) == ("FAIL", "1 of 2 ranks reported: RankFailedError: rank 1 died", 9.0)
    assert gpu_check.verdict("x", [], 2, error="timed out after 5 s", seconds=35.0).line() == \
        "FAIL x: 0 of 2 ranks reported: timed out after 5 s (35.0 s)"
    assert gpu_check.verdict("x", _ranks("SKIP", "SKIP"), 2).status == "SKIP"
    assert gpu_check.verdict("x", _ranks("SKIP", "PASS"), 2).detail == "ranks disagree: ['PASS', 'SKIP']"
    passed, failed = gpu_check.Verdict("PASS", "a", "", 0), gpu_check.Verdict("FAIL", "b", "", 0)
    assert gpu_check.exit_code([passed, gpu_check.Verdict("SKIP", "c", "", 0)]) == 0
    assert gpu_check.exit_code([passed, failed]) == 1


def test_where_each_check_runs():
    """Two ranks on NCCL given two GPUs; on one GPU NCCL at world size 1 for the launch and gloo
    with both ranks on the GPU for the rest; the host over gloo. --quick: one launch per backend."""
    names = list(gpu_check.LAUNCHED)
    assert gpu_check.batches(names, "cuda", 2, quick=True) == [("nccl", 2, names)]
    assert gpu_check.batches(names, "cuda", 1, quick=True) == [("nccl", 1, ["launch"]), ("gloo", 2, names[1:])]
    assert gpu_check.batches(names, "cpu", 0, quick=True) == [("gloo", 2, names)]
    assert gpu_check.batches(names, "cuda", 4, quick=False) == [("nccl", 2, [n]) for n in names]


def test_without_a_gpu_every_check_is_skipped(capsys):
    if _cuda_devices():
        pytest.skip("this host has a GPU")
    verdicts = gpu_check.run(gpu_check.parse(["--only", "launch,calibrate"]))
    assert [(v.status, v.name) for v in verdicts] == [("SKIP", "launch"), ("SKIP", "calibrate")]
    assert capsys.readouterr().out.startswith("SKIP launch: no GPU")
    with pytest.raises(SystemExit):
        gpu_check.parse(["--only", "launch,warp_drive"])


def _cuda_devices() -> int:
    import torch
    return torch.cuda.device_count()


def test_a_check_against_a_wrong_reference_fails():
    """parallelize's check in this process (tp 1, no process group), its reference computed from
    another seed's model: the check reports the mismatch, and its verdict is FAIL."""
    import torch

    paths = _load("gpu_check_paths")
    from tensorpar.models.tiny import make_tiny_model
    ctx = paths.Ctx(0, 1, torch.device("cpu"), Path("."), quick=True)
    assert paths.check_parallelize(ctx).startswith("none x1 on cpu: float64 logits")  # the right reference: passes

    def other_seed(dense, ids, cotangent):
        return paths.dense_run(make_tiny_model("llama", seed=5), ids, cotangent)

    with pytest.raises(paths.Mismatch, match=r"tp 1 torch.float64: \d+ of \d+ above 1e-10: logits"):
        paths.check_parallelize(ctx, _reference=other_seed)


def _stand_in(tmp_path, body: str) -> list:
    script = tmp_path / "calibrate_stand_in.py"
    script.write_text("import json, sys\nargs = sys.argv[1:]\n" + body)
    return [sys.executable, str(script)]


def test_the_calibrate_check(tmp_path):
    missing = _stand_in(tmp_path, "sys.exit(\"tensorpar: error: argument command: invalid choice: 'calibrate'\")")
    v = gpu_check.check_calibrate(tmp_path, 30, command=missing)
    assert (v.status, v.detail) == ("SKIP", "`tensorpar calibrate` does not exist yet (tensorpar: error: argument "
                                            "command: invalid choice: 'calibrate')")
    writes = _stand_in(tmp_path, "if '--help' in args:\n    print('--ranks --out --quick'); sys.exit(0)\n"
                                 "assert args[:2] == ['--ranks', '2'] and args[-1] == '--quick', args\n"
                                 "open(args[3], 'w').write(json.dumps({'gemm': {}, 'links': []}))\n")
    v = gpu_check.check_calibrate(tmp_path, 30, command=writes)
    assert (v.status, v.detail) == ("PASS", "wrote a profile of 2 fields (gemm, links)")
    fails = _stand_in(tmp_path, "if '--help' in args:\n    sys.exit(0)\nsys.exit('calibrate: no room')\n")
    v = gpu_check.check_calibrate(tmp_path, 30, command=fails)
    assert (v.status, v.detail) == ("FAIL", "exit status 1: calibrate: no room")
    silent = _stand_in(tmp_path, "sys.exit(0)\n")
    assert gpu_check.check_calibrate(tmp_path / "empty", 30, command=silent).status == "FAIL"
