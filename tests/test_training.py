"""MARS training: the attention mask is docs/METHOD.md's three rules, the streams are what decoding sees,
the loss learns, and a trained adapter saves, loads, resumes and still decodes greedily at tau = 1.0."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from mars_demo import cli
from mars_demo.engine.backends import backend_for
from mars_demo.engine.backends.cpu import paths
from mars_demo.engine.checkpoints import loading
from mars_demo.engine.checkpoints.loading import load_model
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import collect, stream
from mars_demo.research.training import (
    Example,
    TrainConfig,
    causal_lm,
    collate,
    epoch_batches,
    hidden_states,
    load_examples,
    mars_loss,
    micro_batches,
    model_mask,
    noisy_start,
    train,
    validate,
)

from conftest import CORPUS, PROMPTS, make_lm, make_tokenizer

# ----------------------------------------------------------------------------- mask


def rule(q: tuple[bool, int], k: tuple[bool, int], block: int) -> bool:
    """docs/METHOD.md's three rules, one (stream is noisy, position) pair at a time."""
    (q_noisy, pq), (k_noisy, pk) = q, k
    if not q_noisy and not k_noisy:
        return pk <= pq
    if q_noisy and k_noisy:
        return pk <= pq and pk // block == pq // block
    if q_noisy and not k_noisy:
        return pk // block < pq // block
    return False  # clean never sees noisy


def brute_mask(tokens: list[tuple[bool, int, bool]], block: int) -> torch.Tensor:
    """tokens: (noisy, position, valid) per slot. Padding keys are never seen; every slot sees itself."""
    n = len(tokens)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i, (qn, qp, _) in enumerate(tokens):
        for j, (kn, kp, kv) in enumerate(tokens):
            out[i, j] = i == j or (kv and rule((qn, qp), (kn, kp), block))
    return out


def example(n_prompt: int, n_response: int, offset: int = 10) -> Example:
    return Example(tuple(range(offset, offset + n_prompt)), tuple(range(100, 100 + n_response)))


@pytest.mark.parametrize("block", [1, 2, 3, 4])
@pytest.mark.parametrize("restrict", [False, True])
def test_mask_is_the_three_rules(block, restrict):
    rng = random.Random(block)
    for _ in range(6):
        exs = [example(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(3)]
        batch = collate(exs, mask_id=1, pad_id=0, block_size=block, restrict=restrict)
        starts = [noisy_start(len(ex.prompt), block) if restrict else 0 for ex in exs]
        noisy_width = max(len(ex) - s for ex, s in zip(exs, starts))
        clean_width = max(len(ex) for ex in exs)
        assert batch.input_ids.shape == (3, noisy_width + clean_width)
        for row, (ex, start) in enumerate(zip(exs, starts)):
            n, l = len(ex) - start, len(ex)
            tokens = [(True, start + i, True) for i in range(n)] + [(True, 0, False)] * (noisy_width - n)
            tokens += [(False, i, True) for i in range(l)] + [(False, 0, False)] * (clean_width - l)
            assert batch.attention[row, 0].equal(brute_mask(tokens, block))
            # The input itself: prompt kept in the noisy stream, response masked, clean stream = x.
            x = list(ex.prompt + ex.response)
            noisy = [t if i < len(ex.prompt) else 1 for i, t in enumerate(x)][start:]
            assert batch.input_ids[row, :n].tolist() == noisy
            assert batch.input_ids[row, noisy_width : noisy_width + l].tolist() == x


@pytest.mark.parametrize("block", [2, 3, 4])
def test_restricted_mask_is_the_full_mask_restricted(block):
    ex = example(7, 6)
    full = collate([ex], 1, 0, block, restrict=False)
    part = collate([ex], 1, 0, block, restrict=True)
    start, l = noisy_start(7, block), len(ex)
    keep = list(range(start, l)) + list(range(l, 2 * l))  # the kept noisy slots, then every clean slot
    assert part.attention[0, 0].equal(full.attention[0, 0][keep][:, keep])
    assert part.position_ids[0].tolist() == full.position_ids[0, keep].tolist()


def test_targets_skip_block_starts_and_prompt():
    block, ex = 4, example(5, 9)  # response positions 5..13
    batch = collate([ex], mask_id=1, pad_id=0, block_size=block)
    start, x = noisy_start(5, block), list(ex.prompt + ex.response)
    noisy_positions = [i for i in range(5, 14) if i % block]
    assert batch.noisy_targets.tolist() == [x[i] for i in noisy_positions]
    assert batch.noisy_sources.tolist() == [i - 1 - start for i in noisy_positions]
    noisy_width = 14 - start
    assert batch.clean_targets.tolist() == x[5:]
    assert batch.clean_sources.tolist() == [noisy_width + i - 1 for i in range(5, 14)]


# ----------------------------------------------------------------------------- the model reads the mask


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_user_4d_mask_is_used(tiny_llama, implementation):
    model = tiny_llama.model
    previous = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        ids = torch.tensor([[5, 17, 33, 8, 90, 41, 7]])
        n = ids.shape[1]
        plain = model(input_ids=ids).logits
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        with_mask = model(input_ids=ids, attention_mask=model_mask(causal, model, torch.float32)).logits
        torch.testing.assert_close(with_mask, plain, rtol=1e-5, atol=1e-5)
        only_self = torch.eye(n, dtype=torch.bool)[None, None]
        other = model(input_ids=ids, attention_mask=model_mask(only_self, model, torch.float32)).logits
        assert not torch.allclose(other[:, 1:], plain[:, 1:], atol=1e-3)  # the mask really changes attention
    finally:
        model.set_attn_implementation(previous)


def all_logits(model, batch) -> torch.Tensor:
    return causal_lm(model).get_output_embeddings()(hidden_states(model, batch))


@pytest.mark.parametrize("block", [2, 4])
def test_streams_match_what_decoding_sees(tiny_lm, block):
    """Clean stream = plain forward of x.

    Noisy slot i = a causal forward of clean[:block start] + noisy[block start..i].
    """
    model, mask_id = tiny_lm.model, tiny_lm.meta.mask_token_id
    exs = [example(6, 9), example(3, 4, offset=40)]  # two rows: padding in both streams
    batch = collate(exs, mask_id, pad_id=0, block_size=block)
    with torch.no_grad():
        logits = all_logits(model, batch)
        noisy_width = batch.input_ids.shape[1] - max(len(ex) for ex in exs)
        for row, ex in enumerate(exs):
            x, n_prompt = list(ex.prompt + ex.response), len(ex.prompt)
            start = noisy_start(n_prompt, block)
            plain = model(input_ids=torch.tensor([x])).logits[0]
            torch.testing.assert_close(logits[row, noisy_width : noisy_width + len(x)], plain, rtol=1e-4, atol=1e-4)
            noisy = [t if i < n_prompt else mask_id for i, t in enumerate(x)]
            for i in range(start, len(x)):
                first = i // block * block
                seen = torch.tensor([x[:first] + noisy[first : i + 1]])
                expected = model(input_ids=seen).logits[0, -1]
                torch.testing.assert_close(logits[row, i - start], expected, rtol=1e-4, atol=1e-4)


def test_ar_objective_is_plain_next_token_loss_on_the_response(tiny_lm):
    """The AR-SFT baseline: no noisy stream, and its loss is HF's causal LM loss on the response tokens."""
    model, mask_id = tiny_lm.model, tiny_lm.meta.mask_token_id
    exs = [example(6, 9), example(3, 4, offset=40)]
    batch = collate(exs, mask_id, pad_id=0, block_size=4, noisy=False)
    assert batch.noisy_targets.numel() == 0 and mask_id not in batch.input_ids.tolist()[0]
    assert batch.input_ids.shape[1] == max(len(ex) for ex in exs)
    with torch.no_grad():
        loss, noisy_loss, ar_loss = mars_loss(model, batch, ar_weight=1.5)
        nll, count = 0.0, 0
        for ex in exs:
            x = torch.tensor([ex.prompt + ex.response])
            labels = x.clone()
            labels[0, : len(ex.prompt)] = -100  # the prompt carries no loss
            n = len(ex.response)
            nll += model(input_ids=x, labels=labels).loss.item() * n
            count += n
    assert noisy_loss.item() == 0.0
    assert ar_loss.item() == pytest.approx(nll / count, rel=1e-4)
    assert loss.item() == pytest.approx(1.5 * nll / count, rel=1e-4)


# ----------------------------------------------------------------------------- validation


def decoding_passes(model, exs: list[Example], mask_id: int, block: int) -> tuple[list[list[float]], list[list[bool]]]:
    """Per full block at p: the pass decoding would run there (x[:p] + B-1 masks), its B candidates'
    confidences and whether each candidate is the row's token."""
    confs, rights = [], []
    for ex in exs:
        x, n_prompt = list(ex.prompt + ex.response), len(ex.prompt)
        for p in range(0, len(x) - block + 1, block):
            if p < n_prompt:
                continue
            logits = logits_of(model, x[:p] + [mask_id] * (block - 1))[p - 1 :]  # (B, vocab)
            conf, guess = torch.softmax(logits, dim=-1).max(dim=-1)
            confs.append(conf.tolist())
            rights.append([g == t for g, t in zip(guess.tolist(), x[p : p + block])])
    return confs, rights


@pytest.mark.parametrize("block", [2, 4])
def test_validation_is_what_decoding_would_accept(tiny_lm, block):
    """Each full block is one decoding pass: acceptance, matches, losses and argmax agreement by brute force."""
    model, mask_id = tiny_lm.model, tiny_lm.meta.mask_token_id
    exs = [example(6, 14), example(3, 9, offset=40), example(5, 2, offset=70)]  # the last has no full block
    confs, rights = decoding_passes(model, exs, mask_id, block)
    masks = sorted(c for row in confs for c in row[1:])
    gaps = [(masks[k + 1] - masks[k], k) for k in range(len(masks) // 4, 3 * len(masks) // 4)]
    gap, k = max(gaps)
    assert gap > 1e-3
    tau = (masks[k] + masks[k + 1]) / 2  # half the masks pass, none near the threshold
    counts, matched, reach = [], 0, [0] * block
    for conf, right in zip(confs, rights):
        n = 1
        while n < block and conf[n] >= tau:
            reach[n] += 1
            n += 1
        counts.append(n)
        matched += sum(right[1:n])
    extra = sum(counts) - len(counts)
    assert 0 < extra < len(counts) * (block - 1)  # the case is not trivial

    result, plain = validate(model, exs, mask_id, pad_id=0, block_size=block, taus=(tau, 1.0), batch_size=2, step=7)
    assert result.step == 7 and result.tau == tau
    assert result.tokens_per_pass == pytest.approx(sum(counts) / len(counts), abs=1e-4)
    assert result.extra_match == pytest.approx(matched / extra, abs=1e-4)
    assert result.reach == pytest.approx([r / len(counts) for r in reach[1:]], abs=1e-4)
    with torch.no_grad():
        _, noisy_loss, ar_loss = mars_loss(model, collate(exs, mask_id, 0, block))
    assert (result.noisy_loss, result.ar_loss) == pytest.approx((noisy_loss.item(), ar_loss.item()), abs=1e-4)
    agree = [
        (
            logits_of(model, list(ex.prompt + ex.response))[len(ex.prompt) - 1 : -1].argmax(-1)
            == torch.tensor(ex.response)
        ).tolist()
        for ex in exs
    ]
    assert result.ar_agreement == pytest.approx(sum(map(sum, agree)) / sum(map(len, agree)), abs=1e-4)
    # the AR head's probability of each row token, from a plain causal forward over the row
    p_row = sorted(
        p for ex in exs
        for p in torch.softmax(logits_of(model, list(ex.prompt + ex.response))[len(ex.prompt) - 1 : -1], dim=-1)
        .gather(-1, torch.tensor(ex.response)[:, None]).squeeze(-1).tolist()
    )
    assert result.ar_confidence == pytest.approx(sum(p_row) / len(p_row), abs=1e-4)
    assert result.ar_sure == pytest.approx(sum(p >= tau for p in p_row) / len(p_row), abs=1e-4)
    gap, k = max((p_row[k + 1] - p_row[k], k) for k in range(len(p_row) // 4, 3 * len(p_row) // 4))
    assert gap > 1e-4
    tau_ar = (p_row[k] + p_row[k + 1]) / 2  # between a quarter and three quarters of the tokens are that sure
    # the AR path reference: each full block at p as if candidate j's confidence were P(x_p..x_{p+j-1})
    # under the AR head
    paths = []
    for ex in exs:
        x, n_prompt = list(ex.prompt + ex.response), len(ex.prompt)
        probs = torch.softmax(logits_of(model, x), dim=-1)  # row i: the distribution of x[i + 1]
        for p in range(0, len(x) - block + 1, block):
            if p >= n_prompt:
                paths.append(torch.tensor([probs[p - 1 + j, x[p + j]] for j in range(block)]).cumprod(0).tolist())
    second = sorted(path[1] for path in paths)  # tiny probabilities in a random model: split them by ratio
    ratio, j = max((second[j + 1] / second[j], j) for j in range(len(second) // 4, 3 * len(second) // 4))
    assert ratio > 1.01
    tau_path = (second[j] * second[j + 1]) ** 0.5
    path_counts = []
    for path in paths:
        n = 1
        while n < block and path[n] >= tau_path:
            n += 1
        path_counts.append(n)
    by_ar, by_path = validate(model, exs, mask_id, 0, block, taus=(tau_ar, tau_path), batch_size=2)
    assert by_ar.ar_sure == pytest.approx((len(p_row) - k - 1) / len(p_row), abs=1e-4)
    assert by_path.ar_path_tokens_per_pass == pytest.approx(sum(path_counts) / len(path_counts), abs=1e-4)
    assert 1 < by_path.ar_path_tokens_per_pass < 2
    one_by_one, = validate(model, exs, mask_id, 0, block, taus=(tau,), batch_size=1)  # padding changes nothing
    for key, value in vars(result).items():
        assert getattr(one_by_one, key) == (0 if key == "step" else pytest.approx(value, abs=2e-4)), key
    assert plain.tokens_per_pass == 1.0 and plain.extra_match is None  # tau = 1.0: one token per pass
    expected = (result.ar_loss, result.ar_agreement, result.ar_confidence)
    assert (plain.ar_loss, plain.ar_agreement, plain.ar_confidence) == expected


# ----------------------------------------------------------------------------- data order


def test_batches_cover_every_example_once_per_epoch():
    lengths = [random.Random(i).randint(5, 50) for i in range(37)]
    for epoch in range(2):
        batches = epoch_batches(lengths, 4, seed=1, epoch=epoch)
        assert sorted(i for b in batches for i in b) == list(range(37))
    assert epoch_batches(lengths, 4, 1, 0) == epoch_batches(lengths, 4, 1, 0)
    stream_all = micro_batches(lengths, 4, seed=1)
    first = [next(stream_all) for _ in range(15)]
    resumed = micro_batches(lengths, 4, seed=1, start=7)
    assert [next(resumed) for _ in range(8)] == first[7:]  # resuming mid-run crosses the epoch boundary alike


def test_load_examples_cuts_responses():
    rows = [{"prompt_ids": [1, 2], "response_ids": list(range(10))}, {"prompt_ids": [1], "response_ids": []}]
    assert load_examples(rows, 4) == [Example((1, 2), (0, 1, 2, 3))]


# ----------------------------------------------------------------------------- training runs


def tiny_rows(tokenizer, count: int = 8) -> list[dict]:
    rows = []
    for i in range(count):
        prompt = PROMPTS[i % len(PROMPTS)]
        response = tokenizer(CORPUS[i % len(CORPUS)][: 40 + 7 * i])["input_ids"] + [tokenizer.eos_token_id]
        rows.append({"prompt": prompt, "prompt_ids": prompt_ids(tokenizer, prompt), "response_ids": response})
    return rows


def tied_lm():
    """A tiny Llama with tied input/output embeddings, like SmolLM2, and no tokenizer mask token."""
    tokenizer = make_tokenizer(None)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


@pytest.fixture()
def base_dir(tmp_path):
    """A tiny tied base saved to disk, so it can be named as a base spec like smollm2-135m."""
    model, tokenizer = tied_lm()
    path = tmp_path / "base"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


FAST = {"block_size": 4, "lora_rank": 8, "lr": 1e-2, "batch_size": 4, "save_every": 100, "warmup": 0.1}


def test_loss_falls(tmp_path):
    lm = make_lm("qwen2")
    examples = load_examples(tiny_rows(lm.tokenizer), 128)
    result = train(lm, examples, TrainConfig(max_steps=20, **FAST), tmp_path / "run", base_spec="tiny", progress=False)
    first, last = result.history[0], result.history[-1]
    assert last.noisy_loss < 0.7 * first.noisy_loss and last.ar_loss < first.ar_loss
    assert all(h.loss == pytest.approx(h.noisy_loss + h.ar_loss, abs=1e-3) for h in result.history)

    config = TrainConfig(max_steps=2, ar_weight=3.0, **FAST)
    weighted = train(make_lm("qwen2"), examples, config, tmp_path / "w", base_spec="tiny", progress=False)
    assert all(h.loss == pytest.approx(h.noisy_loss + 3.0 * h.ar_loss, abs=1e-3) for h in weighted.history)


def logits_of(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_adapter_round_trip_tied_embeddings(tmp_path, base_dir):
    lm = load_model(base_dir, block_size=4)
    mask_id = lm.meta.mask_token_id
    before = lm.model.get_input_embeddings().weight[mask_id].clone()
    examples = load_examples(tiny_rows(lm.tokenizer), 128)
    out = tmp_path / "run"
    result = train(lm, examples, TrainConfig(max_steps=3, **FAST), out, base_spec=base_dir, progress=False)

    files = ("adapter_config.json", "adapter_model.safetensors", "mars.json", "loss.jsonl", "loss.png", "training.json")
    for name in files:
        assert (out / name).is_file(), name
    assert {v.dtype for v in load_file(out / "adapter_model.safetensors").values()} == {torch.float16}
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == base_dir
    assert [json.loads(line)["step"] for line in (out / "loss.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert json.loads((out / "training.json").read_text())["steps"] == 3

    model = result.model
    with torch.no_grad():  # what was saved: fp16 copies of the trained tensors
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(p.half().float())
    merged = model.merge_and_unload().eval()
    emb, head = merged.get_input_embeddings().weight, merged.get_output_embeddings().weight
    assert not torch.equal(emb[mask_id], before)  # the mask row trained ...
    assert torch.equal(emb[mask_id], head[mask_id])  # ... and stays tied to the LM head

    loaded = load_model(str(out))
    assert loaded.meta.mask_token_id == mask_id and loaded.meta.block_size == 4
    ids = prompt_ids(lm.tokenizer, PROMPTS[0]) + [mask_id] * 3
    torch.testing.assert_close(logits_of(loaded.model, ids), logits_of(merged, ids), rtol=1e-5, atol=1e-5)


def test_tau_one_is_greedy_after_training(tmp_path, base_dir):
    lm = load_model(base_dir, block_size=4)
    examples = load_examples(tiny_rows(lm.tokenizer), 128)
    result = train(lm, examples, TrainConfig(max_steps=5, **FAST), tmp_path / "run", base_spec=base_dir, progress=False)
    model = result.model.merge_and_unload().eval()
    for prompt in PROMPTS[:2]:
        ids = prompt_ids(lm.tokenizer, prompt)
        config = DecodeConfig(tau=1.0, max_new_tokens=24)
        ours = collect(stream(backend_for(model), lm.tokenizer, ids, config, mask_id=lm.meta.mask_token_id,
                              block_size=4)).token_ids
        hf = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
            max_new_tokens=24, eos_token_id=lm.tokenizer.eos_token_id, pad_token_id=lm.tokenizer.pad_token_id,
        )[0, len(ids):].tolist()
        assert ours == hf[: len(ours)] and (len(ours) == len(hf) or ours[-1] == lm.tokenizer.eos_token_id)


def trained_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_resume_continues_exactly(tmp_path):
    config = TrainConfig(max_steps=6, **(FAST | {"save_every": 2, "batch_size": 3, "grad_accum": 2}))
    rows = tiny_rows(make_tokenizer("<|mask|>"), count=7)
    straight = train(
        make_lm("qwen2"), load_examples(rows, 128), config, tmp_path / "a", base_spec="tiny", progress=False
    )

    out = tmp_path / "b"
    cut = train(make_lm("qwen2"), load_examples(rows, 128), config, out, base_spec="tiny", progress=False, stop_after=3)
    assert cut.steps == 3  # interrupted after step 3; the checkpoint is from step 2
    with pytest.raises(ValueError, match="--resume"):
        train(make_lm("qwen2"), load_examples(rows, 128), config, out, base_spec="tiny", progress=False)
    grown = load_examples(rows + tiny_rows(make_tokenizer("<|mask|>"), count=2), 128)  # the data file grew meanwhile
    resumed = train(make_lm("qwen2"), grown, config, out, base_spec="tiny", progress=False, resume=True)

    assert [h.step for h in resumed.history] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(straight.history, resumed.history):
        expected = pytest.approx((b.loss, b.noisy_loss, b.ar_loss, b.lr), abs=1e-5)
        assert (a.loss, a.noisy_loss, a.ar_loss, a.lr) == expected
    ours, theirs = trained_state(straight.model), trained_state(resumed.model)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6)


def held_out_rows(tokenizer, count: int = 3) -> list[dict]:
    rows = []
    for i in range(count):
        prompt = f"A held-out question, number {i}?"
        response = tokenizer(CORPUS[(i + 1) % len(CORPUS)][: 30 + 5 * i])["input_ids"] + [tokenizer.eos_token_id]
        rows.append({"prompt": prompt, "prompt_ids": prompt_ids(tokenizer, prompt), "response_ids": response})
    return rows


def test_validation_during_training_logs_and_resumes(tmp_path):
    """Validation before the first step, every val_every steps and at the end; a resume keeps the log whole."""
    tokenizer = make_tokenizer("<|mask|>")
    examples, held_out = load_examples(tiny_rows(tokenizer, 6), 128), load_examples(held_out_rows(tokenizer), 128)
    config = TrainConfig(max_steps=5, **(FAST | {"save_every": 2}))
    kwargs = {
        "base_spec": "tiny", "progress": False, "val_examples": held_out, "val_every": 2, "val_data": "held.jsonl"
    }
    straight = train(make_lm("qwen2"), examples, config, tmp_path / "a", **kwargs)
    assert [v.step for v in straight.validation] == [0, 2, 4, 5]
    first, last = straight.validation[0], straight.validation[-1]
    assert last.ar_loss < first.ar_loss and last.noisy_loss < first.noisy_loss  # it learns what generalises here
    logged = [json.loads(line) for line in (tmp_path / "a" / "val.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [0, 2, 4, 5] and logged[-1]["ar_loss"] == last.ar_loss
    summary = json.loads((tmp_path / "a" / "training.json").read_text())
    assert summary["validation"]["step"] == 5 and summary["val_examples"] == 3 and summary["val_data"] == "held.jsonl"

    out = tmp_path / "b"
    train(make_lm("qwen2"), examples, config, out, stop_after=3, **kwargs)  # checkpoint at step 2
    resumed = train(make_lm("qwen2"), examples, config, out, resume=True, **kwargs)
    assert [v.step for v in resumed.validation] == [0, 2, 4, 5]
    assert [json.loads(line)["step"] for line in (out / "val.jsonl").read_text().splitlines()] == [0, 2, 4, 5]
    for a, b in zip(straight.validation, resumed.validation):
        expected = pytest.approx((b.noisy_loss, b.ar_loss, b.ar_agreement), abs=1e-3)
        assert (a.noisy_loss, a.ar_loss, a.ar_agreement) == expected

    quiet = train(make_lm("qwen2"), examples, config, tmp_path / "c", base_spec="tiny", progress=False)
    assert quiet.validation == [] and not (tmp_path / "c" / "val.jsonl").exists()
    assert "validation" not in json.loads((tmp_path / "c" / "training.json").read_text())


def test_the_first_bundled_load_and_later_ones_share_one_compute_table_entry(tmp_path, base_dir, monkeypatch):
    lm = load_model(base_dir, block_size=4)
    train(lm, load_examples(tiny_rows(lm.tokenizer), 128), TrainConfig(max_steps=1, **FAST), tmp_path / "adapter",
          base_spec=base_dir, progress=False)
    monkeypatch.setattr(loading, "BUNDLED_ADAPTER", tmp_path / "adapter")  # a tiny stand-in for the bundled pair
    monkeypatch.setattr(loading, "bundled_base_dir", lambda: Path(base_dir))
    monkeypatch.setenv("MARS_DEMO_CACHE", str(tmp_path / "cache"))
    first = load_model(precision="fp32")  # merges the adapter and saves the merged copy
    assert (loading.merged_bundled_dir() / "model.safetensors").is_file() and not first.compute.cached
    again = load_model(precision="fp32")  # from the merged copy: the table measured by the first load
    assert again.compute.cached and again.compute.costs_ms == first.compute.costs_ms
    assert len(json.loads((tmp_path / "cache" / paths.TABLE_FILE).read_text())) == 1


def test_init_adapter_starts_from_its_weights(tmp_path, base_dir):
    lm = load_model(base_dir, block_size=4)
    examples = load_examples(tiny_rows(lm.tokenizer), 128)
    first = tmp_path / "first"
    train(lm, examples, TrainConfig(max_steps=2, **FAST), first, base_spec=base_dir, progress=False)
    saved = load_model(str(first))
    ids = prompt_ids(saved.tokenizer, PROMPTS[1]) + [saved.meta.mask_token_id] * 3
    expected = logits_of(saved.model, ids)

    fresh = load_model(base_dir, block_size=4)
    second = train(
        fresh, examples, TrainConfig(max_steps=1, **(FAST | {"lr": 1e-9})), tmp_path / "second",
        base_spec=base_dir, init_adapter=first, progress=False,
    )
    torch.testing.assert_close(logits_of(second.model.eval(), ids), expected, rtol=1e-4, atol=1e-4)
    assert json.loads((tmp_path / "second" / "training.json").read_text())["init_adapter"] == str(first)
    assert json.loads((first / "training.json").read_text())["init_adapter"] is None


# ----------------------------------------------------------------------------- command line


def test_train_command(tmp_path, base_dir, capsys):
    tokenizer = make_tokenizer(None)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in tiny_rows(tokenizer, 5)))
    out = tmp_path / "cli"
    argv = ["train", "--base", base_dir, "--data", str(data), "--out", str(out), "--lora-rank", "4",
            "--max-steps", "2", "--batch-size", "2", "--save-every", "1"]
    assert cli.main(argv) == 0
    assert "2/2 steps" in capsys.readouterr().out
    assert (out / "checkpoint" / "state.pt").is_file() and (out / "adapter_model.safetensors").is_file()
    summary = json.loads((out / "training.json").read_text())
    assert summary["lora_rank"] == 4 and summary["lora_alpha"] == 4 and summary["examples"] == 5

    assert cli.main(argv) == 2  # a checkpoint is there: refuse to overwrite it silently
    assert "--resume" in capsys.readouterr().err
    assert cli.main(["train", "--data", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert cli.main(["train", "--data", str(data), "--out", str(out), "--batch-size", "0"]) == 2
    assert cli.main(["train", "--data", str(data), "--out", str(out), "--ar-weight", "-1"]) == 2

    later = tmp_path / "later"
    assert cli.main(argv[:6] + [str(later), "--skip-rows", "3", "--ar-weight", "2.5"] + argv[7:]) == 0
    summary = json.loads((later / "training.json").read_text())
    assert summary["examples"] == 2 and summary["data"] == f"{data}[3:]" and summary["ar_weight"] == 2.5
    assert cli.main(argv[:6] + [str(tmp_path / "none"), "--skip-rows", "5"] + argv[7:]) == 2
    assert "after row 5" in capsys.readouterr().err

    window = tmp_path / "window"
    assert cli.main(argv[:6] + [str(window), "--skip-rows", "1", "--max-rows", "3"] + argv[7:]) == 0
    summary = json.loads((window / "training.json").read_text())
    assert summary["examples"] == 3 and summary["data"] == f"{data}[1:4]"
    assert cli.main(argv[:6] + [str(tmp_path / "zero"), "--max-rows", "0"] + argv[7:]) == 2

    looping = dict(tiny_rows(tokenizer, 1)[0], response_ids=[11, 12, 13, 14, 15] * 8)  # 32 of 37 4-grams repeat
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(data.read_text() + json.dumps(looping) + "\n")
    unloop = tmp_path / "unloop"
    assert cli.main(argv[:4] + [str(mixed)] + argv[5:6] + [str(unloop), "--max-repeat", "0.5"] + argv[7:]) == 0
    summary = json.loads((unloop / "training.json").read_text())
    assert summary["examples"] == 5
    assert summary["data"] == f"{mixed} without loops (repeated 4-grams > 0.5: 1 of 6 rows)"
    assert cli.main(argv[:4] + [str(mixed)] + argv[5:6] + [str(tmp_path / "all"), "--max-repeat", "1"] + argv[7:]) == 0
    assert json.loads((tmp_path / "all" / "training.json").read_text())["examples"] == 6
    assert cli.main(argv[:6] + [str(tmp_path / "bad"), "--max-repeat", "1.5"] + argv[7:]) == 2

    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(row) + "\n" for row in held_out_rows(tokenizer)))
    validated = tmp_path / "validated"
    flags = ["--val-data", str(held), "--val-every", "1", "--val-rows", "2"]
    assert cli.main(argv[:6] + [str(validated), *flags] + argv[7:]) == 0
    assert "held out (step 2)" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in (validated / "val.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert json.loads((validated / "training.json").read_text())["val_examples"] == 2
    logged = json.loads((validated / "training.json").read_text())["validation"]
    assert cli.main([
        "validate", "--model", str(validated), "--data", str(held), "--rows", "2", "--taus", "0.9,1", "--json",
    ]) == 0
    at_09, at_1 = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert at_1["tokens_per_pass"] == 1.0 and at_09["tau"] == 0.9 and at_09["rows"] == 2
    for key in ("noisy_loss", "ar_loss", "tokens_per_pass"):  # the saved (fp16) adapter measures what training logged
        assert at_09[key] == pytest.approx(logged[key], abs=0.02)
    assert cli.main(["validate", "--model", str(validated), "--data", str(held)]) == 0
    assert "tok/pass" in capsys.readouterr().out
    assert cli.main(["validate", "--model", str(validated), "--data", str(held), "--trees", "--json"]) == 0
    trees = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert trees["costs_ms"] is None and [h["depth"] for h in trees["hits"]] == [1, 2, 3]  # block 4: 3 masks
    assert {tuple(s["shape"]) for s in trees["shapes"]} >= {(1, 1, 1), (2, 1), (3, 3, 3)}
    assert cli.main(["validate", "--model", str(validated), "--data", str(held), "--taus", "1.5"]) == 2
    assert cli.main(["validate", "--model", str(validated), "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert cli.main(argv[:6] + [str(tmp_path / "leak"), "--val-data", str(data)] + argv[7:]) == 2
    assert "held-out prompts" in capsys.readouterr().err
    missing = [str(tmp_path / "nowhere"), "--val-data", str(tmp_path / "missing.jsonl")]
    assert cli.main(argv[:6] + missing + argv[7:]) == 2

    baseline = tmp_path / "ar-sft"
    assert cli.main(argv[:6] + [str(baseline), "--objective", "ar"] + argv[7:]) == 0
    summary = json.loads((baseline / "training.json").read_text())
    assert summary["objective"] == "ar" and summary["noisy_stream"].startswith("none")
    assert summary["final_noisy_loss"] == 0.0
    assert cli.main(argv[:6] + [str(tmp_path / "nothing"), "--objective", "ar", "--ar-weight", "0"] + argv[7:]) == 2
    assert "AR weight above 0" in capsys.readouterr().err


def test_distill_command_appends_and_resumes(tmp_path, base_dir, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[:3]))
    out = tmp_path / "data.jsonl"
    argv = ["distill", "--base", base_dir, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "6",
            "--batch-size", "2"]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["prompt"] for r in rows) == sorted(PROMPTS[:3])
    assert all(r["prompt_ids"] and 1 <= len(r["response_ids"]) <= 6 for r in rows)
    assert load_examples(rows, 128)  # what train reads
    assert cli.main(argv) == 0 and len(out.read_text().splitlines()) == 3  # nothing new to do
    assert "0 new answers" in capsys.readouterr().out


def test_prompts_split_is_seeded():
    from mars_demo.commands.prompts import split

    items = [f"p{i}" for i in range(10)]
    heldout, rest = split(items, 3, seed=0)
    assert len(heldout) == 3 and sorted(heldout + rest) == sorted(items)
    assert split(items, 3, seed=0) == (heldout, rest) and split(items, 3, seed=1) != (heldout, rest)
    assert cli.main(["prompts", "--count", "5", "--heldout", "9", "--out-dir", "/tmp/unused"]) == 2


def test_full_fine_tuning_saves_a_loadable_model(tmp_path, base_dir):
    lm = load_model(base_dir, block_size=4)
    examples = load_examples(tiny_rows(lm.tokenizer), 128)
    out = tmp_path / "full"
    config = TrainConfig(max_steps=2, **(FAST | {"lora_rank": None, "lr": 1e-3}))
    result = train(lm, examples, config, out, base_spec=base_dir, progress=False)
    loaded = load_model(str(out))
    assert loaded.meta.mask_token_id == lm.meta.mask_token_id and loaded.meta.block_size == 4
    with safe_open(out / "model.safetensors", "pt") as saved:  # the tied LM head is stored once
        names = set(saved.keys())  # a safetensors handle, not a dict
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()
    ids = prompt_ids(lm.tokenizer, PROMPTS[2])
    trained = result.model.eval()
    with torch.no_grad():  # the saved weights are fp16 copies
        for p in trained.parameters():
            p.copy_(p.half().float())
    torch.testing.assert_close(logits_of(loaded.model, ids), logits_of(trained, ids), rtol=1e-4, atol=1e-4)
