"""The lean decoding forward (tensorpar.models.lean) against the model's own (Hugging Face) forward:
every step's logits, dense in this process and split on 4 ranks; its collectives against the
split model's own; and every case where it must not run, where ``generate`` falls back to the
model's forward (``engine="auto"``) or refuses (``engine="lean"``)."""
import functools

import pytest
import torch

from tensorpar import distributed as dist
from tensorpar.models.generation import generate
from tensorpar.models.lean import FAMILIES, lean_decoder
from tensorpar.models.tiny import make_tiny_model
from tests import _lean_workers as W

# float64 on both sides: the lean forward runs the same operations in the same dtype (here it
# matches bit for bit); a split model adds the row splits' partial sums in another order, ~1e-16
# relative. 1e-10 is far above either and far below any fault (a wrong sign in the rotation, a
# bias added twice, a padding key attended to: 1e-3 or more).
TOL = 1e-10


def _steps(model, prompts, new, engine, **kw):
    ids, logits = generate(model, prompts, new, return_logits=True, engine=engine, **kw)
    return ids, logits


def _worst(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("kw", [{}, {"do_sample": True, "top_k": 5, "top_p": 0.9, "seed": 2}])
def test_dense_lean_equals_the_models_own_forward(arch, kw):
    model = make_tiny_model(arch, seed=1)
    assert lean_decoder(model)[0] is not None, lean_decoder(model)[1]
    for prompts in (W.PROMPTS, [[3, 1, 4, 1, 5, 9]]):  # left padding, and a batch of one without it
        want_ids, want = _steps(model, prompts, 6, "hf", **kw)
        got_ids, got = _steps(model, prompts, 6, "lean", **kw)
        assert torch.equal(got_ids, want_ids)
        assert _worst(got, want) <= TOL
        assert (want[0] - want[1]).abs().max() > 1e-3  # the logits move from step to step


def test_dense_lean_greedy_equals_transformers_generate():
    """An expected side that shares no code with tensorpar's loop: transformers' own generate."""
    model = make_tiny_model("llama", seed=1)
    ids = torch.tensor([[0, 0, 5, 9, 11], [4, 4, 9, 10, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    config = model.generation_config
    config.eos_token_id = None
    want = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0,
                          generation_config=config)
    got = generate(model, ids, 7, attention_mask=mask, engine="lean")
    assert torch.equal(got, want)
    assert len({tuple(row) for row in got[:, -7:].tolist()}) == 2


def _hooked(model):
    """A user's forward hook that changes layer 0's output: only the model's own forward runs it."""
    model.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: out * 1.5)
    return model


def _hooked_partial(model):
    """The same through a ``functools.partial``, the form tensorpar's own region hooks take."""
    model.model.layers[1].self_attn.register_forward_hook(
        functools.partial(lambda mod, args, out, scale: (out[0] * scale, *out[1:]), scale=0.5))
    return model


def _submodule_training(model):
    """The model in eval mode, one attention in training mode (its dropout on)."""
    model.model.layers[1].self_attn.train()
    return model


def _patched_forward(model):
    """A forward set on the instance, as accelerate's offloading does."""
    mlp = model.model.layers[0].mlp
    own = mlp.forward
    mlp.forward = lambda x: own(x) * 2
    return model


def _sliding(model):
    model.config.sliding_window = 4
    return model


def _eager(model):
    model.set_attn_implementation("eager")
    return model


def _training(model):
    return model.train()


@pytest.mark.parametrize("arch, change, why", [
    ("gpt2", None, "model type 'gpt2' is not one of llama, mistral, qwen2"),
    ("llama", _hooked, "model.layers.0.mlp has forward hooks that change its output"),
    ("llama", _hooked_partial, "model.layers.1.self_attn has forward hooks that change its output"),
    ("llama", _eager, "attention implementation 'eager'"),
    ("llama", _training, "training mode"),
    ("llama", _submodule_training, "model.layers.1.self_attn is in training mode"),
    ("llama", _patched_forward, "model.layers.0.mlp has a forward of its own set on the instance"),
    ("mistral", _sliding, "pass the sliding window of 4"),
])
def test_where_the_lean_forward_must_not_run_auto_uses_the_models_own(arch, change, why):
    """``engine="lean"`` refuses with the reason; ``"auto"`` computes what the model's own forward
    does (the hook applied, the window kept, ...)."""
    model = make_tiny_model(arch, seed=1)
    model = change(model) if change else model
    with pytest.raises(ValueError, match="engine='lean' cannot run") as exc:
        generate(model, W.PROMPTS, 5, engine="lean")
    assert why in str(exc.value)
    if change in (_training, _submodule_training):
        return  # dropout is off in the tiny models: nothing to see in the tokens
    # transformers' eager attention in float64 turns a left-padded row into NaN (its own generate
    # too, transformers 5.24): that case runs unpadded
    prompts = [[3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 2, 8]] if change is _eager else W.PROMPTS
    want_ids, want = _steps(model, prompts, 5, "hf")
    got_ids, got = _steps(model, prompts, 5, "auto")
    assert torch.equal(got_ids, want_ids) and _worst(got, want) == 0


def test_a_global_module_hook_sends_generate_to_the_models_own_forward():
    """A hook registered for every module runs in the model's forward only: the lean one refuses."""
    from torch import nn
    model = make_tiny_model("llama", seed=1)
    want_plain = _steps(model, W.PROMPTS, 3, "hf")[1]
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: out * 0.5 if type(mod) is nn.Linear else None)
    try:
        assert "global module forward hook" in lean_decoder(model)[1]
        want, got = _steps(model, W.PROMPTS, 3, "hf")[1], _steps(model, W.PROMPTS, 3, "auto")[1]
    finally:
        handle.remove()
    assert _worst(got, want) == 0 and _worst(want, want_plain) > 1e-3
    assert lean_decoder(model)[0] is not None  # and the ledger's own global hooks do not count
    with dist.ledger():
        assert lean_decoder(model)[0] is not None


def test_the_fallback_cases_have_power():
    """The hook and the window change the logits: a lean forward that ignored them would be seen."""
    plain, hooked = make_tiny_model("llama", seed=1), _hooked(make_tiny_model("llama", seed=1))
    assert _worst(_steps(plain, W.PROMPTS, 3, "hf")[1], _steps(hooked, W.PROMPTS, 3, "hf")[1]) > 1e-3
    hooked = _hooked_partial(make_tiny_model("llama", seed=1))
    assert _worst(_steps(plain, W.PROMPTS, 3, "hf")[1], _steps(hooked, W.PROMPTS, 3, "hf")[1]) > 1e-3
    patched = _patched_forward(make_tiny_model("llama", seed=1))
    assert _worst(_steps(plain, W.PROMPTS, 3, "hf")[1], _steps(patched, W.PROMPTS, 3, "hf")[1]) > 1e-3
    plain, windowed = make_tiny_model("mistral", seed=1), _sliding(make_tiny_model("mistral", seed=1))
    assert _worst(_steps(plain, W.PROMPTS, 5, "hf")[1], _steps(windowed, W.PROMPTS, 5, "hf")[1]) > 1e-3


def test_bad_engine_is_refused_before_anything_runs():
    model = make_tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match=r"engine must be one of auto, lean, hf, got 'fast'"):
        generate(model, W.PROMPTS, 2, engine="fast")


def test_generated_tokens_outlive_inference_mode():
    """The lean forward runs under inference mode; what generate returns must still serve autograd
    (an embedding of the generated ids saves them for backward)."""
    model = make_tiny_model("llama", seed=1)
    ids, logits = generate(model, W.PROMPTS, 3, return_logits=True, engine="lean")
    assert not ids.is_inference() and not any(s.is_inference() for s in logits)
    model.model.embed_tokens(ids).sum().backward()
    assert model.model.embed_tokens.weight.grad is not None


@functools.lru_cache(maxsize=None)
def split_results() -> list:
    return dist.launch(W.lean_worker, 4, deadline=900)


@pytest.mark.parametrize("case", list(W.CASES))
@pytest.mark.parametrize("tp", [2, 4])
def test_split_lean_equals_the_unsplit_models_own_forward(case, tp):
    for rank, res in enumerate(split_results()):
        c = res[(case, tp)]
        assert c["why_not"] == "", c["why_not"]
        for name in W.SAMPLERS:
            s = c[name]
            assert s["tokens"] == s["want"], (rank, name)
            assert s["err"] <= TOL, (rank, name, s["err"])
            assert s["varies"], (rank, name)
        # this rank's KV heads only: 1/tp of the dense cache, or one replicated head
        assert c["cache_heads"] == [max(1, c["dense_kv_heads"] // tp)] * len(c["cache_heads"])


@pytest.mark.parametrize("tp", [2, 4])
def test_split_lean_issues_the_collectives_of_the_models_own_forward(tp):
    """The same all-reduces (same modules, same shapes, same order) and the same candidate
    exchange as the split model's own forward: what the planner predicts for a decode step."""
    for res in split_results():
        for case in W.CASES:
            for name in W.SAMPLERS:
                s = res[(case, tp)][name]
                assert s["lean_records"] == s["hf_records"], (case, name)
                assert sum(op == "all_reduce" for op, _, _ in s["lean_records"]) > 0
