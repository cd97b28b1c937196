"""Budgeted KV cache and eviction policies (docs/methods.md §11) on the tiny backbone."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from lightning_llm.backbones.inspect import cache_kwarg
from lightning_llm.eviction import (
    H2O,
    BudgetedCache,
    EvictionPolicy,
    FullCache,
    SnapKV,
    StreamingLLM,
    generate_with_budget,
    record_prefill,
)

PROMPT = 30  # the length of the `prompt` fixture (conftest.py)


@pytest.fixture(scope="module")
def eager_attentions(model, prompt):
    """Attention probabilities ``[1, Hq, L, L]`` per layer of the full prompt, from transformers' eager path."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        return eager(prompt, output_attentions=True).attentions


def _forward(model, cache, ids, start):
    pos = torch.arange(start, start + ids.shape[1])[None]
    with torch.no_grad(), cache.attach(model):
        return model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache}).logits


def _group_sum(x, hkv=2):  # [B, Hq, S] -> [B, Hkv, S]; query heads i*G..(i+1)*G-1 share KV head i
    return x.reshape(x.shape[0], hkv, -1, x.shape[-1]).sum(dim=2)


def _streaming_keep(sinks, window, budget, s=PROMPT):
    return torch.cat([torch.arange(sinks), torch.arange(s - (budget - sinks), s)])


def _expected_keep(scores, sinks, window, budget):
    s = scores.shape[-1]
    top = scores[..., sinks : s - window].topk(budget - sinks - window, dim=-1).indices + sinks
    fixed = torch.cat([torch.arange(sinks), torch.arange(s - window, s)]).expand(*scores.shape[:2], -1)
    return torch.cat([fixed, top], dim=-1).sort(dim=-1).values


@pytest.mark.parametrize("policy", [FullCache(), StreamingLLM(), H2O(), SnapKV()], ids=repr)
def test_large_budget_reproduces_generate_exactly(model, prompt, policy):
    calls = []
    ref = model.generate(
        prompt, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    out = generate_with_budget(
        model, prompt, policy=policy, budget=64, max_new_tokens=6, output_logits=True, memory=calls.append
    )
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.logits, torch.stack(ref.logits, dim=1))
    assert calls == []
    for st in out.cache_stats:
        assert (st.seen, st.kept, st.evicted, st.peak_kept) == (PROMPT + 5, PROMPT + 5, 0, PROMPT + 5)
    assert out.peak_cache_bytes == 4 * 2 * (2 * (PROMPT + 5) * 32) * 4  # layers x (k, v) x Hkv*S*D x fp32


@pytest.mark.parametrize(
    "policy", [StreamingLLM(4, 8), H2O(4, 8), SnapKV(4, 8, observation_window=8, kernel_size=3)], ids=repr
)
def test_small_budget_accounting_and_on_evict(model, prompt, policy):
    budget, steps = 16, 4
    evicted = []
    cache = BudgetedCache(policy, budget, num_layers=4, on_evict=lambda i, k, v: evicted.append((i, k, v)))
    ids, seen = prompt, 0
    full_ids = prompt
    for step in range(steps):
        before = [
            cache.kept_positions(i) if seen else torch.zeros(1, 2, 0, dtype=torch.long) for i in range(4)
        ]
        n_calls = len(evicted)
        logits = _forward(model, cache, ids, seen)
        new = torch.arange(seen, seen + ids.shape[1]).expand(1, 2, -1)
        seen += ids.shape[1]
        for layer, st in enumerate(cache.stats()):
            assert (st.seen, st.kept, st.evicted, st.peak_kept) == (seen, budget, seen - budget, budget)
            kept = cache.kept_positions(layer)
            assert kept.shape == (1, 2, budget) and bool((kept.diff(dim=-1) > 0).all())
            assert bool((kept[..., :4] == torch.arange(4)).all())  # sinks
            assert bool((kept[..., -8:] == torch.arange(seen - 8, seen)).all())  # recent window
        # exactly one on_evict per layer, with the evicted tokens (previously kept + new, minus kept now)
        calls = evicted[n_calls:]
        assert [c[0] for c in calls] == [0, 1, 2, 3]
        for layer, k, v in calls:
            cand = torch.cat([before[layer], new], dim=-1)
            gone = torch.stack(
                [cand[0, h][~torch.isin(cand[0, h], cache.kept_positions(layer)[0, h])] for h in range(2)]
            )[None]
            assert k.shape == v.shape == (1, 2, gone.shape[-1], 32)
            # the reference: a plain full-cache forward; its keys equal ours for layer 0 always (keys of layer 0
            # depend on the token and position only) and for every layer at prefill (attention saw everything)
            if layer == 0 or step == 0:
                full = DynamicCache()
                with torch.no_grad():
                    model(full_ids, use_cache=True, **{cache_kwarg(model): full})
                idx = gone[..., None].expand(-1, -1, -1, 32)
                torch.testing.assert_close(k, full.layers[layer].keys.gather(2, idx), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(v, full.layers[layer].values.gather(2, idx), rtol=1e-5, atol=1e-5)
        ids = logits[:, -1:].argmax(-1)
        full_ids = torch.cat([full_ids, ids], dim=-1)
    assert cache.peak_bytes == 4 * 2 * (2 * budget * 32) * 4


def test_streaming_llm_positions_and_mask_match_masked_full_forward(model, prompt):
    """After eviction, logits equal a full forward whose 4D mask hides exactly the evicted positions: this
    proves RoPE positions and the shrunken-cache mask (incl. causality inside a multi-token chunk)."""
    sinks, window, budget = 4, 8, 16
    cache = BudgetedCache(StreamingLLM(sinks, window), budget, num_layers=4)
    chunks = [prompt, torch.tensor([[7, 8, 9]]), torch.tensor([[11]]), torch.tensor([[12]])]
    seq = torch.cat(chunks, dim=-1)
    n = seq.shape[1]
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    ours, seen = [], 0
    for chunk in chunks:
        visible = torch.ones(
            n, dtype=torch.bool
        )  # what this chunk's queries may see: kept + the chunk itself
        if seen:
            kept = cache.kept_positions(0)
            for layer in range(4):  # StreamingLLM keeps the same positions on every layer and head
                assert torch.equal(cache.kept_positions(layer), kept.expand(1, 2, -1))
            expected = torch.cat([torch.arange(sinks), torch.arange(seen - (budget - sinks), seen)])
            assert torch.equal(kept[0, 0], expected)
            visible[:seen] = False
            visible[kept[0, 0]] = True
        rows = slice(seen, seen + chunk.shape[1])
        allowed[rows] &= visible
        ours.append(_forward(model, cache, chunk, seen)[0])
        seen += chunk.shape[1]
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        ref = model(seq, attention_mask=mask).logits[0]
    torch.testing.assert_close(torch.cat(ours), ref, rtol=1e-5, atol=1e-5)
    # and eviction mattered: without the mask the logits after eviction differ
    with torch.no_grad():
        plain = model(seq).logits[0]
    assert (plain[PROMPT:] - ref[PROMPT:]).abs().max() > 1e-3


def test_h2o_keeps_heavy_hitters(model, prompt, eager_attentions):
    sinks, window, budget = 4, 8, 16
    policy = H2O(sinks, window)
    cache = BudgetedCache(policy, budget, num_layers=4)
    _forward(model, cache, prompt, 0)
    for layer, attn in enumerate(eager_attentions):
        scores = _group_sum(attn.sum(dim=2))  # mass received from every prompt query
        keep = _expected_keep(scores, sinks, window, budget)
        torch.testing.assert_close(policy._acc[layer], scores.gather(-1, keep), rtol=1e-4, atol=1e-5)
        assert torch.equal(cache.kept_positions(layer), keep)
        assert not torch.equal(keep[0, 0], _streaming_keep(sinks, window, budget))  # not trivially recency


def test_snapkv_keeps_observation_window_votes(model, prompt, eager_attentions):
    sinks, window, budget, obs, kernel = 4, 8, 16, 6, 3
    cache = BudgetedCache(SnapKV(sinks, window, observation_window=obs, kernel_size=kernel), budget, 4)
    _forward(model, cache, prompt, 0)
    for layer, attn in enumerate(eager_attentions):
        votes = _group_sum(attn[:, :, -obs:].sum(dim=2))[0]  # [Hkv, S]
        padded = torch.nn.functional.pad(votes, (1, 1), value=-1.0)
        pooled = torch.stack([padded[:, i : i + kernel].max(dim=-1).values for i in range(PROMPT)], dim=-1)
        keep = _expected_keep(pooled[None], sinks, window, budget)
        assert torch.equal(cache.kept_positions(layer), keep)
        assert not torch.equal(keep[0, 0], _streaming_keep(sinks, window, budget))  # not trivially recency


def test_snapkv_avg_prefix_pools_only_the_prefix_like_kvpress(model, prompt, eager_attentions):
    sinks, window, budget, obs, kernel = 4, 4, 16, 6, 3
    policy = SnapKV(sinks, window, observation_window=obs, kernel_size=kernel, pooling="avg_prefix")
    cache = BudgetedCache(policy, budget, 4)
    _forward(model, cache, prompt, 0)
    for layer, attn in enumerate(eager_attentions):
        votes = _group_sum(attn[:, :, -obs:].sum(dim=2))[0, :, : PROMPT - obs]  # [Hkv, S - obs], prefix only
        padded = torch.nn.functional.pad(votes, (1, 1), value=0.0)
        pooled = torch.stack([padded[:, i : i + kernel].mean(dim=-1) for i in range(PROMPT - obs)], dim=-1)
        scores = torch.cat([pooled, torch.full((pooled.shape[0], obs), 1e3)], dim=-1)  # window kept first
        keep = _expected_keep(scores[None], sinks, window, budget)
        assert torch.equal(cache.kept_positions(layer), keep)
        assert set(range(PROMPT - obs, PROMPT)) <= set(keep[0, 0].tolist())
    with pytest.raises(ValueError, match="pooling"):
        SnapKV(pooling="mean")


def test_errors(model, prompt):
    with pytest.raises(ValueError, match="budget"):
        generate_with_budget(model, prompt, policy=StreamingLLM(4, 8), budget=11, max_new_tokens=1)
    with pytest.raises(ValueError, match="needs a budget"):
        BudgetedCache(H2O(), None, num_layers=4)
    with pytest.raises(ValueError, match="kernel_size"):
        SnapKV(kernel_size=4)
    with pytest.raises(TypeError, match="EvictionPolicy"):
        BudgetedCache("h2o", 16, num_layers=4)
    with pytest.raises(ValueError, match="unsupported model"):
        generate_with_budget(torch.nn.Linear(2, 2), prompt, policy=H2O(), budget=32, max_new_tokens=1)

    class Sliding(torch.nn.Module):
        config = copy.deepcopy(model.config)

    Sliding.config.layer_types = ["sliding_attention"] * 4
    with pytest.raises(ValueError, match="unsupported model"):
        generate_with_budget(Sliding(), prompt, policy=StreamingLLM(), budget=32, max_new_tokens=1)
    with pytest.raises(ValueError, match="left-padded"):
        mask = torch.ones_like(prompt).index_fill_(1, torch.tensor([3]), 0)
        generate_with_budget(model, prompt, mask, policy=H2O(), budget=32, max_new_tokens=1)
    with pytest.raises(NotImplementedError, match="memory"):
        mask = torch.ones_like(prompt).index_fill_(1, torch.tensor([0]), 0)
        generate_with_budget(
            model, prompt, mask, policy=H2O(), budget=32, max_new_tokens=1, memory=lambda *a: None
        )
    with pytest.raises(TypeError, match="num_beams"):
        generate_with_budget(model, prompt, policy=H2O(), budget=32, max_new_tokens=1, num_beams=2)
    with pytest.raises(RuntimeError, match="attach"):  # attention policy without the query hooks
        cache = BudgetedCache(H2O(4, 8), 16, num_layers=4)
        with torch.no_grad():
            model(prompt, use_cache=True, **{cache_kwarg(model): cache})
    assert issubclass(StreamingLLM, EvictionPolicy)


def test_sampling_and_eos(model, prompt):
    g = torch.Generator().manual_seed(0)
    out = generate_with_budget(
        model,
        prompt.repeat(2, 1),
        policy=H2O(4, 8),
        budget=16,
        max_new_tokens=5,
        do_sample=True,
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        generator=g,
    )
    assert out.sequences.shape == (2, PROMPT + 5)
    assert all(st.kept == 16 and st.seen == PROMPT + 4 for st in out.cache_stats)
    first = generate_with_budget(model, prompt, policy=StreamingLLM(4, 8), budget=16, max_new_tokens=1)
    eos = int(first.sequences[0, -1])
    stopped = generate_with_budget(
        model, prompt, policy=StreamingLLM(4, 8), budget=16, max_new_tokens=5, eos_token_id=eos
    )
    assert stopped.sequences.shape[1] == PROMPT + 1


@pytest.mark.parametrize(
    "policy", [FullCache(), StreamingLLM(4, 8), H2O(4, 8), SnapKV(4, 8, observation_window=8)], ids=repr
)
def test_left_padded_batch_equals_one_prompt_at_a_time(model, prompt, policy):
    # rows of 30, 23, 17 and 11 real tokens under a 16-slot budget: evicting at prefill, at decode only, never
    lengths = (PROMPT, 23, 17, 11)
    rows = [prompt[0, PROMPT - n :] for n in lengths]
    ids = torch.zeros((len(rows), PROMPT), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, PROMPT - len(row) :] = row
        mask[i, PROMPT - len(row) :] = 1
    batched = generate_with_budget(
        model, ids, mask, policy=policy, budget=16, max_new_tokens=8, output_logits=True
    )
    for i, row in enumerate(rows):
        alone = generate_with_budget(
            model, row[None], policy=policy, budget=16, max_new_tokens=8, output_logits=True
        )
        assert torch.equal(batched.sequences[i, PROMPT:], alone.sequences[0, len(row) :])
        torch.testing.assert_close(batched.logits[i], alone.logits[0])
    # a recorded prefill replayed through the cache gives exactly the same run
    prefill = record_prefill(model, ids, mask)
    replayed = generate_with_budget(
        model, ids, mask, policy=policy, budget=16, max_new_tokens=8, output_logits=True, prefill=prefill
    )
    assert torch.equal(replayed.sequences, batched.sequences)
    assert torch.equal(replayed.logits, batched.logits)
    assert (
        replayed.cache_stats == batched.cache_stats and replayed.peak_cache_bytes == batched.peak_cache_bytes
    )
    with pytest.raises(ValueError, match="other input_ids"):
        generate_with_budget(model, ids, policy=policy, budget=16, max_new_tokens=1, prefill=prefill)
    last = batched.cache_stats[-1]
    assert last.seen == PROMPT + 7 and last.kept == (16 if policy.evicts else PROMPT + 7)
