"""MARS sliding-window decoding and its AR baseline, with a KV cache (docs/METHOD.md, "Decoding").

One pass feeds [tokens accepted last pass | B-1 masks], reads B candidates (the
last real token's output is the AR next-token distribution, mask j's output is
the (j+1)-ahead guess), accepts the confident prefix, and crops the masks' entries
off the cache. The AR baseline is the same loop with no masks, so both share the
prefill, the cache type, the events and the timer. Exact and hybrid modes are the
same loop with verifying passes (exact.py, docs/METHOD.md, "Exact and hybrid modes").

Decoders are generators that yield one StepEvent per forward pass; the last event
carries the run's totals. tau is read from a live source before every pass.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from ..backends.base import Backend, KVCache
from ..backends.placement import SeededGenerator
from ..model import LoadedModel
from . import exact, speculative, tree
from .acceptance import accept_prefix
from .chat import prompt_ids
from .commit import commit_tokens, cut_at_stop_string
from .config import VERIFYING_MODES, DecodeConfig, check_tau, resolve_max_fed
from .metrics import Rates
from .sampling import Sampling
from .surface import Surface
from .tree_shape import TreeShape, parse_tree
from .width import OneRow, WidthController


class LiveTau:
    """A tau the caller may change while a decoder runs; the decoder reads it before every pass."""

    def __init__(self, value: float = 0.9) -> None:
        self.set(value)

    def set(self, value: float) -> None:
        self._value = check_tau(value)

    def get(self) -> float:
        return self._value


@dataclass(frozen=True)
class RunStats(Rates):
    """A finished run's totals and rates (metrics.Rates), and why it finished."""

    finish_reason: str = "length"  # "eos", "stop" or "length"


@dataclass(frozen=True)
class StepEvent:
    """One forward pass: the tokens it accepted, their text and confidences, the tau in force."""

    index: int
    token_ids: tuple[int, ...]
    pieces: tuple[str, ...]  # text of each accepted token ("" for special tokens)
    confidences: tuple[float, ...]
    tau: float
    seconds: float
    stats: RunStats | None = None  # totals, on the final event only
    origins: tuple[str, ...] = ()  # per token: exact.AR, exact.DRAFT (verified) or exact.MASK (confidence)
    width: int = 0  # tokens the pass fed past the newest accepted one, plus one (1: an AR pass)
    # candidate trees (DecodeConfig.tree) only: per token the rank of the tree node it was among its mask's
    # candidates (0: the top guess; tree.NOT_A_NODE for AR's token and masks), and the shape the pass verified
    branches: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def done(self) -> bool:
        return self.stats is not None


@dataclass
class Generation:
    """A finished run, collected from its events."""

    steps: list[StepEvent] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(step.text for step in self.steps)

    @property
    def token_ids(self) -> list[int]:
        return [t for step in self.steps for t in step.token_ids]

    @property
    def stats(self) -> RunStats:
        return self.steps[-1].stats


def collect(events: Iterable[StepEvent]) -> Generation:
    return Generation(list(events))


@dataclass(frozen=True)
class _Pass:
    tokens: list[int]
    confidences: list[float]
    tau: float
    seconds: float
    finish: str | None
    origins: list[str]
    cached: int  # the cache's length after the pass (a 0-d tensor for a static cache: read it, it syncs)
    width: int = 0  # as StepEvent.width
    branches: list[int] = field(default_factory=list)  # as StepEvent.branches
    shape: tuple[int, ...] = ()  # as StepEvent.shape


def eos_ids(backend: Backend, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = backend.model.generation_config.eos_token_id
    found = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        found.add(tokenizer.eos_token_id)
    return found


def context_limit(backend: Backend) -> int:
    return int(getattr(backend.config, "max_position_embeddings", None) or 1 << 30)


def check_prompt(backend: Backend, n_prompt: int, window: int) -> None:
    if n_prompt == 0:
        raise ValueError("the prompt is empty")
    limit = context_limit(backend)
    if n_prompt + window > limit:
        raise ValueError(f"the prompt is {n_prompt} tokens; this model's context is {limit} tokens")


def forward_window(backend: Backend, cache: KVCache, fed: torch.Tensor, window: int, steady: bool = False):
    """Run one cached forward pass over ``fed`` (1, n); logits (window, vocab) of its last ``window`` positions.

    ``steady``: a pass after the prefill (base.Backend.forward).
    """
    return backend.forward(fed, cache, keep=window, steady=steady)[0]


def capped_width(window: int, fed_tokens: int, max_fed: int) -> int:
    """Candidates of a pass that feeds ``fed_tokens`` accepted tokens under the cap ``max_fed`` (>= 2)."""
    return min(window, max(2, max_fed - fed_tokens + 1))


def steady_shapes(window: int, max_fed: int | None) -> set[tuple[int, int]]:
    """(tokens fed, logits kept) of every steady pass of AR and of MARS with no width controller (``mars_pass``):
    AR's one token, and a MARS pass's accepted tokens, 1 to ``window``, with its masks under ``max_fed``."""
    shapes = {(1, 1)}
    for accepted in range(1, window + 1):
        width = window if max_fed is None else capped_width(window, accepted, max_fed)
        shapes.add((accepted + width - 1, width))
    return shapes


def lookahead(window: int, verifying: bool) -> int:
    """Positions a pass may use past the newest committed token: B - 1 masks, or drafts + masks when verifying."""
    return 2 * window - 1 if verifying else window


def forward_fed(backend: Backend, cache: KVCache, fed: exact.Fed) -> torch.Tensor:
    """One cached verifying pass; logits (keep, vocab)."""
    return backend.forward(fed.ids, cache, positions=fed.position_ids, mask=fed.attention_mask, keep=fed.keep)[0]


def verify_pass(
    backend: Backend, cache: KVCache, pending: list[int], drafts: list[int], lookahead: int, mask_id: int,
    tau: float, metric: str, fallback: bool = True, rule: speculative.Rule | None = None,
    proposal: torch.Tensor | None = None,
) -> tuple[exact.Verdict, int]:
    """One verifying pass (exact.py): check the drafts, draft again, crop what is not kept off the cache.

    ``rule``: at a temperature, the drafts (drawn from ``proposal``) are checked by speculative sampling.
    Returns the verdict and the pass's width (StepEvent.width: the columns fed past the pending tokens, plus one).
    """
    fed = exact.verify_window(
        pending, drafts, lookahead, mask_id, cache.get_seq_length(), backend.dtype, backend.device,
        fallback=fallback,
    )
    logits = forward_fed(backend, cache, fed)
    if rule is None or rule.sampling.greedy:
        verdict = exact.verify(logits, drafts, lookahead, tau, metric)
    else:
        verdict = rule.verify(logits, drafts, lookahead, tau, metric, proposal)
    cache.crop(fed.width - len(pending) - verdict.cached)  # rejected drafts and both mask groups
    return verdict, fed.width - len(pending) + 1


def mars_pass(
    backend: Backend, cache: KVCache, pending: list[int], masks: torch.Tensor, tau: float, metric: str,
    sampling: Sampling, generator: SeededGenerator, max_fed: int | None, steady: bool = False, width: int | None = None,
) -> tuple[list[int], list[float], int]:
    """One MARS pass: feed [pending | masks], accept the confident prefix, drop the masks off the cache.

    Returns the accepted tokens, their confidences and the pass's width (candidates offered).

    At tau = 1.0 only candidate 1 can be accepted, so the masks are skipped (a plain AR pass).
    ``width`` (candidates, the width controller's choice) overrides the window and ``max_fed``.
    Inputs go where ``masks`` is (the first layer's device); sampling happens on the logits' device.
    """
    if width is None:
        width = 1 if tau >= 1.0 else masks.shape[1] + 1
        if width > 1 and max_fed is not None:
            width = capped_width(width, len(pending), max_fed)
    width = 1 if tau >= 1.0 else width
    fed = torch.cat([torch.tensor([pending], dtype=torch.long, device=masks.device), masks[:, : width - 1]], dim=1)
    logits = forward_window(backend, cache, fed, width, steady)
    tokens, confs = accept_prefix(
        logits, tau, metric, sampling.temperature, generator.on(logits.device), sampling.top_p, sampling.top_k
    )
    cache.crop(width - 1)  # accepted tokens are fed next pass
    return tokens, confs, width


@torch.inference_mode()
def decode_passes(
    backend: Backend,
    prompt: list[int],
    config: DecodeConfig,
    *,
    window: int,
    mask_id: int,
    tau: LiveTau,
    stop_ids: set[int],
    widths: OneRow | None = None,
) -> Iterator[_Pass]:
    """The decoding loop in token space under ``config``; ``window`` = 1 is plain AR decoding. The cache is local.

    Exact and hybrid modes: the masks' guesses that tau does not accept become drafts that the next pass
    verifies (exact.py; at a temperature by the rule, speculative.py; tau = 1.0 is lossless). ``config.max_fed``
    caps the tokens fed after the prefill of a MARS pass; ``widths`` (width.py) instead prices each MARS pass's
    width on the cost curve.
    """
    verifying, metric = config.mode in VERIFYING_MODES, config.metric
    max_fed, max_new_tokens = resolve_max_fed(config.max_fed, backend.compute), config.max_new_tokens
    check_prompt(backend, len(prompt), lookahead(window, verifying))
    max_new_tokens = min(max_new_tokens, context_limit(backend) - len(prompt) - lookahead(window, verifying) + 1)
    generator = SeededGenerator(config.seed)
    rule = speculative.Rule(Sampling(config.temperature, config.top_p, config.top_k), generator)
    masks = torch.full((1, window - 1), mask_id, dtype=torch.long, device=backend.device)
    # verifying passes take 4-D masks, which a compiled backend's static cache does not: no size for it
    cache = backend.new_cache(None if verifying else len(prompt) + max_new_tokens + window)
    pending = [*prompt]  # fed next pass, not yet in the cache: the prompt first, then the tokens accepted last pass
    verifier = verifier_for(backend, config, window, mask_id, rule) if verifying else None
    history, produced = [*prompt], 0  # every committed token (where exact mode looks up drafts), their count
    while True:
        tau_now = tau.get()
        started = time.perf_counter()
        if verifier is not None:
            verdict, width, shape = verifier.step(backend, cache, pending, history, tau_now, metric)
            tokens, confs, origins, branches = verdict.tokens, verdict.confidences, verdict.origins, verdict.branches
            pending = tokens[verdict.cached :]
        else:
            chosen = widths.choose(tau_now, max_new_tokens - produced, len(pending), produced) if widths else None
            tokens, confs, width = mars_pass(backend, cache, pending, masks, tau_now, metric, rule.sampling,
                                             generator, max_fed if produced else None, produced > 0, chosen)
            if chosen is not None:
                widths.observe(tau_now, chosen, len(tokens))
            origins, branches, shape = [exact.AR] + [exact.MASK] * (len(tokens) - 1), [], ()
            pending = tokens
        tokens, finish = commit_tokens(tokens, max_new_tokens - produced, stop_ids)
        produced += len(tokens)
        history += tokens
        seconds, n = time.perf_counter() - started, len(tokens)
        yield _Pass(tokens, confs[:n], tau_now, seconds, finish, origins[:n], cache.get_seq_length(), width,
                    branches[:n], shape)
        if finish:
            return


@dataclass
class ChainRun:
    """A run's chain verification (exact.py): the next drafts, at a temperature their q, and DraftDepth."""

    depths: exact.DraftDepth
    window: int  # B
    mask_id: int
    rule: speculative.Rule
    drafts: list[int] = field(default_factory=list)  # guesses for the tokens after the pending ones
    proposal: torch.Tensor | None = None

    def step(
        self, backend: Backend, cache: KVCache, pending: list[int], history: list[int], tau: float, metric: str
    ) -> tuple[exact.Verdict, int, tuple[int, ...]]:
        """One verifying pass; its verdict, width and shape (a chain: one 1 per draft)."""
        # Exact passes take the layout that pays on this machine; hybrid ones keep the window for the masks.
        # (One sequence's layouts all feed masks beside their drafts: the chain's default kinds.)
        layout = self.depths.layout() if tau >= 1.0 else exact.Layout(self.window - 1, True)
        depth, fallback, _ = layout
        drafts, proposal = speculative.pick_drafts(history, self.drafts, self.proposal, depth, tau >= 1.0)
        verdict, width = verify_pass(backend, cache, pending, drafts, depth, self.mask_id, tau, metric, fallback,
                                     self.rule, proposal)
        self.depths.observe(len(drafts), verdict.cached)
        if tau >= 1.0 and depth and self.depths.costs:  # a drafting layout the model weighed
            self.depths.observe_yield(layout, len(verdict.tokens))
        self.drafts, self.proposal = verdict.drafts, verdict.proposal
        return verdict, width, (1,) * len(drafts)


def verifier_for(backend: Backend, config: DecodeConfig, window: int, mask_id: int, rule: speculative.Rule):
    """A verifying run's passes: a chain (ChainRun), or candidate trees (tree.TreeRun) where ``config.tree`` asks."""
    shape, costs = parse_tree(config.tree), backend.costs_ms()
    if shape is None:
        return ChainRun(exact.DraftDepth(window - 1, costs), window, mask_id, rule)
    fixed = None if shape == "auto" else shape
    return tree.TreeRun(TreeShape(window - 1, costs, fixed), window, mask_id, rule)


class Detokenizer:
    """Incremental detokenisation: the text each new token adds, holding back split characters."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window decoded with each new token
        self.read = 0  # tokens whose text has been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever was held back (a character split at the very end)."""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.read = len(self.ids)
        return after[len(before) :]


def stream(
    backend: Backend,
    tokenizer: PreTrainedTokenizerBase,
    prompt: list[int],
    config: DecodeConfig,
    *,
    mask_id: int,
    block_size: int,
    tau: LiveTau | None = None,
) -> Iterator[StepEvent]:
    """Decode token ids ``prompt`` under ``config``, one StepEvent per forward pass.

    Raises ValueError at once (not at the first pass) for an empty or over-long prompt.
    """
    window = 1 if config.mode == "ar" else (config.block_size or block_size)
    verifying = config.mode in VERIFYING_MODES
    check_prompt(backend, len(prompt), lookahead(window, verifying))
    if config.mode == "exact":
        tau = LiveTau(1.0)  # lossless: only verified tokens are committed, whatever a live tau says
    passes = decode_passes(
        backend, prompt, config, window=window, mask_id=mask_id, tau=tau or LiveTau(config.tau),
        stop_ids=eos_ids(backend, tokenizer), widths=width_controller(backend, config, window),
    )
    return _events(passes, Detokenizer(tokenizer), config.stop)


def width_controller(backend: Backend, config: DecodeConfig, window: int) -> OneRow | None:
    """MARS with ``max_fed`` "auto" on a measured CPU path: each pass's width priced on the path's cost curve."""
    costs = backend.costs_ms()
    if config.mode != "mars" or config.max_fed != "auto" or costs is None or len(costs) < 2:
        return None
    return OneRow(WidthController(Surface.from_curve(costs), window))


def _events(passes: Iterator[_Pass], detok: Detokenizer, stops: tuple[str, ...]) -> Iterator[StepEvent]:
    """Turn token-space passes into StepEvents: text pieces, stop strings, running totals."""
    emitted, tokens, seconds = "", 0, 0.0
    for index, step in enumerate(passes):
        pieces = [detok.push(t) for t in step.tokens]
        finish = step.finish
        keep = cut_at_stop_string(pieces, emitted, stops)
        if keep is not None:
            step.tokens[keep:], pieces[keep:], finish = [], [], "stop"
        elif finish and pieces:
            pieces[-1] += detok.flush()
        emitted += "".join(pieces)
        tokens += len(step.tokens)
        seconds += step.seconds
        stats = RunStats(tokens, index + 1, seconds, finish) if finish else None
        yield StepEvent(
            index=index,
            token_ids=tuple(step.tokens),
            pieces=tuple(pieces),
            confidences=tuple(step.confidences[: len(step.tokens)]),
            tau=step.tau,
            seconds=step.seconds,
            stats=stats,
            origins=tuple(step.origins[: len(step.tokens)]),
            width=step.width,
            branches=tuple(step.branches[: len(step.tokens)]),
            shape=step.shape,
        )
        if finish:
            return


def generate(
    lm: LoadedModel, prompt: str | list[dict], config: DecodeConfig = DecodeConfig(), tau: LiveTau | None = None
) -> Iterator[StepEvent]:
    """Apply the chat template to ``prompt`` (text or messages) and stream its decoding."""
    if isinstance(prompt, str) and not prompt.strip():
        raise ValueError("the prompt is empty")
    return stream_ids(lm, prompt_ids(lm.tokenizer, prompt), config, tau)


def stream_ids(
    lm: LoadedModel, ids: list[int], config: DecodeConfig = DecodeConfig(), tau: LiveTau | None = None
) -> Iterator[StepEvent]:
    """Stream the decoding of token ids ``ids`` (chat template already applied) with a loaded model."""
    return stream(
        lm.backend, lm.tokenizer, ids, config, mask_id=lm.meta.mask_token_id, block_size=lm.meta.block_size, tau=tau
    )
