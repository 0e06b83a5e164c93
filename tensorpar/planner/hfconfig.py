"""A Hugging Face ``config.json`` read as a :class:`~tensorpar.planner.models.ModelSpec`.

Only the model types whose every parameter and attention pattern the planner counts are accepted;
any other raises ``ValueError`` listing the supported ones, rather than being counted as something
it is not. Field names and defaults are those of the ``transformers`` configuration classes:

- llama, mistral, qwen2, qwen3 -> ``llama`` family. qwen2 has q/k/v biases; qwen3 has per-head
  q/k RMSNorms (``qk_norm``). Sliding windows: mistral windows every layer (``sliding_window``,
  default 4096); qwen2/qwen3 only with ``use_sliding_window``, in the layers from
  ``max_window_layers`` on (or as ``layer_types`` lists them).
- gpt2, gpt_bigcode -> ``gpt`` family. gpt_bigcode (SantaCoder, StarCoder) uses multi-query
  attention unless ``multi_query`` is false: one K/V head shared by all query heads
  (Li et al. 2023, "StarCoder", Sec. 5.1; Shazeer 2019).

Refused: openai-gpt (post-norm, no final LayerNorm), ``attention_bias`` on llama / qwen3 (it
biases o_proj as well, which the planner does not count), llama's ``mlp_bias``, cross-attention
(:class:`NotModelled`: ``tensorpar plan`` then plans the config from tensorpar's own split). A
config of any type is first checked by :func:`check_sizes`: a layer count, width, head count,
vocabulary or position limit that is zero or negative, at the top or in a nested config
(``text_config``, ``llm_config``, ...), is refused naming the file and the field.
"""
from __future__ import annotations

import json
from pathlib import Path

from .models import ModelSpec

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
GPT_TYPES = ("gpt2", "gpt_bigcode")
SUPPORTED = LLAMA_TYPES + GPT_TYPES
_REFUSED = {"openai-gpt": "GPT-1 normalises after each block and has no final LayerNorm, which the gpt family "
                          "counts"}
# Sizes a config may give (the names of transformers' configuration classes, old and new): where
# one is given as a number (or a list of them, one per layer), each must be positive. head_dim is
# not among them: 0 means "derived" in some configurations (GLM-5).
CORE_SIZES = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers", "encoder_layers", "hidden_size",
              "n_embd", "d_model", "num_attention_heads", "n_head", "num_key_value_heads", "vocab_size",
              "intermediate_size", "n_inner", "ffn_dim", "max_position_embeddings", "n_positions")


class NotModelled(ValueError):
    """A config whose model type or option the formulas do not count (not a wrong config)."""


def read_config(path) -> dict:
    """``config.json`` as a dict: ``ValueError`` naming the file unless it is a JSON object whose
    sizes pass :func:`check_sizes`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such config.json: {path}")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a JSON object (got {type(cfg).__name__}); a config.json is one object")
    check_sizes(cfg, str(path))
    return cfg


def _nested(cfg: dict, where: str = ""):
    """``(prefix, dict)`` of the config and of every config nested in it (``text_config``,
    ``llm_config``, ``vision_config``, ``decoder``, ...), depth first."""
    yield where, cfg
    for key, value in cfg.items():
        if isinstance(value, dict) and (key.endswith("_config") or key in ("decoder", "encoder", "generator")):
            yield from _nested(value, f"{where}{key}.")


# Where a multimodal or composite config nests its language model, as transformers names it
# (``get_text_config``) and as some remote-code models do (InternVL's ``llm_config``).
TEXT_KEYS = ("text_config", "llm_config", "language_config", "decoder", "generator", "text_decoder")


def text_configs(cfg: dict) -> list:
    """``cfg`` and the language model's config nested in it, in that order: where a size of the
    text model (its heads, layers, positions) is looked up."""
    return [cfg] + [cfg[k] for k in TEXT_KEYS if isinstance(cfg.get(k), dict)]


def _positive(value) -> bool:
    items = value if isinstance(value, list) else [value]
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in items)


def check_sizes(cfg: dict, source: str) -> None:
    """Every size of :data:`CORE_SIZES` that ``cfg`` or a config nested in it gives is a positive
    number (per layer: a list of them); ``ValueError`` naming ``source`` and the field otherwise
    (``num_hidden_layers: -3`` built a model of no layers, planned as if it were one)."""
    for where, sub in _nested(cfg):
        for name in CORE_SIZES:
            value = sub.get(name)
            if value is not None and not _positive(value):
                raise ValueError(f"{source}: {where}{name}={value!r} must be a positive integer")


def from_hf_config(path, *, seq: int | None = None) -> ModelSpec:
    """Shapes from a Hugging Face ``config.json`` file (see :func:`from_hf_dict`)."""
    path = Path(path)
    cfg = read_config(path)
    return from_hf_dict(cfg, seq=seq, name=cfg.get("_name_or_path") or path.parent.name or "hf",
                        source=str(path))


def from_hf_dict(cfg: dict, *, seq: int | None = None, name: str | None = None,
                 source: str = "the config") -> ModelSpec:
    """Shapes from a Hugging Face config as a dict (``config.to_dict()`` or a parsed
    ``config.json``). ``seq`` defaults to ``max_position_embeddings`` / ``n_positions``;
    ``seq_source`` of the result says which. :class:`NotModelled` for a type or option the
    formulas do not count; ``ValueError`` naming ``source`` for sizes that make no model."""
    if not isinstance(cfg, dict):
        raise ValueError(f"a Hugging Face config must be a dict (config.to_dict()); got {type(cfg).__name__}")
    check_sizes(cfg, source)
    kind = cfg.get("model_type", "")
    if kind not in SUPPORTED:
        why = f" ({_REFUSED[kind]})" if kind in _REFUSED else ""
        raise NotModelled(f"unsupported model_type {kind!r} in {source}{why}; valid: {', '.join(SUPPORTED)}")
    _refuse_unmodelled(cfg, kind, source)
    name = name or cfg.get("_name_or_path") or "hf"
    try:
        return _llama(cfg, kind, seq, name, source) if kind in LLAMA_TYPES else _gpt(cfg, kind, seq, name, source)
    except KeyError as exc:
        raise ValueError(f"{source}: a {kind} config needs {exc.args[0]!r}") from None
    except ValueError as exc:  # the shapes make no model: say which file
        raise ValueError(f"{source}: {exc}") from None


def _refuse_unmodelled(cfg: dict, kind: str, source: str) -> None:
    # mistral, qwen2 and qwen3 hard-code their MLP biases off, mistral its attention biases too
    options = {"attention_bias": ("llama", "qwen3"), "mlp_bias": ("llama",), "add_cross_attention": GPT_TYPES}
    for option, kinds in options.items():
        if kind in kinds and cfg.get(option):
            raise NotModelled(f"{kind} with {option}={cfg[option]!r} in {source} is not modelled by the planner; "
                              f"valid: {option}=false")


def _seq(cfg: dict, seq: int | None, key: str, default: int, source: str) -> tuple[int, str]:
    if seq is not None:
        return seq, "given"
    if cfg.get(key) is not None:
        return cfg[key], f"{key} in {source}"
    return default, f"default {default} ({key} not in {source})"


def _llama(cfg: dict, kind: str, seq: int | None, name: str, source: str) -> ModelSpec:
    layers = cfg["num_hidden_layers"]
    window, window_layers = sliding_window(cfg, kind, layers)
    seq, seq_source = _seq(cfg, seq, "max_position_embeddings", 4096, source)
    return ModelSpec(
        name=name, family="llama", layers=layers, hidden=cfg["hidden_size"],
        heads=cfg["num_attention_heads"], kv_heads=cfg.get("num_key_value_heads"),
        ffn=cfg["intermediate_size"], vocab=cfg["vocab_size"], head_dim=cfg.get("head_dim"),
        seq=seq, seq_source=seq_source, tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3",
        sliding_window=window, window_layers=window_layers)


def sliding_window(cfg: dict, kind: str, layers: int) -> tuple[int | None, int | None]:
    """``(W, layers using it)`` as transformers builds the masks; ``(None, None)`` for none.
    Mistral windows every layer (its ``layer_types`` are ignored); qwen2/qwen3 only with
    ``use_sliding_window``, in the layers ``layer_types`` marks ``sliding_attention``, else in
    those from ``max_window_layers`` (default 28) on; llama has no window."""
    if kind == "mistral":
        window, count = cfg.get("sliding_window", 4096), layers
    elif kind in ("qwen2", "qwen3") and cfg.get("use_sliding_window", False):
        window = cfg.get("sliding_window", 4096)
        types = cfg.get("layer_types")
        count = (sum(t == "sliding_attention" for t in types) if types is not None
                 else max(0, layers - cfg.get("max_window_layers", 28)))
    else:
        return None, None
    return (window, count) if window is not None and count else (None, None)


def _gpt(cfg: dict, kind: str, seq: int | None, name: str, source: str) -> ModelSpec:
    hidden = cfg.get("n_embd", cfg.get("hidden_size"))
    heads = cfg.get("n_head", cfg.get("num_attention_heads"))
    multi_query = kind == "gpt_bigcode" and cfg.get("multi_query", True)  # GPTBigCodeConfig's default
    seq, seq_source = _seq(cfg, seq, "n_positions", 1024, source)
    return ModelSpec(
        name=name, family="gpt", layers=cfg.get("n_layer", cfg.get("num_hidden_layers")),
        hidden=hidden, heads=heads, kv_heads=1 if multi_query else heads,
        ffn=cfg.get("n_inner") or 4 * hidden, vocab=cfg["vocab_size"],
        seq=seq, seq_source=seq_source, max_positions=cfg.get("n_positions"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)))
