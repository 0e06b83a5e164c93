"""Workers for tests/test_models_sequence.py (spawned ranks import them)."""
import copy
import warnings

import torch
import torch.distributed as tdist

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.models.tiny import make_tiny_model
from tensorpar.models.training import saved_activation_bytes
from tensorpar.sharding import probes

# decoders with RMSNorm (llama), LayerNorm with biases, learned positions and row biases (gpt2),
# per-head q/k norms inside the region (qwen3), parallel attention + MLP and an in-place residual
# (falcon), a fused q/k/v projection (phi3), a post-norm encoder (bert)
ARCHS = ("llama", "gpt2", "qwen3", "falcon", "phi3", "bert")
# Qwen3's k_norm computes in float32: with 2 KV heads at tp 4 each rank rounds its partial key
# gradient there before the replicated heads' gradients are summed, a tensor-parallel (not a
# sequence-parallel) effect of ~1e-7; 4 KV heads keep this check at float64's rounding.
SIZES = {"qwen3": {"num_key_value_heads": 4}}
BATCH, SEQ = 2, 8


def _ids(model, seq=SEQ, seed=3):
    return torch.randint(0, model.config.vocab_size, (BATCH, seq), generator=torch.Generator().manual_seed(seed))


def _out(model, ids):
    out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out[0]


def _errors(dense, split, ids) -> dict:
    """Output and every parameter's gradient of the split model against the dense model's
    (built from the same seed, run here in plain torch). Each error is relative to the largest
    dense value of its block's gradients (the output's: of the output): a gradient that is zero
    in exact arithmetic (BERT's key bias, under softmax) is judged on its block's scale."""
    cot = torch.randn(_out(dense, ids).shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    dense.zero_grad(set_to_none=True)
    want = _out(dense, ids)
    (want * cot).sum().backward()
    got = _out(split, ids)
    (got * cot).sum().backward()
    dense_grads = dict(dense.named_parameters())
    blocks = [name for name, _ in probes.blocks(dense)]

    def block(name):
        return next((b for b in blocks if name.startswith(b + ".")), name)
    scale = {}
    for name, p in dense_grads.items():
        scale[block(name)] = max(scale.get(block(name), 0.0), p.grad.abs().max().item())
    errs = {"<output>": ((got - want).abs().max() / want.abs().max()).item()}
    for name, p in split.named_parameters():
        g = p.tp_spec.apply(dense_grads[name].grad) if p.tp_spec.is_shard else dense_grads[name].grad
        errs[name] = (p.grad - g).abs().max().item() / scale[block(name)]
    return errs


def exact_worker(tp_sizes):
    """Each arch split over ``tp`` ranks with sequence parallelism and without the built-in proof
    (this test is the check): the worst relative error of output and gradients, per arch and tp."""
    warnings.filterwarnings("ignore")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    out = {}
    for tp in tp_sizes:
        groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
        group = groups[rank // tp]
        for arch in ARCHS:
            dense = make_tiny_model(arch, seed=1, **SIZES.get(arch, {})).train()
            split = parallelize(copy.deepcopy(dense), tp_group=group if tp < world else None,
                                sequence_parallel=True, prove=False).train()
            errs = _errors(dense, split, _ids(dense))
            worst = max(errs, key=errs.get)
            out[(arch, tp)] = (errs[worst], worst, split.tp_report.sequence_parallel)
    return out


def ledger_worker():
    """The tiny llama at tp 4 with sequence parallelism: one forward + backward under the ledger."""
    warnings.filterwarnings("ignore")
    dense = make_tiny_model("llama", seed=1)
    split = parallelize(copy.deepcopy(dense), sequence_parallel=True).train()
    ids = _ids(dense)
    with dist.ledger(split) as led:
        _out(split, ids).sum().backward()
    return [(r.op, r.module, r.phase, r.payload_bytes, r.bytes_sent) for r in led.records]


if __name__ == "__main__":
    for r in dist.launch(ledger_worker, 4)[0]:
        print(r)


def memory_worker():
    """Saved-for-backward bytes per module of the tiny llama at tp 4, with and without sequence
    parallelism, on the same batch."""
    warnings.filterwarnings("ignore")
    dense = make_tiny_model("llama", seed=1)
    ids = _ids(dense, seq=16)
    out = {}
    for sp in (False, True):
        split = parallelize(copy.deepcopy(dense), sequence_parallel=sp).train()
        out[sp], _ = saved_activation_bytes(split, lambda: _out(split, ids))
    return out


def refusal_worker():
    """What sequence parallelism refuses, each with the model left as it was where it changed nothing."""
    warnings.filterwarnings("ignore")
    from tensorpar.nn import regions
    out = {}
    moe = make_tiny_model("mixtral", seed=1)
    try:
        parallelize(moe, sequence_parallel=True)
    except ValueError as exc:
        out["moe"] = (str(exc), hasattr(moe, "tp_report"))
    bart = make_tiny_model("bart", seed=1)  # an encoder-decoder: its decoder's keys come from the encoder
    try:
        parallelize(bart, sequence_parallel=True)
    except ValueError as exc:
        out["cross"] = (str(exc), hasattr(bart, "tp_report"))
    groups = [dist.new_group([r]) for r in range(tdist.get_world_size())]
    one = groups[tdist.get_rank()]  # tp 1: a group of one rank each
    try:
        parallelize(make_tiny_model("llama"), tp_group=one, sequence_parallel=True)
    except ValueError as exc:
        out["tp1"] = str(exc)
    split = parallelize(make_tiny_model("llama", seed=1), sequence_parallel=True)
    try:
        _out(split, _ids(split, seq=7))
    except ValueError as exc:
        out["seq7"] = str(exc)
    try:  # the hidden states between blocks are chunks: not returned as if whole
        split(input_ids=_ids(split), output_hidden_states=True)
    except ValueError as exc:
        out["hidden_states"] = str(exc)

    # a wrong sequence-parallel split (the norms' gradients left partial) is caught by the proof
    # and undone, the model left dense
    victim = make_tiny_model("llama", seed=1)
    real = regions.sync_grad
    regions.sync_grad = lambda module, attr, group: None
    try:
        parallelize(victim, sequence_parallel=True)
    except ValueError as exc:
        layer = victim.model.layers[0]
        hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in victim.modules())
        out["wrong"] = (str(exc), hasattr(victim, "tp_report"), type(layer.mlp.down_proj).__name__, hooks)
    finally:
        regions.sync_grad = real
    return out


def _digest(t: torch.Tensor) -> str:
    import hashlib
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


class _Dropouts(torch.overrides.TorchFunctionMode):
    """Every dropout drawn while it is active: ``(input != 0, output != 0)``, flat, in call order."""

    def __init__(self):
        super().__init__()
        self.draws = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.nn.functional.dropout and kwargs.get("training", args[2] if len(args) > 2 else True):
            x = args[0]
            self.draws.append(((x != 0).detach().flatten(), (out != 0).detach().flatten(), x.dim()))
        return out


def dropout_worker(steps=2):
    """GPT-2 with dropout everywhere (embeddings, attention probabilities, both residual branches),
    eager attention, in training mode, at tp 4 (the world) and tp 2 (pairs [0, 1] and [2, 3]),
    with and without sequence parallelism: every mask each rank draws in ``steps`` training
    forwards, in order; a digest of the last block's output (the residual stream) and of the
    default generator's state after them, for the test to compare across ranks. The default
    generator is seeded 11 before ``parallelize`` (whose tracker takes ``initial_seed() + 2718 +
    tp_rank``) and again before the first step."""
    warnings.filterwarnings("ignore")
    rank = tdist.get_rank()
    dense = make_tiny_model("gpt2", seed=1, attn_pdrop=0.5, resid_pdrop=0.5, embd_pdrop=0.5)
    dense.set_attn_implementation("eager")  # dropout on the attention probabilities, where a hook sees it
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {}
    for tp, group in ((4, None), (2, pairs[rank // 2])):
        for sp in (False, True):
            torch.manual_seed(11)
            split = parallelize(copy.deepcopy(dense), tp_group=group, sequence_parallel=sp).train()
            torch.manual_seed(11)
            seen, last = _Dropouts(), []
            hook = split.transformer.h[-1].register_forward_hook(lambda m, a, o: last.append(o[0] if isinstance(o, tuple) else o))
            with seen:
                for step in range(steps):
                    split(input_ids=_ids(split, seed=3 + step))
            hook.remove()
            out[(tp, sp)] = {"draws": seen.draws, "last": _digest(last[-1].detach()),
                             "rng": _digest(torch.get_rng_state()), "forked": "_tp_rng_fork" in split.__dict__}
    return out
