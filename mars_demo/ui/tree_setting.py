"""The sidebar's candidate-tree setting: its choices, its help, and the check of a visitor's value.

``DecodeConfig.tree`` is None (exact mode's chain of drafts, the default), "auto" (a shape chosen before every
pass by expected tokens per ms) or a fixed shape "2,1,1" (docs/METHOD.md, "Candidate trees"). The dropdown offers
the chain, auto and a few shapes, and takes a typed shape; exact and hybrid runs read it, MARS runs ignore it.
A value it cannot use gets one sentence that never echoes the value (it may be huge, or markup).
"""

from __future__ import annotations

import gradio as gr

from ..engine.decoding.tree_shape import AUTO, MAX_BRANCH, MAX_NODES, parse_tree

CHAIN = "chain"  # the dropdown's value for DecodeConfig.tree = None
TREE_CHOICES = [("chain (default)", CHAIN), ("auto", AUTO), ("2,1,1", "2,1,1"), ("2,2,1", "2,2,1"), ("3,1", "3,1")]
MAX_CHARS = 64  # longer than any shape parse_tree takes
BAD_TREE = (f"Candidate tree must be chain, auto or a shape such as 2,1,1: comma-separated candidates per depth, "
            f"each 1 to {MAX_BRANCH}, at most 15 deep and {MAX_NODES} drafts in all")
TREE_INFO = (
    "Exact and hybrid modes: a pass verifies a tree of the masks' top candidates, not one guess per position; the "
    "text is the same. 2,1,1: 2 candidates at depth 1, 1 under each at depths 2 and 3; auto picks each pass's shape "
    "by expected tokens per ms. On a small CPU a chain is usually as fast (docs/bench/history.md, \"Candidate trees\")."
)


def check_tree(value) -> str | None:
    """The dropdown's value as DecodeConfig.tree: None for the chain (or nothing chosen), "auto", or a shape
    without spaces; a ValueError (a TypeError for another type) with ``BAD_TREE`` for anything else."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(BAD_TREE)
    value = value.replace(" ", "")
    if value in ("", CHAIN):
        return None
    try:
        if len(value) > MAX_CHARS:
            raise ValueError(BAD_TREE)
        parse_tree(value)
    except ValueError:
        raise ValueError(BAD_TREE) from None
    return value


def tree_control() -> gr.Dropdown:
    """The sidebar's dropdown (custom shapes reach the handlers, which check them with ``check_tree``)."""
    return gr.Dropdown(choices=TREE_CHOICES, value=CHAIN, allow_custom_value=True, label="Candidate tree",
                       info=TREE_INFO, elem_id="tree")
