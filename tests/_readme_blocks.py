"""Run the README's python blocks in one process, each as ``python example.py`` runs it in its own
folder (one import of torch and transformers and one fork server for all the blocks, instead of
one of each per block): ``python tests/_readme_blocks.py FOLDER ...`` runs each ``FOLDER/example.py``
in turn as ``__main__``, with that folder as the working directory and ``sys.path[0]``, the script
alone in ``sys.argv`` and the environment this process started with, then writes
``FOLDER/result.json``: ``{"exit": the exit status python would give, "error": the traceback or
null}``.

The ranks a block launches are forked from the fork server as in a process of its own, and import
the block again as their main module. What the blocks do share is the modules an earlier block
imported: tests/test_docs.py checks that each block imports the tensorpar modules it names.
"""
import json
import os
import runpy
import signal
import sys
import traceback

TIMEOUT_S = 300  # one block, as tests/test_docs.py gives each command line


class BlockTimeout(BaseException):
    """Not an ``Exception``: a block's own ``except Exception`` does not swallow it."""


def _alarm(signum, frame):
    raise BlockTimeout(f"the block ran past {TIMEOUT_S} s")


def run_block(folder: str, environ: dict) -> dict:
    script = os.path.join(os.path.abspath(folder), "example.py")
    os.chdir(folder)
    os.environ.clear()
    os.environ.update(environ)  # what an earlier block set is gone, as in a fresh process
    sys.path[0] = os.path.dirname(script)  # the script's folder, as python puts it first
    sys.argv = [script]
    print(f"--- {script}", flush=True)
    print(f"--- {script}", file=sys.stderr, flush=True)
    signal.alarm(TIMEOUT_S)
    try:
        # an absolute path: the ranks import it again (multiprocessing's main_path) from their own folder
        runpy.run_path(script, run_name="__main__")
        return {"exit": 0, "error": None}
    except SystemExit as exc:  # python's exit status for sys.exit(code)
        code = exc.code
        return {"exit": code if isinstance(code, int) else (0 if code is None else 1), "error": repr(exc)}
    except BaseException:
        return {"exit": 1, "error": traceback.format_exc()}
    finally:
        signal.alarm(0)
        sys.stdout.flush()
        sys.stderr.flush()


def main(folders: list) -> None:
    environ = dict(os.environ)
    signal.signal(signal.SIGALRM, _alarm)
    for folder in folders:
        result = run_block(folder, environ)
        with open(os.path.join(folder, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main([os.path.abspath(f) for f in sys.argv[1:]])
