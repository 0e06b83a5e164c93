"""`tensorpar run`: shard a real checkpoint over local ranks and prove it computes the same function.

Per rank: load only this rank's slices (``load_sharded``), run the task under the ledger. Rank 0
also runs the unsplit model on the same inputs. The report holds the task's result (a sentence
similarity ranking for encoders; for decoders each prompt's tokens, greedy or sampled, beside the
unsplit model's: :mod:`tensorpar.jobs.run_generation`), the largest difference from the unsplit
model, the parameters each rank holds, the collectives the ledger recorded beside the
planner's prediction for the same run (the same ring formula over the recorded calls: equal means
the same calls of the same sizes), and the bytes the sockets really carried (gloo).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch

from tensorpar import distributed as dist
from tensorpar.jobs.common import (DTYPES, TOLERANCE, check_tp, dense_model, is_decoder, no_phase, nonfinite,
                                   open_checkpoint, parse_dtype, quiet_transformers)
from tensorpar.jobs.run_generation import (NOT_PREDICTED, SAMPLING, generate_rows, generation_result, generation_task,
                                           has_tokenizer, options_given)
from tensorpar.models.checkpoint import load_sharded
from tensorpar.models.minilm import minilm_path, sentence_embeddings
from tensorpar.models.sampling import Sampler
from tensorpar.sharding.inventory import predict_collectives

DEFAULT_SENTENCES = (
    "A man is playing a guitar.",
    "Someone is strumming a guitar on stage.",
    "The cat sleeps on the windowsill.",
    "A kitten is napping in the sun by the window.",
    "Tensor parallelism splits weight matrices across devices.",
    "The model's weights are sharded over several GPUs.",
)


@dataclass
class RunReport:
    model: str  # a name: the packaged model's, else the directory's
    model_path: str
    family: str
    tp: int
    dtype: str
    backend: str
    task: str  # "sentence-embedding" or "generation"
    max_abs_diff: float
    max_rel_diff: float
    tolerance_rel: float
    params_total: int
    params_per_rank: list
    fixes: list
    ledger: dict
    result: dict = field(default_factory=dict)
    load: list = field(default_factory=list)
    nonfinite: list = field(default_factory=list)  # the checkpoint's parameters holding NaN or inf

    @property
    def ledger_matches(self) -> bool:
        """Recorded calls equal to the planner's, wherever it predicts them (see ``NOT_PREDICTED``)."""
        gen = self.ledger.get("generation")
        parts = [self.ledger, *([gen] if gen is not None and gen["compared"] else [])]
        return all(p["ledger_bytes_per_rank"] == p["predicted_bytes_per_rank"] for p in parts)

    @property
    def ok(self) -> bool:
        return (not self.nonfinite and self.max_rel_diff <= self.tolerance_rel
                and self.result.get("tokens_match", True)
                and self.result.get("decode_max_rel_diff", 0.0) <= self.tolerance_rel and self.ledger_matches)

    def to_dict(self) -> dict:
        return {**asdict(self), "ledger_matches": self.ledger_matches, "ok": self.ok}


def run(model_dir=None, *, tp: int = 2, dtype: str = "float32", backend: str = "auto",
        sentences=None, prompt=None, prompt_ids=None, max_new_tokens: int = 16,
        do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
        seed: int = 0, eos_token_id=None, pad_token_id: int | None = None, engine: str = "auto",
        phase=no_phase) -> RunReport:
    """Shard ``model_dir`` (default: the packaged all-MiniLM-L6-v2) over ``tp`` local ranks.

    Encoders embed ``sentences``. Decoders continue ``prompt`` (a text or a list of texts) or
    ``prompt_ids`` (a list of token ids or a list of such lists, of any lengths), with
    :func:`tensorpar.models.generation.generate`'s options under its names, checked here before
    any rank starts (``ValueError`` naming the value). ``phase(text)``: a context manager around
    each phase (the CLI shows them with their time)."""
    with phase("checking the checkpoint (headers, sizes, tp)"):
        ckpt = open_checkpoint(model_dir if model_dir is not None else minilm_path())
        name = "all-MiniLM-L6-v2" if model_dir is None else ckpt.path.name
        parse_dtype(dtype)
        fixes = check_tp(ckpt, tp)
        options = {"do_sample": do_sample, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                   "seed": seed, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "engine": engine}
        task = _task(ckpt, sentences, prompt, prompt_ids, max_new_tokens, options)
        dist.check_world(tp)  # TENSORPAR_* values, torchrun's variables, room for the ranks: before any starts
        backend = dist.resolve_backend(backend, tp)
    spec = {"path": str(ckpt.path), "dtype": dtype, **task}
    with phase(f"{tp} ranks: shards, {task['task']}; rank 0: unsplit model"):
        per_rank = dist.launch(run_worker, tp, spec, backend=backend)
    return _report(name, ckpt, tp, dtype, per_rank[0]["transport"], fixes, per_rank, task)


def _task(ckpt, sentences, prompt, prompt_ids, max_new_tokens, options) -> dict:
    if not is_decoder(ckpt):
        if prompt is not None or prompt_ids is not None:
            raise ValueError(f"--prompt is for decoders; {ckpt.path} is a {ckpt.family} encoder "
                             f"(it embeds --sentence TEXT instead)")
        if options_given(options):
            raise ValueError(f"{', '.join(options_given(options))}: for decoders; {ckpt.path} is a "
                             f"{ckpt.family} encoder (it embeds --sentence TEXT instead)")
        if not has_tokenizer(ckpt.path):
            raise ValueError(f"{ckpt.path} has no tokenizer: an encoder needs one to embed sentences")
        sentences = list(sentences or DEFAULT_SENTENCES)
        if len(sentences) < 2 or not all(isinstance(s, str) and s.strip() for s in sentences):
            raise ValueError(f"need at least two non-empty sentences to rank, got {sentences!r}")
        return {"task": "sentence-embedding", "sentences": sentences}
    if sentences:
        raise ValueError(f"--sentence is for encoders; {ckpt.path.name} is a {ckpt.family} decoder "
                         f"(it continues --prompt TEXT or --prompt-ids instead)")
    return generation_task(ckpt, prompt, prompt_ids, max_new_tokens, options)


# ---- on every rank ---------------------------------------------------------------------------

def run_worker(spec: dict) -> dict:
    quiet_transformers()
    dtype = DTYPES[spec["dtype"]]
    model, load = load_sharded(spec["path"], dtype=dtype, device=dist.rank_device())
    model.eval()
    task = _encode if spec["task"] == "sentence-embedding" else generate_rows
    with dist.ledger(model=model, wire=True) as led:
        split = task(model, spec)
    out = {"rank": dist.get_rank(), "load": load.to_dict(), "params_total": model.tp_report.params_total,
           "params": model.tp_report.params_per_rank, "records": [r.to_dict() for r in led.records],
           "bytes_sent": led.total_bytes_sent(), "wire_bytes_sent": led.wire_bytes_sent(), "split": split,
           "transport": dist.transport(None)}
    if dist.get_rank() == 0:
        dense = dense_model(spec["path"], dtype)
        out["dense"], out["nonfinite"] = task(dense, spec), nonfinite(dense)
    return out


@torch.no_grad()
def _encode(model, spec) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec["path"])
    # base_model: the encoder itself, also when the checkpoint carries a head (BertForMaskedLM)
    emb = sentence_embeddings(model.base_model, tok, spec["sentences"])  # (N, H), unit rows
    n_tokens = tok(spec["sentences"], padding=True, truncation=True, return_tensors="pt")["input_ids"].shape
    return {"output": emb, "input_shape": list(n_tokens)}


# ---- the report --------------------------------------------------------------------------------

_LAYER = re.compile(r"^(.*?\.(?:layers|layer|h)\.\d+)(?:\.|$)")


def per_layer(records: list[dict]) -> dict:
    """Records grouped by transformer block (``model.layers.3``) or top-level module."""
    out: dict = {}
    for r in records:
        m = _LAYER.match(r["module"])
        key = m.group(1) if m else (r["module"] or "(outside any module)")
        s = out.setdefault(key, {"collectives": 0, "bytes_sent": 0, "ops": {}})
        s["collectives"] += 1
        s["bytes_sent"] += r["bytes_sent"]
        s["ops"][r["op"]] = s["ops"].get(r["op"], 0) + 1
    return out


def _report(name, ckpt, tp, dtype, backend, fixes, per_rank, task) -> RunReport:
    rank0 = per_rank[0]
    split, dense = rank0["split"]["output"], rank0["dense"]["output"]
    diff = (split.double() - dense.double()).abs().max().item()
    scale = dense.double().abs().max().item() or 1.0
    batch, seq = rank0["split"]["input_shape"]
    workload = "forward" if task["task"] == "sentence-embedding" else "logits"
    predicted = _predict(ckpt, tp, dtype, batch, seq, workload, backend)
    # ledger_bytes: the ring formula over the recorded calls (the planner's formula: equal means the
    # same calls of the same sizes); wire_bytes: what the TCP sockets carried (None off gloo)
    ledger = {"workload": workload, "ledger_bytes_per_rank": [r["bytes_sent"] for r in per_rank],
              "wire_bytes_per_rank": [r["wire_bytes_sent"] for r in per_rank],
              "predicted_bytes_per_rank": predicted.bytes_sent_per_rank,
              "predicted": [i.to_dict() for i in predicted.items], "collectives": rank0["records"],
              "predicted_per_layer_bytes_per_rank": predicted.per_layer_bytes_sent_per_rank,
              "per_layer": per_layer(rank0["records"]),
              "predicted_per_module": _predicted_per_module(predicted)}
    if task["task"] == "generation":
        ledger["generation"] = _generation_ledger(ckpt, tp, dtype, backend, task, per_rank, batch, seq)
    return RunReport(model=name, model_path=str(ckpt.path), family=ckpt.family, tp=tp, dtype=dtype, backend=backend,
                     task=task["task"], max_abs_diff=diff, max_rel_diff=diff / scale,
                     tolerance_rel=TOLERANCE[DTYPES[dtype]], params_total=rank0["params_total"],
                     params_per_rank=[r["params"] for r in per_rank], fixes=fixes, ledger=ledger,
                     result=_result(task, rank0, ckpt.path), load=[r["load"] for r in per_rank],
                     nonfinite=rank0["nonfinite"])


def _generation_ledger(ckpt, tp, dtype, backend, task, per_rank, batch, seq) -> dict:
    """The generation's recorded calls beside the planner's ``generate`` of ``batch`` prompts
    padded to ``seq`` tokens, for the steps that ran (fewer than asked once every row stopped)."""
    steps = len(per_rank[0]["split"]["tokens"][0])
    out = {"ledger_bytes_per_rank": [r["split"]["generation_bytes_sent"] for r in per_rank],
           "wire_bytes_per_rank": [r["split"]["generation_wire_bytes_sent"] for r in per_rank], "steps": steps}

    candidates = Sampler(**{k: task["options"][k] for k in SAMPLING}).candidates
    if candidates is None and tp > 1:
        return {**out, "predicted_bytes_per_rank": None, "compared": False, "note": NOT_PREDICTED}
    gen = _predict(ckpt, tp, dtype, batch, seq, "generate", backend, steps, candidates or 1)
    return {**out, "predicted_bytes_per_rank": gen.bytes_sent_per_rank, "compared": True}


def _predicted_per_module(predicted) -> dict:
    """Rank 0's predicted bytes by module name (the ledger's), for the modules outside the blocks
    (a name with ``*`` is every layer's module of the kind)."""
    out: dict = {}
    for item in predicted.items:
        if "*" not in item.where:
            out[item.where] = out.get(item.where, 0) + item.total_bytes_sent_per_rank[0]
    return out


def _result(task, rank0, path) -> dict:
    if task["task"] == "sentence-embedding":
        emb = rank0["split"]["output"]
        sim = (emb @ emb.T).tolist()  # unit rows: cosine similarity
        n = len(task["sentences"])
        pairs = sorted(((sim[i][j], i, j) for i in range(n) for j in range(i + 1, n)), reverse=True)
        return {"sentences": task["sentences"],
                "ranking": [{"a": task["sentences"][i], "b": task["sentences"][j], "similarity": s}
                            for s, i, j in pairs]}
    return generation_result(task, rank0, path)


def _predict(ckpt, tp, dtype, batch, seq, workload, backend, new_tokens=1, candidates=1):
    """The planner's prediction of every collective each rank issues in this run, from the
    inventory of the checkpoint's architecture (its plan resolved on the meta device)."""
    elem = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    return predict_collectives(ckpt.path, tp, batch, seq, elem, workload, new_tokens=new_tokens,
                               candidates=candidates, backend=backend)
