"""The runtimes a time estimate can be for (:mod:`tensorpar.planner.estimate`): what overlaps,
which kernels, what the optimizer and the elementwise work move. tensorpar's own on a CPU and on a
GPU, and Megatron-LM as its published runs ran it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .profile import Profile


@dataclass(frozen=True)
class Runtime:
    """How the runtime being estimated runs a step (what overlaps, which kernels).

    ``attention``: ``fused`` (SDPA/FlashAttention: scores never reach memory) or ``unfused``;
    ``optimizer_bytes_per_param``: bytes read and written per parameter by one optimizer step
    (with clipping); ``optimizer``: which one (``torch-adamw``, tensorpar's, is the one
    ``calibrate`` times); ``dp_overlap``: whether data-parallel gradient reduction runs during the
    backward; ``bucket_bytes``: its bucket size (the last bucket cannot overlap);
    ``dp_bucket_copies``: whether DDP copies each gradient into its bucket and back (PyTorch's
    DDP without ``gradient_as_bucket_view``; Megatron's own DDP reduces a contiguous buffer);
    ``elementwise_accesses``: ``(forward, backward)`` reads and writes of each kept activation
    element by the elementwise work (``(2, 4)``: fused kernels; :data:`EAGER_ELEMENTWISE`);
    ``optimizer_fp32_states``: the optimizer keeps float32 master weights and moments whatever the
    model's dtype (mixed precision), so its bytes are the same at 16 bits; else its states are in
    the weights' dtype (PyTorch's AdamW) and a 16-bit model's step moves half the bytes.
    """
    name: str
    attention: str = "fused"
    optimizer_bytes_per_param: float = 96.0
    dp_overlap: bool = False
    bucket_bytes: float = 25 * 2**20
    optimizer: str | None = None
    dp_bucket_copies: bool = True
    elementwise_accesses: tuple = (2.0, 4.0)
    optimizer_fp32_states: bool = False


# PyTorch's eager modules (Hugging Face's, as tensorpar runs them) read and write each kept
# activation element about 3 times in forward and 7.6 in backward, not 2 and 4: an RMSNorm is a
# square, a mean, a scale and a weight, rotary five passes over q and k, and autograd's backward of
# each product two more. Counted by tools/elementwise_count.py with PyTorch's profiler over Hugging
# Face's Llama (2 x 128 tokens, float32, the slope over 1 and 6 blocks): the operands and results
# of every op that computes but views, GEMMs and the attention kernel (its own term), per access to
# the elements the split's ``activations`` say a block keeps: 3.02 and 7.58.
EAGER_ELEMENTWISE = (3.0, 7.6)

# PyTorch's AdamW (its default: a loop over the tensors on a CPU, foreach on a GPU) with clipping, as
# tensorpar.train_step runs it: about twelve elementwise passes over four-byte states (weight decay, two moments, the square root,
# its scaling and epsilon, the update; the norm and the clip): 96 bytes per parameter.
ON_CPU = Runtime("tensorpar", optimizer="torch-adamw", elementwise_accesses=EAGER_ELEMENTWISE)
# On a GPU the same code, with DDP's gradient buckets overlapping the backward (its reducer's
# hooks fire per bucket as gradients are ready).
ON_GPU = Runtime("tensorpar (GPU)", dp_overlap=True, optimizer="torch-adamw",
                 elementwise_accesses=EAGER_ELEMENTWISE)
# Megatron-LM as published in 2020 (README tables): unfused attention with dropout on the scores,
# apex FusedAdam (one kernel: fp16 gradient, fp32 master, two moments read, three written, the
# fp16 copy: 32 bytes with the norm), PyTorch DDP overlapping gradient all-reduce with backward.
MEGATRON_2020 = Runtime("Megatron-LM 2020", attention="unfused", optimizer_bytes_per_param=32.0, dp_overlap=True,
                        optimizer="apex-fused-adam", optimizer_fp32_states=True)
# Megatron-LM as Narayanan et al. 2021 ran it: the same kernels (scores still go through memory),
# gradients all-reduced after the backward (its own DDP, no overlap).
MEGATRON_2021 = Runtime("Megatron-LM 2021", attention="unfused", optimizer_bytes_per_param=32.0, dp_overlap=False,
                        optimizer="apex-fused-adam", dp_bucket_copies=False, optimizer_fp32_states=True)


def default_runtime(profile: Profile) -> Runtime:
    return ON_CPU if profile.synchronous else ON_GPU
