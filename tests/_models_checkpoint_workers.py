"""Module-level worker functions for the checkpoint, MiniLM and discovered-plan cases of
tests/test_models_checkpoint.py (spawned ranks must import them), and the toy model no family
plan knows (also used in-process by tests/test_models_plans.py).

Groups, ids and the relative error come from :mod:`tests._models_workers`; each rank returns
plain data the test asserts on.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.models.tiny import make_tiny_model
from tests._models_workers import TP3_DOES_NOT_FIT, _ids, _rel, tp_groups

SENTENCES = ["The cat sits on the mat.",
             "Tensor parallelism splits each weight matrix across several devices and sums the pieces.",
             "hello", "Ein Satz auf Deutsch, mit Umlauten: äöü."]


class _ReadLog:
    """Stands in for ``safetensors.safe_open`` and records every read, independently of the
    loader's own ``bytes_read``: the elements of each ``get_slice(k)[index]`` and each
    ``get_tensor(k)`` (a whole tensor: never wanted)."""

    def __init__(self, real):
        self.real, self.slices, self.tensors = real, [], []

    def __call__(self, *args, **kwargs):
        log, f = self, self.real(*args, **kwargs)

        class Slice:
            def __init__(self, sl, key):
                self.sl, self.key = sl, key

            def get_shape(self):
                return self.sl.get_shape()

            def get_dtype(self):
                return self.sl.get_dtype()

            def __getitem__(self, index):
                t = self.sl[index]
                log.slices.append((self.key, t.numel()))
                return t

        class File:
            def __enter__(self):
                f.__enter__()
                return self

            def __exit__(self, *exc):
                return f.__exit__(*exc)

            def keys(self):
                return f.keys()

            def get_slice(self, key):
                return Slice(f.get_slice(key), key)

            def get_tensor(self, key):
                t = f.get_tensor(key)
                log.tensors.append((key, t.numel()))
                return t
        return File()


def _load_logged(path, group):
    import safetensors

    from tensorpar.models.checkpoint import load_sharded
    log, real = _ReadLog(safetensors.safe_open), safetensors.safe_open
    safetensors.safe_open = log
    try:
        model, report = load_sharded(path, tp_group=group)
    finally:
        safetensors.safe_open = real
    return model, report, log


def _checkpoint_case(family, path, group) -> dict:
    from transformers import AutoModelForCausalLM
    model, report, log = _load_logged(path, group)
    in_memory = parallelize(make_tiny_model(family, dtype=torch.float32), tp_group=group)
    a, b = model.state_dict(), in_memory.state_dict()
    dense = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = _ids(5)
    with torch.no_grad():
        rel = _rel(model(input_ids=ids).logits, dense(input_ids=ids).logits)
    return {"same_shards": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
            "logits_rel": rel, "report": report.to_dict(), "elements_read": sum(n for _, n in log.slices),
            "get_tensor_calls": len(log.tensors), "held": sum(p.numel() for p in model.parameters()),
            "tp_rank": dist.get_rank(group), "files": sorted(p.name for p in Path(path).iterdir())}


def _minilm_result(model, emb, dense_emb, report) -> dict:
    return {"max_abs": float((emb - dense_emb).abs().max()), "report": report.to_dict(),
            "per_rank": model.tp_report.params_per_rank, "total": model.tp_report.params_total,
            "norms": emb.norm(dim=1).tolist()}


def _sequential_case(group) -> dict:
    """``"auto"`` on a bare nn.Sequential(Linear, ReLU, Linear): output and input gradient."""
    torch.manual_seed(0)
    dense = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    model = parallelize(copy.deepcopy(dense), tp_group=group, example_inputs=x)
    x_tp, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_tp, y_ref = model(x_tp), dense(x_ref)
    (y_tp * y_ref.detach()).sum().backward()  # a non-uniform output gradient
    (y_ref * y_ref.detach()).sum().backward()
    return {"rel": _rel(y_tp.detach(), y_ref.detach()), "grad_rel": _rel(x_tp.grad, x_ref.grad),
            "styles": model.tp_report.styles, "types": [type(m).__name__ for m in model]}


def _discovered_case(group) -> dict:
    dense = Toy().double()
    ids = _ids(11, (2, 6)) % Toy.VOCAB
    model = parallelize(copy.deepcopy(dense), tp_group=group, example_inputs=(ids,))
    with torch.no_grad():
        rel = _rel(model(ids), dense(ids))
    return {"rel": rel, "styles": model.tp_report.styles, "notes": model.tp_report.notes,
            "source": model.tp_report.source, "sequential": _sequential_case(group)}


def checkpoint_worker(tiny_dirs: dict) -> dict:
    """MiniLM at tp 4, 2 and 3 (tp 4 first: the only load whose memory growth is measured in a
    fresh process; later loads reuse freed heap); tiny checkpoints at tp 2, 3 (where they fit)
    and 4; the toy model under the discovered plan at tp 2 and 4."""
    from transformers import AutoTokenizer, BertModel

    from tensorpar.models.minilm import load_minilm, minilm_path, sentence_embeddings
    groups, rank, out = tp_groups(), dist.get_rank(), {}
    first, tok, first_report = load_minilm(tp_group=groups[4][0])
    first_emb = sentence_embeddings(first, tok, SENTENCES)
    dense = BertModel.from_pretrained(minilm_path()).eval()
    dense_emb = sentence_embeddings(dense, AutoTokenizer.from_pretrained(minilm_path()), SENTENCES)
    out[("minilm", 4)] = {**_minilm_result(first, first_emb, dense_emb, first_report), "fresh": True}
    for tp in (2, 3, 4):
        group, members = groups[tp]
        if rank not in members:
            continue
        for family, path in tiny_dirs.items():
            if not (tp == 3 and family in TP3_DOES_NOT_FIT):
                out[("ckpt", family, tp)] = _checkpoint_case(family, path, group)
        if tp != 4:
            model, tok, report = load_minilm(tp_group=group)
            emb = sentence_embeddings(model, tok, SENTENCES)
            out[("minilm", tp)] = {**_minilm_result(model, emb, dense_emb, report), "fresh": False}
        if tp != 3:
            out[("toy", tp)] = _discovered_case(group)
    return out


class ToyMLP(torch.nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(h, f), torch.nn.Linear(f, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class NormedMLP(ToyMLP):
    """A LayerNorm over the MLP width between the pair: not column-local, must stay whole."""

    def __init__(self, h, f):
        super().__init__(h, f)
        self.norm = torch.nn.LayerNorm(f)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


class ToyBlock(torch.nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.norm, self.mlp = torch.nn.LayerNorm(h), ToyMLP(h, f)

    def forward(self, x):
        return x + self.mlp(self.norm(x))  # the residual makes the block itself no pair


class Toy(torch.nn.Module):
    """A model no family plan knows: embedding, two residual MLP blocks, a normed MLP, tied head."""
    VOCAB, HIDDEN, FFN = 30, 16, 32

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(self.VOCAB, self.HIDDEN)
        self.blocks = torch.nn.ModuleList([ToyBlock(self.HIDDEN, self.FFN) for _ in range(2)])
        self.extra = NormedMLP(self.HIDDEN, self.FFN)
        self.head = torch.nn.Linear(self.HIDDEN, self.VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)  # (B, T, H)
        for block in self.blocks:
            x = block(x)
        return self.head(x + self.extra(x))  # (B, T, V)
