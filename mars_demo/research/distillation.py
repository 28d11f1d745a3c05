"""Training data for MARS: prompts the instruct model writes itself, and its own greedy answers.

Self-distillation keeps one-token behaviour intact (the targets are what the model
would say anyway) and makes future tokens learnable (they are the model's own
continuations). Prompts come from sampling the user turn of the chat template,
optionally opened with a few words that steer towards a kind of request, so the
set covers explanations, code, arithmetic, stories, emails and the rest.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..engine.decoding.chat import pad_id, prompt_ids, user_turn_prefix
from ..engine.model import LoadedModel

logger = logging.getLogger(__name__)

# Openers that steer the sampled user turn toward the kinds of request a demo should cover.
# The empty opener leaves the model free.
OPENERS = (
    "", "", "", "", "Explain", "How do I", "How can I", "What is", "What are", "Why does", "Why is",
    "Write a Python function", "Write a JavaScript function", "Write a SQL query",
    "Write a C++ program", "Write a bash script", "Write a Java method", "Fix this code:",
    "Write a short story", "Write a poem", "Write a haiku", "Write an email", "Write a letter",
    "Summarize", "Compare", "What's the difference between", "List", "Give me", "Give three tips",
    "Calculate", "Solve", "A farmer has", "If a train", "What is 17", "Translate", "Describe",
    "Can you help me", "What are the benefits of", "Create a recipe", "Suggest", "Tell me about",
    "Plan a", "Rewrite the following sentence", "Define", "Who was", "When did", "Outline",
    "Brainstorm", "Write a product description", "Write a tweet", "Should I", "Is it true that",
)


def _usable(text: str) -> bool:
    return 12 <= len(text) <= 600 and any(c.isalpha() for c in text) and "<|" not in text


@torch.no_grad()
def sample_prompts(
    lm: LoadedModel, count: int, *, seed: int = 0, batch_size: int = 32, max_tokens: int = 80
) -> list[str]:
    """``count`` distinct user requests written by the model itself (temperature 1, top-p 0.95)."""
    tok, model = lm.tokenizer, lm.model
    prefix = user_turn_prefix(tok)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seen: set[str] = set()
    prompts: list[str] = []
    with tqdm(total=count, desc="prompts") as bar:
        while len(prompts) < count:
            opener = rng.choice(OPENERS)
            ids = tok(prefix + opener, return_tensors="pt", add_special_tokens=False).input_ids
            ids = ids.to(model.device).repeat(batch_size, 1)  # same opener per batch: no padding
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_p=0.95,
                max_new_tokens=max_tokens, eos_token_id=tok.eos_token_id, pad_token_id=pad_id(tok),
            )
            for row in out[:, ids.shape[1]:].tolist():
                if tok.eos_token_id not in row:
                    continue  # cut off mid-request
                body = tok.decode(row[: row.index(tok.eos_token_id)], skip_special_tokens=True)
                text = (opener + body).strip() if opener else body.strip()
                key = " ".join(text.lower().split())
                if _usable(text) and key not in seen:
                    seen.add(key)
                    prompts.append(text)
                    bar.update(1)
    return prompts[:count]


def read_prompts(path: str | Path) -> list[str]:
    """A JSON list of strings, or one prompt per line."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        items = json.loads(text)
        if not all(isinstance(p, str) for p in items):
            raise ValueError(f"{path}: a JSON prompts file must be a list of strings")
        return items
    return [line.strip() for line in text.splitlines() if line.strip()]


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file; a last line still being written by another process is left out."""
    if not Path(path).is_file():
        return []
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines) - 1:
                raise
    return rows


def _batches(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@torch.no_grad()
def distill(
    lm: LoadedModel,
    prompts: list[str],
    out_path: str | Path,
    *,
    max_new_tokens: int = 128,
    batch_size: int = 16,
) -> int:
    """Append the model's greedy answers to ``out_path`` (JSONL); prompts already there are skipped.

    Each line: ``prompt``, ``prompt_ids`` (chat template applied), ``response_ids``
    (ending in EOS when the answer finished), ``response`` (text), ``finished``.
    Returns how many new lines were written.
    """
    tok, model = lm.tokenizer, lm.model
    done = {row["prompt"] for row in read_jsonl(out_path)}
    todo = [p for p in dict.fromkeys(prompts) if p not in done]
    encoded = sorted(((p, prompt_ids(tok, p)) for p in todo), key=lambda item: len(item[1]))
    pad = pad_id(tok)
    written = 0
    with open(out_path, "a", encoding="utf-8") as sink, tqdm(total=len(encoded), desc="distill") as bar:
        for batch in _batches(encoded, batch_size):
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch], device=model.device)
            attention = torch.tensor(
                [[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch], device=model.device
            )
            out = model.generate(
                input_ids, attention_mask=attention, do_sample=False, max_new_tokens=max_new_tokens,
                eos_token_id=tok.eos_token_id, pad_token_id=pad,
            )
            for (prompt, ids), row in zip(batch, out[:, width:].tolist()):
                finished = tok.eos_token_id in row
                response = row[: row.index(tok.eos_token_id) + 1] if finished else row
                record = {
                    "prompt": prompt,
                    "prompt_ids": ids,
                    "response_ids": response,
                    "response": tok.decode(response, skip_special_tokens=True),
                    "finished": finished,
                }
                sink.write(json.dumps(record, ensure_ascii=False) + "\n")
                written += 1
            sink.flush()
            bar.update(len(batch))
    return written
