"""The documentation a newcomer reads: README.md and docs/*.md say only what is true today.

Tier 1 (no ranks; importing what the names name takes a few seconds):

- every ``tensorpar.x.y`` name the docs mention resolves: the longest prefix that imports as a
  module, then ``getattr`` for the rest (so an alias module such as ``tensorpar.distributed`` for a
  renamed package resolves as long as it exposes the names); ``from tensorpar.x import a, b`` in a
  code block checks ``a`` and ``b`` too;
- every relative link (and image) points at a file that exists, and a ``#heading`` link at a
  heading of that file; every repository path quoted in backticks (``tests/...``, ``tools/...``,
  ``tensorpar/...``, ``docs/...``) exists;
- the README is at most 250 lines, and its shell lines are all ones this test can judge;
- docs/cli.md names every command and every option of ``tensorpar``'s parser (what ``--help``
  prints) and no other, and every ``tensorpar CMD --option`` a page shows (in a shell block or an
  inline code span) is an option CMD has; the command whose output the README shows is the one
  ``make run`` runs;
- every ``TENSORPAR_*`` variable the code reads is in docs/reliability.md;
- every ``python`` block of every page parses;
- each ``python`` block of the README imports the tensorpar modules it names (``tensorpar.x``).

Tier 2 (real ranks): every code block of the README runs as written, each in a fresh folder of
its own (a ``.venv`` there links to this checkout's, so ``.venv/bin/...`` works as in the
checkout): each ``tensorpar`` command line of a ``bash`` block in a fresh process, with exit code
0; the ``python`` blocks one after the other in one fresh process (tests/_readme_blocks.py), each
as ``python example.py`` runs it, with exit status 0: one import of torch and one fork server for
all, where a process each cost ~8 s more per block. A block guards its launch with
``if __name__ == "__main__":``, since the ranks import the main module; every block's ranks are
forked afresh. An earlier block's imports stay imported in that process, so tier 1 checks that
each block imports the tensorpar modules it names. ``make`` lines are not run here: ``make run``
is ``tensorpar run``, which the README names and this test runs; ``make test`` would run this
test, and the other targets take minutes. A ``text`` block right after a ``bash`` block is the
output of its last command: every shown line that is not ``...`` must match a line of the real
output, in order, with digits masked (figures vary with the machine) and runs of blanks taken as
one (table columns widen with the figures). The command lines and the python blocks' process run
two at a time (they are independent).
"""
import argparse
import ast
import importlib
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
# The environment running these tests (the checkout's .venv, also for a copy of the tree that has
# none, as tools/mutants.py makes): the README's `.venv/bin/...` lines run from it.
VENV = Path(sys.prefix)

NAME = re.compile(r"(?<![\w./-])tensorpar(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"^[ \t]*from[ \t]+(tensorpar(?:\.\w+)*)[ \t]+import[ \t]+([\w \t,]+?)[ \t]*(?:#.*)?$", re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"`((?:tests|tools|tensorpar|docs)/[\w./-]*\w)`")
FENCE = re.compile(r"^```(\w*)\s*$")
# How a README shell line runs tensorpar: the installed command or the module, from .venv or PATH.
TENSORPAR_COMMAND = re.compile(r"^(?:\.venv/bin/)?(?:tensorpar|python3? -m tensorpar)(?:\s|$)")


def fenced_blocks(text: str) -> list:
    """``[(language, body, first line number), ...]`` of the fenced code blocks in ``text``."""
    blocks, open_ = [], None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence and open_ is None:
            open_ = (fence.group(1), [], number + 1)
        elif line.strip() == "```" and open_ is not None:
            blocks.append((open_[0], "\n".join(open_[1]), open_[2]))
            open_ = None
        elif open_ is not None:
            open_[1].append(line)
    return blocks


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (a link inside one is code, not a link)."""
    out, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            out.append(line)
    return "\n".join(out)


def resolve(name: str):
    """The object a dotted name means: the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:  # only "this prefix is no module"; a broken import fails
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                continue
            raise
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def names_in(text: str) -> set:
    names = set(NAME.findall(text))
    for lang, body, _ in fenced_blocks(text):
        for module, imported in FROM_IMPORT.findall(body):
            names |= {f"{module}.{n.split()[0]}" for n in imported.split(",") if n.strip()}
    return names


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, blanks as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    seen, out = {}, set()
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list:
    bad = []
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not files here
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


def command_lines(body: str) -> list:
    """The command lines of a shell block: continuations joined, blank lines and comments left out."""
    lines, joined = [], ""
    for line in body.splitlines():
        joined += line.rstrip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        if joined.strip() and not joined.lstrip().startswith("#"):
            lines.append(joined.strip())
        joined = ""
    return lines


def readme_cases() -> dict:
    """The README's runnable pieces: ``python`` scripts, ``tensorpar`` commands (each with the
    ``text`` block shown as its output, if any) and the ``make`` lines left to the reader."""
    blocks = fenced_blocks(README.read_text())
    cases = {"python": [], "command": [], "make": [], "unjudged": []}
    for i, (lang, body, line) in enumerate(blocks):
        if lang == "python":
            cases["python"].append((f"python@L{line}", body))
        elif lang in ("bash", "sh", "shell"):
            after = blocks[i + 1] if i + 1 < len(blocks) else None
            shown = after[1] if after and after[0] == "text" and _adjacent(line, body, after[2]) else None
            commands = command_lines(body)
            for j, cmd in enumerate(commands):
                kind = "make" if re.match(r"^make(\s|$)", cmd) else \
                    "command" if TENSORPAR_COMMAND.match(cmd) else "unjudged"
                output = shown if j == len(commands) - 1 else None
                cases[kind].append((f"bash@L{line}:{cmd.split()[0]}#{j}", cmd, output))
    return cases


def _adjacent(line: int, body: str, next_line: int) -> bool:
    """The next block opens right after this one closes (only blank lines between)."""
    between = README.read_text().splitlines()[line + len(body.splitlines()):next_line - 2]
    return all(not s.strip() for s in between)


def masked(line: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"\d+", "0", line)).strip()


def unmatched_shown_line(shown: str, real: str):
    """The first shown line (not ``...``) with no matching real line after the previous match."""
    real_lines = [masked(s) for s in real.splitlines()]
    at = 0
    for line in shown.splitlines():
        if line.strip() == "...":
            continue
        want = masked(line)
        while at < len(real_lines) and real_lines[at] != want:
            at += 1
        if at == len(real_lines):
            return line
        at += 1
    return None


CASES = readme_cases()

# The command line: each command's parser (what `tensorpar CMD --help` prints) is the source of truth.
CLI_DOC = ROOT / "docs" / "cli.md"
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")
SHOWN_COMMAND = re.compile(r"(?:^|(?<=[\s/(]))(?:python3? )?(?:-m )?tensorpar ([a-z][\w-]*)(.*)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def cli_options() -> dict:
    """``{command: {"--option", ...}}`` as the parser of ``tensorpar`` defines them."""
    from tensorpar.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for a in p._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
            for name, p in sub.choices.items()}


def cli_sections(text: str) -> dict:
    """``{command: the text of its section}`` in docs/cli.md: a section opens at ``## `tensorpar CMD` ``."""
    parts = re.split(r"^## `tensorpar ([a-z][\w-]*)`\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def shown_commands(text: str) -> list:
    """``[(command, "--opt --opt2 ...")]`` of every tensorpar command line a page shows: in shell
    blocks (continuations joined) and in inline code spans of its prose."""
    lines = []
    for lang, body, _ in fenced_blocks(text):
        if lang in ("bash", "sh", "shell", "console", ""):
            lines += [re.sub(r"\s#.*$", "", line) for line in command_lines(body)]  # comments are prose
    lines += CODE_SPAN.findall(prose(text))
    found = []
    for line in lines:
        for m in SHOWN_COMMAND.finditer(line):
            found.append((m.group(1), " ".join(OPTION.findall(m.group(2)))))
    return found


# ---------------------------------------------------------------------------------------------
# Tier 1


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_tensorpar_name_the_docs_mention_resolves(path):
    bad = []
    for name in sorted(names_in(path.read_text())):
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            bad.append(f"{name} ({type(exc).__name__}: {str(exc)[:120]})")
    assert not bad, f"{path.name} names what does not exist: " + "; ".join(bad)


def test_the_name_reader_finds_names_in_prose_and_imports():
    text = ("see `tensorpar.distributed.ledger(model=m)` and tensorpar.models.generate.\n"
            "a path tensorpar/distributed/shm.py is no name\n```python\n"
            "from tensorpar.models import load_sharded, make_tiny_model  # x\n```\n")
    assert names_in(text) == {"tensorpar.distributed.ledger", "tensorpar.models.generate", "tensorpar.models",
                              "tensorpar.models.load_sharded", "tensorpar.models.make_tiny_model"}
    with pytest.raises(AttributeError):
        resolve("tensorpar.models.no_such_name")
    with pytest.raises(ModuleNotFoundError):
        resolve("tensorparx.models")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_python_block_the_docs_show_parses(path):
    """docs/ blocks are fragments (the README's run whole, below), but each must be Python."""
    bad = []
    for lang, body, line in fenced_blocks(path.read_text()):
        try:
            ast.parse(body) if lang == "python" else None
        except SyntaxError as exc:
            bad.append(f"line {line + (exc.lineno or 1) - 1}: {exc.msg}")
    assert not bad, f"{path.name}: python blocks that do not parse: {bad}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_relative_link_points_at_a_file_that_exists(path):
    assert not broken_links(path), f"{path.name}: " + "; ".join(broken_links(path))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_repository_path_the_docs_quote_exists(path):
    missing = sorted({p for p in REPO_PATH.findall(path.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{path.name} quotes paths that do not exist: {missing}"


def test_the_link_reader_knows_headings_and_files(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `code` heading: yes\n## Twice\n## Twice\n[ok](#a-code-heading-yes) [ok](#twice-1) "
                    "[no](#nowhere) [no](missing.md) ![img](page.md) [web](https://example.com/x)\n"
                    "```text\n[not a link](missing-too.md)\n```\n")
    assert broken_links(page) == ["#nowhere: no heading #nowhere in page.md", f"missing.md: no file {tmp_path}/missing.md"]


def test_the_readme_is_at_most_250_lines():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/"


def test_every_readme_shell_line_is_one_this_test_judges():
    """torchrun and other commands belong in docs/ (they need what a test machine lacks)."""
    assert not CASES["unjudged"], f"README shell lines neither make nor tensorpar: {CASES['unjudged']}"
    assert CASES["command"] and CASES["python"], "the README shows no runnable example"


def unimported_modules(body: str) -> list:
    """``tensorpar.X`` the code names (``import tensorpar``, then ``tensorpar.X``) where ``X`` is a
    module it does not import (``import tensorpar.X``, ``from tensorpar.X import ...``) and no name
    ``import tensorpar`` gives (its lazy names, its former names). A fresh interpreter has only
    what the code imports; the README's blocks run in one process, where another block's import
    would hide this."""
    tree = ast.parse(body)
    imported, aliases = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):  # `import tensorpar.x` binds tensorpar too
            imported |= {a.name for a in node.names}
            aliases |= {a.asname or "tensorpar" for a in node.names if a.name == "tensorpar"}
            aliases |= {"tensorpar" for a in node.names if a.name.startswith("tensorpar.") and not a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    import tensorpar
    given = set(tensorpar.__all__) | {n.split(".")[1] for n in tensorpar._FORMER_NAMES}
    named = {f"tensorpar.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id in aliases and n.attr not in given}
    return sorted(m for m in named if not any(i == m or i.startswith(m + ".") for i in imported))


def test_each_readme_python_block_imports_the_tensorpar_modules_it_names():
    bad = {case_id: unimported_modules(body) for case_id, body in CASES["python"]}
    assert not {c: m for c, m in bad.items() if m}, f"README python blocks name modules they do not import: {bad}"


def test_the_import_reader_finds_modules_named_but_not_imported():
    assert unimported_modules("import torch, tensorpar\nfrom tensorpar.models import generate\n"
                              "tensorpar.parallelize(tensorpar.models.make_tiny_model('x'))\n"
                              "tensorpar.dist.launch(f, 2); tensorpar.nn.Linear; tensorpar.__version__") == ["tensorpar.nn"]
    assert unimported_modules("import tensorpar.nn.layers\nfrom tensorpar import models\n"
                              "tensorpar.nn.x; tensorpar.models.y; tensorpar.sharding.z") == ["tensorpar.sharding"]
    assert unimported_modules("import tensorpar as tp\ntp.nn.x") == ["tensorpar.nn"]


def _tensorpar_args(command: str) -> str:
    """``run --tp 2`` of ``.venv/bin/tensorpar run --tp 2`` or ``$(VPY) -m tensorpar run --tp 2``."""
    m = re.search(r"(?:^|[\s/])(?:-m )?tensorpar (.*)$", command.strip())
    return m.group(1).strip() if m else ""


def test_the_readme_shows_the_output_of_what_make_run_runs():
    """The README's shown output is checked against the command above it: that command must be the
    one `make run` runs (a Makefile that changed its flags would leave the README showing another job)."""
    recipe = re.search(r"^run:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, "the Makefile has no run target"
    made = [_tensorpar_args(line) for line in recipe.group(1).splitlines() if "tensorpar" in line]
    shown = [_tensorpar_args(cmd) for _, cmd, output in CASES["command"] if output is not None]
    assert len(made) == 1 and made[0] in shown, f"make run runs `tensorpar {made}`; the README shows output of {shown}"


def test_shown_output_is_matched_line_by_line_with_digits_masked():
    real = "Proof: 1.42e-07 (relative 7.90e-07)\n│ 0.619  │ a │\nparams 22,713,216\nlast\n"
    assert unmatched_shown_line("Proof: 8.20e-08 (relative 4.57e-07)\n...\nlast", real) is None
    assert unmatched_shown_line("│ 0.6 │ a │", real) is None  # digits and blanks vary, words do not
    assert unmatched_shown_line("last\nparams 22,713,216", real) == "params 22,713,216"  # order
    assert unmatched_shown_line("Proof: 1e-07 (absolute 7.90e-07)", real) == "Proof: 1e-07 (absolute 7.90e-07)"


def test_the_cli_reference_has_every_command_and_option_and_no_other():
    options, sections = cli_options(), cli_sections(CLI_DOC.read_text())
    missing = {cmd: sorted(o for o in opts if not re.search(rf"(?<![\w-]){o}(?![\w-])", sections.get(cmd, "")))
               for cmd, opts in options.items()}
    assert not {c: m for c, m in missing.items() if m}, f"docs/cli.md lacks these options: {missing}"
    assert set(sections) == set(options), f"docs/cli.md's commands {sorted(sections)} != the CLI's {sorted(options)}"
    extra = {cmd: sorted(set(OPTION.findall(text)) - options[cmd] - {"--help"}) for cmd, text in sections.items()}
    assert not {c: e for c, e in extra.items() if e}, f"docs/cli.md names options the CLI lacks: {extra}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_command_the_docs_show_has_those_options(path):
    options = cli_options()
    bad = sorted({f"tensorpar {cmd} {opts}".strip() for cmd, opts in shown_commands(path.read_text())
                  if cmd not in options or not set(opts.split()) <= options[cmd] | {"--help"}})
    assert not bad, f"{path.name} shows commands or options the CLI lacks: {bad}"


def test_every_environment_variable_tensorpar_reads_is_documented():
    """A ``TENSORPAR_*`` variable the code reads changes how ranks run: the user must find it."""
    variable = re.compile(r"TENSORPAR_[A-Z][A-Z_]*")  # whole names: TENSORPAR_TRACE is not TENSORPAR_TRACEBACK
    read = {m for f in (ROOT / "tensorpar").rglob("*.py") for m in variable.findall(f.read_text())}
    documented = set(variable.findall((ROOT / "docs" / "reliability.md").read_text()))
    assert read and not read - documented, f"docs/reliability.md lacks {sorted(read - documented)}"


def test_the_command_reader_finds_commands_in_blocks_and_spans():
    text = ("Run `tensorpar plan --model x --tp 8` or `python -m tensorpar run --json`.\n```bash\n"
            ".venv/bin/tensorpar train --dp 2 \\\n    --zero 3  # comment --not\n"
            "torchrun --nproc-per-node 4 -m tensorpar verify --tp 2\n```\n```text\ntensorpar run --no\n```\n")
    assert sorted(shown_commands(text)) == [("plan", "--model --tp"), ("run", "--json"),
                                            ("train", "--dp --zero"), ("verify", "--tp")]
    assert cli_sections("## `tensorpar run`\nx --a\n## `tensorpar plan`\ny\n") == {"run": "\nx --a\n", "plan": "\ny\n"}


# ---------------------------------------------------------------------------------------------
# Tier 2: the README's examples, run as written


def _folder(root: Path, case_id: str) -> Path:
    folder = root / re.sub(r"\W", "_", case_id)
    folder.mkdir()
    (folder / ".venv").symlink_to(VENV)
    return folder


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),  # this tree, not an installed one
            "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}


def _run_command(case_id: str, command: str, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=_folder(root, case_id), env=_env(), capture_output=True,
                          text=True, timeout=300)


def _run_python_blocks(blocks: list, root: Path) -> dict:
    """``{case_id: CompletedProcess}`` of each block (its exit status, its error and the process's
    output), all run by one process of tests/_readme_blocks.py."""
    folders = [_folder(root, case_id) for case_id, _ in blocks]
    for folder, (_, body) in zip(folders, blocks):
        (folder / "example.py").write_text(body)
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "_readme_blocks.py"), *map(str, folders)], cwd=root,
                       env=_env(), capture_output=True, text=True, timeout=300 * len(blocks))
    out = {}
    for folder, (case_id, _) in zip(folders, blocks):
        done = folder / "result.json"
        res = json.loads(done.read_text()) if done.exists() else \
            {"exit": None, "error": f"no result: the process running the blocks exited {r.returncode} before"}
        out[case_id] = subprocess.CompletedProcess(r.args, res["exit"], r.stdout, f"{r.stderr}\n{res['error']}")
    return out


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    with ThreadPoolExecutor(max_workers=2) as pool:  # independent: two at a time on two cores
        blocks = pool.submit(_run_python_blocks, CASES["python"], root)
        commands = {case_id: pool.submit(_run_command, case_id, cmd, root) for case_id, cmd, _ in CASES["command"]}
    return {**blocks.result(), **{case_id: f.result() for case_id, f in commands.items()}}


def _why(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-3000:]}"


@pytest.mark.multirank
@pytest.mark.parametrize("case_id", [c for c, _ in CASES["python"]])
def test_each_readme_python_block_runs(readme_runs, case_id):
    r = readme_runs[case_id]
    assert r.returncode == 0, _why(r)


@pytest.mark.multirank
@pytest.mark.parametrize("case_id, command", [(c, cmd) for c, cmd, _ in CASES["command"]])
def test_each_readme_command_exits_0(readme_runs, case_id, command):
    r = readme_runs[case_id]
    assert r.returncode == 0, f"{command}\n{_why(r)}"


@pytest.mark.multirank
@pytest.mark.parametrize("case_id, command, shown", [c for c in CASES["command"] if c[2] is not None])
def test_readme_shown_output_is_the_real_output(readme_runs, case_id, command, shown):
    real = readme_runs[case_id].stdout
    line = unmatched_shown_line(shown, real)
    assert line is None, f"README shows a line `{command}` does not print (in this order):\n{line}\n" \
                         f"real output:\n{real}"
