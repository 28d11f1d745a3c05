"""One frozen, validated setting per decoding run.

The CLI flags and the UI sliders read their defaults and ranges from here, so a
value outside them is refused in one place, with one message.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

from .sampling import Sampling, check_temperature, check_top_k, check_top_p
from .tree_shape import parse_tree

Mode = Literal["mars", "ar", "exact", "hybrid"]
Metric = Literal["probability", "entropy", "margin"]
MODES: tuple[str, ...] = ("mars", "ar", "exact", "hybrid")
# Modes whose unaccepted mask guesses become drafts the next pass verifies (docs/METHOD.md, "Exact and hybrid modes").
VERIFYING_MODES: tuple[str, ...] = ("exact", "hybrid")
METRICS: tuple[str, ...] = ("probability", "entropy", "margin")

# (minimum, maximum, step) for the numeric settings; the UI builds its sliders from these.
RANGES: dict[str, tuple[float, float, float]] = {
    "tau": (0.0, 1.0, 0.01),
    "block_size": (1, 16, 1),
    "max_new_tokens": (1, 2048, 1),
    "temperature": (0.0, 2.0, 0.05),
    "top_p": (0.05, 1.0, 0.05),  # a slider's range; any value above 0 and at most 1 is accepted (1: off)
    "top_k": (0, 200, 1),  # 0: off; any whole number of at least 0 is accepted
}


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode one prompt.

    mode: "mars" (accept confident candidates), "ar" (one token per pass), "exact" (the
      masks' guesses are drafts the next pass verifies: greedy AR's output in fewer
      passes; tau is not read) or "hybrid" (confident candidates accepted as in "mars",
      the rest verified as in "exact"; tau = 1.0 is "exact"). See docs/METHOD.md, "Exact and hybrid modes".
      At a temperature, exact mode checks drafts by the speculative-sampling rule, so its output is
      distributed as AR sampling's (docs/METHOD.md, "Sampling without loss").
    tau: acceptance threshold read at the start of the run (a live source may change it
      between passes); 1.0 means one token per pass, whatever the metric.
    block_size: candidates per pass (B); None takes the checkpoint's.
    metric: probability of the chosen token >= tau, entropy <= tau (nats), or
      top1 - top2 probability margin >= tau.
    temperature: 0 is greedy; above 0 samples (MARS and AR: Gumbel-max noise; exact and hybrid: the rule).
    top_p, top_k: above temperature 0, draw only from the smallest set of most likely tokens whose
      probability reaches top_p (1: off), and only from the top_k most likely (0: off); confidence
      is read before them. sampling.py.
    stop: strings that end the output; the output ends with the stop string, as in transformers.
    max_fed: how wide a MARS pass is, for CPUs where a pass's cost grows with its width. "auto":
      each pass's width priced on the model's measured CPU compute path (decoding/width.py; batches:
      on the cost surface), the full window where nothing is measured. None: the paper's full
      window. An integer N: at most N tokens fed (last pass's tokens + masks; at least one mask;
      the prefill always gets B-1). docs/METHOD.md, "Width".
    tree: exact and hybrid modes only (other modes do not read it): None verifies a chain of drafts (the
      masks' top guesses; exact.DraftDepth picks its depth), "auto" a tree of the masks' candidates whose
      shape is chosen before every pass by expected tokens per ms (tree_shape.TreeShape: a chain where
      width costs), a shape "2,1,1" that tree always (b_d candidates per depth). At a temperature, exact mode
      only (recursive rejection; hybrid is refused). docs/METHOD.md, "Candidate trees".
    """

    mode: Mode = "mars"
    tau: float = 0.9
    block_size: int | None = None
    max_new_tokens: int = 256
    metric: Metric = "probability"
    temperature: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    max_fed: int | Literal["auto"] | None = "auto"
    top_p: float = 1.0
    top_k: int = 0
    tree: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        check_tau(self.tau)
        if self.block_size is not None and (int(self.block_size) != self.block_size or self.block_size < 1):
            raise ValueError(f"block size must be an integer of at least 1, got {self.block_size}")
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ValueError(f"max new tokens must be an integer of at least 1, got {self.max_new_tokens}")
        check_temperature(self.temperature, RANGES["temperature"][1])
        check_top_p(self.top_p)
        check_top_k(self.top_k)
        if self.max_fed not in (None, "auto") and (
            not isinstance(self.max_fed, int) or isinstance(self.max_fed, bool) or self.max_fed < 2
        ):
            raise ValueError(f"max fed must be 'auto', None or an integer of at least 2, got {self.max_fed!r}")
        parse_tree(self.tree)
        if self.tree is not None and self.temperature > 0 and self.mode == "hybrid":
            raise ValueError("candidate trees at a temperature: exact mode only (hybrid verifies chains there)")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a tuple of non-empty strings")

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k)

    def with_(self, **changes) -> DecodeConfig:
        """A copy with some fields changed, validated again; unknown names are an error."""
        names = {f.name for f in fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise TypeError(f"unknown decode setting(s): {', '.join(sorted(unknown))}")
        return replace(self, **changes)


def resolve_max_fed(max_fed: int | str | None, compute) -> int | None:
    """The cap a config's ``max_fed`` means on ``compute`` (a measured compute path, or None): "auto" is its cap."""
    if max_fed == "auto":
        return compute.max_fed if compute is not None else None
    return max_fed


def check_tau(tau: float) -> float:
    if not isinstance(tau, (int, float)) or not 0.0 <= float(tau) <= 1.0:
        raise ValueError(f"tau must be between 0 and 1, got {tau}")
    return float(tau)
