"""Quality and speed of MARS against its own tau = 1.0 output, the AR decoder and the base model.

Every prompt is decoded by the AR decoder (mode "ar"), by MARS at tau = 1.0 (the
reference output) and by MARS at each other tau, in that order, prompt after prompt,
so that machine load falls on all of them alike; one warm-up decode of each mode
comes first. All decoding is greedy. Figures per tau, pooled over the prompts, are
those of engine/decoding/metrics.py (``DEFINITIONS`` below says each in a line, and goes into
the JSON report); besides them:

  time_ratio          sum of AR seconds / sum of MARS seconds on the same prompts
                      (each decoder's own timer); ``speedup`` is the tokens/s ratio.
  extra_ar_match      share of the extra-accepted tokens (the 2nd, 3rd, ... token of a
                      pass) that equal the evaluated model's argmax given the accepted
                      prefix, i.e. that AR would also have chosen there; read from one
                      teacher-forced pass over prompt + output. 1.0 when a tau accepts
                      no extra token (``extra_tokens`` = 0 says so). ``by_position``
                      gives the same share per in-pass position.
  repeated_ngrams     share of the outputs' token 4-grams that already occurred earlier in
                      the same output, pooled: loops lower the NLL, so read dNLL beside it.
Once per run: tau1_vs_base_nll (the base-scored NLL of the tau = 1.0 outputs minus that
of the base model's own greedy outputs) and base_argmax_agreement (the share of the
base's greedy output tokens that the evaluated model's teacher-forced argmax reproduces).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from ..engine.backends.base import Backend
from ..engine.decoding.chat import prompt_ids
from ..engine.decoding.config import DecodeConfig, check_tau, resolve_max_fed
from ..engine.decoding.loop import collect, stream_ids
from ..engine.decoding.metrics import REFERENCE_TAU, Rates, agreement, exact_match, prefix_agreement, speedup
from ..engine.decoding.metrics import pooled_nll as pooled
from ..engine.decoding.scoring import Scored, teacher_forced
from ..engine.model import LoadedModel

logger = logging.getLogger(__name__)

NGRAM = 4  # repeated_ngrams counts token 4-grams
# Written into the JSON report so that it explains itself.
DEFINITIONS = {
    "tokens_per_forward": "total tokens / total forward passes, over the prompts",
    "tokens_per_second": "total tokens / total seconds of the decoder's own passes, over the prompts",
    "speedup": "tokens_per_second / that of the AR decoder on the same prompts (runs interleaved per prompt)",
    "time_ratio": "sum of AR decoder seconds / sum of MARS seconds on the same prompts",
    "extra_ar_match": "share of tokens beyond the first of each pass that equal the evaluated model's "
    "teacher-forced argmax given the accepted prefix; 1.0 when extra_tokens is 0",
    "by_position": "the same share per in-pass position (1 = the AR token of the pass)",
    "agreement": "mean over prompts of common prefix with the tau=1.0 output / length of the longer of the two",
    "exact_match": "share of prompts whose output equals the tau=1.0 output",
    "nll_base": "NLL per token under the base model, teacher-forced, token-weighted over prompts",
    "nll_self": "NLL per token under the evaluated model itself, teacher-forced, token-weighted over prompts",
    "delta_nll_base": "nll_base of this tau's outputs minus nll_base of the tau=1.0 outputs",
    "delta_nll_self": "nll_self of this tau's outputs minus nll_self of the tau=1.0 outputs",
    "repeated_ngrams": f"share of token {NGRAM}-grams that repeat an earlier one in the same output, pooled",
    "tau1_vs_base_nll": "nll_base of the tau=1.0 outputs minus nll_base of the base model's own greedy outputs",
    "base_argmax_agreement": "share of the base's greedy output tokens equal to the evaluated model's "
    "teacher-forced argmax at that position",
}
DEFAULT_TAUS = (1.0, 0.95, 0.9, 0.8, 0.7)
WARMUP_TOKENS = 8


# --- metric functions: pure, on token ids -----------------------------------------------


def mean_nll(backend: Backend, prompt: Sequence[int], output: Sequence[int]) -> float:
    """NLL per token of ``output`` given ``prompt`` under ``backend``'s model, teacher-forced."""
    if not output:
        raise ValueError("the NLL per token of an empty output is undefined")
    scored = teacher_forced(backend, prompt, output)
    return scored.total / scored.tokens


def pooled_nll(scores: Sequence[Scored]) -> float:
    """Token-weighted NLL per token over several outputs (metrics.pooled_nll): sum of token NLLs / total tokens."""
    return pooled((s.total, s.tokens) for s in scores)


def repeated_ngrams(output: Sequence[int], n: int = NGRAM) -> tuple[int, int]:
    """(n-grams that occurred earlier in ``output``, all n-grams of ``output``)."""
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for i in range(len(output) - n + 1):
        gram = tuple(output[i : i + n])
        repeats += gram in seen
        seen.add(gram)
    return repeats, max(len(output) - n + 1, 0)


def repetition(outputs: Sequence[Sequence[int]]) -> float:
    """Pooled share of repeated n-grams over several outputs (0.0 when none has an n-gram)."""
    counts = [repeated_ngrams(o) for o in outputs]
    total = sum(n for _, n in counts)
    return sum(r for r, _ in counts) / total if total else 0.0


def argmax_agreement(scores: Sequence[Scored], outputs: Sequence[Sequence[int]]) -> float:
    """Share of the tokens of ``outputs`` that equal the teacher-forced argmax there (1.0 if no tokens)."""
    tokens = sum(len(o) for o in outputs)
    same = sum(a == t for s, o in zip(scores, outputs) for a, t in zip(s.argmax, o))
    return same / tokens if tokens else 1.0


def pass_positions(pass_lengths: Sequence[int]) -> list[int]:
    """In-pass position (1-based) of every output token, from the number of tokens each pass accepted.

    [3, 1, 2] -> [1, 2, 3, 1, 1, 2]: position 1 is the AR token of a pass, 2.. are its extras.
    """
    return [k for n in pass_lengths for k in range(1, n + 1)]


def ar_match(output: Sequence[int], argmax: Sequence[int], pass_lengths: Sequence[int]) -> dict[int, tuple[int, int]]:
    """Per in-pass position: (tokens that equal the AR argmax at their place, tokens), for positions that occur."""
    positions = pass_positions(pass_lengths)
    if not len(output) == len(argmax) == len(positions):
        raise ValueError(
            f"output ({len(output)}), argmax ({len(argmax)}) and passes ({len(positions)} tokens) disagree in length"
        )
    counts: dict[int, list[int]] = {}
    for token, best, position in zip(output, argmax, positions):
        slot = counts.setdefault(position, [0, 0])
        slot[0] += int(token == best)
        slot[1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(counts.items())}


def merge_counts(items: Sequence[dict[int, tuple[int, int]]]) -> dict[int, tuple[int, int]]:
    """Add up per-position (matched, total) counts, e.g. over prompts."""
    total: dict[int, tuple[int, int]] = {}
    for counts in items:
        for k, (m, n) in counts.items():
            m0, n0 = total.get(k, (0, 0))
            total[k] = (m0 + m, n0 + n)
    return dict(sorted(total.items()))


def extra_ar_match(counts: dict[int, tuple[int, int]]) -> tuple[float, int]:
    """(share of extra tokens, positions >= 2, that match AR; number of extra tokens); 1.0 when there are none."""
    matched = sum(m for k, (m, _) in counts.items() if k >= 2)
    extras = sum(n for k, (_, n) in counts.items() if k >= 2)
    return (matched / extras if extras else 1.0), extras


# --- the evaluation run ------------------------------------------------------------------


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate. tau = 1.0 is always run (it is the reference) and listed first."""

    taus: tuple[float, ...] = DEFAULT_TAUS
    max_new_tokens: int = 128
    block_size: int | None = None  # None: the checkpoint's
    warmup: bool = True
    max_fed: int | str | None = "auto"  # see DecodeConfig

    def __post_init__(self) -> None:
        if not self.taus:
            raise ValueError("choose at least one tau")
        for tau in self.taus:
            check_tau(tau)
        self.decode("mars")  # same checks as decoding

    @property
    def levels(self) -> tuple[float, ...]:
        """The taus to run: 1.0 first, then the rest from high to low, without repeats."""
        rest = sorted({float(t) for t in self.taus} - {REFERENCE_TAU}, reverse=True)
        return (REFERENCE_TAU, *rest)

    def decode(self, mode: str, tau: float = REFERENCE_TAU) -> DecodeConfig:
        return DecodeConfig(
            mode=mode, tau=tau, block_size=self.block_size, max_new_tokens=self.max_new_tokens, max_fed=self.max_fed
        )


@dataclass(frozen=True)
class Decoded:
    """One prompt decoded once: its tokens, how many each pass accepted, and the decoder's seconds."""

    token_ids: tuple[int, ...]
    pass_lengths: tuple[int, ...]
    seconds: float
    text: str
    finish_reason: str

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def forward_passes(self) -> int:
        return len(self.pass_lengths)

    @property
    def rates(self) -> Rates:
        return Rates(self.tokens, self.forward_passes, self.seconds)


def decode(lm: LoadedModel, ids: list[int], config: DecodeConfig) -> Decoded:
    result = collect(stream_ids(lm, ids, config))
    return Decoded(
        token_ids=tuple(result.token_ids),
        pass_lengths=tuple(len(s.token_ids) for s in result.steps),
        seconds=result.stats.seconds,
        text=result.text,
        finish_reason=result.stats.finish_reason,
    )


@dataclass
class Runs:
    """Every decode of an evaluation, prompt i at index i."""

    ar: list[Decoded] = field(default_factory=list)
    mars: dict[float, list[Decoded]] = field(default_factory=dict)
    base: list[Decoded] = field(default_factory=list)  # the base model's own greedy output


def same_tokenizer(a: LoadedModel, b: LoadedModel) -> bool:
    return a.tokenizer is b.tokenizer or a.tokenizer.get_vocab() == b.tokenizer.get_vocab()


def decode_all(
    lm: LoadedModel, base: LoadedModel, prompts: list[list[int]], config: EvalConfig, progress: bool = True
) -> Runs:
    """AR, tau = 1.0 and every tau, interleaved per prompt; then the base model's greedy outputs."""
    runs = Runs(mars={tau: [] for tau in config.levels})
    if config.warmup:
        short = DecodeConfig(
            mode="ar", max_new_tokens=min(WARMUP_TOKENS, config.max_new_tokens), block_size=config.block_size
        )
        decode(lm, prompts[0], short)
        decode(lm, prompts[0], short.with_(mode="mars", tau=min(config.levels)))
    total = len(prompts) * (1 + len(config.levels)) + (0 if base is lm else len(prompts))
    with tqdm(total=total, desc="decode", disable=not progress) as bar:
        for ids in prompts:
            runs.ar.append(decode(lm, ids, config.decode("ar")))
            bar.update(1)
            for tau in config.levels:
                runs.mars[tau].append(decode(lm, ids, config.decode("mars", tau)))
                bar.update(1)
        if base is lm:
            runs.base = list(runs.ar)  # the AR decoder is the evaluated model's greedy decoding
        else:
            for ids in prompts:
                runs.base.append(decode(base, ids, config.decode("ar")))
                bar.update(1)
    return runs


class Scorer:
    """teacher_forced, memoised per (prompt, output): many taus give the same output."""

    def __init__(self, backend: Backend, prompts: list[list[int]]) -> None:
        self.backend, self.prompts = backend, prompts
        self.memo: dict[tuple[int, tuple[int, ...]], Scored] = {}

    def __call__(self, index: int, output: Sequence[int]) -> Scored:
        key = (index, tuple(output))
        if key not in self.memo:
            self.memo[key] = teacher_forced(self.backend, self.prompts[index], output)
        return self.memo[key]


def score_all(runs: Runs, own: Scorer, base: Scorer, progress: bool = True) -> None:
    """Fill both scorers' memos: the evaluated model scores MARS outputs, the base scores those and its own."""
    jobs = [(own, i, r.token_ids) for mine in [*runs.mars.values(), runs.base] for i, r in enumerate(mine)]
    jobs += [(base, i, r.token_ids) for mine in [*runs.mars.values(), runs.base] for i, r in enumerate(mine)]
    todo = list(dict.fromkeys(job for job in jobs if (job[1], job[2]) not in job[0].memo))
    for scorer, i, output in tqdm(todo, desc="score", disable=not progress):
        scorer(i, output)


def tau_row(
    tau: float, runs: list[Decoded], ar: list[Decoded], reference: list[Decoded], own: list[Scored], base: list[Scored],
    reference_nll: dict[str, float],
) -> dict:
    """The pooled figures of one tau (see DEFINITIONS); ``own`` and ``base`` score ``runs`` with each model."""
    rates, ar_rates = Rates.pool(r.rates for r in runs), Rates.pool(r.rates for r in ar)
    counts = merge_counts([ar_match(r.token_ids, s.argmax, r.pass_lengths) for r, s in zip(runs, own)])
    match, extras = extra_ar_match(counts)
    outputs, references = [r.token_ids for r in runs], [r.token_ids for r in reference]
    nll = {"base": pooled_nll(base), "self": pooled_nll(own)}
    return {
        "tau": tau,
        "tokens": rates.tokens,
        "forward_passes": rates.forward_passes,
        "tokens_per_forward": rates.tokens_per_forward,
        "seconds": rates.seconds,
        "tokens_per_second": rates.tokens_per_second,
        "speedup": speedup(rates, ar_rates),
        "time_ratio": ar_rates.seconds / rates.seconds if rates.seconds > 0 else None,
        "extra_tokens": extras,
        "extra_ar_match": match,
        "by_position": [{"position": k, "tokens": n, "ar_match": m / n} for k, (m, n) in counts.items()],
        "agreement": agreement(outputs, references),
        "exact_match": exact_match(outputs, references),
        **{f"nll_{who}": value for who, value in nll.items()},
        **{f"delta_nll_{who}": value - reference_nll[who] for who, value in nll.items()},
        "repeated_ngrams": repetition(outputs),
    }


def summarise(runs: Runs, own: Scorer, base: Scorer, texts: list[str]) -> dict:
    """Score every output and pool the figures; ``own`` scores with the evaluated model, ``base`` with the base."""
    reference = runs.mars[REFERENCE_TAU]
    ref_nll = pooled_nll([base(i, r.token_ids) for i, r in enumerate(reference)])
    ref_nll_self = pooled_nll([own(i, r.token_ids) for i, r in enumerate(reference)])
    base_nll = pooled_nll([base(i, r.token_ids) for i, r in enumerate(runs.base)])
    rows = []
    for tau, mine in runs.mars.items():
        own_scores = [own(i, r.token_ids) for i, r in enumerate(mine)]
        base_scores = [base(i, r.token_ids) for i, r in enumerate(mine)]
        rows.append(tau_row(tau, mine, runs.ar, reference, own_scores, base_scores,
                            {"base": ref_nll, "self": ref_nll_self}))
    ar = Rates.pool(r.rates for r in runs.ar)
    return {
        "prompts": len(texts),
        "ar": {"tokens": ar.tokens, "forward_passes": ar.forward_passes, "seconds": ar.seconds,
               "tokens_per_second": ar.tokens_per_second},
        "tau1_equals_ar": sum(r.token_ids == a.token_ids for r, a in zip(reference, runs.ar)) / len(texts),
        "tau1_nll": ref_nll,
        "base_greedy_nll": base_nll,
        "tau1_vs_base_nll": ref_nll - base_nll,
        "base_argmax_agreement": argmax_agreement(
            [own(i, r.token_ids) for i, r in enumerate(runs.base)], [r.token_ids for r in runs.base]
        ),
        "base_greedy_repeated_ngrams": repetition([r.token_ids for r in runs.base]),
        "taus": rows,
        "per_prompt": [
            {
                "prompt": text,
                "ar": _run_record(runs.ar[i]),
                "base_greedy": _run_record(runs.base[i]),
                "mars": {str(tau): _run_record(mine[i], reference[i]) for tau, mine in runs.mars.items()},
            }
            for i, text in enumerate(texts)
        ],
    }


def _run_record(run: Decoded, reference: Decoded | None = None) -> dict:
    record = {
        "text": run.text,
        "token_ids": list(run.token_ids),
        "pass_lengths": list(run.pass_lengths),
        "seconds": run.seconds,
        "finish_reason": run.finish_reason,
    }
    if reference is not None:
        record["agreement"] = prefix_agreement(run.token_ids, reference.token_ids)
    return record


def evaluate(
    lm: LoadedModel, base: LoadedModel, prompts: Sequence[str], config: EvalConfig = EvalConfig(), progress: bool = True
) -> dict:
    """Decode, score and summarise (see the module docstring). Pass ``base=lm`` to score with the model itself."""
    if not prompts:
        raise ValueError("no prompts to evaluate")
    if any(not p.strip() for p in prompts):
        raise ValueError("a prompt is empty")
    if not same_tokenizer(lm, base):
        raise ValueError(
            f"the base model {base.name!r} does not share the tokenizer of {lm.name!r}: NLLs would not compare"
        )
    ids = [prompt_ids(lm.tokenizer, p) for p in prompts]
    started = time.perf_counter()
    runs = decode_all(lm, base, ids, config, progress)
    logger.info("decoded %d prompts in %.1f s", len(ids), time.perf_counter() - started)
    own = Scorer(lm.backend, ids)
    scorer = own if base is lm else Scorer(base.backend, ids)
    score_all(runs, own, scorer, progress)
    report = summarise(runs, own, scorer, list(prompts))
    block = config.block_size or lm.meta.block_size
    return {
        "model": lm.name,
        "base": base.name,
        "block_size": block,
        "max_new_tokens": config.max_new_tokens,
        "max_fed": resolve_max_fed(config.max_fed, lm.compute),
        "device": str(lm.device),
        "dtype": str(lm.model.dtype).removeprefix("torch."),
        "definitions": DEFINITIONS,
        **report,
    }
