"""The two producers of a split model agree: the templates (``tensorpar.architecture.templates``,
standard library, what the planner plans presets, ``--family`` shapes and the published reference
cases from) equal the meta-device producer (``tensorpar.sharding.inventory.build_inventory``: what
``parallelize`` does) field for field, wherever both apply: the six types the templates know, each
at tp 1, 2 and 4, with the options the templates model (windows, q/k/v biases, per-head q/k norms,
multi-query attention, dropout). Tier 1 (meta device, no ranks): a drift in transformers' module
layout, or a template that stops saying what the runtime does, fails here.
"""
from __future__ import annotations

import dataclasses

import pytest

from tensorpar.models.tiny import make_tiny_config
from tensorpar.planner.hfconfig import from_hf_dict
from tensorpar.planner.source import TemplateSource
from tensorpar.sharding.inventory import build_inventory

DROPOUT = {"resid_pdrop": 0.1, "attn_pdrop": 0.1, "embd_pdrop": 0.1}  # GPT-2's defaults
CASES = {
    "llama": {},
    "mistral": {"sliding_window": 8},  # a window in every layer: what makes it a mistral
    "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "qwen3": {},
    "gpt2": DROPOUT,
    "gpt_bigcode": DROPOUT,
}


def _config(arch: str):
    cfg = make_tiny_config(arch)
    for key, value in CASES[arch].items():
        setattr(cfg, key, value)
    return cfg


def _differences(meta, template) -> list:
    """Fields that differ; the collective sites as a multiset (their order is the modules' walk,
    which the planner never reads), the name (a path or a preset name) left out."""
    out = [f.name for f in dataclasses.fields(meta)
           if f.name not in ("name", "sites") and getattr(meta, f.name) != getattr(template, f.name)]
    if sorted(map(repr, meta.sites)) != sorted(map(repr, template.sites)):
        out.append("sites")
    return out


@pytest.mark.parametrize("arch", list(CASES))
def test_templates_equal_the_meta_producer(arch):
    cfg = _config(arch)
    source = TemplateSource(from_hf_dict(cfg.to_dict()))
    for tp in (1, 2, 4):
        meta, template = build_inventory(cfg, tp), source.at(tp)
        assert _differences(meta, template) == [], (arch, tp)
        assert meta.params and meta.sites and meta.activations  # a comparison of empty records proves nothing
    assert source.valid_tp_sizes() == list(build_inventory(cfg, 1).valid_tp_sizes)


def test_a_tp_neither_splits_is_refused_by_both():
    """tp 3 splits no tiny llama (4 heads): both producers refuse, naming the valid sizes."""
    cfg = _config("llama")
    with pytest.raises(ValueError, match=r"tp_size \(3\) must divide n_heads \(4\).*valid tp sizes: 1, 2, 4") as meta:
        build_inventory(cfg, 3)
    with pytest.raises(ValueError) as template:
        TemplateSource(from_hf_dict(cfg.to_dict())).at(3)
    assert str(template.value) == str(meta.value)
