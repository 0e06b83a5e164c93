"""Plans as data: module-name patterns and the units that split together. Standard library only.

A plan maps module (or parameter) name patterns to style names. Patterns are matched against a
name in full and relative to the model's base model (``model.`` in ``LlamaForCausalLM``,
``transformer.`` in GPT-2, ``bert.`` in BERT heads), so one plan serves the bare model and its
heads; ``*`` matches one name component (a layer index). Style names are those of
``tensorpar.sharding.styles``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


def join_name(anchor: str, suffix: str) -> str:
    """``anchor.suffix``, or ``anchor`` for the empty suffix (the anchor itself)."""
    return f"{anchor}.{suffix}" if suffix else anchor


def parent_name(name: str) -> str:
    return name.rpartition(".")[0]


def generic(name: str) -> str:
    """A layer's name with its index replaced by ``*`` (``model.layers.*.mlp.up_proj``)."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part)
                              for part in re.split(r"(\*)", pattern)) + r"\Z")


def compile_plan(styles: dict, valid: tuple) -> list:
    """``[(pattern, regex, style)]``; ValueError for a style outside ``valid``."""
    if not isinstance(styles, dict) or not styles:
        raise ValueError(f"a plan must be a non-empty dict of module-name pattern -> style; got {styles!r}")
    compiled = []
    for pattern, style in styles.items():
        if not isinstance(pattern, str) or style not in valid:
            raise ValueError(f"plan entry {pattern!r}: style {style!r} is not one of {', '.join(valid)}")
        compiled.append((pattern, pattern_regex(pattern), style))
    return compiled


def match_style(compiled: list, names: tuple) -> tuple[str, str] | None:
    """``(pattern, style)`` of the first entry matching any of ``names`` (full, relative)."""
    for pattern, regex, style in compiled:
        if any(n is not None and regex.match(n) for n in names):
            return pattern, style
    return None


def relative_names(name: str, prefix: str | None) -> tuple:
    """``(name, name inside the base model or None)``: what plan patterns are matched against."""
    return name, (name[len(prefix):] if prefix and name.startswith(prefix) else None)


@dataclass(frozen=True)
class Unit:
    """Modules of one family block that split together or not at all (an attention block, an MLP).

    Once a user plan shards any module of the unit, every ``members`` entry needs its style: a
    column split without its row partner leaves a sharded activation where a whole one is
    expected, and q split without k, v and the per-rank head counts computes another function
    (heads mixed up) without any error. Names are ``anchor`` + ``.`` + suffix (``""``: the
    anchor itself). ``optional`` entries may be left out: the MLP region entry saves one
    all-reduce of dX in backward but changes no result.
    """
    kind: str  # "attention" or "mlp"
    anchor: str
    members: tuple  # ((suffix, style), ...)
    optional: tuple = ()

    def entries(self) -> list[tuple[str, str]]:
        """``[(pattern, style)]``: the unit's plan entries, optional ones first."""
        return [(join_name(self.anchor, sfx), style) for sfx, style in self.optional + self.members]


def plan_of_units(first: dict, units: tuple, last: dict) -> dict:
    return {**first, **{pat: style for u in units for pat, style in u.entries()}, **last}
