"""`tensorpar train`: train a causal LM on a (dp, tp) mesh of local ranks, with checkpoints."""
from __future__ import annotations

import contextlib
import json
import sys

from tensorpar.cli.errors import fail
from tensorpar.cli.progress import console, reporting_rank


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a causal LM over pp x dp x tp local ranks (pipeline stages, DDP or "
                                     "FSDP around tensor parallelism), with checkpoints that resume at any layout")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="a local Hugging Face causal-LM checkpoint (config.json + safetensors); default: a tiny "
                        "random Llama generated offline into the output folder")
    p.add_argument("--tp", type=int, default=2, metavar="N",
                   help="tensor-parallel ranks (must divide the heads; default 2)")
    p.add_argument("--dp", type=int, default=2, metavar="M",
                   help="data-parallel ranks (default 2); dp x tp ranks in all")
    p.add_argument("--pp", type=int, default=1, metavar="P",
                   help="pipeline ranks (default 1): the model cut into stages of consecutive blocks; pp x dp x tp "
                        "ranks in all")
    p.add_argument("--schedule", default="1F1B", metavar="NAME",
                   help="the pipeline schedule, PyTorch's: GPipe, 1F1B (default), Interleaved1F1B, LoopedBFS, "
                        "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV")
    p.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="microbatches per step and dp rank (must divide --batch / --dp; default --pp)")
    p.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="stages per pipeline rank (default 1; 2 for the interleaved and V schedules)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="between the blocks' regions each tp rank holds its chunk of the sequence "
                        "(--seq must divide by tp)")
    p.add_argument("--zero", type=int, default=0, metavar="{0,3}",
                   help="0: DDP, every dp rank holds its tp shard whole (default); 3: FSDP, parameters, gradients "
                        "and optimizer state sharded over dp")
    p.add_argument("--steps", type=int, default=20, metavar="S",
                   help="the step to train up to, counted from the start (default 20)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (default 1e-3)")
    p.add_argument("--batch", type=int, default=8, metavar="B",
                   help="global sequences per step, shared out over dp (default 8)")
    p.add_argument("--seq", type=int, default=64, metavar="T", help="tokens per sequence (default 64)")
    p.add_argument("--data", metavar="FILE_OR_DIR", default=None,
                   help="a UTF-8 text file (the model's tokenizer, else its bytes) or a folder of .npy files of "
                        "1-D token ids (read in sorted name order); default: a small packaged corpus")
    p.add_argument("--save-every", type=int, default=None, metavar="K",
                   help="save a checkpoint every K steps into OUT/checkpoints")
    p.add_argument("--out", metavar="DIR", default="tensorpar-train",
                   help="the output folder: loss.png, checkpoints/, the generated model (default ./tensorpar-train)")
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="a tensorpar checkpoint (a folder with `latest`, or one step's folder), saved at any "
                        "layout: training goes on from its step up to --steps")
    p.add_argument("--export", metavar="DIR", default=None,
                   help="at the end, write the trained model as a Hugging Face directory")
    p.add_argument("--max-norm", type=float, default=1.0, metavar="X",
                   help="clip the whole model's gradient norm to this (default 1.0)")
    p.add_argument("--weight-decay", type=float, default=0.01, metavar="WD", help="AdamW's weight decay (default 0.01)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seeds the batches of every step (and the generated model; default 0)")
    p.add_argument("--dtype", default="float32", metavar="NAME", help="float32 (default), float64, bfloat16")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="go on past a step whose loss or gradient norm is NaN or inf (by default training stops "
                        "there, exit 1, naming the step)")
    p.add_argument("--backend", default="auto", metavar="NAME",
                   help="auto (NCCL with a GPU per rank, else shared memory between local ranks), shm, gloo, nccl")
    p.add_argument("--profile", metavar="FILE", default=None,
                   help="a hardware profile from tensorpar calibrate: the report puts the planner's estimate of a "
                        "step beside the median of the run's steps")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=main)


def main(args) -> int:
    from tensorpar.jobs.train import NonFiniteLossError, TrainConfig, train

    cfg = TrainConfig(model=args.model, tp=args.tp, dp=args.dp, pp=args.pp, schedule=args.schedule,
                      microbatches=args.microbatches, virtual_stages=args.virtual_stages,
                      sequence_parallel=args.sequence_parallel,
                      zero=args.zero, steps=args.steps, lr=args.lr, batch=args.batch, seq=args.seq, data=args.data,
                      save_every=args.save_every, out=args.out, resume=args.resume, export=args.export,
                      max_norm=args.max_norm, weight_decay=args.weight_decay, seed=args.seed, dtype=args.dtype,
                      backend=args.backend, allow_nonfinite=args.allow_nonfinite, profile=args.profile)
    try:
        with _Progress(quiet=args.json) as bar:
            report = train(cfg, on_event=bar.on_event if bar.live else None, phase=bar.phase)
    except NonFiniteLossError as exc:  # the run diverged: named, exit 1 like a failed rank
        return fail(args, str(exc), 1)
    if not reporting_rank():  # under torchrun every process holds the report: rank 0 prints it
        return 0
    if args.json:
        print(json.dumps(report.to_dict(), default=str))
    else:
        _show(report)
    return 0


def _mb(n) -> str:
    return "-" if n is None else f"{n / 2 ** 20:,.2f}"


class _Progress:
    """Rank 0's progress on stderr: a phase line while checking and starting, then a bar with the
    step, the loss, tokens/s and the memory each rank holds. Quiet with ``--json``, when stderr is
    not a terminal, and on torchrun's processes other than rank 0 (as :class:`Phases`)."""

    def __init__(self, quiet: bool):
        self.live = not (quiet or not sys.stderr.isatty() or not reporting_rank())
        self._bar = self._task = None
        self._memory = ""

    def __enter__(self):
        if self.live:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn)

            self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=Console(stderr=True))
            self._bar.__enter__()
            self._task = self._bar.add_task("starting", total=None, info="")
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False

    def phase(self, text: str):
        if self._bar is not None:
            self._bar.update(self._task, description=text)
        return contextlib.nullcontext()

    def on_event(self, event: dict) -> None:
        kind = event["event"]
        if kind == "start":
            self._bar.update(self._task, description=f"training on {event['world_size']} ranks",
                             total=event["steps"] - event["start"], completed=0)
        elif kind == "step":
            if event["memory"] is not None:
                states = ", ".join(_mb(m["state_bytes"]) for m in event["memory"][:8])
                more = ", ..." if len(event["memory"]) > 8 else ""
                rss = max(m["peak_rss_bytes"] for m in event["memory"])
                self._memory = f"  state MiB/rank {states}{more}  (peak RSS <= {_mb(rss)} MiB)"
            info = (f"step {event['step']}  loss {event['loss']:.4f}  {event['tokens_per_s']:,.0f} tok/s"
                    f"{self._memory}")
            self._bar.update(self._task, advance=1, info=info)
        elif kind == "save":
            self._bar.console.print(f"checkpoint of step {event['step']}: {event['path']}")


def _show(r) -> None:
    from rich.table import Table

    con, lay = console(), r.layout
    if r.generated_model:
        con.print(f"no --model: a tiny random Llama (256 ids) was generated offline in {r.model_path}")
    data = r.data["path"] or "the packaged corpus"
    pipe = lay["pipeline"]
    stages = (f"pp {lay['pp']} ({pipe['schedule']}, {pipe['microbatches']} microbatches, blocks per stage "
              f"{pipe['stage_blocks']}) x " if pipe else "")
    con.print(f"[bold]{r.model}[/] ({r.dtype}) on {stages}dp {lay['dp']} x tp {lay['tp']} = {lay['world_size']} ranks "
              f"({lay['backend']}), zero {lay['zero']} ({lay['data_parallel'].upper()})"
              f"{', sequence parallel' if lay['sequence_parallel'] else ''}; data: {data} "
              f"({r.data['tokens']:,} tokens, {r.data['tokenizer'] or 'token ids'}); batch {r.batch} x {r.seq} tokens")
    if r.resumed_from:
        con.print(f"resumed from {r.resumed_from} at step {r.start_step}")
    t = Table(title=f"Steps {r.start_step + 1}-{r.steps}", title_justify="left")
    for col in ("step", "loss", "grad norm", "tokens/s"):
        t.add_column(col, justify="right")
    for i in _sample(len(r.losses), 12):
        t.add_row(str(r.step_numbers[i]), f"{r.losses[i]:.5f}", f"{r.grad_norms[i]:.4f}", f"{r.tokens_per_s[i]:,.0f}")
    con.print(t)
    _memory_table(con, r)
    _communication_table(con, r)
    e = r.time_estimate
    if e is not None:
        con.print(f"step time: measured {e['measured_s'] * 1e3:.1f} ms (median of {e['steps_timed']} steps), planner's "
                  f"estimate {e['estimate_s'] * 1e3:.1f} ms from {e['profile']} (measured / estimate "
                  f"{e['measured_vs_estimate']:.2f}; largest term {e['dominant']})")
    for path in r.checkpoints:
        con.print(f"checkpoint: {path}")
    if r.export:
        con.print(f"exported (Hugging Face directory): {r.export}")
    con.print(f"loss curve: {r.png}")


def _sample(n: int, k: int) -> list:
    """At most ``k`` indices of ``n``, evenly spread, the first and the last among them."""
    return list(range(n)) if n <= k else sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _memory_table(con, r) -> None:
    from rich.table import Table

    gpu = any(m["cuda_max_allocated_bytes"] is not None for m in r.memory_per_rank)
    t = Table(title="Memory per rank (MiB): the tensors it holds (under FSDP its shards), the planner's figure "
                    "for them, and its process", 
              title_justify="left")
    cols = ["rank", "(pp, dp, tp)", "parameters", "gradients", "optimizer", "total", "planner", "peak RSS"]
    for col in cols + (["GPU peak"] if gpu else []):
        t.add_column(col, justify="right")
    tp, dp = r.layout["tp"], r.layout["dp"]
    for m in r.memory_per_rank:
        rank = m["rank"]
        row = [str(rank), f"({rank // (dp * tp)}, {rank // tp % dp}, {rank % tp})", _mb(m["parameter_bytes"]),
               _mb(m["gradient_bytes"]), _mb(m["optimizer_bytes"]), _mb(m["state_bytes"]),
               _mb(m["planned_state_bytes"]), _mb(m["peak_rss_bytes"])]
        t.add_row(*row, *([_mb(m["cuda_max_allocated_bytes"])] if gpu else []))
    con.print(t)


def _communication_table(con, r) -> None:
    from rich.table import Table

    if not r.communication_per_rank:
        return
    step = r.communication_per_rank[0]["step"]
    t = Table(title=f"Communication per rank at step {step}: the calls the ledger recorded beside the planner's",
              title_justify="left")
    for col in ("rank", "calls", "planner", "bytes sent", "planner", "equal"):
        t.add_column(col, justify="right")
    for c in r.communication_per_rank:
        t.add_row(str(c["rank"]), str(c["calls"]), str(c["planned_calls"]), f"{c['bytes_sent']:,.0f}",
                  f"{c['planned_bytes_sent']:,.0f}", "yes" if c["equal"] else "[red]no[/]")
    con.print(t)
