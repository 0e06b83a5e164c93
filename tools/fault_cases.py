"""The cases `make faults` runs (tools/faults.py is the engine that runs and judges them).

Four kinds of case:

- a **command line** from one of the lists the tests also run (:data:`CLI_LISTS`), judged by its
  exit code and its one line on stderr; ``{name}`` in an argument is a folder its fixture group
  made (:data:`FIXTURES`);
- a **security** case: ``tensorpar train --resume`` on a crafted checkpoint, judged by the one
  line and by what it left: no code run (the payload's marker file absent), the victim copy
  beside the checkpoint unchanged;
- an **API** call (:data:`API_CASES`), each a function here returning ``(outcome, detail)``;
- a **launch fault** (:data:`LAUNCH_FAULTS`): a launch whose rank raises, dies, is stopped,
  waits for a peer that never comes, ...; judged by the named error, its words and the seconds
  it took.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (module, list, class, fixture group): lists of (argv, expected words) the tests run too
CLI_LISTS = [
    ("tests.test_cli_jobs", "VERIFY_ERRORS", "bad input", "jobs"),
    ("tests.test_cli_jobs", "RUN_ERRORS", "bad input", "jobs"),
    ("tests.test_cli_jobs", "NESTED_ERRORS", "bad input", "jobs"),
    ("tests.test_models_generation", "RUN_ID_ERRORS", "bad input", "jobs"),
    ("tests.test_cli_train", "TRAIN_ERRORS", "bad input", "train"),
    ("tests.test_planner_cli", "PLAN_ERRORS", "bad input", "plan"),
    ("tests.test_dist", "LAUNCH_CLI_ERRORS", "bad input", "out"),
    ("tests.test_serve_server", "SERVE_ERRORS", "bad input", "serve"),
    ("tools.fault_cases", "MORE_BAD_INPUTS", "bad input", "jobs"),
    ("tools.fault_cases", "VALID_INPUTS", "valid input", "jobs"),
]
MORE_BAD_INPUTS = [
    (["plan", "--model", "llama-2-7b", "--tp", "0"], "tp (0) must be a positive integer"),
    (["plan", "--model", "no-such-model"], "no-such-model"),
    (["plan", "--model", "llama-2-7b", "--pp", "0"], "pp (0) must be a positive integer"),
    (["plan", "--model", "llama-2-7b", "--search"], "--devices"),
    (["bench", "--suite", "nope"], "--suite 'nope': unknown ['nope']; valid:"),
    (["bench", "--repeats", "1"], "--repeats 1: need at least 3 rounds"),
    (["run", "--dtype", "int8"], "--dtype 'int8' is not supported; valid:"),
    (["verify", "--model", "{llama}", "--tp", ""], "--tp needs at least one size"),
    (["verify", "--model", "{llama}", "--inject-fault", "9"], "--inject-fault 9: valid blocks are 0..1"),
    (["run", "--model", "{llama}", "--max-new-tokens", "0"], "--max-new-tokens"),
]
# what must be accepted (words None): a model folder planned from its config; a checkpoint laid out
# as the Hugging Face hub cache keeps it (files linked into ../../blobs), loaded and run at tp 2
VALID_INPUTS = [
    (["plan", "--model", "{llama}", "--inventory", "--tp", "2"], None),
    (["run", "--model", "{hub_snapshot}", "--prompt-ids", "1,2,3", "--max-new-tokens", "2"], None),
]


# ---- fixtures: each group's folders, made once by the parent -------------------------------------

def _jobs_fixtures(root: Path) -> dict:
    from tensorpar.models.tiny import make_tiny_checkpoint
    from tests.test_cli_jobs import _broken_checkpoints
    from tests.test_models_checkpoint import _as_hub_cache

    llama = make_tiny_checkpoint(root / "llama", "llama")
    dirs = {"llama": llama}
    for name, config in (("unknown", {"model_type": "not_a_model"}), ("corrupt", {"model_type": "t5"}),
                         ("broken", None)):
        (root / name).mkdir()
        (root / name / "config.json").write_text("{model_type: llama" if config is None else json.dumps(config))
        (root / name / "model.safetensors").write_bytes(b"")
        dirs[name] = root / name
    (root / "broken-copies").mkdir()
    dirs.update(_broken_checkpoints(llama, root / "broken-copies"))
    dirs["hub_snapshot"] = _as_hub_cache(Path(llama), root / "hub")
    return dirs


def _train_fixtures(root: Path) -> dict:
    from tests.test_cli_train import train_fixtures
    return train_fixtures(str(root))


def _plan_fixtures(root: Path) -> dict:
    from tests.test_planner_cli import plan_fixtures
    return plan_fixtures(root)


def _security_fixtures(root: Path) -> dict:
    from tensorpar.models.tiny import make_tiny_checkpoint
    from tests.test_checkpoint_safety import crafted_checkpoints

    dirs = crafted_checkpoints(root)
    dirs["llama"] = str(make_tiny_checkpoint(root / "llama", "llama"))
    return dirs


_HELD: list = []  # sockets the run keeps listening on: a port in use for serve's refusal


def _serve_fixtures(root: Path) -> dict:
    """The served model of the serve tests, and a port this process listens on (the faults run's
    parent lives through every case)."""
    import socket

    from tests._serve_workers import make_served_model

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    _HELD.append(held)
    return {"m": str(make_served_model(root / "m")), "port": str(held.getsockname()[1])}


FIXTURES = {"jobs": _jobs_fixtures, "train": _train_fixtures, "plan": _plan_fixtures,
            "out": lambda root: {"out": str(root / "out")}, "security": _security_fixtures,
            "serve": _serve_fixtures}


# ---- API calls ---------------------------------------------------------------------------------------

def _api(call, expect, words) -> tuple[str, str]:
    from faults import judge_exception

    try:
        call()
        exc = None
    except Exception as e:  # noqa: BLE001 - judged
        exc = e
    return judge_exception(exc, expect, words)


def _tiny(seed=1):
    from tensorpar.models.tiny import make_tiny_model
    return make_tiny_model("llama", seed=seed)


def launch_a_lambda():
    from tensorpar import distributed as dist
    return _api(lambda: dist.launch(lambda: 1, 2), ValueError, ["is a lambda: the spawned ranks cannot import it"])


def launch_absurd_world():
    from tensorpar import distributed as dist
    from tests import _dist_workers as W
    return _api(lambda: dist.launch(W.pid_worker, 100_000), ValueError, ["more local ranks than this machine"])


def launch_world_zero():
    from tensorpar import distributed as dist
    from tests import _dist_workers as W
    return _api(lambda: dist.launch(W.pid_worker, 0), ValueError, ["world_size"])


def launch_nested():
    from tensorpar import distributed as dist
    from tests import _dist_workers as W
    res = dist.launch(W.nested_launch_worker, 2, deadline=120)
    return ("clean", res[0][:160]) if all("launch() called inside" in r for r in res) else ("silent", str(res)[:160])


def generate_on_a_string():
    from tensorpar.models import generate
    return _api(lambda: generate(_tiny(), "hello", max_new_tokens=2), ValueError, ["tokenize"])


def generate_past_positions():
    import torch

    from tensorpar.models import generate
    model = _tiny()
    limit = model.config.max_position_embeddings
    return _api(lambda: generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=limit), ValueError,
                ["max_position_embeddings"])


def save_into_a_file():
    import torch

    import tensorpar
    with tempfile.TemporaryDirectory() as d:
        target = Path(d) / "a-file"
        target.write_text("not a folder")
        model = _tiny()
        return _api(lambda: tensorpar.save(model, torch.optim.AdamW(model.parameters()), target, step=1), ValueError,
                    [str(target), "not a folder"])


def export_into_unwritable():
    """/proc: no file can be made there, whoever asks (a folder chmod 500 would not stop root)."""
    import tensorpar
    return _api(lambda: tensorpar.export(_tiny(), Path("/proc/tensorpar-export")), ValueError, ["not writable"])


def adamw_checkpoint_into_sgd():
    import torch

    import tensorpar
    with tempfile.TemporaryDirectory() as d:
        model = _tiny()
        tensorpar.save(model, torch.optim.AdamW(model.parameters()), d, step=1)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return _api(lambda: tensorpar.load(model, sgd, d), ValueError, ["optimizer kinds differ"])


def save_does_not_delete_what_latest_names():
    """The case that deleted a folder outside the checkpoint folder: ``latest`` naming
    ``../victim/step-00000001`` while the same step is saved again."""
    import torch

    import tensorpar
    with tempfile.TemporaryDirectory() as d:
        model, root = _tiny(), Path(d)
        opt = torch.optim.AdamW(model.parameters())
        tensorpar.save(model, opt, root / "victim", step=1)
        before = _digest(root / "victim")
        (root / "ckpt").mkdir()
        (root / "ckpt" / "latest").write_text("../victim/step-00000001")
        outcome, detail = _api(lambda: tensorpar.save(model, opt, root / "ckpt", step=1), ValueError, ["latest"])
        if _digest(root / "victim") != before:
            return "silent", "the victim folder outside the checkpoint changed: " + detail
        return outcome, detail


def train_into_an_out_of_another_run():
    """A second run with another --seed into an --out that holds the first run's checkpoints."""
    from faults import judge_cli
    from tensorpar.models.tiny import make_tiny_checkpoint
    from tests._cli_batch import run_all

    with tempfile.TemporaryDirectory() as d:
        model = str(make_tiny_checkpoint(Path(d) / "llama", "llama"))
        base = ["train", "--model", model, "--dp", "1", "--tp", "2", "--steps", "1", "--seq", "8", "--batch", "2",
                "--save-every", "1", "--out", str(Path(d) / "out")]
        first, second = run_all([base, base + ["--seed", "1"]])
        if first["rc"] != 0:
            return "refused", f"the first run failed: {first['stderr'][:160]}"
        return judge_cli(second, "holds the checkpoints of another run (step 1: seed 0 (now 1))")


def train_nonfinite_loss():
    """--lr 1e30: the loss turns NaN within a few steps; the run stops there, exit 1, one line."""
    from faults import judge_cli
    from tensorpar.models.tiny import make_tiny_checkpoint
    from tests._cli_batch import run_all

    with tempfile.TemporaryDirectory() as d:
        model = str(make_tiny_checkpoint(Path(d) / "llama", "llama"))
        res = run_all([["train", "--model", model, "--dp", "1", "--tp", "1", "--lr", "1e30", "--steps", "6",
                        "--seq", "16", "--batch", "4", "--out", str(Path(d) / "out")]])[0]
        return judge_cli(res, "training stopped at step", rc=1)


def train_rank_stopped():
    """A rank SIGSTOPped while `tensorpar train` runs: the job ends, naming it, within 30 s."""
    return _train_rank_signalled(signal.SIGSTOP, ["--dp", "1", "--tp", "2"], 2, "stopped")


def train_pipeline_rank_killed():
    """A rank SIGKILLed while `tensorpar train --pp 2` runs (its peer stage waits on a transfer from
    it): the job ends, naming it, within 30 s."""
    return _train_rank_signalled(signal.SIGKILL, ["--pp", "2", "--dp", "1", "--tp", "1", "--microbatches", "2"], 2,
                                 "rank 1")


def _train_rank_signalled(sig, layout: list, ranks_n: int, word: str):
    from tensorpar.models.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as d:
        model = str(make_tiny_checkpoint(Path(d) / "llama", "llama"))
        cmd = [sys.executable, "-m", "tensorpar", "train", "--model", model, *layout, "--steps",
               "100000", "--seq", "16", "--batch", "2", "--out", str(Path(d) / "out"), "--json"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            ranks = _wait_for_ranks(proc.pid, ranks_n, 120)
            time.sleep(5)  # training under way
            os.kill(ranks[-1], sig)
            t0 = time.monotonic()
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return "hang", f"tensorpar train still running 60 s after a rank got {sig.name}"
        except TimeoutError:  # the harness found no ranks: the job must not outlive the case
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        took = time.monotonic() - t0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    detail = f"rc {proc.returncode} after {took:.1f}s: {err.strip()[:160]}"
    if proc.returncode == 0:
        return "silent", detail
    if len(lines) != 1 or "Traceback" in err:
        return "traceback", detail
    return ("clean" if word in lines[0] and took < 30 else "unclear"), detail


def _wait_for_ranks(pid: int, n: int, bound: float) -> list[int]:
    """The local ranks under the launcher ``pid``: children of its fork server (a forked rank keeps
    the server's command line, so it is told by its parent, not its name) or spawned interpreters."""
    t_end = time.monotonic() + bound
    while time.monotonic() < t_end:
        tree = _descendants(pid)
        servers = {p for p in tree if "multiprocessing.forkserver" in _cmdline(p) and _parent(p) == pid}
        kids = [p for p in tree if _parent(p) in servers or "spawn_main" in _cmdline(p)]
        if len(kids) >= n:
            return sorted(kids)
        time.sleep(0.5)
    raise TimeoutError(f"{n} ranks did not start within {bound} s")


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().split(")")[-1].split()[1])
    except OSError:
        return None


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().split(")")[-1].split()[1])
            except OSError:
                continue
    out, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out


def _cmdline(pid) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _env_case(variable: str, value: str, words: str):
    from faults import judge_cli
    from tests._cli_batch import run_all

    old = os.environ.get(variable)
    os.environ[variable] = value
    try:
        res = run_all([["run", "--model", "{llama}".format(**_JOBS_DIRS), "--prompt-ids", "1,2"]])[0]
    finally:
        os.environ.pop(variable) if old is None else os.environ.__setitem__(variable, old)
    return judge_cli(res, words)


def _torchrun_case(extra: dict, words: str):
    from tensorpar import distributed as dist
    from tests import _dist_workers as W

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", **extra}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    try:
        return _api(lambda: dist.launch(W.pid_worker, 2), ValueError, [words])
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


_JOBS_DIRS: dict = {}

# (class, name, function in this module, arguments, bound in seconds)
API_CASES = [
    ("bad input", "launch of a lambda", "launch_a_lambda", (), 30),
    ("bad input", "launch of 100000 local ranks", "launch_absurd_world", (), 30),
    ("bad input", "launch of 0 ranks", "launch_world_zero", (), 30),
    ("bad input", "launch inside a rank", "launch_nested", (), 60),
    ("bad input", "generate on a string", "generate_on_a_string", (), 30),
    ("bad input", "generate past max_position_embeddings", "generate_past_positions", (), 30),
    ("bad input", "save into a path that is a file", "save_into_a_file", (), 30),
    ("bad input", "export into an unwritable folder", "export_into_unwritable", (), 30),
    ("bad input", "an AdamW checkpoint loaded into SGD", "adamw_checkpoint_into_sgd", (), 30),
    ("bad input", "train into an --out holding another run's checkpoints", "train_into_an_out_of_another_run", (),
     120),
    ("fault", "train reaches a NaN loss (--lr 1e30)", "train_nonfinite_loss", (), 120),
    ("fault", "a rank stopped (SIGSTOP) during tensorpar train", "train_rank_stopped", (), 180),
    ("fault", "a pipeline stage's rank killed (SIGKILL) during tensorpar train --pp 2", "train_pipeline_rank_killed",
     (), 180),
    ("security", "save where latest names ../victim/step-00000001", "save_does_not_delete_what_latest_names", (),
     30),
]


def api_cases() -> list[tuple]:
    from tests.test_dist import ENV_ERRORS, TORCHRUN_LEFTOVERS

    out = list(API_CASES)
    for variable, value, words in ENV_ERRORS:
        out.append(("bad input", f"{variable}={value!r} tensorpar run", "_env_case", (variable, value, words), 60))
    for extra, words in TORCHRUN_LEFTOVERS:
        name = ", ".join(f"{k}={v}" for k, v in extra.items()) or "same world size"
        out.append(("bad input", f"leftover torchrun variables ({name})", "_torchrun_case", (extra, words), 30))
    return out


def run_api(function: str, args: tuple, dirs: dict) -> tuple[str, str]:
    _JOBS_DIRS.update(dirs.get("jobs", {}))
    return globals()[function](*args)


# ---- security: train --resume on each crafted checkpoint ------------------------------------------------

def security_cases() -> list[tuple]:
    from tests.test_checkpoint_safety import CHECKPOINT_CLI_ERRORS, CRAFTED
    return [(name, argv, words) for name, (argv, words) in zip(CRAFTED, CHECKPOINT_CLI_ERRORS)]


def run_security(name: str, argv: list, words: str, dirs: dict) -> tuple[str, str]:
    """The one line, and what is left: no payload ran, the victim beside the checkpoint unchanged."""
    from faults import judge_cli
    from tests._cli_batch import run_all
    from tests.test_checkpoint_safety import MARKER

    sec = dirs["security"]
    case = Path(sec[name]).parent
    before = _digest(case / "victim")
    res = run_all([[a.format(**sec) for a in argv]])[0]
    outcome, detail = judge_cli(res, words)
    if (case / MARKER).exists() or (case.parent / MARKER).exists():
        return "silent", "the crafted checkpoint RAN CODE: " + detail
    if _digest(case / "victim") != before:
        return "silent", "the victim outside the checkpoint changed: " + detail
    return outcome, detail


def _digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- launch faults -----------------------------------------------------------------------------------

# name: (description, bound in seconds)
LAUNCH_FAULTS = {
    "dying": ("a rank dies, its peers lose the connection", 30),
    "raising_peer": ("a rank raises while its peer waits in a collective", 30),
    "mismatch_op": ("two ranks in different collectives (all_reduce / all_gather)", 20),
    "mismatch_extra": ("one rank issues a collective the other does not", 20),
    "stuck": ("a rank stuck outside any collective (4 s collective timeout)", 25),
    "deadline": ("the deadline passes (6 s)", 25),
    "mesh_peer": ("dp 2 x tp 2: a tp peer never comes (launch timeout 3 s)", 45),
    "long_timeout_group": ("a group with its own 1 h timeout, its peer never comes (launch timeout 2 s)", 30),
    "stopped": ("a rank stopped (SIGSTOP) while its peer waits", 30),
    "silent": ("a rank silent (GIL held in native code), unresponsive bound 3 s", 30),
    "drifting_replicas": ("replicas drift (optimizer), ranks fed different batches", 60),
    "launcher_killed": ("the launcher is SIGKILLed", 60),
    "launcher_interrupted": ("the launcher is sent Ctrl-C", 60),
}


def launch_cases() -> list[tuple]:
    out = []
    for world, bad, how in ((2, 1, "raise"), (4, 2, "raise"), (2, 0, "kill"), (4, 3, "kill")):
        verb = "raises" if how == "raise" else "is SIGKILLed"
        out.append((f"rank {bad} of {world} {verb}", ("pid_file", world, bad, how), 30 if world == 2 else 45))
    return out + [(desc, (name,), bound) for name, (desc, bound) in LAUNCH_FAULTS.items()]
