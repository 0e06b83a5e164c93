"""`make faults`: the fault-injection catalogue, run in one go, each case judged by what a user sees.

Every case is a thing a user can do wrong, or a thing that can go wrong under them, with what
tensorpar promises for it:

- **bad input** (a command line or an API call): refused before any rank starts or any step is
  taken — a CLI exits 2 with one line on stderr holding the expected words and nothing on
  stdout; an API call raises ``ValueError`` (or the named error) whose message is one line
  holding them;
- **fault** (a rank raising, SIGKILLed, stopped; ranks in different collectives; a deadline):
  the launch ends with the named error naming the right rank or calls, within the stated seconds;
- **security** (a crafted checkpoint): refused before anything is read from it or written next
  to it, and nothing outside its folder touched;
- **valid input**: accepted (exit 0 / no exception).

Each case ends in one outcome: ``clean`` (as promised), ``traceback`` (an unexpected exception
or a multi-line error), ``silent`` (accepted, or no error, where one was due), ``unclear`` (the
right exit code, the wrong words), ``refused`` (valid input refused), ``hang`` (past its bound:
the case is killed) or ``leak`` (it left a /dev/shm entry, a rendezvous folder or a process).

Cases run in a child process that streams one JSON line per case; the parent holds each case to
its bound, kills the child's process group on a hang and starts a new child for the cases left.

    python tools/faults.py                        # every case, then the totals; exit 1 on any miss
    python tools/faults.py --write docs/faults.md # and the table with its totals, for the docs
    python tools/faults.py launch                 # the cases whose name contains "launch"

Not part of `make test` (a few minutes on 2 cores); the same cases run as tests there.
"""
from __future__ import annotations

import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

OUTCOMES = ("clean", "traceback", "silent", "unclear", "refused", "hang", "leak")


@dataclass(frozen=True)
class Case:
    cls: str  # bad input | fault | security | valid input
    name: str
    kind: str  # cli | api | launch
    spec: tuple  # cli: (argv, words; None: must succeed); api: (module:function, args); launch: (name, args)
    bound_s: float = 60.0


# ---- the catalogue (tools/fault_cases.py) -------------------------------------------------------

def catalogue() -> list[Case]:
    import fault_cases as F

    cases = []
    for module, name, cls, group in F.CLI_LISTS:
        for argv, words in getattr(importlib.import_module(module), name):
            cases.append(Case(cls, " ".join(argv)[:80], "cli", (argv, words, group)))
    for name, argv, words in F.security_cases():
        cases.append(Case("security", f"train --resume on a crafted checkpoint: {name}", "security",
                          (name, argv, words)))
    for cls, name, function, args, bound in F.api_cases():
        cases.append(Case(cls, name, "api", (function, args), bound))
    for name, spec, bound in F.launch_cases():
        cases.append(Case("fault", name, "launch", spec, bound))
    return cases


def _groups(case: Case) -> set:
    if case.kind == "cli":
        return {case.spec[2]}
    if case.kind == "security":
        return {"security"}
    return {"jobs"} if case.kind == "api" else set()


# ---- running one case (in the child) ------------------------------------------------------------

def _one_line(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def judge_cli(res: dict, words: str | None, rc: int = 2) -> tuple[str, str]:
    """A command line's result: ``words`` None means it must succeed; else it must exit ``rc``
    (2: refused before any rank started; 1: stopped by a named error) with one line holding them."""
    lines = _one_line(res["stderr"])
    detail = f"rc {res['rc']}: {res['stderr'].strip()[:160]}"
    if words is None:
        return ("clean" if res["rc"] == 0 else "refused"), detail
    if "Traceback" in res["stderr"] or res["rc"] not in (0, rc):
        return "traceback", detail
    if res["rc"] == 0:
        return "silent", detail
    if len(lines) != 1 or res["stdout"]:
        return "traceback", detail
    return ("clean" if words in lines[0] else "unclear"), detail


def judge_exception(exc: BaseException | None, expect: type, words: list[str]) -> tuple[str, str]:
    if exc is None:
        return "silent", "no error"
    text = str(exc)
    detail = f"{type(exc).__name__}: {text.splitlines()[0][:160] if text else ''}"
    if not isinstance(exc, expect):
        return "traceback", detail
    if len(_one_line(text.split("\n--- traceback on rank")[0])) != 1:
        return "traceback", detail
    return ("clean" if all(w in text for w in words) else "unclear"), detail


def run_cli(argv: list[str], words: str | None, group: str, dirs: dict) -> tuple[str, str]:
    from tests._cli_batch import run_all

    res = run_all([[a.format(**dirs[group]) for a in argv]])[0]
    return judge_cli(res, words if words is None else words.format(**dirs[group]))


def _launch_case(worker, world, *args, expect, words, bound_s, **kw) -> tuple[str, str]:
    from tensorpar import distributed as dist

    t0 = time.monotonic()
    try:
        dist.launch(worker, world, *args, **kw)
        exc = None
    except Exception as e:  # noqa: BLE001 - judged below
        exc = e
    took = time.monotonic() - t0
    outcome, detail = judge_exception(exc, expect, words)
    if outcome == "clean" and took >= bound_s:
        outcome = "hang"
    return outcome, f"after {took:.1f}s: {detail}"


def launch_fault(name, *args) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(prefix="tensorpar-fault-") as tmp:
        return _launch_fault(name, tmp, *args)


def _launch_fault(name, tmp, *args) -> tuple[str, str]:
    import fault_cases as F
    from tensorpar import distributed as dist
    from tests import _dist_workers as W

    os.environ["TENSORPAR_CHECK_COLLECTIVES"] = "0"  # what a user's launch does by default
    os.environ.pop("TENSORPAR_UNRESPONSIVE_TIMEOUT", None)  # the defaults a user's launch has
    if name == "silent":
        os.environ["TENSORPAR_UNRESPONSIVE_TIMEOUT"] = "3"
    if name == "pid_file":
        world, bad, how = args
        with tempfile.TemporaryDirectory() as d:
            words = [f"rank {bad} failed", "boom on purpose" if how == "raise" else "SIGKILL"]
            return _launch_case(W.pid_file_worker, world, d, bad, how, expect=dist.RankFailedError, words=words,
                                bound_s=30 if world == 2 else 45, timeout=300)
    table = {
        "dying": (W.dying_worker, 3, (1,), dict(timeout=30, deadline=60), dist.RankFailedError,
                  ["rank 1 failed: RankDied"]),
        "raising_peer": (W.raising_peer_worker, 2, (), dict(deadline=60), dist.RankFailedError,
                         ["rank 1 failed: ValueError"]),
        "mismatch_op": (W.mismatched_worker, 2, ("op",), dict(timeout=60, deadline=120),
                        dist.MismatchedCollectivesError, ["rank 0 in all_reduce #2", "rank 1 in all_gather #2"]),
        "mismatch_extra": (W.mismatched_worker, 2, ("extra",), dict(timeout=60, deadline=120),
                           dist.MismatchedCollectivesError, ["rank 0 in all_gather #2", "rank 1 in all_reduce #2"]),
        "stuck": (W.stuck_rank_worker, 2, (), dict(timeout=4, deadline=60), dist.RankFailedError,
                  ["rank 1 not in a collective"]),
        "deadline": (W.stuck_rank_worker, 2, (), dict(timeout=60, deadline=6), dist.LaunchTimeoutError,
                     ["rank 1 not in a collective"]),
        "mesh_peer": (W.mesh_peer_never_comes_worker, 4, (tmp,), dict(timeout=3, deadline=120), dist.RankStuckError,
                      ["rank 1 is stuck", "on group [0, 1]"]),
        "long_timeout_group": (W.long_timeout_group_worker, 2, (tmp,), dict(timeout=2, deadline=60),
                               dist.RankStuckError, ["rank 1 is stuck", "past the launch's timeout of 2s"]),
        "stopped": (W.stopped_rank_worker, 2, (tmp,), dict(timeout=20, deadline=60), dist.RankUnresponsiveError,
                    ["is stopped (/proc state 'T'"]),
        "silent": (W.silent_rank_worker, 2, (tmp,), dict(timeout=20, deadline=60), dist.RankUnresponsiveError,
                   ["no heartbeat"]),
    }
    if name in table:
        worker, world, wargs, kw, expect, words = table[name]
        return _launch_case(worker, world, *wargs, expect=expect, words=words, bound_s=F.LAUNCH_FAULTS[name][1], **kw)
    return {"drifting_replicas": _drifting_replicas,
            "launcher_killed": lambda: _launcher_case("kill"),
            "launcher_interrupted": lambda: _launcher_case("interrupt")}[name]()


def _drifting_replicas() -> tuple[str, str]:
    """One rank's optimizer with another learning rate, and ranks fed different batches, in
    train_step(audit=True): both named, with the ranks."""
    from tensorpar import distributed as dist
    from tests import _audit_workers as A

    t0 = time.monotonic()
    res = dist.launch(A.training_audit_worker, 2, deadline=120)[0]
    took = time.monotonic() - t0
    named = res["clean"] and "ranks [1]" in (res["lr"] or "") and "input_ids differs" in (res["batch"] or "")
    outcome = "clean" if named else ("silent" if res["lr"] is None or res["batch"] is None else "unclear")
    return outcome, f"after {took:.1f}s: {str(res['lr'])[:120]}"


def _launcher_case(how: str) -> tuple[str, str]:
    """A launcher in its own process, SIGKILLed or sent Ctrl-C once its ranks run: every rank
    gone within 30 s, and (Ctrl-C) one line saying so."""
    with tempfile.TemporaryDirectory() as d:
        directory = Path(d)
        script = directory / "launcher.py"
        script.write_text(
            f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
            "from tensorpar import distributed as dist\nfrom tests import _dist_workers as W\n"
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
            proc.kill() if how == "kill" else os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=120)
        pids = [int(f.read_text()) for f in directory.glob("rank*.pid")]
        while any(_alive(p) for p in pids) and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        took, text = time.monotonic() - t0, (directory / "stderr").read_text()
    gone = not any(_alive(p) for p in pids)
    detail = f"{'all gone' if gone else 'LEFT RUNNING'} {took:.1f}s after; stderr: {text.strip()[-120:]!r}"
    if not gone:
        return "hang", detail
    if how == "kill":
        return ("clean" if "leaked" not in text else "leak"), detail
    if "Traceback" in text:
        return "traceback", detail
    return ("clean" if text.strip().splitlines()[-1:] == ["interrupted"] else "unclear"), detail


def child(indices: list[int], fixtures: str) -> None:
    """Run the cases ``indices``, one JSON line each (``start`` before, the outcome after)."""
    import fault_cases as F

    cases = catalogue()
    dirs = json.loads((Path(fixtures) / "fixtures.json").read_text())
    for i in indices:
        case = cases[i]
        print(json.dumps({"start": i}), flush=True)
        try:
            if case.kind == "cli":
                outcome, detail = run_cli(*case.spec, dirs)
            elif case.kind == "security":
                outcome, detail = F.run_security(*case.spec, dirs)
            elif case.kind == "launch":
                outcome, detail = launch_fault(*case.spec)
            else:
                outcome, detail = F.run_api(*case.spec, dirs)
        except Exception as exc:  # noqa: BLE001 - a case that raises where it should judge is a traceback
            outcome, detail = "traceback", f"{type(exc).__name__}: {str(exc)[:160]}"
        print(json.dumps({"done": i, "outcome": outcome, "detail": detail}), flush=True)
        sys.stdin.readline()  # the parent has looked for what the case left: only then the next one


def make_fixtures(root: Path, groups: set) -> None:
    """The folders the cases name, each group's made once under ``root``, listed in fixtures.json."""
    import fault_cases as F

    dirs = {}
    for group in sorted(groups):
        (root / group).mkdir()
        dirs[group] = {k: str(v) for k, v in F.FIXTURES[group](root / group).items()}
    (root / "fixtures.json").write_text(json.dumps(dirs))


# ---- the parent ---------------------------------------------------------------------------------

def run_cases(cases: list[Case], indices: list[int], fixtures: Path) -> dict:
    """``{index: (outcome, detail)}``: the cases run in children, each held to its bound."""
    results, left = {}, list(indices)
    while left:
        proc = subprocess.Popen([sys.executable, __file__, "--child", ",".join(map(str, left)), str(fixtures)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                start_new_session=True, cwd=ROOT)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        current, started = None, time.monotonic()
        while True:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line:
                msg = json.loads(line)
                if "start" in msg:
                    current, started = msg["start"], time.monotonic()
                    _SEEN.update(_leftovers())
                    continue
                results[msg["done"]] = _with_leaks((msg["outcome"], msg["detail"]))
                _print(cases[msg["done"]], *results[msg["done"]])
                left.remove(msg["done"])
                current = None
                proc.stdin.write("next\n")
                proc.stdin.flush()
            elif current is not None and time.monotonic() - started > cases[current].bound_s + 30:
                os.killpg(proc.pid, signal.SIGKILL)
                results[current] = ("hang", f"still running after {cases[current].bound_s + 30:.0f} s: killed")
                _print(cases[current], *results[current])
                left.remove(current)
                current = None
                break
        proc.wait()
        if current is not None:  # the child died in a case
            results[current] = ("traceback", f"the case ended its process (exit {proc.returncode})")
            _print(cases[current], *results[current])
            left.remove(current)
    return results


def _print(case: Case, outcome: str, detail: str) -> None:
    mark = "ok  " if outcome == "clean" else "MISS"
    print(f"{mark} {outcome:9} {case.cls:11} {case.name:72} {detail}", flush=True)


_SEEN: dict = {}


def _with_leaks(row):
    """The case's outcome, ``leak`` if it left a rendezvous folder or a /dev/shm entry behind
    (waiting up to 10 s: a killed launcher's reaper removes its folder a moment after)."""
    outcome, detail = row
    t0 = time.monotonic()
    while True:
        now = _leftovers()
        new = {k: now[k] - _SEEN.get(k, set()) for k in ("shm", "rendezvous")}
        if not any(new.values()) or time.monotonic() - t0 > 10:
            break
        time.sleep(0.2)
    if any(new.values()):
        return "leak", f"{detail}; LEFT: {sorted(new['shm'] | new['rendezvous'])[:4]}"
    return outcome, detail


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _leftovers() -> dict:
    rdzv = {p.name for p in Path(tempfile.gettempdir()).glob("tensorpar-rdzv-*")}
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    procs = {p for p in os.listdir("/proc") if p.isdigit() and _alive(int(p)) and _is_ours(int(p))}
    return {"processes": procs, "shm": shm, "rendezvous": rdzv}


def _cmdline(pid) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


# Set in this run's environment, so that its processes (which inherit it, orphaned or not) are told
# from others' on the same machine (another checkout's tests, a second run).
RUN_MARK = "TENSORPAR_FAULTS_RUN_ID"


def _is_ours(pid: int) -> bool:
    """A sleep or a Python started by this run (what the cases run), orphaned or not; not
    multiprocessing's resource tracker, which lives as long as its process by design."""
    cmd = _cmdline(pid)
    if "resource_tracker" in cmd or pid == os.getpid() or not _marked(pid):
        return False
    return cmd.startswith("sleep 300") or "multiprocessing.spawn" in cmd or "tensorpar" in cmd or "faults.py" in cmd


def _marked(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{RUN_MARK}={os.environ[RUN_MARK]}".encode() in f.read().split(b"\0")
    except (OSError, KeyError):
        return False


def totals(cases: list[Case], results: dict) -> dict:
    out = {o: 0 for o in OUTCOMES}
    for i in results:
        out[results[i][0]] += 1
    return out


def write_doc(path: Path, cases: list[Case], results: dict, count: dict, leaks: list) -> None:
    rows = "\n".join(f"| {cases[i].cls} | {cases[i].name.replace('|', '/')} | {results[i][0]} |" for i in sorted(results))
    line = ", ".join(f"{count[o]} {o}" for o in OUTCOMES)
    path.write_text(
        "# Fault-injection catalogue\n\n"
        "Generated by `make faults` (`tools/faults.py --write docs/faults.md`); do not edit by hand.\n"
        "Each case is judged by what a user sees (see the script's docstring for the outcomes).\n\n"
        f"**{len(results)} cases: {line}; leaks after all cases: {len(leaks)}.**\n\n"
        "| class | case | outcome |\n|---|---|---|\n" + rows + "\n")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        child([int(i) for i in argv[1].split(",")], argv[2])
        return 0
    os.environ[RUN_MARK] = f"{os.getpid()}-{time.time_ns()}"
    write = Path(argv[argv.index("--write") + 1]) if "--write" in argv else None
    names = [a for i, a in enumerate(argv) if not a.startswith("--") and (i == 0 or argv[i - 1] != "--write")]
    cases = catalogue()
    indices = [i for i, c in enumerate(cases) if not names or any(n in c.name for n in names)]
    before = _leftovers()
    _SEEN.update(before)
    with tempfile.TemporaryDirectory(prefix="tensorpar-faults-") as tmp:
        make_fixtures(Path(tmp), set().union(*(_groups(cases[i]) for i in indices)))
        results = run_cases(cases, indices, Path(tmp))
    time.sleep(10)  # what a case left: still there 10 s after the last one ended
    after = _leftovers()
    leaks = [f"{kind}: {n}" + (f" ({_cmdline(n)[:80]})" if kind == "processes" else "")
             for kind in ("processes", "shm", "rendezvous") for n in sorted(after[kind] - before[kind])]
    count = totals(cases, results)
    print(f"\n{len(results)} cases: " + ", ".join(f"{count[o]} {o}" for o in OUTCOMES))
    print(f"leaks after all cases: {len(leaks)}" + (f" ({'; '.join(leaks[:8])})" if leaks else ""))
    if write is not None:
        write_doc(write, cases, results, count, leaks)
    missed = count["clean"] != len(results)
    return 1 if missed or leaks else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
