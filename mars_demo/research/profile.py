"""Where a batch-1 pass spends its time: the model body, the LM head, and the rest (``bench``'s profile)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..engine.backends.cpu.backend import CpuBackend
from ..engine.decoding.config import DecodeConfig, resolve_max_fed
from ..engine.decoding.loop import stream_ids
from ..engine.decoding.metrics import per_forward
from ..engine.model import LoadedModel

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; annotations are not evaluated at run time


def sync(model: PreTrainedModel) -> None:
    """On a GPU, wait for the queued work (so a clock charges it to the part that queued it)."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


class PassClock:
    """Forward hooks timing the model body (embeddings + layers) and the LM head across passes."""

    def __init__(self, lm: LoadedModel) -> None:
        model = self.model = lm.model
        backend = lm.backend
        self.lean = backend.lean if isinstance(backend, CpuBackend) else None  # it takes a clock, not hooks
        self.parts = {"forward_body": model.get_decoder(), "lm_head": model.get_output_embeddings()}
        self.seconds = dict.fromkeys(self.parts, 0.0)
        self._started: dict[str, float] = {}
        self._handles: list = []

    def _pre(self, name: str):
        def hook(*_):
            sync(self.model)  # on a GPU, charge queued work to the part that queued it
            self._started[name] = time.perf_counter()
        return hook

    def _post(self, name: str):
        def hook(*_):
            sync(self.model)
            self.seconds[name] += time.perf_counter() - self._started.pop(name)
        return hook

    def __enter__(self) -> Self:
        if self.lean is not None:  # the CPU engine calls neither module: it takes a clock instead
            marks = {name: (self._pre(name), self._post(name)) for name in self.parts}
            self.lean.clock = lambda name, starting: marks[name][0 if starting else 1]()
            return self
        for name, module in self.parts.items():
            self._handles += [
                module.register_forward_pre_hook(self._pre(name)), module.register_forward_hook(self._post(name))
            ]
        return self

    def __exit__(self, *_) -> None:
        if self.lean is not None:
            self.lean.clock = None
        for handle in self._handles:
            handle.remove()


def profile_passes(
    lm: LoadedModel, prompts: list[list[int]], tau: float, block_size: int, max_new_tokens: int,
    *, max_fed: int | str | None = "auto", limit: int = 4, progress: bool = False,
) -> dict:
    """Where a batch-1 pass spends its time: model body, LM head, and the rest (acceptance, cache crop, host).

    MARS at ``tau`` (as benchmarked, and with the paper's full window if that differs) and the
    AR decoder, on the first ``limit`` prompts; milliseconds per pass.
    """
    profile: dict = {"tau": tau, "block_size": block_size, "prompts": min(limit, len(prompts))}
    variants = [("mars", "mars", max_fed), ("ar", "ar", None)]
    if resolve_max_fed(max_fed, lm.compute) is not None:
        variants.insert(1, ("mars_full_window", "mars", None))
    for name, mode, cap in variants:
        config = DecodeConfig(mode=mode, tau=tau, block_size=block_size, max_new_tokens=max_new_tokens, max_fed=cap)
        passes = tokens = 0
        seconds = 0.0
        with PassClock(lm) as clock:
            for ids in tqdm(prompts[:limit], desc=f"profile {name}", disable=not progress, leave=False):
                for event in stream_ids(lm, ids, config.with_(block_size=block_size)):
                    passes, tokens, seconds = passes + 1, tokens + len(event.token_ids), seconds + event.seconds
        parts = {**clock.seconds, "acceptance_and_host": max(seconds - sum(clock.seconds.values()), 0.0)}
        profile[name] = {
            "passes": passes,
            "tokens_per_forward": round(per_forward(tokens, passes), 4),
            "ms_per_pass": {k: round(1000 * v / max(passes, 1), 4) for k, v in parts.items()}
            | {"total": round(1000 * seconds / max(passes, 1), 4)},
            "share": {k: round(v / seconds, 4) if seconds > 0 else 0.0 for k, v in parts.items()},
        }
    return profile
