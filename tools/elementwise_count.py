"""How many times PyTorch's eager modules read and write each activation element a block keeps for
backward: the count behind ``tensorpar.planner.estimate.EAGER_ELEMENTWISE``.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python tools/elementwise_count.py     # ~20 s

Hugging Face's Llama at the estimates suite's sizes (``BENCH_LLAMA``), float32, 2 x 128 tokens, one
process: a forward with the loss and its backward, each under PyTorch's profiler with the
operands' shapes. Every op that computes (not a view, not a GEMM, not the attention kernel, which
the estimate counts apart) is charged its operands' and its result's bytes; an op whose work is
done by ops under it is charged through them, except a reduction (a norm's mean), charged its
operand's read. The per-block figure is the slope over models of 1 and 6 blocks (the loss, the
embedding and the head cancel), divided by the bytes of one access to every element the split
model's ``activations`` say a block keeps.
"""
from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from tensorpar.architecture.tiny_sizes import BENCH_LLAMA  # noqa: E402
from tensorpar.models.tiny import make_tiny_checkpoint  # noqa: E402
from tensorpar.models.training import causal_lm_loss  # noqa: E402
from tensorpar.sharding.inventory import MetaSource  # noqa: E402

BATCH, SEQ = 2, 128
VIEWS = {"as_strided", "view", "slice", "transpose", "t", "expand", "unsqueeze", "reshape", "_reshape_alias", "empty",
         "empty_strided", "empty_like", "resize_", "detach", "alias", "select", "narrow", "split", "chunk", "permute",
         "squeeze", "unbind", "lift_fresh", "_unsafe_view", "set_", "contiguous", "to", "_to_copy", "zeros",
         "zeros_like", "ones_like", "new_empty", "new_empty_strided", "new_zeros", "item", "_local_scalar_dense",
         "is_nonzero", "expand_as", "view_as", "split_with_sizes", "clone", "flatten", "arange", "scalar_tensor",
         "lift", "result_type", "empty_permuted", "resolve_conj", "resolve_neg"}
APART = {"mm", "bmm", "addmm", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_flash_attention_for_cpu_backward", "embedding", "embedding_dense_backward",
         "index_select"}
REDUCTIONS = {"mean", "sum", "linalg_vector_norm"}


def _computes(event) -> bool:
    name = event.name[6:]
    return event.name.startswith("aten::") and name not in VIEWS


def charged_bytes(prof) -> float:
    """Bytes the profiled ops moved (see the module docstring), 4 per float32 element."""
    total = 0.0
    for e in prof.events():
        if not _computes(e) or e.name[6:] in APART:
            continue
        name = e.name[6:]
        children = [c for c in e.cpu_children if _computes(c)]
        if children and name not in REDUCTIONS:
            continue
        if any(c.name[6:] in REDUCTIONS for c in _ancestors(e)):
            continue  # a reduction's own children: charged through it
        sizes = [math.prod(s) for s in e.input_shapes if isinstance(s, (list, tuple)) and s
                 and all(isinstance(x, int) for x in s)]
        if not sizes:
            continue
        if name in REDUCTIONS:
            total += 4 * sizes[0]
        elif name == "fill_":
            total += 4 * sizes[0]
        elif name == "copy_":
            total += 8 * sizes[0]
        else:
            total += 4 * (sum(sizes) + max(sizes))
    return total


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def measure(layers: int) -> tuple[float, float]:
    """``(forward, backward)`` bytes of a Llama of ``layers`` blocks."""
    from transformers import AutoModelForCausalLM
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "llama", "llama", dtype=torch.float32,
                                    **dict(BENCH_LLAMA, num_hidden_layers=layers))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    causal_lm_loss(model, ids).backward()  # warm-up
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as fwd:
        loss = causal_lm_loss(model, ids)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as bwd:
        loss.backward()
    return charged_bytes(fwd), charged_bytes(bwd)


def kept_bytes_per_block() -> float:
    """One float32 access to every element a block keeps, as the planner counts them (unsplit)."""
    from transformers import LlamaConfig
    split = MetaSource(LlamaConfig(**BENCH_LLAMA)).at(1)
    a = split.activations[0]
    return BATCH * SEQ * 4 * (a.replicated + a.sharded[0])


def main() -> None:
    torch.set_num_threads(1)
    one, six = measure(1), measure(6)
    kept = kept_bytes_per_block()
    fwd, bwd = ((b - a) / 5 / kept for a, b in zip(one, six))
    print(f"per block: {kept / 1e6:.2f} MB kept at one access; the elementwise work makes {fwd:.2f} accesses "
          f"in forward and {bwd:.2f} in backward (fused kernels: 2 and 4)")


if __name__ == "__main__":
    main()
