"""Run several `tensorpar` command lines in one process (one import of torch and transformers
instead of one per command): ``python -m tests._cli_batch '[["verify", "--tp", "3"], ...]'`` prints
``[{"rc", "stdout", "stderr"}, ...]`` as JSON, each from ``tensorpar.cli.main`` exactly as the
``tensorpar`` entry point calls it. For errors raised before any rank starts."""
import contextlib
import io
import json
import sys

from tensorpar.cli import main


def run_all(arg_lists: list) -> list:
    results = []
    for args in arg_lists:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(args)
            except SystemExit as exc:  # argparse's own errors
                rc = exc.code
        results.append({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})
    return results


if __name__ == "__main__":
    print(json.dumps(run_all(json.loads(sys.argv[1]))))
