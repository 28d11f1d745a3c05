"""Candidate trees in exact and hybrid modes (decoding/tree.py, docs/METHOD.md "Candidate trees").

Greedy AR's output token for token, cached == uncached, the cache after every pass holds exactly the
committed tokens with a one-token pass's keys and values, on fp32 (transformers' cache) and on every
CPU path (the CPU engine's cache). As in test_exact.py, "drafty" copies (a bias on the LM head towards
four tokens) make the masks' candidates right often enough that branches other than the top guess hold.
"""

from __future__ import annotations

import json
import re
from contextlib import nullcontext

import pytest
import torch
from transformers import DynamicCache

from mars_demo.cli import main
from mars_demo.engine.backends.cpu.cache import CpuCache
from mars_demo.engine.backends.cpu.calibration import token_ids
from mars_demo.engine.backends.cpu.paths import convert
from mars_demo.engine.backends.hf import HFCache
from mars_demo.engine.decoding import exact, tree, tree_sampled
from mars_demo.engine.decoding.batch import stream_batch
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import LiveTau, collect, decode_passes, eos_ids, generate, stream, verifier_for
from mars_demo.engine.decoding.sampling import Sampling
from mars_demo.engine.decoding.speculative import Rule
from mars_demo.engine.decoding.tree_shape import TreeShape, auto_shapes, nodes, parse_tree
from tests.reference import reference_tree
from tests.test_sampling import SIGNIFICANCE, TOP_K, TOP_P, ar_distribution, chi_square_p

from conftest import PROMPTS, make_lm

MAX_NEW = 24
BLOCKS = (2, 4, 8)
SHAPES = ("1", "2,1,1", "3,2,1", "2,2,2,2", "auto")


def drafty(lm, eos: float | None = None):
    bias = torch.zeros(lm.model.config.vocab_size)
    bias[[50, 60, 70, 80]] = 7.0
    if eos is not None:
        bias[lm.tokenizer.eos_token_id] = eos
    lm.model.lm_head.bias = torch.nn.Parameter(bias)
    return lm


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-drafty", "qwen2-drafty"])
def lm(request):
    arch, _, bias = request.param.partition("-")
    return drafty(make_lm(arch)) if bias else make_lm(arch)


def ar_ids(lm, prompt: str, max_new: int = MAX_NEW) -> list[int]:
    return collect(generate(lm, prompt, DecodeConfig(mode="ar", max_new_tokens=max_new))).token_ids


def passes(lm, prompt: str, block_size: int, tree_: str, tau: float = 1.0, max_new: int = MAX_NEW, stop_ids=None):
    config = DecodeConfig(mode="hybrid", tau=tau, max_new_tokens=max_new, tree=tree_)
    return list(decode_passes(
        lm.backend, prompt_ids(lm.tokenizer, prompt), config, window=block_size, mask_id=lm.meta.mask_token_id,
        tau=LiveTau(tau), stop_ids=eos_ids(lm.backend, lm.tokenizer) if stop_ids is None else stop_ids,
    ))


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("shape", SHAPES)
def test_trees_equal_greedy_ar(lm, block_size, shape):
    for prompt in PROMPTS:
        config = DecodeConfig(mode="exact", block_size=block_size, max_new_tokens=MAX_NEW, tree=shape)
        ours = collect(generate(lm, prompt, config))
        assert ours.token_ids == ar_ids(lm, prompt)
        hybrid = collect(generate(lm, prompt, config.with_(mode="hybrid", tau=1.0)))
        assert [s.token_ids for s in hybrid.steps] == [s.token_ids for s in ours.steps]
        for step in ours.steps:
            assert len(step.branches) == len(step.origins) == len(step.token_ids)
            assert all((b == tree.NOT_A_NODE) == (o != exact.DRAFT) for b, o in zip(step.branches, step.origins))
            assert len(step.shape) <= block_size - 1 and exact.MASK not in step.origins


def test_a_chain_shaped_tree_is_the_chain(lm):
    """Shape 1,1,1 at block size 4 feeds and commits exactly what exact mode's chain does (no cost curve)."""
    for prompt in PROMPTS:
        chain = passes(lm, prompt, 4, None)
        as_tree = passes(lm, prompt, 4, "1,1,1")
        assert [(p.tokens, p.origins, p.cached, p.width) for p in as_tree] == [
            (p.tokens, p.origins, p.cached, p.width) for p in chain
        ]


def test_wider_trees_keep_other_branches_and_take_fewer_passes():
    lm = drafty(make_lm("qwen2"))
    chain = sum(len(passes(lm, p, 4, "1,1,1")) for p in PROMPTS)
    wide = [q for p in PROMPTS for q in passes(lm, p, 4, "3,2,1")]
    assert len(wide) < chain
    assert any(b > 0 for q in wide for b in q.branches)  # a candidate other than the top guess was committed
    assert {q.shape for q in wide} >= {(3, 2, 1)}


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("tau", [1.0, 0.5])
@pytest.mark.parametrize("shape", ["2,1,1", "3,2,1"])
def test_cached_equals_uncached_reference(lm, block_size, tau, shape):
    stop = eos_ids(lm.backend, lm.tokenizer)
    for prompt in PROMPTS[:2]:
        ids = prompt_ids(lm.tokenizer, prompt)
        config = DecodeConfig(mode="hybrid", tau=tau, block_size=block_size, max_new_tokens=MAX_NEW, tree=shape)
        ours = collect(stream(lm.backend, lm.tokenizer, ids, config, mask_id=lm.meta.mask_token_id, block_size=4))
        expected, per_pass = reference_tree(
            lm.model, ids, block_size=block_size, mask_id=lm.meta.mask_token_id, shape=parse_tree(shape), tau=tau,
            max_new_tokens=MAX_NEW, stop_ids=stop,
        )
        assert ours.token_ids == expected
        assert [len(s.token_ids) for s in ours.steps] == per_pass


def held(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(cache, CpuCache):
        return [(k[:, :, : cache.end], v[:, :, : cache.end]) for k, v in cache.buffers]
    return [(layer.keys, layer.values) for layer in cache.inner.layers]


def prefix_copy(cache, columns: int):
    """A copy of ``cache`` holding its first ``columns`` columns."""
    if isinstance(cache, CpuCache):
        other = CpuCache(cache.layers)
        other.buffers = [(k[:, :, :columns].clone(), v[:, :, :columns].clone()) for k, v in cache.buffers]
        other.end = columns
        return other
    inner = DynamicCache()
    for i, layer in enumerate(cache.inner.layers):
        inner.update(layer.keys[:, :, :columns].clone(), layer.values[:, :, :columns].clone(), i)
    return HFCache(inner)


def run_trees(lm, prompt: str, shape: str, steps: int = 12, block_size: int = 4):
    """Drive the tree passes by hand: yields (run, cache, history, pending, verdict) after every pass."""
    backend = lm.backend
    config = DecodeConfig(mode="exact", tree=shape)
    run = verifier_for(backend, config, block_size, lm.meta.mask_token_id, Rule(config.sampling, None))
    cache, history = backend.new_cache(), prompt_ids(lm.tokenizer, prompt)
    pending = list(history)
    for _ in range(steps):
        candidates = run.drafts(history, block_size - 1, True)
        verdict, _, _ = run.step(backend, cache, pending, history, 1.0, "probability")
        history = history + verdict.tokens
        pending = verdict.tokens[verdict.cached :]
        yield candidates, cache, history, pending, verdict


def on_path(arch: str, path: str):
    lm = drafty(make_lm(arch))
    if path != "fp32":
        convert(lm.model, path, smoothing=token_ids(lm.tokenizer, PROMPTS) if path == "int8dyn" else None)
    return lm


PATHS = ["fp32", "bf16", "int8", "int8dyn"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_kept_keys_and_values_are_a_one_token_pass_s(arch, path):
    """After every pass the cache holds the committed tokens but the pending ones, and each kept draft's keys
    and values are those of a one-token pass at its position after the same prefix: bit for bit on the
    row-exact paths, to float rounding on fp32 (transformers' SDPA)."""
    lm = on_path(arch, path)
    assert isinstance(lm.backend.new_cache(), HFCache if path == "fp32" else CpuCache)
    with torch.inference_mode():
        check_kept_columns(lm, path)


def check_kept_columns(lm, path: str) -> None:
    runs = [(p, "3,2,1", 4) for p in PROMPTS] + [(PROMPTS[0], "1,1,1,1,1,1,1", 8), (PROMPTS[1], "2,2,2,2", 8)]
    for prompt, shape, block_size in runs:  # block size 8: passes of 20 rows and more
        for _, cache, history, pending, verdict in run_trees(lm, prompt, shape, block_size=block_size):
            committed = len(history) - len(pending)
            assert cache.get_seq_length() == committed
            for column in range(committed - verdict.cached, committed):  # the drafts this pass kept
                alone = prefix_copy(cache, column)
                lm.backend.forward(torch.tensor([[history[column]]]), alone)
                for (k, v), (k1, v1) in zip(held(cache), held(alone)):
                    if path == "fp32":
                        torch.testing.assert_close(k[:, :, column], k1[:, :, column], atol=1e-5, rtol=1e-5)
                        torch.testing.assert_close(v[:, :, column], v1[:, :, column], atol=1e-5, rtol=1e-5)
                    else:
                        assert torch.equal(k[:, :, column], k1[:, :, column])
                        assert torch.equal(v[:, :, column], v1[:, :, column])


@pytest.mark.parametrize("path", PATHS[1:])
@pytest.mark.parametrize("shape", ["3,2,1", "auto"])
def test_row_exact_paths_give_greedy_ar(path, shape):
    lm = on_path("qwen2", path)
    for block_size in BLOCKS:
        for prompt in PROMPTS:
            config = DecodeConfig(mode="exact", block_size=block_size, max_new_tokens=MAX_NEW, tree=shape)
            assert collect(generate(lm, prompt, config)).token_ids == ar_ids(lm, prompt)


def test_int8dyn_torch_layers_give_greedy_ar(torch_layers):
    lm = on_path("llama", "int8dyn")
    assert lm.backend.lean.native is None  # the torch layers around the native kernels
    for prompt in PROMPTS:
        config = DecodeConfig(mode="exact", block_size=4, max_new_tokens=MAX_NEW, tree="3,2,1")
        assert collect(generate(lm, prompt, config)).token_ids == ar_ids(lm, prompt)


@pytest.mark.parametrize("block_size", BLOCKS)
def test_stop_tokens_and_length_cut_inside_branches(block_size):
    """Every token of AR's output, made a stop token, ends the tree run where it ends AR; every max_new_tokens
    cuts it where it cuts AR; some of those cuts fall on a kept node that was not the top guess."""
    lm = drafty(make_lm("llama"))
    off_main = 0
    for prompt in PROMPTS[:3]:
        full = ar_ids(lm, prompt)
        for token in dict.fromkeys(full):
            out = passes(lm, prompt, block_size, "3,2,1", stop_ids={token})
            assert [t for p in out for t in p.tokens] == full[: full.index(token) + 1] and out[-1].finish == "eos"
            off_main += out[-1].branches[-1] > 0
        for n in range(1, len(full) + 1):
            out = passes(lm, prompt, block_size, "3,2,1", max_new=n, stop_ids=set())
            assert [t for p in out for t in p.tokens] == full[:n] and out[-1].finish == "length"
            off_main += out[-1].branches[-1] > 0
    assert off_main > 0


def test_eos_on_a_losing_branch_is_not_committed():
    """EOS is the masks' second candidate again and again; the runs still equal AR, and passes that drafted
    EOS on a branch AR did not take commit no EOS."""
    lm = drafty(make_lm("qwen2"), eos=6.8)
    eos, losing = lm.tokenizer.eos_token_id, 0
    for prompt in PROMPTS:
        config = DecodeConfig(mode="exact", block_size=4, max_new_tokens=MAX_NEW, tree="3,2,1")
        assert collect(generate(lm, prompt, config)).token_ids == ar_ids(lm, prompt)
        with torch.inference_mode():
            steps = [(c, v) for c, _, _, _, v in run_trees(lm, prompt, "3,2,1", steps=6)]
        for candidates, verdict in steps:
            if any(eos in ranked[1:3] for ranked in candidates) and eos not in verdict.tokens:
                losing += 1
    assert losing > 0


def test_eos_on_a_losing_branch_by_hand():
    """Nodes a (rank 0) and EOS (rank 1) at depth 1; AR says a: EOS is dropped, a and AR's next token kept."""
    a, e, b, vocab = 5, 2, 7, 10
    t = tree.build([[a, e], [b]], (2, 1))  # nodes: a, EOS, b under a, b under EOS
    assert t.tokens == [a, e, b, b] and t.parents == [-1, -1, 0, 1] and t.main == [0, 2]
    logits = torch.zeros(1 + 4 + 2 + 2, vocab)
    for row, token in [(0, a), (1, 3), (2, 9), (3, 9)]:  # root says a; after a AR says 3: node b fails
        logits[row, token] = 5.0
    verdict = tree.verify_tree(logits, t, 2, 1.0, "probability", branch=2)
    assert verdict.tokens == [a, 3] and verdict.path == [0] and verdict.branches == [0, tree.NOT_A_NODE]
    logits[0] = 0.0
    logits[0, e] = 5.0  # root says EOS: the second branch holds
    verdict = tree.verify_tree(logits, t, 2, 1.0, "probability", branch=2)
    assert verdict.tokens == [e, 9] and verdict.path == [1] and verdict.origins == [exact.DRAFT, exact.AR]


def test_stop_strings_end_tree_runs_where_they_end_ar(tiny_llama):
    full = collect(generate(tiny_llama, PROMPTS[2], DecodeConfig(mode="ar", max_new_tokens=40)))
    cut_at = re.search(r"[A-Za-z ]{2}", full.text[3:]).group(0)
    config = DecodeConfig(mode="exact", max_new_tokens=40, stop=(cut_at,), tree="2,2,1")
    stopped = collect(generate(tiny_llama, PROMPTS[2], config))
    assert stopped.stats.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(cut_at) + len(cut_at)]


def brute_force_allowed(t: tree.Tree, k: int, cached: int, L: int, g: int) -> torch.Tensor:
    """Who sees whom, read off the rules one pair at a time (tree.py's module docstring)."""
    N = len(t.tokens)
    n = k + N + L + g

    def ancestors(i):
        out = {i}
        while t.parents[i] >= 0:
            i = t.parents[i]
            out.add(i)
        return out

    allowed = torch.zeros(n, cached + n, dtype=torch.bool)
    for q in range(n):
        for key in range(cached + n):
            c = key - cached
            if c < 0 or (c < k and (q >= k or c <= q)):
                allowed[q, key] = True  # the cache, and the pending tokens (causally among themselves)
            elif k <= q < k + N and k <= c < k + N:
                allowed[q, key] = (c - k) in ancestors(q - k)
            elif k + N <= q < k + N + L:
                allowed[q, key] = (k <= c < k + N and c - k in t.main) or k + N <= c <= q
            elif q >= k + N + L:
                allowed[q, key] = k + N + L <= c <= q
    return allowed


@pytest.mark.parametrize("shape", [(2, 1), (3, 2, 1), (1, 1, 1), (2, 2, 2)])
def test_the_mask_and_the_positions_follow_the_ancestry(shape):
    cached, pending, L = 5, [11, 12], 3
    t = tree.build([[20, 21, 22], [30, 31, 32], [40, 41, 42]], shape)
    assert len(t.tokens) == nodes(shape) and t.shape == shape
    fed = tree.tree_window(pending, t, L, 99, cached, torch.float32, "cpu")
    assert torch.equal(fed.attention_mask[0, 0] == 0, brute_force_allowed(t, 2, cached, L, L))
    last = cached + len(pending) - 1
    want = [cached, cached + 1] + [last + d for d in t.depths] + [last + t.depth + 1 + i for i in range(L)]
    assert fed.position_ids[0].tolist() == want + [last + 1 + i for i in range(L)]
    if max(shape) == 1:  # a chain: exactly exact mode's window
        chain = exact.verify_window(pending, t.tokens, L, 99, cached, torch.float32, "cpu")
        assert torch.equal(chain.ids, fed.ids) and torch.equal(chain.position_ids, fed.position_ids)
        assert torch.equal(chain.attention_mask, fed.attention_mask)


def filled_caches(columns: int = 9) -> list:
    """A CpuCache and an HFCache, 2 layers, each column's keys and values set to its index (and minus it)."""
    keys = torch.arange(columns, dtype=torch.float32).view(1, 1, columns, 1).expand(1, 2, columns, 4).contiguous()
    cpu = CpuCache(2)
    cpu.open(keys, columns)
    inner = DynamicCache()
    for layer in range(2):
        cpu.write(layer, keys, -keys)
        inner.update(keys.clone(), -keys.clone(), layer)
    return [cpu, HFCache(inner)]


@pytest.mark.parametrize("kind", [0, 1])
def test_compact_moves_the_kept_columns_into_place(kind):
    cache = filled_caches()[kind]
    cache.compact(3, [4, 6, 7])
    assert cache.get_seq_length() == 6
    for k, v in held(cache):
        assert k[0, 1, :, 0].tolist() == [0, 1, 2, 4, 6, 7] and torch.equal(v, -k)
    cache.compact(2, [2, 3])  # in place already
    assert [k[0, 0, :, 0].tolist() for k, _ in held(cache)] == [[0, 1, 2, 4]] * 2
    cache.compact(1, [])
    assert cache.get_seq_length() == 1
    for bad in ([0], [3, 2], [1, 1], [9]):
        with pytest.raises(ValueError, match="compact"):
            filled_caches()[kind].compact(1, bad)


def test_the_shape_rule_picks_chains_on_the_cpu_curve_and_trees_where_width_is_free():
    cpu = {1: 4.51, 2: 4.53, 3: 4.73, 4: 5.08, 5: 5.57, 8: 7.02}  # issue #37's Zen 4 curve
    shapes = TreeShape(3, cpu)
    depth = exact.DraftDepth(3, cpu)
    chosen, fallback = shapes.layout()
    assert max(chosen) == 1 and (len(chosen), fallback) == depth.layout()[:2]  # at the prior: DraftDepth's chain
    assert max(TreeShape(3, None).layout()[0]) > 1  # no curve: width is free, the tree grows
    assert TreeShape(3, {w: 10.0 * w for w in range(1, 9)}).layout() == ((), True)  # every token a pass: AR
    # a noisy curve whose last step is flat (fp32 measured beside other work): trees wider than the curve are
    # priced at its mean slope, so they do not look free; AR, as DraftDepth says
    noisy = {1: 52.34, 2: 87.21, 3: 107.66, 4: 81.7, 5: 94.55, 6: 93.41, 7: 109.41, 8: 99.38}
    assert TreeShape(3, noisy).layout() == ((), True) and exact.DraftDepth(3, noisy).layout().depth == 0
    gentle = TreeShape(3, {w: 10.0 + 0.05 * w for w in range(1, 40)})
    for _ in range(100):  # the top guess holds one time in three, the second as often: two candidates pay
        for truth in (10, 11, 12):
            gentle.observe([[10, 11, 12]] * 3, [truth])
    assert gentle.within(0, 1) == pytest.approx(gentle.within(0, 2) / 2, rel=0.02)
    assert gentle.layout()[0][0] >= 2


def test_auto_shapes_and_parse():
    assert (1,) in auto_shapes(3) and (3, 2, 1) in auto_shapes(3) and (1, 2) not in auto_shapes(3)
    assert all(nodes(s) <= 16 and len(s) <= 3 for s in auto_shapes(3))
    assert parse_tree("2,1,1") == (2, 1, 1) and parse_tree("auto") == "auto" and parse_tree(None) is None
    for bad in ("", "0", "4", "2,,1", "a", "2.0", "-1", ",".join(["3"] * 5), 3):
        with pytest.raises(ValueError, match="tree must be"):
            DecodeConfig(mode="exact", tree=bad)
    with pytest.raises(ValueError, match="exact mode only"):
        DecodeConfig(mode="hybrid", tree="auto", temperature=0.7)
    assert DecodeConfig(mode="exact", tree="auto", temperature=0.7).tree == "auto"
    assert DecodeConfig(mode="mars", tree="2,1").tree == "2,1"  # not read outside exact and hybrid


def test_a_batch_refuses_trees(tiny_llama):
    ids = [prompt_ids(tiny_llama.tokenizer, p) for p in PROMPTS[:2]]
    with pytest.raises(ValueError, match="one sequence at a time"):
        stream_batch(tiny_llama.backend, tiny_llama.tokenizer, ids, DecodeConfig(mode="exact", tree="2,1"),
                     mask_id=3, block_size=4)


def test_generate_tree_flag_prints_branches_and_shapes(model_dir, capsys):
    def run(*flags):
        argv = ["generate", "--model", model_dir, "--prompt", "Count.", "--max-new-tokens", "12", "--json", *flags]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    ar, trees = run("--mode", "ar"), run("--mode", "exact", "--tree", "2,1")
    assert trees["token_ids"] == ar["token_ids"]
    assert all(len(s["branches"]) == len(s["tokens"]) and len(s["shape"]) <= 2 for s in trees["steps"][1:])
    assert not any(s.get("branches") for s in run("--mode", "exact", "--tree", "none")["steps"])  # a chain: no ranks


@pytest.mark.parametrize(
    "flags, message",
    [(["--tree", "4"], "tree must be"), (["--tree", "2,x"], "tree must be"),
     (["--tree", "auto", "--temperature", "0.7", "--mode", "hybrid"], "exact mode only")],
)
def test_bad_tree_flags_are_one_line_and_exit_2(flags, message, capsys):
    parse_error = "--temperature" not in flags  # argparse refuses a bad shape itself
    with pytest.raises(SystemExit) if parse_error else nullcontext() as raised:
        code = main(["generate", "--prompt", "hi", "--mode", "exact", *flags])
    code = raised.value.code if parse_error else code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error:") and message in err


# -- at a temperature: recursive rejection (tree_sampled.py) -------------------------------------------------


def tree_runs(lm, ids, how, n: int, tokens: int, block_size: int, shape: str) -> tuple[list[tuple], list]:
    """The first ``tokens`` tokens of ``n`` seeded exact-mode runs with trees, and all their passes."""
    stop, outputs, every = eos_ids(lm.backend, lm.tokenizer), [], []
    for seed in range(n):
        config = DecodeConfig(mode="exact", temperature=how.temperature, top_p=how.top_p, top_k=how.top_k,
                              max_new_tokens=tokens, seed=seed, max_fed=None, tree=shape)
        passes = list(decode_passes(lm.backend, ids, config, window=block_size, mask_id=lm.meta.mask_token_id,
                                    tau=LiveTau(1.0), stop_ids=stop))
        outputs.append(tuple(t for p in passes for t in p.tokens))
        every += passes
    return outputs, every


@pytest.fixture(scope="module")
def sampling_lm():
    return drafty(make_lm("llama"))


@pytest.mark.parametrize("how", [TOP_K, TOP_P], ids=["top-k", "top-p"])
@pytest.mark.parametrize("shape", ["2,1", "3"])
def test_sampled_trees_sample_as_ar_sampling(sampling_lm, how, shape):
    """The first three tokens of exact mode with trees against AR sampling's distribution, enumerated exactly
    (test_sampling.py's chi-square test); candidates other than the top guess are kept, and rejections resampled."""
    ids = prompt_ids(sampling_lm.tokenizer, PROMPTS[0])
    samples, every = tree_runs(sampling_lm, ids, how, 800, 3, 3, shape)
    assert chi_square_p(samples, ar_distribution(sampling_lm, ids, how, 3)) > SIGNIFICANCE
    assert any(b > 0 for p in every for b in p.branches)
    assert {o for p in every for o in p.origins} >= {exact.DRAFT, exact.RESAMPLED}


def _walk_without_renormalising(children, p_at, uniforms):
    """Child i kept with p(x_i), not p(x_i) / (what the rejected siblings left): later siblings come too rarely."""
    path, row = [], 0
    while children[row]:
        kept = [node for node in children[row] if uniforms[node] < p_at[node]][:1]
        if not kept:
            return path, row
        path.append(kept[0])
        row = 1 + kept[0]
    return path, row


@pytest.mark.parametrize("broken", [False, True], ids=["the rule", "not renormalised"])
def test_the_tree_rule_alone_gives_p(monkeypatch, broken):
    """Hand-made logits over 6 tokens: three candidates at depth 1, one under each at depth 2. The first two
    committed tokens must follow p at the root, then p at the node of the first (one token where it was drawn
    from the root's residual). A walk that does not renormalise fails the same test."""
    if broken:
        monkeypatch.setattr(tree_sampled, "walk", _walk_without_renormalising)
    t = tree.build([[0, 1, 2], [3]], (3, 1))  # rows: 0 the root, 1-3 nodes 0, 1, 2, 4-6 node 3 under each
    logits = torch.randn(1 + 6 + 2 + 2, 6, generator=torch.Generator().manual_seed(5))
    p = torch.softmax(logits, -1).double()
    expected = {(x,): float(p[0, x]) for x in range(3, 6)}
    expected |= {(x, y): float(p[0, x] * p[1 + x, y]) for x in range(3) for y in range(6)}
    generator, how = torch.Generator().manual_seed(0), Sampling(temperature=1.0)
    samples = [tuple(tree_sampled.verify_tree_sampled(logits, t, 2, how, generator, "probability", 3,
                                                      tree.ranked_candidates)[0][:2]) for _ in range(6000)]
    assert (chi_square_p(samples, expected) > SIGNIFICANCE) != broken


def test_walk_by_hand():
    children = [[0, 1], [2], [], []]  # the root's two children; node 0 has one child (node 2)
    assert tree_sampled.walk(children, [0.5, 0.3, 0.9, 0.0], [0.6, 0.5, 0.1, 0.0]) == ([1], 2)  # 0.6 * 0.5 < 0.3
    assert tree_sampled.walk(children, [0.5, 0.3, 0.9, 0.0], [0.6, 0.7, 0.1, 0.0]) == ([], 0)  # 0.7 * 0.5 >= 0.3
    assert tree_sampled.walk(children, [0.5, 0.3, 0.9, 0.0], [0.4, 0.0, 0.1, 0.0]) == ([0, 2], 3)  # to a leaf
