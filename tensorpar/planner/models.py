"""Model shapes the planner counts from: two families, presets, and Hugging Face ``config.json``.

- ``gpt``: learned position embeddings, input and output embeddings tied, biases on every linear,
  LayerNorm (weight and bias), GELU MLP ``h -> ffn -> h`` (default ffn = 4h). GPT-2 (Radford et al.
  2019), GPT-3 (Brown et al. 2020), Megatron-LM (Shoeybi et al. 2019; Narayanan et al. 2021).
- ``llama``: rotary positions (no parameters), untied embeddings, no biases, RMSNorm (weight only),
  SwiGLU MLP ``h -> 2 x ffn -> h`` (gate, up, down), grouped-query attention (``kv_heads``).
  Touvron et al. 2023 (Llama 2); Dubey et al. 2024 (The Llama 3 Herd of Models, Table 3).

Two per-model options change what the bounds count: ``sliding_window`` (Mistral 7B, Jiang et al.
2023, Sec. 2: a query attends to at most ``W`` keys, in ``window_layers`` of the layers, all by
default) and ``qk_norm`` (Qwen3: an RMSNorm of ``head_dim`` weights on the queries and one on the
keys of every layer).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from tensorpar.architecture.templates import FAMILIES

from .layout import check_size


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer by its shapes. ``seq`` is the sequence length planned for."""

    family: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    ffn: int | None = None
    head_dim: int | None = None
    tied_embeddings: bool | None = None
    qkv_bias: bool | None = None
    max_positions: int | None = None
    sliding_window: int | None = None
    window_layers: int | None = None
    qk_norm: bool = False
    name: str = "custom"
    seq_source: str = "given"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family ({self.family!r}) must be one of: {', '.join(FAMILIES)}")
        for f in ("layers", "hidden", "heads", "vocab", "seq"):
            check_size(f, getattr(self, f))
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads}) "
                             "unless head_dim is given")
        defaults = {"kv_heads": self.heads, "head_dim": self.hidden // self.heads,
                    "ffn": default_ffn(self.family, self.hidden),
                    "tied_embeddings": self.family == "gpt", "qkv_bias": self.family == "gpt"}
        for key, value in defaults.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)  # frozen: fill the defaults once, here
        for f in ("kv_heads", "ffn", "head_dim"):
            check_size(f, getattr(self, f))
        if self.max_positions is not None:
            check_size("max_positions", self.max_positions)
            if self.family == "gpt" and self.seq > self.max_positions:
                raise ValueError(f"seq ({self.seq}) exceeds the learned position table "
                                 f"(max_positions={self.max_positions}); valid: seq <= {self.max_positions}")
        self._check_window()
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads}); "
                             f"valid kv_heads: {', '.join(map(str, divisors(self.heads)))}")

    def _check_window(self) -> None:
        if self.sliding_window is None:
            if self.window_layers not in (None, 0):
                raise ValueError(f"window_layers ({self.window_layers}) needs a sliding_window; valid: 0 or None")
            return
        check_size("sliding_window", self.sliding_window)
        if self.window_layers is None:
            object.__setattr__(self, "window_layers", self.layers)  # every layer, as in Mistral 7B
        w = self.window_layers
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= self.layers:
            raise ValueError(f"window_layers ({w!r}) must be an integer from 0 to layers ({self.layers})")

    def attended_keys(self, context: int) -> float:
        """Keys one query at position ``context`` attends to, averaged over the layers:
        ``context``, or at most ``W`` in the sliding-window layers (a query sees itself and the
        ``W - 1`` keys before it, the Hugging Face mask; Mistral's reference code allows one more,
        so ``W`` is the smaller count a bound may use)."""
        if self.sliding_window is None:
            return float(context)
        windowed = min(context, self.sliding_window)
        return (self.window_layers * windowed + (self.layers - self.window_layers) * context) / self.layers

    def causal_keys_per_query(self, seq: int) -> float:
        """Mean keys per query over a causal sequence of ``seq`` tokens and over the layers:
        ``(s + 1) / 2`` unmasked pairs per query, or with a window of ``W`` keys
        ``(W (W + 1) / 2 + (s - W) W) / s`` when s > W."""
        full = (seq + 1) / 2
        if self.sliding_window is None:
            return full
        w = min(seq, self.sliding_window)
        windowed = (w * (w + 1) / 2 + (seq - w) * w) / seq
        return (self.window_layers * windowed + (self.layers - self.window_layers) * full) / self.layers

    @property
    def position_table(self) -> int:
        """Rows of the learned position embedding (gpt family): ``max_positions``, else ``seq``."""
        return self.max_positions or self.seq

    @property
    def biases(self) -> bool:
        """Biases on the output projections and the MLP (gpt family)."""
        return self.family == "gpt"

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: LayerNorm has weight and bias, RMSNorm a weight."""
        return 2 * self.hidden if self.family == "gpt" else self.hidden

    @property
    def mlp_matrices(self) -> int:
        """h x ffn matrices in the MLP: 2 for GELU (up, down), 3 for SwiGLU (gate, up, down)."""
        return 2 if self.family == "gpt" else 3

    def to_dict(self) -> dict:
        return asdict(self)


def default_ffn(family: str, hidden: int) -> int:
    """gpt: 4h (Vaswani et al. 2017). llama: 2/3 * 4h rounded up to a multiple of 256, the rule of
    Meta's reference ``llama/model.py`` (``multiple_of=256``): 4096 -> 11008, 5120 -> 13824."""
    if family == "gpt":
        return 4 * hidden
    return 256 * -(-int(2 * 4 * hidden / 3) // 256)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab, seq):
    return ModelSpec(name=name, family="llama", layers=layers, hidden=hidden, heads=heads,
                     kv_heads=kv_heads, ffn=ffn, vocab=vocab, seq=seq, seq_source="preset")


def _gpt(name, layers, hidden, heads, vocab=51200, seq=2048):
    return ModelSpec(name=name, family="gpt", layers=layers, hidden=hidden, heads=heads,
                     vocab=vocab, seq=seq, seq_source="preset")


# Llama: the config.json files Meta published with the weights (Llama 2: Touvron et al. 2023,
# Table 1 context 4k; Llama 3: Dubey et al. 2024, Table 3, pre-training context 8k).
# GPT-3 175B: Brown et al. 2020, Table 2.1, with the vocabulary padded to 51,200 as Megatron-LM
# does (Narayanan et al. 2021, Table 1: 174.6B parameters).
# Megatron-LM: Shoeybi et al. 2019, Table 1 (seq 1024, vocab 51,200); Narayanan et al. 2021,
# Table 1 (seq 2048, vocab 51,200); Korthikanti et al. 2022, Table 3 (22B).
PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    _llama("llama-3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    _gpt("gpt3-175b", 96, 12288, 96),
    _gpt("megatron-1.2b", 40, 1536, 16, seq=1024),
    _gpt("megatron-2.5b", 54, 1920, 20, seq=1024),
    _gpt("megatron-4.2b", 64, 2304, 24, seq=1024),
    _gpt("megatron-8.3b", 72, 3072, 32, seq=1024),
    _gpt("megatron-1.7b", 24, 2304, 24),
    _gpt("megatron-3.6b", 30, 3072, 32),
    _gpt("megatron-7.5b", 36, 4096, 32),
    _gpt("megatron-18.4b", 40, 6144, 48),
    _gpt("megatron-22b", 48, 6144, 64),
    _gpt("megatron-39.1b", 48, 8192, 64),
    _gpt("megatron-76.1b", 60, 10240, 80),
    _gpt("megatron-145.6b", 80, 12288, 96),
    _gpt("megatron-310.1b", 96, 16384, 128),
    _gpt("megatron-529.6b", 105, 20480, 128),
    _gpt("megatron-1t", 128, 25600, 160),
)}


def get_model(name: str, *, seq: int | None = None) -> ModelSpec:
    """A preset by name. A Hugging Face ``config.json`` is read by :func:`tensorpar.planner.
    from_hf_config` (shapes of the six types the templates know) or planned as the runtime splits
    it (``tensorpar.sharding.inventory.MetaSource``: any type)."""
    key = str(name).strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(PRESETS)}, "
                         "or the path of a Hugging Face config.json")
    spec = PRESETS[key]
    return spec if seq is None else _replace(spec, seq=seq, seq_source="given")


def _replace(spec: ModelSpec, **changes) -> ModelSpec:
    return ModelSpec(**{**asdict(spec), **changes})
