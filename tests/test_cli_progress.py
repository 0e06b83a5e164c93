"""Long commands show their phases and elapsed time on a terminal, and nothing with --json or
when stderr is not a terminal (a pipe, a log, CI): stdout stays the report alone."""
import os
import pty
import subprocess
import sys


def _on_a_terminal(*args) -> tuple[str, str]:
    """Run ``tensorpar ARGS`` with stderr on a pseudo-terminal; ``(stdout, what the terminal got)``."""
    master, slave = pty.openpty()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120"}
    proc = subprocess.Popen([sys.executable, "-m", "tensorpar", *args], stdout=subprocess.PIPE, stderr=slave,
                            env=env, text=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # the terminal closed: the process exited
            break
        if not data:
            break
        chunks.append(data)
    out = proc.stdout.read()
    proc.wait(timeout=120)
    os.close(master)
    return out, b"".join(chunks).decode(errors="replace")


def test_phases_with_their_time_on_a_terminal():
    out, term = _on_a_terminal("plan", "--model", "llama-2-70b", "--search", "--devices", "64")
    assert "searching tp x pp x dp over 64 devices" in term and "0:00:0" in term  # elapsed h:mm:ss
    assert "searching" not in out  # the report alone on stdout


def test_nothing_on_the_terminal_with_json():
    out, term = _on_a_terminal("plan", "--model", "llama-2-70b", "--search", "--devices", "64", "--json")
    assert term.strip() == "" and out.lstrip().startswith("{")


def test_nothing_on_stderr_when_it_is_a_pipe():
    r = subprocess.run([sys.executable, "-m", "tensorpar", "plan", "--model", "llama-2-70b", "--search",
                        "--devices", "64"], capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert "searching" not in r.stderr and "searching" not in r.stdout


def test_a_phase_that_fails_is_not_shown_done():
    """A config is planned by building its model on the meta device, in a phase: transformers' own
    default Ministral config (head_dim None) fails there, which shows a cross, not a check mark,
    and the error line follows. (An unknown model type is refused before any phase.)"""
    import json
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        (open(os.path.join(d, "config.json"), "w")).write(json.dumps({"model_type": "ministral"}))
        out, term = _on_a_terminal("plan", "--model", os.path.join(d, "config.json"), "--tp", "2")
    assert "✗" in term and "✓" not in term and "failed after" in term, term
