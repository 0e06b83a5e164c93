"""Training data: token streams (a text file, a folder of ``.npy`` ids, the packaged corpus) and
the global batch of every step, drawn from the step number and a seed (:mod:`tensorpar.data.tokens`)."""
from tensorpar.data.tokens import TokenStream, batch_for_step, open_tokens, window_starts

__all__ = ["TokenStream", "batch_for_step", "open_tokens", "window_starts"]
