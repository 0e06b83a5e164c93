"""Module-level worker of tests/test_models_checkpoint_archs.py (spawned ranks must import it):
each rank loads tiny float64 checkpoints of many architectures with ``load_sharded`` and checks
them against the dense ``from_pretrained`` model of the same directory, returning plain data.

One launch of 4 ranks: tp 2 cases split between the pairs [0, 1] and [2, 3] (they run at the same
time), then tp 4 cases on all four ranks.
"""
from __future__ import annotations

import torch

from tensorpar import distributed as dist
from tests._models_checkpoint_workers import _load_logged

VOCAB = 130  # of every tiny config (tensorpar.architecture.tiny_sizes)


def _dense(path):
    """The model transformers itself loads from ``path`` (the class ``config.json`` names)."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(path)
    return getattr(transformers, config.architectures[0]).from_pretrained(path).eval()


def _eager(model):
    """transformers' grouped-matmul experts kernel takes no float64: both models run the loop."""
    if hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = "eager"
    return model


def _held(spec, full: torch.Tensor) -> int:
    """Elements of the dense tensor in ``spec``'s shard (padding rows are not read)."""
    count = [0]

    def get(index):
        block = full[index]
        count[0] += block.numel()
        return block
    spec.take(get)
    return count[0]


def _shards(model, dense, read_whole) -> dict:
    """Each parameter's shard against ``tp_spec.apply`` of the dense parameter (bit for bit, same
    dtype), and the checkpoint elements those shards (and those of ``read_whole``) and the
    persistent buffers hold."""
    full = dense.state_dict()
    wrong, held, held_whole = [], 0, 0
    for name, p in model.named_parameters():
        spec = p.tp_spec
        if p.dtype != full[spec.key].dtype or not torch.equal(p.detach(), spec.apply(full[spec.key])):
            wrong.append(name)
        n = _held(spec, full[spec.key])
        held += n
        held_whole += n if spec.key in read_whole else 0
    params = {n for n, _ in dense.named_parameters(remove_duplicate=False)}
    persistent = {n for n in full if n not in params}  # what the checkpoint holds besides parameters
    buffers = {n: b for n, b in model.named_buffers() if n in persistent}
    wrong += [n for n, b in buffers.items() if b.dtype != full[n].dtype or not torch.equal(b, full[n])]
    return {"wrong_shards": wrong, "held_elements": held + sum(b.numel() for b in buffers.values()),
            "held_whole_elements": held_whole,
            "split": sum(p.tp_spec.is_shard for p in model.parameters())}


def _case(path, group) -> dict:
    model, report, log = _load_logged(path, group)
    # counted now: a module transformers first imports during the load keeps the logging
    # safe_open it imported, and from_pretrained would log into it too
    logged, get_tensor_calls = sum(n for _, n in log.slices), len(log.tensors)
    dense = _eager(_dense(path))
    _eager(model)
    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, dense(input_ids=ids).logits
    rel = float((got - want).abs().max() / want.abs().max())
    return {"rel": rel, "report": report.to_dict(), "tp_rank": dist.get_rank(group),
            "logged_elements": logged, "get_tensor_calls": get_tensor_calls,
            **_shards(model, dense, report.read_whole)}


def archs_worker(pairs: tuple, tp4: dict) -> dict:
    """``pairs``: ``({case: dir} of ranks 0-1, {case: dir} of ranks 2-3)`` at tp 2; ``tp4``:
    ``{case: dir}`` on all four ranks. ``{(case, tp): result}`` of this rank."""
    torch.set_num_threads(1)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = dist.get_rank() // 2
    out = {}
    for case, path in pairs[mine].items():
        out[(case, 2)] = _case(path, groups[mine])
    for case, path in tp4.items():
        out[(case, 4)] = _case(path, None)
    return out
