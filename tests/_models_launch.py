"""The one 4-rank launch behind tests/test_models_{parallelize,training,checkpoint}.py.

Spawning 4 ranks that import torch and transformers costs ~20 s of CPU on this machine, so
the three test modules share a single launch (run on first use, once per pytest session) and
each reads its part of the results. The MiniLM load at tp 4 runs first in every rank: it is
the load whose memory growth is measured in a fresh process.
"""
import atexit
import functools
import tempfile
from pathlib import Path

from tensorpar import distributed as dist
from tensorpar.models.tiny import make_tiny_checkpoint
from tests import _models_checkpoint_workers as C, _models_workers as W

TINY_CHECKPOINTS = ("llama", "gpt2")
SHARDED = {"llama": "20KB"}  # the llama checkpoint is split over many files with an index
ALL = [0, 1, 2, 3]
TRAINING_CASES = [("llama", 4, "float64", ALL),   # GQA 4/2 heads: KV heads replicated, grads synced
                  ("gpt2", 4, "float64", ALL),    # Conv1D, fused qkv, tied embeddings, padded vocab
                  ("llama", 4, "float32", ALL),
                  ("llama", 2, "float64", [0, 1]),
                  ("qwen2", 2, "float64", [2, 3]),  # MQA (replicated KV), tied embeddings
                  ("llama", 2, "float32", [0, 1]),
                  ("gpt2", 2, "float32", [2, 3]),
                  ("llama_tied", 2, "float64", [0, 1])]  # tied Llama head


def all_worker(tiny_dirs: dict, training_cases: list) -> dict:
    """Every multi-rank model test in one launch (run in each spawned rank)."""
    return {"checkpoint": C.checkpoint_worker(tiny_dirs), "inference": W.inference_worker(),
            "training": W.training_worker(training_cases)}


@functools.lru_cache(maxsize=None)
def results() -> dict:
    """``{"checkpoint" | "inference" | "training": [per-rank result, ...]}``."""
    tmp = tempfile.TemporaryDirectory(prefix="tensorpar-models-")
    atexit.register(tmp.cleanup)
    dirs = {f: str(make_tiny_checkpoint(Path(tmp.name) / f, f, max_shard_size=SHARDED.get(f)))
            for f in TINY_CHECKPOINTS}
    per_rank = dist.launch(all_worker, 4, dirs, TRAINING_CASES, deadline=600)
    return {part: [r[part] for r in per_rank] for part in per_rank[0]}


def merged(part: str) -> dict:
    """``{case: [result of each rank that ran it]}`` for ``part``."""
    out = {}
    for res in results()[part]:
        for key, val in res.items():
            out.setdefault(key, []).append(val)
    return out
