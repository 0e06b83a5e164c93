"""Token streams for training, and the global batch of every step.

A stream is 1-D token ids: a UTF-8 text file tokenized with the model's tokenizer (else its bytes
are the ids, which needs a vocabulary of at least 256), a folder of ``.npy`` files of integer ids
read back to back in sorted name order (memory-mapped, never copied whole), or the packaged
corpus (:mod:`tensorpar.data.corpus`). Every id is checked against the vocabulary when the stream
is opened, so a bad one is named with its file before any rank starts.

The batch of step ``s`` depends on ``s``, the seed and the stream only
(:func:`window_starts`): a run resumed at step ``s`` reads exactly what the uninterrupted run
read there.
"""
from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import numpy as np
import torch

from tensorpar.data.corpus import CORPUS

_CHUNK = 1 << 22  # ids checked per read of a memory-mapped file


class TokenStream:
    """Token ids as one or more 1-D arrays back to back. ``source``: what it was read from
    (``{"kind", "path", "tokenizer"}``), for the report. Pickles ``.npy`` files by name, so a
    rank maps them itself instead of receiving a copy."""

    def __init__(self, parts: list, source: dict, files: list | None = None):
        self.parts, self.source, self.files = parts, source, files
        self.ends = np.cumsum([len(p) for p in parts]).tolist()  # (n_parts,): end offset of each part

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getstate__(self):
        if self.files is not None:
            return {"source": self.source, "files": self.files}
        return {"source": self.source, "parts": self.parts}

    def __setstate__(self, state):
        files = state.get("files")
        parts = state["parts"] if files is None else [np.load(f, mmap_mode="r") for f in files]
        self.__init__(parts, state["source"], files)

    def fingerprint(self) -> str:
        """``length:sha256`` of the first and last 65,536 token ids (int64): what a resumed run
        compares to know it reads the same tokens, without hashing a large dataset whole."""
        n, k = len(self), 65536
        h = hashlib.sha256()
        for start in sorted({0, max(0, n - k)}):
            h.update(np.ascontiguousarray(self.window(start, min(k, n - start)), dtype=np.int64).tobytes())
        return f"{n}:{h.hexdigest()[:16]}"

    def window(self, start: int, length: int) -> np.ndarray:
        """Ids ``start .. start+length-1`` of the stream, across part boundaries; (length,) int64."""
        pieces, begin = [], 0
        for part, end in zip(self.parts, self.ends):
            lo, hi = max(start, begin), min(start + length, end)  # the window's span inside this part
            if lo < hi:
                pieces.append(np.asarray(part[lo - begin:hi - begin], dtype=np.int64))
            begin = end
        return np.concatenate(pieces)


def window_starts(n_tokens: int, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """The first token of each of the ``batch`` windows of step ``step``: uniform over the
    ``n_tokens - seq + 1`` possible starts, from a generator seeded with
    ``seed * 1_000_003 + step``. (batch,) int64."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n_tokens - seq + 1, (batch,), generator=gen)


def batch_for_step(stream: TokenStream, step: int, batch: int, seq: int, seed: int, rows=slice(None)) -> torch.Tensor:
    """The global batch of step ``step`` (its ``rows``: a dp rank's share), (rows, seq) int64."""
    starts = window_starts(len(stream), step, batch, seq, seed)[rows]
    return torch.from_numpy(np.stack([stream.window(int(s), seq) for s in starts]))  # (rows, seq)


def open_tokens(data, vocab_size: int, model_dir) -> TokenStream:
    """The stream ``data`` names: a text file, a folder of ``.npy`` files, or None (the packaged
    corpus); every id checked against ``vocab_size``. ``model_dir``: where a tokenizer may be."""
    if data is None:
        return _packaged(vocab_size, Path(model_dir))
    path = Path(data)
    if not path.exists():
        raise FileNotFoundError(f"--data {str(path)!r} does not exist")
    if path.is_dir():
        return _npy_folder(path, vocab_size)
    _check_regular(path, "--data")
    return _text_file(path, vocab_size, Path(model_dir))


def _check_regular(path: Path, what: str) -> None:
    """A regular file (or a link to one): a named pipe, a device or a socket would be read forever
    or block waiting for a writer."""
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
                else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise ValueError(f"{what} {str(path)!r} is {kind}; give a regular UTF-8 text file or a folder of .npy "
                         f"token ids")


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"))


def _text_file(path: Path, vocab_size: int, model_dir: Path) -> TokenStream:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--data {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         f"give a UTF-8 text file or a folder of .npy token ids") from None
    ids, how = _tokenize(text, vocab_size, model_dir, f"--data {str(path)!r}")
    _check_ids(ids, vocab_size, f"--data {str(path)!r} tokenized with {how}")
    return TokenStream([ids], {"kind": "text", "path": str(path), "tokenizer": how})


def _packaged(vocab_size: int, model_dir: Path) -> TokenStream:
    """The packaged corpus, tokenized like a text file; a model with neither a tokenizer nor 256
    ids gets its bytes folded into the vocabulary (``byte % vocab_size``): a deterministic stream
    with the text's structure, for a demonstration."""
    if has_tokenizer(model_dir) or vocab_size >= 256:
        ids, how = _tokenize(CORPUS, vocab_size, model_dir, "the packaged corpus")
        _check_ids(ids, vocab_size, f"the packaged corpus tokenized with {how}")
    else:
        ids = np.frombuffer(CORPUS.encode("utf-8"), dtype=np.uint8).astype(np.int64) % vocab_size
        how = f"UTF-8 bytes modulo {vocab_size}"
    return TokenStream([ids], {"kind": "packaged", "path": None, "tokenizer": how})


def _tokenize(text: str, vocab_size: int, model_dir: Path, what: str) -> tuple[np.ndarray, str]:
    if has_tokenizer(model_dir):
        tok = _tokenizer(model_dir)
        return np.asarray(tok.encode(text, add_special_tokens=False), dtype=np.int64), f"the tokenizer of {model_dir}"
    if vocab_size < 256:
        raise ValueError(f"{what}: {model_dir} has no tokenizer and a vocabulary of {vocab_size} ids, fewer than "
                         f"the 256 UTF-8 byte values; give a folder of .npy token ids (--data DIR) or a model "
                         f"with a tokenizer")
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64), "UTF-8 bytes"


_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _tokenizer(model_dir: Path):
    """The model's tokenizer; a file of it that does not parse is named (transformers' own errors
    are a bare parser message or a KeyError that say neither which file nor which folder)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    for name in _TOKENIZER_JSON:
        f = model_dir / name
        if f.is_file():
            try:
                ok = isinstance(json.loads(f.read_text(encoding="utf-8")), dict)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{f} is not valid JSON ({exc}); the model's tokenizer cannot be read: fix or "
                                 f"remove it, or give --data as a folder of .npy token ids") from None
            if not ok:
                raise ValueError(f"{f} is not a JSON object; the model's tokenizer cannot be read")
    hf_logging.set_verbosity_error()  # no "sequence longer than the model's maximum" warning: windows are cut later
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises bare Exceptions for files it cannot parse
        present = ", ".join(n for n in (*_TOKENIZER_JSON, "vocab.txt") if (model_dir / n).is_file())
        words = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ValueError(f"the tokenizer in {model_dir} ({present}) cannot be read: {type(exc).__name__}: {words}; "
                         f"fix or remove its files, or give --data as a folder of .npy token ids") from None


def _npy_folder(path: Path, vocab_size: int) -> TokenStream:
    files = sorted(path.glob("*.npy"))
    if not files:
        raise ValueError(f"--data {str(path)!r} is a folder without .npy files; a tokenized dataset is one or "
                         f"more .npy files of 1-D integer token ids")
    parts = []
    for f in files:
        _check_regular(f, "--data file")
        try:
            arr = np.load(f, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{f} is not a readable .npy file: {exc}") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{f} holds a {arr.ndim}-D array of {arr.dtype}; token ids must be a 1-D integer array")
        _check_ids(arr, vocab_size, str(f))
        parts.append(arr)
    return TokenStream(parts, {"kind": "npy", "path": str(path), "tokenizer": None,
                               "files": [f.name for f in files]}, files=[str(f) for f in files])


def _check_ids(ids, vocab_size: int, what: str) -> None:
    """Every id in ``[0, vocab_size)``, read in chunks (a memory-mapped file is never loaded whole)."""
    for lo in range(0, len(ids), _CHUNK):
        chunk = np.asarray(ids[lo:lo + _CHUNK])
        bad = np.flatnonzero((chunk < 0) | (chunk >= vocab_size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{what}: token id {int(chunk[i])} at position {lo + i} is outside the model's "
                             f"vocabulary of {vocab_size} ids (valid: 0 to {vocab_size - 1})")
