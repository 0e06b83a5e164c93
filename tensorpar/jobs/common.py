"""What `run` and `verify` share: checking a checkpoint and a tp size before any rank starts, and
loading the unsplit model both compare against."""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tensorpar.architecture import configs
from tensorpar.models.checkpoint import check_checkpoint
from tensorpar.sharding.check import check_feasibility
from tensorpar.sharding.model_classes import eager_experts

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}

# Largest relative difference (max |split - unsplit| / max |unsplit|) accepted per dtype. The split
# model sums the same products in another order (per-rank partial sums, then the all-reduce), so
# results differ by rounding only: float64 and float32 keep the layer tests' bounds (1e-10, 1e-5;
# measured on the test models and MiniLM: below 1e-13 and 1e-6); half precisions allow a few
# units of their rounding (bf16 u = 3.9e-3, fp16 u = 4.9e-4) through a model's depth.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 5e-3}


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    family: str
    config: dict  # config.json as a plain dict


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r} is not supported; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


def open_checkpoint(path) -> Checkpoint:
    """Check ``path`` is a Hugging Face checkpoint directory of an architecture transformers knows
    and holds every tensor its model needs, with its shape (headers and index only, no weights
    read: :func:`~tensorpar.models.checkpoint.check_checkpoint`), before any rank starts."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if str(path) == "":  # Path("") is the working directory
        raise ValueError("--model '' is empty; give a Hugging Face checkpoint directory")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"--model {str(path)!r} is not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    if not any(path.glob("*.safetensors")) and not (path / "model.safetensors.index.json").is_file():
        raise ValueError(f"{path} has no *.safetensors weights; tensorpar loads safetensors checkpoints")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg_file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_file} is not a JSON object (got {type(config).__name__})")
    family = config.get("model_type")
    if family not in CONFIG_MAPPING_NAMES:
        raise ValueError(f"model type {family!r} in {cfg_file} is not known to this transformers; "
                         f"tensorpar splits the architectures transformers can build")
    try:
        check_checkpoint(path)
    except StrictDataclassError as exc:  # a validator of transformers' configuration class: its own words
        words = " ".join(str(exc.__cause__ or exc).split())
        raise ValueError(f"{cfg_file}: transformers refuses this {family} config: {words}") from None
    return Checkpoint(path, family, config)


def quiet_transformers() -> None:
    """Library code does not print: no "Loading weights" bars from transformers on the ranks."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def dense_model(path, dtype: torch.dtype):
    """The unsplit model of the checkpoint's own architecture (``config.architectures[0]``), in eval mode."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    cls = getattr(transformers, (config.architectures or ["AutoModel"])[0])
    model = cls.from_pretrained(path, dtype=dtype).eval()
    return eager_experts(model) if dtype == torch.float64 else model


def check_tp(ckpt: Checkpoint, tp: int) -> list[str]:
    """Raise ValueError naming the valid tp sizes unless ``tp`` fits; return the fixes it needs."""
    from transformers import AutoConfig

    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp must be a positive integer, got {tp!r}")
    report = check_feasibility(AutoConfig.from_pretrained(ckpt.path), tp)
    if not report.ok:
        raise ValueError(report.error_message())
    return report.fixes


def is_decoder(ckpt: Checkpoint) -> bool:
    """A causal LM: its class (``architectures[0]``) is one, or its type has only a causal-LM head."""
    from transformers.models.auto import modeling_auto as auto
    arch = (ckpt.config.get("architectures") or [""])[0]
    causal = set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if arch:
        return arch in causal or arch.endswith(("ForCausalLM", "LMHeadModel")) and "Masked" not in arch
    return ckpt.family in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and ckpt.family not in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES


def max_positions(ckpt: Checkpoint) -> int | None:
    """The longest sequence the model's position table or rotary setting allows (None: no limit
    known), from config.json or, in a multimodal model's, from its language model's config
    (``text_config``, ``llm_config``, ...)."""
    return next((n for c in configs.text_configs(ckpt.config) if (n := configs.max_positions(c))), None)


def vocab_size(ckpt: Checkpoint) -> int:
    """The language model's vocabulary (a multimodal model's ``text_config`` and the like: read
    as transformers reads it)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(ckpt.path).get_text_config().vocab_size)


def check_length(ckpt: Checkpoint, tokens: int, what: str) -> None:
    limit = max_positions(ckpt)
    if limit is not None and tokens > limit:
        raise ValueError(f"{what} ({tokens} tokens) is longer than this model's {limit} positions; "
                         f"use at most {limit}")


def nonfinite(model) -> list[str]:
    """Names of this rank's parameters holding NaN or inf (a checkpoint's, once loaded): a split
    of such weights compares NaN with NaN, which no tolerance judges."""
    return [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]


def no_phase(text: str):
    """The jobs' default ``phase``: a phase shown nowhere (the CLI passes one that shows it)."""
    return contextlib.nullcontext()
