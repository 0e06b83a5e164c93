"""Mutants of `tensorpar train`'s checks, the planner's inputs and the mesh (issue 20, area train)."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from mutants import Mutant as M  # noqa: E402

TRAIN, PLAN, MESH = "tests/test_cli_train.py", "tests/test_planner_cli.py", "tests/test_models_mesh.py"
BAD = (TRAIN, "-k", "bad_inputs")
DIVERGING = (TRAIN, "-k", "diverging")
OTHER_RUN = (TRAIN, "-k", "another_runs")
ROOM = (TRAIN, "-k", "room_for")
MESH_NEW = (MESH, "-k", "different_batches or replicated_kv or no_engine")
MUTANTS = [
    # a run that diverges stops at the step, unless told to go on
    M("[train] train: a NaN loss or gradient norm never stops the run", "jobs/train.py",
      'if not (math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"])) and not spec["allow_nonfinite"]:',
      "if False:", DIVERGING),
    M("[train] train: only the loss is watched, not the gradient norm", "jobs/train.py",
      'if not (math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"])) and not spec["allow_nonfinite"]:',
      'if not math.isfinite(h["loss"]) and not spec["allow_nonfinite"]:', DIVERGING),
    M("[train] train: --allow-nonfinite ignored", "jobs/train.py",
      'if not (math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"])) and not spec["allow_nonfinite"]:',
      'if not (math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"])):', DIVERGING),
    M("[train] train: a diverged run still exports", "jobs/train.py",
      'if spec["export"] is not None and stopped is None:', 'if spec["export"] is not None:', DIVERGING),
    M("[train] train: the CLI lets the divergence out as a traceback", "cli/train.py",
      "except NonFiniteLossError as exc:  # the run diverged: named, exit 1 like a failed rank",
      "except ZeroDivisionError as exc:", DIVERGING),
    # paths, room, ranks, weights, before any rank starts
    M("[train] train: an empty path taken for the working directory", "jobs/train_checks.py",
      'if value is not None and str(value) == "":', "if False:", BAD),
    M("[train] train: folders not checked for writing", "jobs/train_checks.py", "check_writable(value)", "pass", BAD),
    M("[train] train: room for one checkpoint, however many the run keeps", "jobs/train_checks.py",
      "n = saves(start, cfg.steps, cfg.save_every)", "n = min(1, saves(start, cfg.steps, cfg.save_every))", ROOM),
    M("[train] train: the export's room not added to the checkpoints' on one filesystem", "jobs/train_checks.py",
      "by_fs.setdefault(_filesystem(path), []).append((flag, path, nbytes, what))",
      "by_fs.setdefault(flag, []).append((flag, path, nbytes, what))", ROOM),
    M("[train] train: a checkpoint estimated as its weights alone", "jobs/train_checks.py",
      "CHECKPOINT_COPIES = 3", "CHECKPOINT_COPIES = 1", ROOM),
    M("[train] train: any number of local ranks accepted", "jobs/train_checks.py",
      "dist.check_world(world)  # the launcher's checks: TENSORPAR_* values, torchrun's variables, room for the ranks", "pass", BAD),
    M("[train] train: non-finite weights reach the ranks", "jobs/train.py", "checks.check_finite_weights(ckpt.path)", "pass",
      BAD),
    M("[train] train: transformers' config validator escapes as a traceback", "jobs/common.py",
      "except StrictDataclassError as exc:  # a validator of transformers' configuration class: its own words",
      "except ZeroDivisionError as exc:", BAD),
    M("[train] train: a nested text config's positions ignored", "jobs/common.py",
      "return next((n for c in configs.text_configs(ckpt.config) if (n := configs.max_positions(c))), None)",
      "return configs.max_positions(ckpt.config)", BAD),
    M("[train] train: a tokenizer.json that is not JSON left to transformers' bare message", "data/tokens.py",
      'ok = isinstance(json.loads(f.read_text(encoding="utf-8")), dict)', "ok = True", BAD),
    # another run's checkpoints in --out
    M("[train] train: --out's checkpoints of another run accepted", "jobs/train_checks.py",
      "differ = [f\"{k} {before[k]!r} (now {now[k]!r})\" for k in now if k in before and before[k] != now[k]]",
      "differ = []", OTHER_RUN),
    M("[train] train: a run resuming from --out's own checkpoints refused", "jobs/train_checks.py",
      "if resume_folder is not None and Path(resume_folder).resolve().parent == save_dir.resolve():", "if False:",
      OTHER_RUN),
    M("[train] train: checkpoints keep the batches' settings only (the learning rate not)", "jobs/train.py",
      'extra = {"train": spec["identity"], "settings": spec["settings"]}', 'extra = {"train": spec["identity"]}',
      OTHER_RUN),
    # the planner's inputs
    M("[train] plan: sizes of config.json not checked", "architecture/configs.py",
      "if value is not None and not positive(value):", "if False:", (PLAN, "-k", "refused_in_one_line")),
    M("[train] plan: transformers' refusal of a config not named", "sharding/inventory.py",
      "except StrictDataclassError as exc:  # a validator of the configuration class: its own words",
      "except ImportError as exc:", (PLAN, "-k", "refused_in_one_line")),
    M("[train] plan: --seq 0 of a config unchecked", "cli/plan.py", "_check_counts(args)",
      "pass", (PLAN, "-k", "refused_in_one_line")),
    M("[train] plan: positions of a nested text config ignored", "sharding/inventory.py",
      "text = text_config(self.config)", "text = self.config", (PLAN, "-k", "nested")),
    # train_step, clipping and the mesh
    M("[train] train_step: tp ranks given different batches not told", "models/training.py",
      "if both[0].item() != -both[1].item():  # max(h) != min(h): the same verdict on every rank", "if False:",
      MESH_NEW),
    M("[train] train_step: the batch check off by default", "models/training.py",
      "max_norm: float | None = None, audit: bool = False, check_batch: bool = True) -> dict:",
      "max_norm: float | None = None, audit: bool = False, check_batch: bool = False) -> dict:", MESH_NEW),
    M("[train] train_step: the batch digest blind to the values", "models/training.py",
      'h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")', "pass", MESH_NEW),
    M("[train] clipping: FSDP's rows of a fused shard taken from row 0 on every dp rank", "models/training.py",
      "return lambda rows: min(rows, d * -(-rows // dp))", "return lambda rows: 0", MESH_NEW),
    M("[train] clipping: replicated KV rows of a fused shard counted on every rank", "models/training.py",
      "sq = sq - shared * (1 - 1 / r)", "sq = sq", MESH_NEW),
    M("[train] FSDP: replicated KV rows summed by a parameter hook FSDP bypasses", "nn/regions.py",
      "if owner is not None:", "if False:", MESH_NEW),
    M("[train] verify: a nested text config's layers ignored (--inject-fault refused)", "jobs/verify.py",
      "return next((n for c in configs.text_configs(config) if (n := configs.n_layers(c))), 0)",
      "return configs.n_layers(config) or 0", ("tests/test_cli_jobs.py", "-k", "nested")),
    M("[train] mesh: dp > 1 without a data-parallel engine accepted", "distributed/dp_engines.py",
      "if data_parallel is None and \"dp\" in names and mesh[\"dp\"].size() > 1:", "if False:", MESH_NEW),
]
