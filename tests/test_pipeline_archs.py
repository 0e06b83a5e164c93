"""Every causal-LM architecture of the matrix (tests/_matrix_workers.py) cut into two pipeline
stages in one process: the stages run in turn equal the model, or the cut is refused.

For each architecture, tiny, float64: ``stage_cut.anatomy(model, ranges)`` either raises
``ValueError`` (a piece registered on one side of the blocks and run on the other, a piece before
them with no stand-in, a forward that does not run over the skeleton or gives other logits: the
proof in ``anatomy``) or the two stages, the second fed the first's hidden states, give the model's
logits and every parameter's gradient of ``<logits, R>``. Equal within 1e-12: the stages run the
model's own operations in its own order (the proof asks bit-equality of the logits), so only the
backward's accumulation order may differ. The architectures refused are listed: one that starts to
be refused, or to be cut, fails here until the list says so. ``make test`` runs ``QUICK``,
``TENSORPAR_MATRIX=all`` every architecture.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

from tensorpar.architecture.pipeline import stage_ranges
from tensorpar.models.tiny import make_tiny_model
from tensorpar.sharding import probes, stage_cut
from tests._matrix_workers import ARCHS, QUICK

# hrm_text always: the one architecture whose stages run but give other logits (the proof refuses it)
RUN = ARCHS if os.environ.get("TENSORPAR_MATRIX") == "all" else QUICK + ("hrm_text",)
TOL = 1e-12
# Refused, each for the reason its message gives: encoder-decoder pieces run out of their
# registration order (layernorm_embedding, per-layer embeddings), position modules taking more than
# the ids, blocks returning tuples the model unpacks or reading attributes of the layer they
# replace, recurrent blocks (hrm_text: other logits), heads registered before the blocks.
REFUSED = {"bamba", "bart", "bigbird_pegasus", "biogpt", "blenderbot-small", "camembert", "cpmant", "ctrl", "dory",
           "gemma4_text", "glm_moe_dsa", "hrm_text", "hy_v4", "llama4_text", "mbart", "mvp", "openai-gpt", "opt",
           "plbart", "prophetnet", "rembert", "roformer", "rwkv", "xlm", "xlm-roberta", "xlnet", "xlstm"}
assert REFUSED <= set(ARCHS)
# the reason given, for one architecture of each kind of refusal
REASONS = {"bart": "model.decoder.layernorm_embedding is registered after its blocks but runs before them",
           "gemma4_text": "model.embed_tokens_per_layer is registered after its blocks but runs before them",
           "hrm_text": "its stages run in turn give other logits than the model",
           "dory": "its stages do not run (AttributeError",
           "xlm-roberta": "lm_head is registered before its blocks but runs among or after them"}


def _cut(arch: str):
    warnings.filterwarnings("ignore")
    dense = make_tiny_model(arch, seed=1).train()
    model = copy.deepcopy(dense)
    n = len(probes.blocks(model))
    ranges = stage_ranges([n - n // 2, n // 2])
    try:
        anat = stage_cut.anatomy(model, ranges)
    except ValueError as exc:
        return None, str(exc)
    vocab = dense.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(2))
    ref = dense(input_ids=ids, use_cache=False).logits
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=ref.dtype)
    (ref * weights).sum().backward()
    first, second = (stage_cut.build_stage(model, anat, i, ranges) for i in range(2))
    got = second(first(ids))
    (got * weights).sum().backward()
    errors = {"logits": float((got - ref).abs().max() / ref.abs().max())}
    want = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        g, w = p.grad, want[name].grad
        if w is not None:
            errors[name] = float("inf") if g is None else float((g - w).abs().max() / max(w.abs().max(), 1e-30))
    return errors, None


@pytest.mark.parametrize("arch", RUN)
def test_two_stages_run_in_turn_equal_the_model_or_the_cut_is_refused(arch):
    torch.set_num_threads(1)
    errors, refusal = _cut(arch)
    if arch in REFUSED:
        assert refusal is not None and "cannot be cut into pipeline stages" in refusal, (arch, errors)
        assert REASONS.get(arch, "") in refusal, refusal
        return
    assert refusal is None, refusal
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, (arch, worst, errors[worst])


def test_most_architectures_can_be_cut():
    assert len(set(ARCHS) - REFUSED) >= 125
