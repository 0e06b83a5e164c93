"""The coverage table: what ``parallelize`` does to every architecture of the test matrix.

``make coverage`` runs tests/test_models_matrix.py with ``TENSORPAR_COVERAGE=coverage.json`` and then
``python -m tensorpar.cli.coverage coverage.json docs/coverage.md``, which renders one row per
architecture and tp size from the run's own results: *exact, split* (logits, every gradient and
every decoding step equal the dense model's, each rank holding at most ``1/tp + 0.1`` of the
layers), *exact, partly whole* (what stays whole and why), *refused* (the error), or *failed* (the
test failed: never expected).
"""
from __future__ import annotations

import json
import sys
from collections import Counter

TOL64, TOL32 = 1e-10, 1e-5
HEADER = """# Architecture coverage

Every causal-LM architecture of transformers {version} that builds as a tiny random model on CPU,
split by `parallelize(model)` (plan `"auto"`) at tp 2 and tp 4 on real gloo ranks and compared
with its unsplit copy (`tests/test_models_matrix.py`): the logits, every parameter's gradient
(each shard against the same slice of the dense gradient), the global gradient norm and the
logits of every greedy decoding step, within 1e-10 relative where the model computes in float64
throughout and 1e-5 where part of it runs in float32 (routers' softmax). Each tiny model holds
every kind of layer its full-size configuration has (sliding and full attention, linear
attention, dense and expert MLPs; `tensorpar.architecture.layer_kinds`).

- **exact, split**: every rank holds at most `1/tp + 0.1` of the decoder layers' parameters.
- **exact, partly whole**: the result is exact, and what stays whole (on every rank) is named
  with the reason: a block no style splits exactly (a state-space or linear-attention mixer, an
  attention that reshapes by its input's width), what the proof found and the registry records.
- **refused**: a `ValueError` before any collective, naming the sizes tp must divide.
- **failed**: never expected; the test fails.

`plan` is where the split comes from: `declared` (the model's own `tp_plan`, translated and
completed), `tensorpar` (tensorpar's registry, for architectures that declare none) or
`discovered` (column/row pairs found and checked numerically). Regenerate with `make coverage`.

"""


def status(run: dict) -> tuple[str, str]:
    """``(status, detail)`` of one rank's result."""
    if run["status"] == "refused":
        return "refused", run["why"].split("; valid")[0][:160]
    if run["status"] != "ran":
        return "failed", run.get("why", "")[:160]
    tol = TOL64 if run["float64"] else TOL32
    errors = [run["logits"], run["grad"], run.get("grad_norm", 0.0), run["generation"] or 0.0]
    if max(errors) > tol:
        return "failed", f"differs by {max(errors):.1e} (tolerance {tol:.0e})"
    if run["reported"] == "split":
        return "exact, split", f"{run['share']:.2f} of the layers per rank"
    whole = "; ".join(f"{k}: {v.split(' (relative')[0][:90]}" for k, v in sorted(run["whole"].items()))
    if not whole:
        kept = ", ".join(n.split(".")[-1] for n, _ in run["layers_replicated"][:3])
        whole = f"replicated by the plan: {kept}"
    return "exact, partly whole", f"{run['share']:.2f} of the layers per rank; {whole}"


def render(results: list) -> str:
    rows, counts = {}, Counter()
    for item in results:
        st, detail = status(item["ranks"][0])
        rows.setdefault(item["arch"], {})[item["tp"]] = (st, detail, item["ranks"][0].get("source", ""))
        counts[(item["tp"], st)] += 1
    tps = sorted({tp for r in rows.values() for tp in r})
    lines = ["| architecture | plan | " + " | ".join(f"tp {tp}" for tp in tps) + " |",
             "|---|---|" + "---|" * len(tps)]
    for arch in sorted(rows):
        cells = [f"**{rows[arch][tp][0]}**: {rows[arch][tp][1]}" if tp in rows[arch] else "" for tp in tps]
        source = next(v[2] for v in rows[arch].values())
        lines.append(f"| {arch} | {source} | " + " | ".join(cells) + " |")
    summary = [f"- tp {tp}: " + ", ".join(f"{n} {st}" for (t, st), n in sorted(counts.items()) if t == tp)
               for tp in tps]
    import transformers
    return HEADER.format(version=transformers.__version__) + "\n".join(summary) + "\n\n" + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m tensorpar.cli.coverage RESULTS.json OUT.md", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        results = json.load(f)
    with open(argv[1], "w") as f:
        f.write(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
