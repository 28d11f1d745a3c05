"""HTML for the two text panes, built from decoding events; every piece of text is escaped.

Model output and prompts are shown as text, never as markup: each token's text and
every attribute value goes through ``html.escape``, so ``<script>`` in an output
renders literally. In the MARS pane the tokens one forward pass accepted share a
colour (three colours alternate so neighbouring passes are told apart) and the shade
deepens with the number of tokens that pass accepted; hovering a token shows its pass,
its confidence, the tau in force and where it came from (a CSS tooltip from ``data-tip``).
In exact and hybrid modes a token the pass verified from a draft is underlined (dotted),
unlike those taken on confidence or from the AR head; sampled, the hover also says whether a token was a
draft kept by the rule, drawn again after a rejection, or the bonus after every draft held. With candidate
trees (DecodeConfig.tree) the hover of a verified draft also names its branch: the main path (every node the
masks' top guess, the chain's) or which candidate of its position it was, at which depth (``branch_tip``).
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from ..engine.decoding.exact import AR, BONUS, DRAFT, MASK, RESAMPLED
from ..engine.decoding.loop import StepEvent
from ..engine.decoding.metrics import Rates
from .charts import PASS_COLORS

SHADES = 4  # passes accepting 1, 2, 3, 4+ tokens get deeper shades
ORIGIN_TIPS = {
    AR: "the AR head's token", DRAFT: "draft verified by the AR head", MASK: "mask accepted on confidence",
    RESAMPLED: "drawn again after the AR head rejected a draft",
    BONUS: "bonus: drawn from the AR head, every draft kept",
}
PANE_NAMES = {"mars": "MARS", "exact": "Exact (verified)", "hybrid": "Hybrid (confidence + verified)"}


def _rgb(hex_color: str) -> str:
    return ", ".join(str(int(hex_color[i : i + 2], 16)) for i in (1, 3, 5))


def _pane_css() -> str:
    rules = []
    for c, color in enumerate(PASS_COLORS):
        rgb = _rgb(color)
        rules.append(f".c{c} {{ border-bottom-color: rgb({rgb}); }}")
        for s in range(1, SHADES + 1):
            rules.append(f".c{c}.s{s}, .swatch.c{c}.s{s} {{ background: rgba({rgb}, {0.10 + 0.15 * s:.2f}); }}")
    return PANE_CSS_BASE + "\n".join(rules)


PANE_CSS_BASE = """
.pane { border: 1px solid var(--border-color-primary); border-radius: 10px; overflow: visible;
  background: var(--block-background-fill); }
.head { display: flex; flex-wrap: wrap; align-items: baseline; gap: 4px 10px; padding: 8px 12px;
  border-bottom: 1px solid var(--border-color-primary); font-size: 13px; }
.name { font-weight: 700; font-size: 15px; }
.mars .name { color: #4f46e5; }
.ar .name { color: #64748b; }
.chip { font-size: 11px; padding: 1px 8px; border-radius: 999px; background: var(--background-fill-secondary);
  color: var(--body-text-color-subdued); border: 1px solid var(--border-color-primary); }
.chip.running { background: #fef3c7; color: #92400e; border-color: #fcd34d; }
.chip.done { background: #dcfce7; color: #166534; border-color: #86efac; }
.chip.stopped, .chip.limit { background: #fee2e2; color: #991b1b; border-color: #fca5a5; }
.stats { flex-basis: 100%; color: var(--body-text-color-subdued); font-variant-numeric: tabular-nums; }
.stats b { color: var(--body-text-color); font-weight: 600; }
.text { padding: 12px 14px 34px; min-height: 220px; max-height: 480px; overflow-y: auto; white-space: pre-wrap;
  word-wrap: break-word; font-size: 15px; line-height: 1.75; color: var(--body-text-color); }
.nl { opacity: 0.45; font-size: 12px; user-select: none; }
.placeholder { color: var(--body-text-color-subdued); font-style: italic; }
.pass { border-bottom: 2px solid transparent; border-radius: 3px; padding: 1px 0;
  box-decoration-break: clone; -webkit-box-decoration-break: clone; }
.tok { position: relative; }
.tok:hover { outline: 1.5px solid #111827; border-radius: 2px; }
.tok:hover::after { content: attr(data-tip); position: absolute; left: 0; top: calc(100% + 3px);
  white-space: normal; width: max-content; max-width: min(460px, 80vw); background: #111827; color: #f9fafb;
  font-size: 12px; line-height: 1.4;
  padding: 3px 8px; border-radius: 5px; z-index: 20; pointer-events: none; font-style: normal; }
.ar .tok:hover { outline-color: #94a3b8; }
.tok.draft { text-decoration: underline dotted 1.5px; text-underline-offset: 4px; }
.legend { display: flex; flex-wrap: wrap; align-items: center; gap: 6px; padding: 6px 12px 8px;
  font-size: 12px; color: var(--body-text-color-subdued); border-top: 1px dashed var(--border-color-primary); }
.swatch { display: inline-block; min-width: 22px; padding: 0 4px; text-align: center; border-radius: 3px;
  color: var(--body-text-color); }
"""

PANE_CSS = _pane_css()

# The panes re-render on every pass; keep the text scrolled to its end while it streams,
# unless the reader has scrolled up (then keep their place).
PANE_JS = """
const follow = () => {
  const text = element.querySelector('.text');
  if (!text) return;
  if (element.querySelector('.placeholder')) element.dataset.follow = 'yes';
  if (element.dataset.follow === 'no') text.scrollTop = Number(element.dataset.top || 0);
  else text.scrollTop = text.scrollHeight;
  text.addEventListener('scroll', () => {
    element.dataset.top = text.scrollTop;
    element.dataset.follow = text.scrollTop + text.clientHeight >= text.scrollHeight - 8 ? 'yes' : 'no';
  });
};
watch('value', follow);
follow();
"""

STATUS_LABELS = {
    "idle": "waiting",
    "running": "decoding…",
    "stopped": "stopped",
    "limit": "time limit",
    "off": "switched off",
}


def _chip(status: str, finish: str | None) -> str:
    label = f"done · {finish}" if status == "done" and finish else STATUS_LABELS.get(status, status)
    return f'<span class="chip {escape(status)}">{escape(label)}</span>'


def _stats(steps: Sequence[StepEvent], with_tau: bool) -> str:
    if not steps:
        return ""
    total = Rates.of_steps(steps)
    parts = [f"tau <b>{steps[-1].tau:.2f}</b>"] if with_tau else []
    parts += [
        f"<b>{total.tokens}</b> tokens",
        f"<b>{total.forward_passes}</b> passes",
        f"<b>{total.tokens_per_forward:.2f}</b> tok/pass",
        f"<b>{total.tokens_per_second:.1f}</b> tok/s",
        f"<b>{total.seconds:.2f}</b> s",
    ]
    return f'<span class="stats">{" · ".join(parts)}</span>'


def branch_tip(step: StepEvent, i: int) -> str:
    """Which branch of the pass's candidate tree token ``i`` came from ("" for a token that was no tree node).

    The kept path's nodes are the pass's first tokens, depth 1, 2, ...; ``step.branches[i]`` is the rank of
    token i among its mask's candidates, and the path is the main one while every rank so far is 0."""
    if i >= len(step.branches) or step.branches[i] < 0:
        return ""
    rank, depth = step.branches[i], i + 1
    if all(b == 0 for b in step.branches[:depth]):
        return f" · tree: main path (the top candidate at depth {depth})"
    where = "a side branch" if rank else "under a side branch"
    return f" · tree: candidate {rank + 1} of its position (depth {depth}, {where})"


def _tokens(step: StepEvent, mars: bool) -> str:
    n = len(step.token_ids)
    spans = []
    origins = step.origins or (None,) * n
    for i, (piece, conf, origin) in enumerate(zip(step.pieces, step.confidences, origins)):
        if not piece:
            continue  # special tokens (EOS) have no text
        count = f" ({n} token{'s' if n != 1 else ''})" if mars else ""
        source = f" · {ORIGIN_TIPS[origin]}" if mars and origin in ORIGIN_TIPS else ""
        source += branch_tip(step, i) if mars else ""
        tip = f"pass {step.index + 1}{count} · confidence {conf:.3f} · tau {step.tau:.2f}{source}"
        text = escape(piece)
        if mars:  # MARS pane: make newline tokens visible, or a pass of newlines shows as nothing
            text = text.replace("\n", '<span class="nl">↵</span>\n')
        kind = " draft" if mars and origin == DRAFT else ""
        spans.append(f'<span class="tok{kind}" data-tip="{escape(tip)}">{text}</span>')
    return "".join(spans)


def _pane(
    side: str, name: str, body: str, steps: Sequence[StepEvent], status: str, finish: str | None, foot: str = ""
) -> str:
    chip, stats = _chip(status, finish), _stats(steps, side == "mars")
    return (
        f'<div class="pane {side}" data-side="{side}" data-status="{escape(status)}" data-passes="{len(steps)}">'
        f'<div class="head"><span class="name">{name}</span>{chip}{stats}</div>'
        f'<div class="text">{body}</div>{foot}</div>'
    )


def legend(mode: str = "mars") -> str:
    swatches = "".join(
        f'<span class="swatch c0 s{s}">{s}{"+" if s == SHADES else ""}</span>' for s in range(1, SHADES + 1)
    )
    drafts = ' · <span class="tok draft">underlined</span>: a draft the pass verified' if mode != "mars" else ""
    return (
        f'<div class="legend">tokens per pass {swatches}'
        f'<span>· colours alternate between passes{drafts} · hover a token for details</span></div>'
    )


def mars_pane(steps: Sequence[StepEvent], status: str = "idle", finish: str | None = None, mode: str = "mars") -> str:
    """The MARS (or exact / hybrid) text, one coloured group per forward pass."""
    if steps:
        body = "".join(
            f'<span class="pass c{s.index % len(PASS_COLORS)} s{min(max(len(s.token_ids), 1), SHADES)}" '
            f'data-pass="{s.index + 1}" data-tokens="{len(s.token_ids)}">{_tokens(s, True)}</span>'
            for s in steps
        )
    else:
        body = '<span class="placeholder">Press Run: MARS output appears here, coloured by forward pass.</span>'
    return _pane("mars", escape(PANE_NAMES.get(mode, "MARS")), body, steps, status, finish, legend(mode))


def ar_pane(steps: Sequence[StepEvent] | None, status: str = "idle", finish: str | None = None) -> str:
    """The AR baseline's text (one token per pass), or a note that it is switched off."""
    if steps is None:
        body = '<span class="placeholder">The AR baseline is switched off.</span>'
        return _pane("ar", "AR baseline", body, [], "off", None)
    if steps:
        body = "".join(_tokens(s, False) for s in steps)
    else:
        body = '<span class="placeholder">The AR baseline on the same weights, one token per forward pass.</span>'
    return _pane("ar", "AR baseline", body, steps, status, finish)


def model_status(name: str, block_size: int, mask_token: str, seconds: float, note: str = "", compute: str = "") -> str:
    """One line under the model picker: what is serving and on which compute path (every value escaped)."""
    extra = f' <span class="note">{escape(note)}</span>' if note else ""
    if compute:
        extra = f' · <span class="compute">compute path {escape(compute)}</span>' + extra
    return (
        f'<div class="model-status ok">Serving <code>{escape(name)}</code> · block size {int(block_size)} · '
        f"mask <code>{escape(mask_token)}</code> · loaded in {seconds:.1f} s{extra}</div>"
    )


def model_message(text: str, kind: str = "info") -> str:
    return f'<div class="model-status {escape(kind)}">{escape(text)}</div>'


STATUS_CSS = """
.model-status { font-size: 12.5px; line-height: 1.5; padding: 6px 10px; border-radius: 8px;
  background: var(--background-fill-secondary); color: var(--body-text-color-subdued); }
.model-status.ok { background: #ecfdf5; color: #065f46; }
.model-status.error { background: #fef2f2; color: #991b1b; }
.model-status code { font-size: 12px; }
.model-status .note { display: block; color: #92400e; }
"""
