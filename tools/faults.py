"""`make faults`: the fault-injection catalogue, run in one go, with totals by class.

Three classes, each case judged by what a user would see:

- **bad input**: a command line the parent must refuse before any rank starts: exit code 2, one
  line on stderr holding the expected words, nothing on stdout (the cases of
  tests/test_cli_jobs.py and a few more for `plan` and `bench`);
- **fault**: something going wrong inside a launch (a rank raising, a rank SIGKILLed, two ranks
  in different collectives, a rank stuck outside any collective, the deadline passing, the
  launcher SIGKILLed or interrupted): the launch must end with the named error naming the right
  rank or calls, within the stated seconds;
- **leak**: what is left: after every fault, new entries in /dev/shm and new rendezvous folders
  (a case that leaves one fails); after all cases, processes this one started (directly or not)
  still alive 10 s later.

    python tools/faults.py          # prints one line per case, then the totals; exit 1 on any miss

Not part of `make test` (about a minute on 2 cores); the same cases run as separate tests there.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

MORE_BAD_INPUTS = [
    (["plan", "--model", "llama-2-7b", "--tp", "0"], "tp (0) must be a positive integer"),
    (["plan", "--model", "no-such-model"], "no-such-model"),
    (["plan", "--model", "llama-2-7b", "--pp", "0"], "pp (0) must be a positive integer"),
    (["plan", "--model", "llama-2-7b", "--search"], "--devices"),
    (["bench", "--suite", "nope"], "--suite 'nope': unknown ['nope']; valid: mlp, models"),
    (["bench", "--repeats", "1"], "--repeats 1: need at least 3 rounds"),
    (["run", "--dtype", "int8"], "--dtype 'int8' is not supported; valid:"),
    (["verify", "--model", "{llama}", "--tp", ""], "--tp needs at least one size"),
    (["verify", "--model", "{llama}", "--inject-fault", "9"], "--inject-fault 9: valid blocks are 0..1"),
    (["run", "--model", "{llama}", "--max-new-tokens", "0"], "--max-new-tokens"),
]


def bad_inputs() -> list[tuple[str, bool, str]]:
    from tensorpar.models.testing import make_tiny_checkpoint
    from tests._cli_batch import run_all
    from tests.test_cli_jobs import RUN_ERRORS, VERIFY_ERRORS, _broken_checkpoints

    root = Path(tempfile.mkdtemp(prefix="tensorpar-faults-"))
    dirs = {"llama": make_tiny_checkpoint(root / "llama", "llama")}
    for name, config in (("unknown", {"model_type": "not_a_model"}), ("corrupt", {"model_type": "t5"}),
                         ("broken", None)):
        dirs[name] = root / name
        dirs[name].mkdir()
        (dirs[name] / "config.json").write_text("{model_type: llama" if config is None else json.dumps(config))
        (dirs[name] / "model.safetensors").write_bytes(b"")
    dirs.update(_broken_checkpoints(dirs["llama"], root))
    cases = VERIFY_ERRORS + RUN_ERRORS + MORE_BAD_INPUTS
    out = []
    for (args, want), res in zip(cases, run_all([[a.format(**dirs) for a in args] for args, _ in cases])):
        lines = res["stderr"].strip().splitlines()
        clean = res["rc"] == 2 and not res["stdout"] and len(lines) == 1 and want in lines[0]
        out.append((" ".join(args)[:70], clean, f"rc {res['rc']}: {res['stderr'].strip()[:150]}"))
    return out


def _launch_case(worker, world, *args, expect, words, bound_s, **kw):
    from tensorpar import dist

    t0 = time.monotonic()
    try:
        dist.launch(worker, world, *args, **kw)
        return False, "the launch returned normally"
    except Exception as exc:  # noqa: BLE001 - judged below
        took = time.monotonic() - t0
        msg = f"{type(exc).__name__} after {took:.1f}s: {str(exc).splitlines()[0][:160]}"
        ok = isinstance(exc, expect) and all(w in str(exc) for w in words) and took < bound_s
        return ok, msg


def _subprocess_case(directory: Path, how: str, bound_s: float):
    """A launcher in its own process, SIGKILLed or sent Ctrl-C once its ranks run."""
    script = directory / "launcher.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
        "from tensorpar import dist\nfrom tests import _dist_workers as W\n"
        "if __name__ == '__main__':\n"
        "    try:\n"
        f"        dist.launch(W.sleepy_worker_with_pid, 2, {str(directory)!r})\n"
        "    except KeyboardInterrupt:\n        print('interrupted', file=sys.stderr)\n")
    with open(directory / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, str(script)], stderr=err, start_new_session=True)
        t_end = time.monotonic() + 60
        while not all((directory / f"rank{r}.pid").exists() for r in range(2)) and time.monotonic() < t_end:
            time.sleep(0.2)
        time.sleep(0.5)
        t0 = time.monotonic()
        if how == "kill":
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    pids = [int(f.read_text()) for f in directory.glob("rank*.pid")]
    while any(_alive(p) for p in pids) and time.monotonic() - t0 < bound_s:
        time.sleep(0.2)
    took = time.monotonic() - t0
    text = (directory / "stderr").read_text()
    gone = not any(_alive(p) for p in pids)
    if how == "kill":
        ok = gone and "leaked" not in text
    else:
        ok = gone and text.strip().splitlines()[-1:] == ["interrupted"] and "Traceback" not in text
    return ok, f"{'all gone' if gone else 'LEFT RUNNING'} {took:.1f}s after; stderr: {text.strip()[-120:]!r}"


def faults() -> list[tuple[str, bool, str]]:
    from tensorpar import dist
    from tests import _dist_workers as W

    os.environ["TENSORPAR_CHECK_COLLECTIVES"] = "0"  # what a user's launch does by default
    out = []
    for world, bad, how in ((2, 1, "raise"), (4, 2, "raise"), (2, 0, "kill"), (4, 3, "kill")):
        with tempfile.TemporaryDirectory() as d:
            expect_words = [f"rank {bad} failed", "boom on purpose" if how == "raise" else "SIGKILL"]
            ok, msg = _launch_case(W.pid_file_worker, world, d, bad, how, expect=dist.RankFailedError,
                                   words=expect_words, bound_s=30 if world == 2 else 45, timeout=300)
            out.append(_with_leaks((f"rank {bad} of {world} {'raises' if how == 'raise' else 'is SIGKILLed'}", ok, msg)))
    cases = [
        ("a rank dies, its peers lose the connection", W.dying_worker, 3, (1,),
         dict(timeout=30, deadline=60), dist.RankFailedError, ["rank 1 failed: RankDied"], 30),
        ("a rank raises while its peer waits in a collective", W.raising_peer_worker, 2, (),
         dict(deadline=60), dist.RankFailedError, ["rank 1 failed: ValueError"], 30),
        ("two ranks in different collectives (all_reduce / all_gather)", W.mismatched_worker, 2, ("op",),
         dict(timeout=60, deadline=120), dist.MismatchedCollectivesError,
         ["rank 0 in all_reduce #2", "rank 1 in all_gather #2"], 20),
        ("one rank issues a collective the other does not", W.mismatched_worker, 2, ("extra",),
         dict(timeout=60, deadline=120), dist.MismatchedCollectivesError,
         ["rank 0 in all_gather #2", "rank 1 in all_reduce #2"], 20),
        ("a rank stuck outside any collective (4 s collective timeout)", W.stuck_rank_worker, 2, (),
         dict(timeout=4, deadline=60), dist.RankFailedError, ["rank 1 not in a collective"], 25),
        ("the deadline passes (6 s)", W.stuck_rank_worker, 2, (),
         dict(timeout=60, deadline=6), dist.LaunchTimeoutError, ["rank 1 not in a collective"], 25),
    ]
    for name, worker, world, args, kw, expect, words, bound in cases:
        ok, msg = _launch_case(worker, world, *args, expect=expect, words=words, bound_s=bound, **kw)
        out.append(_with_leaks((name, ok, msg)))
    out.append(_with_leaks(_leftover_torchrun_env()))
    out.append(_with_leaks(_drifting_replicas()))
    for how in ("kill", "interrupt"):
        with tempfile.TemporaryDirectory() as d:
            ok, msg = _subprocess_case(Path(d), how, bound_s=30)
            out.append(_with_leaks(("the launcher is " + ("SIGKILLed" if how == "kill" else "sent Ctrl-C"), ok, msg)))
    return out


def _leftover_torchrun_env():
    """RANK, WORLD_SIZE and MASTER_* left from another job, for another world size: refused at once."""
    from tests import _dist_workers as W

    env = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ok, msg = _launch_case(W.pid_worker, 2, expect=ValueError, words=["unset RANK WORLD_SIZE"], bound_s=2)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return "leftover torchrun variables (another world size)", ok, msg


def _drifting_replicas():
    """One rank's optimizer with another learning rate, and ranks fed different batches, in
    train_step(audit=True): both named, with the ranks."""
    from tensorpar import dist
    from tests import _audit_workers as A

    t0 = time.monotonic()
    res = dist.launch(A.training_audit_worker, 2, deadline=120)[0]
    took = time.monotonic() - t0
    ok = (res["clean"] and "ranks [1]" in (res["lr"] or "") and "input_ids differs" in (res["batch"] or "")
          and took < 60)
    return "replicas drift (optimizer), ranks fed different batches", ok, f"after {took:.1f}s: {str(res['lr'])[:120]}"


_SEEN: dict = {}


def _with_leaks(row):
    """The case's row, failed if it left a rendezvous folder or a /dev/shm entry behind (waiting up
    to 10 s: a killed launcher's reaper removes its folder a moment after)."""
    name, ok, msg = row
    t0 = time.monotonic()
    while True:
        now = _leftovers()
        new = {k: now[k] - _SEEN[k] for k in ("shm", "rendezvous")}
        if not any(new.values()) or time.monotonic() - t0 > 10:
            break
        time.sleep(0.2)
    if any(new.values()):
        return name, False, f"{msg}; LEFT: {sorted(new['shm'] | new['rendezvous'])[:4]}"
    return name, ok, msg


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _descendants() -> set:
    """Pids whose parent chain leads to this process, or orphans a case left (parent 1, started
    after this script) — what a case may leave behind."""
    me, found = os.getpid(), set()
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().split(")")[-1].split()[1])
            except OSError:
                continue
    for pid in parents:
        p, seen = pid, 0
        while p in parents and p not in (0, 1) and seen < 64:
            if parents[p] == me:
                found.add(pid)
                break
            p, seen = parents[p], seen + 1
    return found


def _leftovers() -> dict:
    rdzv = {p.name for p in Path(tempfile.gettempdir()).glob("tensorpar-rdzv-*")}
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    procs = {p for p in (set(os.listdir("/proc")) - _BASE_PIDS) if p.isdigit() and _alive(int(p))
             and _is_ours(int(p))}
    kids = {str(p) for p in _descendants() if "resource_tracker" not in _cmdline(p)}
    return {"processes": procs | kids, "shm": shm, "rendezvous": rdzv}


def _cmdline(pid) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _is_ours(pid: int) -> bool:
    """A sleep or a Python started from this checkout (what the cases run), orphaned or not;
    not multiprocessing's resource tracker, which lives as long as this process by design."""
    cmd = _cmdline(pid)
    if "resource_tracker" in cmd:
        return False
    return cmd.startswith("sleep 300") or "multiprocessing.spawn" in cmd or "tensorpar" in cmd


_BASE_PIDS: set = set()


def main() -> int:
    global _BASE_PIDS
    _BASE_PIDS = set(os.listdir("/proc"))
    before = _leftovers()
    _SEEN.update(before)
    rows, leaks = [], []
    for cls, run in (("bad input", bad_inputs), ("fault", faults)):
        for name, ok, msg in run():
            rows.append((cls, name, ok, msg))
            print(f"{'ok  ' if ok else 'MISS'} {cls:9} {name:72} {msg}", flush=True)
    time.sleep(10)  # what a case left: still there 10 s after the last one ended
    after = _leftovers()
    for kind in ("processes", "shm", "rendezvous"):
        new = sorted(after[kind] - before[kind] - ({str(os.getpid())} if kind == "processes" else set()))
        leaks += [f"{kind}: {n}" + (f" ({_cmdline(n)[:80]})" if kind == "processes" else "") for n in new]
    totals = {cls: (sum(1 for r in rows if r[0] == cls), sum(1 for r in rows if r[0] == cls and r[2]))
              for cls in ("bad input", "fault")}
    print(f"\nbad inputs tried {totals['bad input'][0]}, clean one-line errors (exit 2, nothing on stdout) "
          f"{totals['bad input'][1]}")
    print(f"faults injected {totals['fault'][0]}, named right within their bound {totals['fault'][1]}, "
          f"survived (missed) {totals['fault'][0] - totals['fault'][1]}")
    print(f"leaks after all cases: {len(leaks)}" + (f" ({'; '.join(leaks[:8])})" if leaks else ""))
    missed = any(not r[2] for r in rows)
    return 1 if missed or leaks else 0


if __name__ == "__main__":
    raise SystemExit(main())
