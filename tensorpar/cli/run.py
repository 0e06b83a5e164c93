"""`tensorpar run`: the main job: a real model split over local ranks, with the proof."""
from __future__ import annotations

import json
import sys

from tensorpar.cli.progress import Phases, console, reporting_rank


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="split a real model over local ranks and prove it computes the same function")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="a local Hugging Face checkpoint (Llama, Mistral, Qwen2, GPT-2, BERT); "
                        "default: the packaged all-MiniLM-L6-v2")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size: ranks to split over (default 2)")
    p.add_argument("--sentence", action="append", metavar="TEXT",
                   help="a sentence to embed (encoders; repeat the option; default: six built-in sentences)")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="decoders: a prompt to continue (repeat the option for a batch of prompts)")
    p.add_argument("--prompt-ids", action="append", metavar="IDS",
                   help="decoders without a tokenizer: a prompt as comma-separated token ids (repeat the "
                        "option for a batch; lengths may differ)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="decoders: tokens to generate (default 16)")
    g = p.add_argument_group("decoders: sampling and stop tokens (generate's options; default greedy)")
    g.add_argument("--do-sample", action="store_true", help="sample the next token instead of taking the best")
    g.add_argument("--temperature", type=float, default=1.0, help="divides the logits before sampling (> 0; default 1)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens only (K >= 1)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probability reaches P (0 < P <= 1; default 1)")
    g.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0): the same tokens every run")
    g.add_argument("--eos-token-id", action="append", metavar="IDS",
                   help="a stop token id, or comma-separated ids (repeatable): a row that produces one stops")
    g.add_argument("--pad-token-id", type=int, default=None,
                   help="what follows a stopped row's stop token, and the left padding (default: the first stop token)")
    g.add_argument("--engine", default="auto", choices=("auto", "lean", "hf"),
                   help="the split model's forward while generating: lean (tensorpar's, Llama/Mistral/Qwen2), "
                        "hf (the model's own), auto (lean where it applies; default)")
    p.add_argument("--dtype", default="float32", help="float32 (default), float64, bfloat16, float16")
    p.add_argument("--backend", default="auto", help="auto (NCCL with a GPU per rank, else shared memory between local ranks), shm, gloo, nccl")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=main)


def _ids(text: str, option: str = "--prompt-ids") -> list[int]:
    """Every item an integer: an empty one (``1,,2``, ``,1``, ``1,``) is a typo, not nothing; an
    empty text is an empty prompt (which ``run`` refuses, naming the prompt)."""
    if not text.strip():
        return []
    items = text.split(",")
    for i, item in enumerate(items):
        try:
            int(item)
        except ValueError:
            what = "empty" if not item.strip() else f"{item.strip()!r}"
            raise ValueError(f"{option} {text!r} must be comma-separated integers, e.g. 1,2,3; item {i + 1} "
                             f"is {what}") from None
    return [int(t) for t in items]


def _prompt_ids(texts: list | None):
    return None if texts is None else [_ids(t) for t in texts]  # one list of ids per --prompt-ids


def _stop_ids(texts: list | None):
    if texts is not None and any(not t.strip() for t in texts):
        raise ValueError("--eos-token-id '' names no token: give one or more ids, e.g. --eos-token-id 2")
    return None if texts is None else [i for t in texts for i in _ids(t, "--eos-token-id")]


def main(args) -> int:
    from tensorpar.jobs.run import run

    with Phases(quiet=args.json) as phase:
        report = run(args.model, tp=args.tp, dtype=args.dtype, backend=args.backend,
                     sentences=args.sentence, prompt=args.prompt, prompt_ids=_prompt_ids(args.prompt_ids),
                     max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                     eos_token_id=_stop_ids(args.eos_token_id), pad_token_id=args.pad_token_id,
                     engine=args.engine, phase=phase)
    if not reporting_rank():  # under torchrun every process holds the report: rank 0 prints it
        return 0 if report.ok else 1
    if args.json:
        print(json.dumps(report.to_dict(), default=str))
    else:
        _show(report)
    if report.nonfinite:
        print(f"tensorpar run: the checkpoint holds NaN or inf in {len(report.nonfinite)} tensors, e.g. "
              f"{report.nonfinite[:3]}: no comparison can prove the split", file=sys.stderr)
        return 1
    if not report.ok:
        print("tensorpar run: the split model does not match (see above)", file=sys.stderr)
        return 1
    return 0


def _show(r) -> None:
    from rich.table import Table

    con = console()
    con.print(f"[bold]{r.model}[/] ({r.family}, {r.dtype}): split over {r.tp} processes ({r.backend}), "
              f"each holding its own shard of every weight matrix")
    if r.task == "sentence-embedding":
        n = len(r.result["ranking"])
        t = Table(title=f"Most similar sentence pairs (cosine of the split model's embeddings; top 5 of {n})",
                  title_justify="left")
        for col in ("similarity", "sentence", "sentence"):
            t.add_column(col)
        for row in r.result["ranking"][:5]:
            t.add_row(f"{row['similarity']:.3f}", row["a"], row["b"])
        con.print(t)
    else:
        _rows(con, r.result)
    _proof(con, r)


def _rows(con, result) -> None:
    """Each prompt's tokens, split and unsplit; how many it produced where a stop token ended it."""
    how = "sampled" if result["options"]["do_sample"] else "greedy"
    several = len(result["rows"]) > 1
    for i, row in enumerate(result["rows"]):
        where = f"prompt {i + 1} {row['prompt_ids']}: " if several else ""
        stopped = f" (stopped after {row['new_tokens']})" if row["stopped"] else ""
        con.print(f"{where}{how} tokens (split): {row['tokens']}{stopped}")
        con.print(f"{where}{how} tokens (unsplit): {row['dense_tokens']}  "
                  f"-> {'identical' if row['tokens_match'] else '[red]DIFFERENT[/]'}")
        if row["text"]:
            con.print(f"{where}text: {row['text']!r}")


def _proof(con, r) -> None:
    from rich.table import Table

    verdict = "[green]within[/]" if r.max_rel_diff <= r.tolerance_rel else "[red]ABOVE[/]"
    con.print(f"\n[bold]Proof[/]: largest difference from the unsplit model {r.max_abs_diff:.2e} "
              f"(relative {r.max_rel_diff:.2e}, {verdict} the {r.dtype} tolerance {r.tolerance_rel:g})")
    fr = ", ".join(f"rank {i}: {n:,} ({n / r.params_total:.1%})" for i, n in enumerate(r.params_per_rank))
    con.print(f"parameters: unsplit {r.params_total:,}; {fr}")
    if r.fixes:
        con.print("fixes applied: " + "; ".join(r.fixes))
    t = Table(title="Communication of rank 0: the calls the ledger recorded beside the planner (ring bytes sent)",
              title_justify="left")
    for col in ("module", "collectives", "ops", "bytes sent", "planner"):
        t.add_column(col, justify="left" if col in ("module", "ops") else "right", no_wrap=col == "module")
    per_block = r.ledger["predicted_per_layer_bytes_per_rank"][0]
    others = r.ledger["predicted_per_module"]
    for name, s in r.ledger["per_layer"].items():
        ops = ", ".join(f"{k} x{v}" for k, v in s["ops"].items())
        pred = per_block if name.rsplit(".", 1)[-1].isdigit() else others.get(name)
        t.add_row(name, str(s["collectives"]), ops, f"{s['bytes_sent']:,}", "" if pred is None else f"{pred:,}")
    con.print(t)
    _bytes_line(con, "bytes sent per rank", r.ledger)
    gen = r.ledger.get("generation")
    if gen:
        how = "sampled" if r.result["options"]["do_sample"] else "greedy"
        _bytes_line(con, f"{how} generation, {len(r.result['rows'])} x {gen['steps']} tokens", gen)


def _bytes_line(con, what: str, part: dict) -> None:
    """The ledger's calls against the planner's (same formula: equal or not), then the wire's bytes."""
    led, pred, wire = part["ledger_bytes_per_rank"], part["predicted_bytes_per_rank"], part["wire_bytes_per_rank"]
    if not part.get("compared", True):
        con.print(f"{what}: recorded calls {led}; [yellow]not compared[/]: {part['note']}")
    else:
        same = "[green]equal[/]" if led == pred else "[red]DIFFERENT[/]"
        con.print(f"{what}: recorded calls {led}, planner predicted {pred}: {same}")
    if all(w is not None for w in wire):
        ratio = ", ".join(f"{w / b:.3f}" if b else "-" for w, b in zip(wire, led))
        con.print(f"  on the wire (TCP counters): {wire}, {ratio} x the ring formula "
                  "(gloo's framing and small-message algorithms included)")
