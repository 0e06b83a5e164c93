"""``tensorpar.architecture.layer_kinds``: a small model holds every kind of layer its full-size config has.

What each test catches: a tiny config shrunk by the config's own rule (a 2-layer Gemma-3 is all
sliding-window, a 2-layer DeepSeek-V3 all dense), which would let the architecture matrix and the
proof's replica pass without ever splitting a full-attention or an expert layer.
"""
import pytest

from tensorpar.architecture.layer_kinds import layer_layout
from tensorpar.models.tiny import make_tiny_config
from tensorpar.sharding.model_classes import config_class, model_class

pytestmark = pytest.mark.filterwarnings("ignore")


def test_layer_type_lists_keep_each_kind_once():
    full = config_class("gemma3_text")()  # 26 layers: 5 sliding, 1 full, repeated
    assert {"sliding_attention", "full_attention"} <= set(full.layer_types)
    out = layer_layout(full)
    assert out["layer_types"] == ["sliding_attention", "full_attention"]
    assert out["num_hidden_layers"] == 2


def test_three_kinds_make_three_layers():
    out = layer_layout(config_class("lfm3")())
    assert sorted(out["layer_types"]) == ["conv", "full_attention", "sliding_attention"]
    assert out["num_hidden_layers"] == 3


@pytest.mark.parametrize("value, want", [(3, 1), (1, 1), (0, None), (61, 2)])
def test_leading_dense_layers(value, want):
    """``first_k_dense_replace``: some dense layers keep one (layer 0), all dense stays all dense."""
    config = config_class("deepseek_v3")(num_hidden_layers=61, first_k_dense_replace=value)
    assert layer_layout(config).get("first_k_dense_replace") == want


def test_periods_offsets_and_index_lists():
    jamba = layer_layout(config_class("jamba")())  # attention every 8th layer from 4, experts every 2nd from 1
    assert (jamba["attn_layer_period"], jamba["attn_layer_offset"]) == (2, 1)
    assert (jamba["expert_layer_period"], jamba["expert_layer_offset"]) == (2, 1)
    flint = layer_layout(config_class("flint")(num_hidden_layers=40, mlp_only_layers=[0, 1]))
    assert flint["mlp_only_layers"] == [0]  # layer 0 dense, layer 1 sparse


@pytest.mark.parametrize("arch, kinds", [
    ("gemma3_text", {"sliding_attention", "full_attention"}),
    ("qwen3_next", {"linear_attention", "full_attention"}),
    ("beam", {"dense", "sparse"}),
])
def test_tiny_configs_hold_every_kind(arch, kinds):
    config = make_tiny_config(arch)
    held = set(getattr(config, "layer_types", None) or []) | set(getattr(config, "mlp_layer_types", None) or [])
    assert kinds <= held, held


def test_tiny_deepseek_v3_has_a_dense_and_an_expert_layer():
    from accelerate import init_empty_weights
    config = make_tiny_config("deepseek_v3")
    with init_empty_weights():
        model = model_class(config)(config)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["DeepseekV3MLP", "DeepseekV3MoE"], kinds


def test_replica_takes_the_layout_of_the_real_config():
    """The proof's replica of a model on the meta device (``certify.tiny_like``) follows the real
    config's layout, not the class defaults."""
    from tensorpar.sharding.replica import tiny_like
    real = config_class("gemma3_text")(num_hidden_layers=12, layer_types=["full_attention"] * 12)
    assert tiny_like(real, 2).layer_types == ["full_attention", "full_attention"]
    real = config_class("deepseek_v3")(num_hidden_layers=61, first_k_dense_replace=1)
    assert tiny_like(real, 2).first_k_dense_replace == 1
