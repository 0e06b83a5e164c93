"""Boundary checks for the reference: each raises ``ValueError`` naming the value and the valid choices.

Every public function of ``tensorpar.reference`` validates its inputs here, before computing
anything, so a malformed call never produces a half-simulated result.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

# numpy dtype kinds accepted as numeric: signed/unsigned integer, float, complex.
# bool ('b'), object ('O'), str ('U'/'S'), bytes/void ('V') and datetimes ('M'/'m') are not.
NUMERIC_KINDS = "iufc"


def check_p(p, name: str = "p") -> int:
    """Return ``p`` as an ``int`` if it is a positive integer (Python or numpy int, not bool)."""
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, (numbers.Integral, np.integer)):
        raise ValueError(f"{name} must be a positive integer (the number of devices), "
                         f"got {p!r} of type {type(p).__name__}")
    if p < 1:
        raise ValueError(f"{name} must be a positive integer (the number of devices), got {p}")
    return int(p)


def as_numeric(a, name: str, *, real: bool = False) -> np.ndarray:
    """``np.asarray(a)``, refusing arrays whose dtype is not integer, float (or complex unless ``real``)."""
    try:
        arr = np.asarray(a)
    except ValueError as exc:  # ragged nested lists
        raise ValueError(f"{name} is not a rectangular numeric array: {exc}") from None
    kinds = "iuf" if real else NUMERIC_KINDS
    if arr.dtype.kind not in kinds:
        valid = "integer or float" if real else "integer, float or complex"
        raise ValueError(f"{name} must be a numeric array ({valid} dtype), got dtype {arr.dtype}")
    return arr


def check_ndim(arr: np.ndarray, name: str, *, exact: int | None = None, minimum: int | None = None):
    if exact is not None and arr.ndim != exact:
        raise ValueError(f"{name} must be {exact}-D, got shape {arr.shape} ({arr.ndim}-D)")
    if minimum is not None and arr.ndim < minimum:
        raise ValueError(f"{name} must be at least {minimum}-D, got shape {arr.shape} ({arr.ndim}-D)")


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` (the valid even split counts of an axis of ``n`` elements)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divides(size: int, p: int, what: str, hint: str = ""):
    """Require that ``p`` shards of an axis of ``size`` elements are equal and non-empty."""
    if size < p or size % p:
        valid = ", ".join(map(str, divisors(size))) or "none (the axis is empty)"
        raise ValueError(f"{what} has {size} elements, which do not divide evenly into p={p} "
                         f"non-empty shards; valid p: {valid}{hint}")


def check_chain(left: int, right: int, left_desc: str, right_desc: str):
    """Require that two contracted axes have the same length."""
    if left != right:
        raise ValueError(f"shapes do not chain: {left_desc} is {left} but {right_desc} is {right}")


def check_byte_count(n, name: str = "n_bytes") -> int:
    """Return a byte count as ``int``: a non-negative, finite, integral number (``14e9`` is fine)."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (numbers.Real, np.integer, np.floating)):
        raise ValueError(f"{name} must be a non-negative integer number of bytes, "
                         f"got {n!r} of type {type(n).__name__}")
    if isinstance(n, (float, np.floating)) and not math.isfinite(n):
        raise ValueError(f"{name} must be a finite number of bytes, got {n!r}")
    if n < 0:
        raise ValueError(f"{name} must be non-negative, got {n!r}")
    if n != int(n):
        raise ValueError(f"{name} must be a whole number of bytes, got {n!r}")
    return int(n)


def check_rank(rank, p: int, name: str = "rank") -> int:
    """A rank index in ``0..p-1`` (Python or numpy int, not bool)."""
    if isinstance(rank, (bool, np.bool_)) or not isinstance(rank, (numbers.Integral, np.integer)) \
            or not 0 <= rank < p:
        raise ValueError(f"{name} must be a rank in 0..{p - 1}, got {rank!r}")
    return int(rank)


def check_choice(value, name: str, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_shape(shape, name: str) -> tuple[int, ...]:
    """A shape as a tuple of non-negative ints (numpy ints fine, bools and floats not)."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of non-negative integers, got {shape!r}") from None
    for d in dims:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (numbers.Integral, np.integer)) or d < 0:
            raise ValueError(f"{name} must be a sequence of non-negative integers, got {shape!r}")
    return tuple(int(d) for d in dims)


def normalize_axis(axis, ndim: int, name: str) -> int:
    """``axis`` as a non-negative index into an array of ``ndim`` axes (negative counts from the end)."""
    is_int = isinstance(axis, (numbers.Integral, np.integer)) and not isinstance(axis, (bool, np.bool_))
    if not is_int or not -ndim <= axis < ndim:
        raise ValueError(f"axis must be an integer in {-ndim}..{ndim - 1} for {name} "
                         f"with {ndim} axes, got {axis!r}")
    return int(axis) % ndim


def check_matmul(X, W, p, fn: str, *, real: bool = False):
    """Validate ``Y = X @ W`` with ``X: (..., in)``, ``W: (in, out)``; return ``(X, W, p)``."""
    p = check_p(p)
    X = as_numeric(X, f"{fn}: X", real=real)
    W = as_numeric(W, f"{fn}: W", real=real)
    check_ndim(X, f"{fn}: X", minimum=1)
    check_ndim(W, f"{fn}: W", exact=2)
    check_chain(X.shape[-1], W.shape[0], f"{fn}: X's last axis (shape {X.shape})",
                f"W's rows (shape {W.shape})")
    return X, W, p
