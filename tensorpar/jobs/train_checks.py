"""What `tensorpar train` checks before any rank starts: each a ``ValueError`` naming the value and
what is valid (the CLI: one line, exit 2).

- the numbers and the layout (:func:`check_numbers`, :func:`check_layout`);
- the paths: none empty (``Path("")`` is the working directory), the output, checkpoint and export
  folders writable (:func:`check_paths`), and, once the model's size is known, room on their
  filesystems for every checkpoint the run will save and the export (:func:`check_room`);
- the ranks: as many as this machine can hold, or torchrun's WORLD_SIZE (:func:`check_world`);
- the model's weights: every one finite (:func:`check_finite_weights`, reading them once);
- what the ranks would refuse later: sequence parallelism over mixture-of-experts layers, a
  transposed (Conv1D) shard saved under FSDP (:func:`check_split`);
- the checkpoint to resume from (:func:`resume_point`), and an output folder already holding the
  checkpoints of another run, which this run's saves would mix with (:func:`check_previous_run`).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tensorpar import distributed as dist
from tensorpar.architecture import configs, pipeline
from tensorpar.distributed.rendezvous import BACKENDS, under_torchrun
from tensorpar.models.saving import LATEST, check_writable, record, resolve
from tensorpar.sharding import sequence
from tensorpar.sharding.inventory import build_inventory

ZERO = {0: "ddp", 3: "fsdp"}  # --zero: the ZeRO stage, and PyTorch's engine that gives it
TRAIN_DTYPES = ("float32", "float64", "bfloat16")
# What a checkpoint of tensorpar train holds per parameter: the weight and AdamW's two moments.
CHECKPOINT_COPIES = 3
# DCP's per-item headers and metadata beside the tensors: measured 1.13 x on the tiny Llama's AdamW
# checkpoint; 1.25 x and 1 MiB leave room for smaller items (as tensorpar.save's own check).
CHECKPOINT_OVERHEAD, CHECKPOINT_SLACK = 1.25, 2 ** 20


def check_numbers(cfg) -> None:
    optional = tuple(n for n in ("save_every", "microbatches", "virtual_stages") if getattr(cfg, n) is not None)
    for name in ("tp", "dp", "pp", "steps", "batch", "seq") + optional:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if cfg.dtype not in TRAIN_DTYPES:
        raise ValueError(f"--dtype {cfg.dtype!r} is not supported for training; valid: {', '.join(TRAIN_DTYPES)}")
    for name, value, positive in (("lr", cfg.lr, True), ("max_norm", cfg.max_norm, True),
                                  ("weight_decay", cfg.weight_decay, False)):
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or value < 0 or (positive and value == 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a {'positive' if positive else 'non-negative'} "
                             f"number, got {value!r}")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed < 2 ** 32:
        raise ValueError(f"--seed must be an integer from 0 to {2 ** 32 - 1}, got {cfg.seed!r}")
    if cfg.seq < 2:
        raise ValueError(f"--seq {cfg.seq}: a next-token loss needs windows of at least 2 tokens")


def check_layout(cfg) -> None:
    if cfg.zero not in ZERO:
        raise ValueError(f"--zero {cfg.zero!r} is not supported; valid: 0 (DDP: every dp rank holds its tp "
                         f"shard whole) or 3 (FSDP: parameters, gradients and optimizer state sharded over dp)")
    if cfg.batch % cfg.dp:
        fits = cfg.dp * max(1, cfg.batch // cfg.dp)
        raise ValueError(f"--batch {cfg.batch} (global sequences per step) must be divisible by --dp {cfg.dp}, "
                         f"so that every dp rank trains on as many rows; e.g. --batch {fits}")
    if cfg.sequence_parallel and cfg.tp < 2:
        raise ValueError("--sequence-parallel splits the sequence over the tp ranks; --tp is 1: use --tp 2 or more")
    if cfg.sequence_parallel and cfg.seq % cfg.tp:
        raise ValueError(f"--seq {cfg.seq} must be divisible by --tp {cfg.tp} with --sequence-parallel; "
                         f"e.g. --seq {cfg.tp * max(1, cfg.seq // cfg.tp)}")
    if cfg.backend not in BACKENDS:
        raise ValueError(f"--backend {cfg.backend!r} is not supported; valid: {', '.join(BACKENDS)}")


def check_paths(cfg) -> None:
    """No path is empty; ``--out`` (where loss.png and checkpoints/ go) and ``--export`` are
    folders this process can write into or create. Creates nothing."""
    for name in ("model", "data", "out", "resume", "export"):
        value = getattr(cfg, name)
        if value is not None and str(value) == "":
            raise ValueError(f"--{name} {str(value)!r} is empty; give a path (an empty one would be the "
                             f"working directory)")
    folders = [("--out", cfg.out), ("--export", cfg.export)]
    if cfg.save_every:
        folders.append(("--save-every", Path(cfg.out) / "checkpoints"))
    for flag, value in folders:
        if value is not None:
            try:
                check_writable(value)
            except ValueError as exc:
                raise ValueError(f"{flag}: {exc}") from None


def check_world(world: int, backend: str, *, dims: str = "dp x tp") -> None:
    """Local ranks: no more than this machine can hold, and the backend can serve them (NCCL: a
    GPU each). Under torchrun the processes are already there: ``dims`` (dp x tp, or pp x dp x tp)
    must be their number."""
    env = os.environ.get("WORLD_SIZE")
    if under_torchrun() and env != str(world):
        flags = " x ".join(f"--{d}" for d in dims.split(" x "))
        raise ValueError(f"{flags} = {world} ranks, but torchrun started WORLD_SIZE={env} processes; "
                         f"run torchrun --nproc-per-node {world} (one node), or choose {dims} = {env}")
    dist.check_world(world)  # the launcher's checks: TENSORPAR_* values, torchrun's variables, room for the ranks
    if not under_torchrun():
        dist.resolve_backend(backend, world)


def check_pipeline(cfg, ckpt) -> dict | None:
    """The pipeline's settings against the model's blocks and the batch (``ValueError`` naming the
    value and the valid choices), resolved: ``{"pp", "schedule", "microbatches", "virtual_stages",
    "stage_blocks"}``; None without pipeline stages."""
    given = cfg.schedule != "1F1B" or cfg.microbatches is not None or cfg.virtual_stages is not None
    if cfg.pp == 1 and not given:
        return None
    blocks = configs.n_layers(ckpt.config)
    if blocks is None:
        raise ValueError(f"--pp {cfg.pp}: {ckpt.path.name}'s config.json names no layer count to cut into stages")
    microbatches = cfg.pp if cfg.microbatches is None else cfg.microbatches
    schedule, virtual, sizes = pipeline.check(pp=cfg.pp, blocks=blocks, schedule=cfg.schedule,
                                              microbatches=microbatches, virtual=cfg.virtual_stages,
                                              batch=cfg.batch // cfg.dp)
    return {"pp": cfg.pp, "schedule": schedule, "microbatches": microbatches, "virtual_stages": virtual,
            "stage_blocks": sizes}


def check_split(cfg, ckpt):
    """The model's inventory (its split at this tp, built on the meta device), after refusing what
    the ranks would refuse later: sequence parallelism over mixture-of-experts layers, and saving
    a transposed (Conv1D) shard under FSDP."""
    inv = build_inventory(ckpt.path, cfg.tp, head=True)
    if cfg.sequence_parallel:
        moe = sorted({s for s in inv.plan.values() if s in sequence.MOE_STYLES})
        if moe:
            raise ValueError(f"--sequence-parallel: {ckpt.path.name} has mixture-of-experts layers ({', '.join(moe)} "
                             f"regions), which sequence parallelism does not chunk; drop --sequence-parallel")
    transposed = [p.name for p in inv.params if any(r.transpose for r in p.ranks)]
    if cfg.zero == 3 and transposed and (cfg.save_every or cfg.export):
        raise ValueError(f"--zero 3 with --save-every/--export: {transposed[0]} is a transposed (Conv1D) shard, "
                         f"which tensorpar cannot yet save under FSDP; use --zero 0")
    return inv


# Rows of a tensor checked at once for NaN and inf: ~64 MiB of float32 in a wide matrix.
_CHUNK_ELEMS = 1 << 24


def check_finite_weights(path: Path) -> None:
    """Every floating tensor of the checkpoint holds finite values, read file by file, memory-mapped,
    in chunks of rows: a NaN or inf is named before any rank starts (the ranks' proof of the split
    would otherwise fail on it as "could not split ... after 8 attempts", and training spread it)."""
    import torch
    from safetensors import safe_open

    for f in _weight_files(Path(path)):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                piece = st.get_slice(name)
                shape = piece.get_shape()
                rows = shape[0] if shape else 1
                step = max(1, _CHUNK_ELEMS // max(1, math.prod(shape[1:])))
                for lo in range(0, rows, step):
                    t = piece[lo:lo + step] if shape else st.get_tensor(name)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        raise ValueError(f"--model {str(path)!r}: tensor {name!r} in {f.name} holds NaN or inf "
                                         f"values; training cannot start from non-finite weights")


def _weight_files(path: Path) -> list:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(path.glob("*.safetensors"))


def saves(start: int, steps: int, save_every: int | None) -> int:
    """How many checkpoints a run of steps ``start+1 .. steps`` writes (each kept)."""
    return 0 if not save_every else steps // save_every - start // save_every


def checkpoint_bytes(params_total: int, itemsize: int) -> int:
    """At most what one checkpoint of tensorpar train takes on disk: the weights and AdamW's two
    moments of every dense parameter, with DCP's overhead."""
    return int(CHECKPOINT_COPIES * params_total * itemsize * CHECKPOINT_OVERHEAD) + CHECKPOINT_SLACK


def check_room(cfg, params_total: int, itemsize: int, start: int, save_dir: Path) -> None:
    """Room for every checkpoint the run will save (each kept: the weights and AdamW's two moments,
    with DCP's overhead) and for the export (the weights), summed where they share a filesystem:
    found before training, not after it (an export that does not fit loses the whole run)."""
    weights = params_total * itemsize
    need = []
    n = saves(start, cfg.steps, cfg.save_every)
    if n:
        one = checkpoint_bytes(params_total, itemsize)
        need.append(("--save-every", save_dir, n * one, f"{n} checkpoints of {one / 2 ** 20:.1f} MiB"))
    if cfg.export is not None:
        need.append(("--export", Path(cfg.export), weights + CHECKPOINT_SLACK, "the exported weights"))
    by_fs = {}
    for flag, path, nbytes, what in need:
        by_fs.setdefault(_filesystem(path), []).append((flag, path, nbytes, what))
    for items in by_fs.values():
        try:
            check_writable(items[0][1], sum(n for _, _, n, _ in items))
        except ValueError as exc:
            what = " and ".join(w for *_, w in items)
            raise ValueError(f"{' and '.join(i[0] for i in items)} ({what}): {exc}") from None


def _filesystem(path: Path) -> int:
    base = next(a for a in (path, *path.absolute().parents) if a.exists())
    return base.stat().st_dev


def run_identity(cfg, tokens) -> dict:
    """What decides the batch of every step (:func:`tensorpar.data.batch_for_step`): kept in each
    checkpoint, compared on resume."""
    return {"seed": cfg.seed, "batch": cfg.batch, "seq": cfg.seq, "data": tokens.fingerprint()}


def run_settings(cfg, model_path: Path) -> dict:
    """What else decides the trained weights (the layout only reorders sums): kept in each
    checkpoint, compared when another run writes into the same ``--out``."""
    return {"model": str(model_path.resolve()), "dtype": cfg.dtype, "lr": cfg.lr,
            "weight_decay": cfg.weight_decay, "max_norm": cfg.max_norm}


def resume_point(cfg, tokens) -> tuple[int, str | None]:
    """``(step, folder)`` of the checkpoint ``cfg.resume`` names; ``(0, None)`` without one."""
    if cfg.resume is None:
        return 0, None

    folder = resolve(cfg.resume)  # ValueError unless a complete tensorpar checkpoint, checked whole
    saved = record(folder)
    step = int(saved["step"])
    run = saved.get("extra", {}).get("train")
    if run is not None:  # saved by tensorpar train: the batches of steps after it depend on these
        now = run_identity(cfg, tokens)
        differ = [f"{k} {run[k]!r} (now {now[k]!r})" for k in now if k in run and run[k] != now[k]]
        if differ:
            raise ValueError(f"--resume {cfg.resume!r} was trained with " + ", ".join(differ) +
                             ": resuming would read other batches than the run it continues; use the same "
                             "--seed, --batch, --seq and --data")
    if step >= cfg.steps:
        raise ValueError(f"--resume {cfg.resume!r} is at step {step}; --steps ({cfg.steps}) must be larger "
                         f"(it is the step to train up to, counted from the start)")
    return step, str(folder)


def check_previous_run(cfg, save_dir: Path, now: dict, resume_folder: str | None) -> None:
    """``--out``'s checkpoints/ is this run's own: a folder holding the checkpoints of a run with
    other settings (another seed, data, learning rate, model, ...) is refused, unless this run
    resumes from it; its saves would otherwise sit beside (and replace ``latest`` among) those of
    a run it does not continue. A rerun with the same settings writes the same checkpoints again."""
    if not (save_dir / LATEST).exists():
        return
    if resume_folder is not None and Path(resume_folder).resolve().parent == save_dir.resolve():
        return  # this run continues the run that folder holds (resume_point compared its batches)
    try:
        saved = record(save_dir)
    except ValueError as exc:
        raise ValueError(f"--out {cfg.out!r}: its checkpoints/ is not this run's ({exc}); give another --out") from None
    extra = saved.get("extra", {})
    before = {**extra.get("train", {}), **extra.get("settings", {})}
    differ = [f"{k} {before[k]!r} (now {now[k]!r})" for k in now if k in before and before[k] != now[k]]
    if not extra.get("train"):
        differ.append("saved by another program than tensorpar train")
    if differ:
        raise ValueError(f"--out {cfg.out!r} holds the checkpoints of another run (step {saved['step']}: "
                         + ", ".join(differ) + f"); this run's saves would mix with them: give another --out, or "
                         f"--resume {str(save_dir)!r} to continue that run")
