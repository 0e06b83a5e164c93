"""A Hugging Face ``config.json`` read as a :class:`~tensorpar.planner.models.ModelSpec`.

Only the model types whose every parameter and attention pattern the planner counts are accepted:
those whose registry entry has :class:`~tensorpar.architecture.registry.Formulas` of the ``llama``
or ``gpt`` family (``registry.formula_types``); any other raises :class:`NotModelled` listing them,
rather than being counted as something it is not. Field names and defaults are those of the
``transformers`` configuration classes:

- ``llama`` family (Llama, Mistral, Qwen2, Qwen3): q/k/v biases where the entry says (Qwen2),
  per-head q/k RMSNorms (Qwen3's ``qk_norm``). Sliding windows as the entry's ``window`` says:
  every layer (Mistral, ``sliding_window``, default 4096), or only with ``use_sliding_window``,
  in the layers from ``max_window_layers`` on or as ``layer_types`` lists them (Qwen2, Qwen3).
- ``gpt`` family (GPT-2, GPT-BigCode): GPT-BigCode (SantaCoder, StarCoder) uses multi-query
  attention unless ``multi_query`` is false: one K/V head shared by all query heads
  (Li et al. 2023, "StarCoder", Sec. 5.1; Shazeer 2019).

Refused: openai-gpt (post-norm, no final LayerNorm), and each type's options its entry's
``refuse`` lists (``attention_bias`` on llama / qwen3 biases o_proj as well, which the planner does
not count; llama's ``mlp_bias``; cross-attention): :class:`NotModelled`, and ``tensorpar plan``
then plans the config from tensorpar's own split. A config of any type is first checked by
``tensorpar.architecture.configs.check_sizes``: a layer count, width, head count, vocabulary or
position limit that is not a positive integer, at the top or in a nested config (``text_config``,
``llm_config``, ...), is refused naming the file and the field.
"""
from __future__ import annotations

import json
from pathlib import Path

from tensorpar.architecture import configs, registry

from .models import ModelSpec

LLAMA_TYPES = registry.formula_types("llama")
GPT_TYPES = registry.formula_types("gpt")
SUPPORTED = LLAMA_TYPES + GPT_TYPES
_REFUSED = {"openai-gpt": "GPT-1 normalises after each block and has no final LayerNorm, which the gpt family "
                          "counts"}


class NotModelled(ValueError):
    """A config whose model type or option the formulas do not count (not a wrong config)."""


def read_config(path) -> dict:
    """``config.json`` as a dict: ``ValueError`` naming the file unless it is a JSON object whose
    sizes pass ``configs.check_sizes``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such config.json: {path}")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a JSON object (got {type(cfg).__name__}); a config.json is one object")
    configs.check_sizes(cfg, str(path))
    return cfg


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
    configs.check_sizes(cfg, source)
    kind = cfg.get("model_type", "")
    if kind not in SUPPORTED:
        why = f" ({_REFUSED[kind]})" if kind in _REFUSED else ""
        raise NotModelled(f"unsupported model_type {kind!r} in {source}{why}; valid: {', '.join(SUPPORTED)}")
    refuse_unmodelled(cfg, kind, source)
    name = name or cfg.get("_name_or_path") or "hf"
    try:
        return _llama(cfg, kind, seq, name, source) if kind in LLAMA_TYPES else _gpt(cfg, kind, seq, name, source)
    except KeyError as exc:
        raise ValueError(f"{source}: a {kind} config needs {exc.args[0]!r}") from None
    except ValueError as exc:  # the shapes make no model: say which file
        raise ValueError(f"{source}: {exc}") from None


def refuse_unmodelled(cfg: dict, kind: str, source: str = "the config") -> None:
    """:class:`NotModelled` for an option of ``cfg`` that ``kind``'s registry ``Formulas.refuse`` lists."""
    for option in registry.ARCHS[kind].formulas.refuse:
        if cfg.get(option):
            raise NotModelled(f"{kind} with {option}={cfg[option]!r} in {source} is not modelled by the planner; "
                              f"valid: {option}=false")


def _seq(cfg: dict, seq: int | None, key: str, default: int, source: str) -> tuple[int, str]:
    if seq is not None:
        return seq, "given"
    if cfg.get(key) is not None:
        return cfg[key], f"{key} in {source}"
    return default, f"default {default} ({key} not in {source})"


def _llama(cfg: dict, kind: str, seq: int | None, name: str, source: str) -> ModelSpec:
    layers, forms = cfg["num_hidden_layers"], registry.ARCHS[kind].formulas
    window, window_layers = sliding_window(cfg, kind, layers)
    seq, seq_source = _seq(cfg, seq, "max_position_embeddings", 4096, source)
    return ModelSpec(
        name=name, family="llama", layers=layers, hidden=cfg["hidden_size"],
        heads=cfg["num_attention_heads"], kv_heads=cfg.get("num_key_value_heads"),
        ffn=cfg["intermediate_size"], vocab=cfg["vocab_size"], head_dim=cfg.get("head_dim"),
        seq=seq, seq_source=seq_source, tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=forms.qkv_bias, qk_norm=forms.qk_norm,
        sliding_window=window, window_layers=window_layers)


def sliding_window(cfg: dict, kind: str, layers: int) -> tuple[int | None, int | None]:
    """``(W, layers using it)`` as transformers builds the masks; ``(None, None)`` for none. The
    entry's ``window``: ``"every"`` windows every layer (Mistral: its ``layer_types`` are ignored);
    ``"optional"`` only with ``use_sliding_window``, in the layers ``layer_types`` marks
    ``sliding_attention``, else in those from ``max_window_layers`` (default 28) on (Qwen2, Qwen3)."""
    window_rule = registry.ARCHS[kind].formulas.window
    if window_rule == "every":
        window, count = cfg.get("sliding_window", 4096), layers
    elif window_rule == "optional" and cfg.get("use_sliding_window", False):
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
    multi_query = registry.ARCHS[kind].formulas.multi_query and cfg.get("multi_query", True)  # its config's default
    seq, seq_source = _seq(cfg, seq, "n_positions", 1024, source)
    return ModelSpec(
        name=name, family="gpt", layers=cfg.get("n_layer", cfg.get("num_hidden_layers")),
        hidden=hidden, heads=heads, kv_heads=1 if multi_query else heads,
        ffn=cfg.get("n_inner") or 4 * hidden, vocab=cfg["vocab_size"],
        seq=seq, seq_source=seq_source, max_positions=cfg.get("n_positions"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)))
