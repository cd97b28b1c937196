"""Learned indexer, latent memory and IndexMemModule (docs/methods.md §11) on the tiny backbone."""

from __future__ import annotations

import pytest
import torch

from lightning_llm.backbones.inspect import cache_kwarg
from lightning_llm.eviction import (
    BudgetedCache,
    IndexerPolicy,
    LatentMemory,
    LightningIndexer,
    generate_with_budget,
    indexer_kl,
    memory_readout,
)
from lightning_llm.kernels.budgeted_attention import budgeted_attention, phi

PROMPT = 30  # the length of the `prompt` fixture (conftest.py)


@pytest.fixture(scope="module")
def indexers(model):
    torch.manual_seed(0)
    return torch.nn.ModuleList(LightningIndexer(model.config.hidden_size, heads=3, dim=8) for _ in range(4))


@pytest.fixture
def memory(model):
    torch.manual_seed(1)
    mem = LatentMemory.for_model(model, gate_bias=0.0, mode="residual")  # the readout's formula, by hand
    for gate in mem.gates:  # a data-dependent gate, so the test sees the gate's input too
        torch.nn.init.normal_(gate.weight, std=0.1)
    return mem


def test_indexer_scores_formula_and_causality(indexers):
    torch.manual_seed(0)
    idx = indexers[0]
    h = torch.randn(2, 5, idx.query.in_features)
    keys = idx.keys(h)
    scores = idx.scores(h, keys, causal_offset=0)
    q = idx.query(h).view(2, 5, idx.heads, idx.dim)
    w = idx.weight(h)
    for t in range(5):
        for s in range(5):
            want = sum(
                w[:, t, j] * torch.relu(q[:, t, j] @ keys[:, s].T).diagonal() * idx.dim**-0.5
                for j in range(idx.heads)
            )
            if s > t:
                assert bool(torch.isinf(scores[:, t, s]).all())
            else:
                torch.testing.assert_close(scores[:, t, s], want, rtol=1e-5, atol=1e-6)


def test_indexer_kl_zero_on_match_and_positive_otherwise():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 6)
    p = logits.softmax(-1)
    assert indexer_kl(logits, p).abs().item() < 1e-6
    assert indexer_kl(torch.zeros_like(logits), p).item() > 0.01
    # masked-out keys (probability 0, score -inf) contribute nothing
    masked = logits.clone()
    masked[..., -1] = float("-inf")
    p0 = masked.softmax(-1)
    assert indexer_kl(masked, p0).abs().item() < 1e-6


@pytest.mark.parametrize("accumulate", [True, False])
def test_large_budget_indexer_and_memory_reproduce_generate_exactly(
    model, prompt, indexers, memory, accumulate
):
    ref = model.generate(
        prompt, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    policy = IndexerPolicy(indexers, sinks=4, window=8, accumulate=accumulate)
    out = generate_with_budget(
        model, prompt, policy=policy, budget=64, max_new_tokens=6, output_logits=True, memory=memory
    )
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.logits, torch.stack(ref.logits, dim=1))
    assert memory.evicted_tokens == 0 and all(memory.state(i) is None for i in range(4))
    assert policy.key_cache_bytes == 4 * (PROMPT + 5) * 8 * 4


def test_memory_state_is_the_fold_of_exactly_the_evicted_tokens(model, prompt, indexers, memory):
    seen = []

    def record(layer, k, v):
        seen.append((layer, k.clone(), v.clone()))
        memory.on_evict(layer, k, v)

    policy = IndexerPolicy(indexers, sinks=2, window=4)
    cache = BudgetedCache(policy, 12, num_layers=4, on_evict=record)
    _decode_steps(model, prompt, cache, memory, steps=3)
    start = PROMPT + 2  # tokens seen: the prefilled prompt, then two one-token decoding steps
    for layer in range(4):
        ks = torch.cat([k for i, k, _ in seen if i == layer], dim=2)
        vs = torch.cat([v for i, _, v in seen if i == layer], dim=2)
        assert ks.shape[2] == cache.stats()[layer].evicted == start - 12
        s, z = memory.state(layer)
        torch.testing.assert_close(s, torch.einsum("bhnf,bhnd->bhfd", phi(ks), vs), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(z, phi(ks).sum(2), rtol=1e-5, atol=1e-5)
    assert memory.evicted_tokens == start - 12
    # every kept set is the same for the KV heads (indexer scores are shared by the heads of a layer)
    for layer in range(4):
        kept = cache.kept_positions(layer)
        assert torch.equal(kept[:, 0], kept[:, 1])
    assert policy.key_cache_bytes == 4 * 12 * 8 * 4


def test_memory_readout_matches_the_kernel_and_a_by_hand_weighted_mean():
    torch.manual_seed(0)
    b, hq, hkv, d = 2, 4, 2, 8
    q = torch.randn(b, hq, 1, d)
    keys, values = torch.randn(b, hkv, 7, d), torch.randn(b, hkv, 7, d)
    s = torch.einsum("bhnf,bhnd->bhfd", phi(keys), values)
    z = phi(keys).sum(2)
    gate = torch.rand(b, hq)
    ours = memory_readout(q, s, z)[:, :, 0] * gate[..., None]
    expand = hq // hkv
    ref = budgeted_attention(
        q[:, :, 0],
        torch.zeros(b, hkv, 1, d),
        torch.zeros(b, hkv, 1, d),
        torch.zeros(b, hkv, dtype=torch.long),  # no kept slots: the kernel returns only the memory readout
        memory_state=s.repeat_interleave(expand, dim=1),
        memory_norm=z.repeat_interleave(expand, dim=1),
        gate=gate,
    )
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    # by hand: a phi-kernel-weighted mean of the evicted values of the query head's KV head (GQA)
    for bi in range(b):
        for h in range(hq):
            j = h // expand
            w = phi(keys[bi, j]) @ phi(q[bi, h, 0])  # [n]
            want = (w[:, None] * values[bi, j]).sum(0) / (w.sum() + 1e-6) * gate[bi, h]
            torch.testing.assert_close(ours[bi, h], want, rtol=1e-5, atol=1e-6)


def test_memory_changes_the_output_only_after_eviction(model, prompt, indexers, memory):
    policy = IndexerPolicy(indexers, sinks=2, window=4)
    with_mem = generate_with_budget(
        model, prompt, policy=policy, budget=12, max_new_tokens=3, output_logits=True, memory=memory
    )
    without = generate_with_budget(
        model, prompt, policy=policy, budget=12, max_new_tokens=3, output_logits=True
    )
    # the first token comes from the prefill, before anything was evicted: identical
    assert torch.equal(with_mem.logits[:, 0], without.logits[:, 0])
    assert not torch.allclose(with_mem.logits[:, 1:], without.logits[:, 1:])


def test_indexer_policy_errors(model, prompt, indexers):
    with pytest.raises(ValueError, match="one indexer per layer"):
        IndexerPolicy([])
    with pytest.raises(ValueError, match="observation_window"):
        IndexerPolicy(indexers, observation_window=0)
    with pytest.raises(ValueError, match="3 indexers"):
        generate_with_budget(
            model, prompt, policy=IndexerPolicy(list(indexers)[:3]), budget=24, max_new_tokens=1
        )
    cache = BudgetedCache(IndexerPolicy(indexers), 24, num_layers=4)
    with pytest.raises(RuntimeError, match="attach"), torch.no_grad():
        model(input_ids=prompt, use_cache=True, **{cache_kwarg(model): cache})


def _needle_data(seed: int = 0):
    from lightning_llm.datamodules.needle import NeedleDataModule

    return NeedleDataModule(
        task="needle",
        task_kwargs={"haystack_words": 24, "value_digits": 1},
        num_train=64,
        num_val=8,
        batch_size=4,
        seed=seed,
    )


def test_indexmem_module_trains_the_indexer_and_gates_only(quiet_trainer):
    from lightning_llm.modules import IndexMemModule

    torch.manual_seed(0)
    module = IndexMemModule("tiny", budget=12, sinks=2, window=4, lr=1e-2)
    frozen = {k: v.clone() for k, v in module.model.state_dict().items()}
    dm = _needle_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    before = {k: v.detach() for k, v in module._losses(batch).items()}
    gates = [g.weight.clone() for g in module.memory.gates]
    quiet_trainer(max_steps=30).fit(module, dm)
    after = module._losses(batch)
    assert after["indexer"].item() < 0.7 * before["indexer"].item()
    assert before["memory"].item() > 0 and torch.isfinite(after["memory"])
    assert all(not torch.equal(a, g.weight) for a, g in zip(gates, module.memory.gates, strict=True))
    for k, v in module.model.state_dict().items():
        assert torch.equal(v, frozen[k]), k


def test_indexmem_save_load_and_resume_exact(tmp_path, quiet_trainer):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_llm.modules import IndexMemModule

    def make():
        torch.manual_seed(0)
        return IndexMemModule("tiny", budget_ratio=0.5, sinks=2, window=4, indexer_dim=8)

    straight = make()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    quiet_trainer(max_steps=6, callbacks=[saver], enable_checkpointing=True).fit(straight, _needle_data())
    resumed = make()
    quiet_trainer(max_steps=6).fit(resumed, _needle_data(), ckpt_path=str(tmp_path / "step=3.ckpt"))
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    assert torch.load(tmp_path / "step=3.ckpt", weights_only=True)["hyper_parameters"]["indexer_dim"] == 8

    straight.save_pretrained(tmp_path / "artefact")
    loaded = IndexMemModule.from_pretrained(tmp_path / "artefact")
    assert loaded.hparams.indexer_dim == 8 and loaded.hparams.budget_ratio == 0.5
    for a, b in zip(straight.indexers.parameters(), loaded.indexers.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(straight.memory.parameters(), loaded.memory.parameters(), strict=True):
        assert torch.equal(a, b)
    assert loaded.budget_for(100) == 50 and loaded.budget_for(8) == 6


def test_indexmem_module_errors():
    from lightning_llm.modules import IndexMemModule

    with pytest.raises(ValueError, match="budget"):
        IndexMemModule("tiny", budget=4, sinks=4, window=8)
    with pytest.raises(ValueError, match="budget_ratio"):
        IndexMemModule("tiny", budget_ratio=0.0)
    with pytest.raises(ValueError, match="not both 0"):
        IndexMemModule("tiny", indexer_weight=0.0, memory_weight=0.0)


def _decode_steps(model, prompt, cache, memory, steps=3):
    """Prefill + greedy decode through ``cache`` with ``memory`` attached; the o_proj inputs of layer 3's last step."""
    captured = {}
    ids, start = prompt, 0
    with torch.no_grad(), cache.attach(model), memory.attach(model, cache=cache):
        # registered after the memory's hooks, so it sees the o_proj input with the readout mixed in
        handle = model.model.layers[3].self_attn.o_proj.register_forward_pre_hook(
            lambda _m, args: captured.__setitem__("heads", args[0].clone())
        )
        try:
            for _ in range(steps):
                pos = torch.arange(start, start + ids.shape[1])[None]
                logits = model(
                    input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache}
                ).logits
                start += ids.shape[1]
                ids = logits[:, -1:].argmax(-1)
        finally:
            handle.remove()
    return captured["heads"], logits


def test_softmax_memory_interpolates_between_the_cache_and_the_readout(model, prompt, indexers):
    """mode="softmax": out = o + σ(log m − log Z)(r − o); a tiny mass gives the cache's output, a huge one the
    readout (checked against memory_readout of layer 3's state and queries by hand)."""
    from lightning_llm.eviction.base import rotated_queries

    def run(log_scale):
        torch.manual_seed(1)
        memory = LatentMemory.for_model(model, gate_bias=0.0, mode="softmax")
        with torch.no_grad():
            memory.log_mass_scale.fill_(log_scale)
        policy = IndexerPolicy(indexers, sinks=2, window=4)
        cache = BudgetedCache(policy, 12, num_layers=4, on_evict=memory.on_evict)
        return _decode_steps(model, prompt, cache, memory), memory

    policy = IndexerPolicy(indexers, sinks=2, window=4)
    plain = LatentMemory.for_model(model, gate_bias=-1e4, mode="residual")  # a closed gate: the cache alone
    (cache_heads, cache_logits) = _decode_steps(
        model, prompt, BudgetedCache(policy, 12, 4, plain.on_evict), plain
    )
    (low_heads, low_logits), _ = run(-200.0)
    torch.testing.assert_close(low_heads, cache_heads, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(low_logits, cache_logits, rtol=1e-5, atol=1e-5)

    # a huge mass: the head outputs are the readout of the state before the step, for the step's queries
    torch.manual_seed(1)
    memory = LatentMemory.for_model(model, gate_bias=0.0, mode="softmax")
    with torch.no_grad():
        memory.log_mass_scale.fill_(200.0)
    cache = BudgetedCache(IndexerPolicy(indexers, sinks=2, window=4), 12, 4, on_evict=memory.on_evict)
    seen = {}
    attn = model.model.layers[3].self_attn

    def grab(module, args, kwargs):
        state = memory.state(3)  # None at the prefill (nothing evicted yet)
        seen["q"] = rotated_queries(module, args, kwargs)
        seen["state"] = None if state is None else tuple(t.clone() for t in state)

    handle = attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        high_heads, _ = _decode_steps(model, prompt, cache, memory)
    finally:
        handle.remove()
    read = memory_readout(seen["q"], *seen["state"])  # [1, Hq, 1, D]
    torch.testing.assert_close(
        high_heads, read.transpose(1, 2).reshape(high_heads.shape), rtol=1e-4, atol=1e-5
    )
    assert not torch.allclose(high_heads, cache_heads, atol=1e-3)


def test_decode_kernel_computes_the_softmax_memory_step(model, prompt, indexers):
    """At a decode step, ``budgeted_attention(memory_mode="softmax")`` over the attended keys/values with the
    memory's state (before the step), queries and mass factor ``σ(gate)·e^c`` gives the head outputs
    ``LatentMemory(mode="softmax")`` produces through its hooks (layer 3, after evictions)."""
    from lightning_llm.eviction.base import rotated_queries
    from lightning_llm.eviction.indexer import attention_input

    torch.manual_seed(2)
    memory = LatentMemory.for_model(model, gate_bias=0.0, mode="softmax")
    with torch.no_grad():
        memory.log_mass_scale.normal_(0.0, 1.0)
        for gate in memory.gates:
            torch.nn.init.normal_(gate.weight, std=0.1)
    cache = BudgetedCache(IndexerPolicy(indexers, sinks=2, window=4), 12, 4, on_evict=memory.on_evict)
    attn, seen = model.model.layers[3].self_attn, {}

    def grab(module, args, kwargs):
        state = memory.state(3)
        seen["q"] = rotated_queries(module, args, kwargs)
        seen["hidden"] = attention_input(module, args, kwargs)
        seen["state"] = None if state is None else tuple(t.clone() for t in state)

    update = cache.update

    def recording_update(keys, values, layer_idx, *args, **kwargs):
        out = update(keys, values, layer_idx, *args, **kwargs)
        if layer_idx == 3:
            seen["kv"] = out
        return out

    cache.update = recording_update
    handle = attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        heads, _ = _decode_steps(model, prompt, cache, memory, steps=4)
    finally:
        handle.remove()
    keys, values = seen["kv"]
    b, hkv, s, d = keys.shape
    hq = seen["q"].shape[1]
    state, norm = (t.repeat_interleave(hq // hkv, dim=1) for t in seen["state"])  # per query head
    with torch.no_grad():
        factor = torch.sigmoid(memory.gates[3](seen["hidden"]))[:, -1] * memory.log_mass_scale[3].exp()
    got = budgeted_attention(
        seen["q"][:, :, -1],
        keys,
        values,
        torch.full((b, hkv), s),
        scale=float(attn.scaling),
        memory_state=state,
        memory_norm=norm,
        gate=factor,
        memory_mode="softmax",
    )
    torch.testing.assert_close(got, heads.view(b, hq, d), rtol=1e-5, atol=1e-5)
    no_memory = budgeted_attention(
        seen["q"][:, :, -1], keys, values, torch.full((b, hkv), s), scale=float(attn.scaling)
    )
    assert (got - no_memory).abs().max() > 1e-3  # the slot mattered at this step


def test_softmax_memory_needs_the_cache_and_trains(model, quiet_trainer, tmp_path):
    from lightning_llm.modules import IndexMemModule

    memory = LatentMemory.for_model(model, mode="softmax")
    with pytest.raises(ValueError, match="needs the cache"), memory.attach(model):
        pass
    with pytest.raises(ValueError, match="mode"):
        LatentMemory.for_model(model, mode="slot")
    torch.manual_seed(0)
    module = IndexMemModule("tiny", budget=12, sinks=2, window=4, lr=1e-2, memory_mode="softmax")
    scale = module.memory.log_mass_scale.detach().clone()
    quiet_trainer(max_steps=5).fit(module, _needle_data())
    assert not torch.equal(module.memory.log_mass_scale, scale)
    module.save_pretrained(tmp_path)
    loaded = IndexMemModule.from_pretrained(tmp_path)
    assert loaded.memory.mode == "softmax"
    assert torch.equal(loaded.memory.log_mass_scale, module.memory.log_mass_scale)


def test_memory_uses_no_extra_kv_slots(model, prompt, indexers, memory):
    """The memory adds a readout, never cache entries: per-layer cache statistics and peak KV bytes are those of
    the indexer alone at the same budget (the behaviour test compares accuracies at exactly these budgets)."""
    runs = [
        generate_with_budget(
            model,
            prompt,
            policy=IndexerPolicy(indexers, sinks=2, window=2),
            budget=8,
            max_new_tokens=4,
            memory=m,
        )
        for m in (None, memory)
    ]
    assert memory.evicted_tokens > 0
    assert runs[0].cache_stats == runs[1].cache_stats  # as many tokens kept and evicted, layer by layer
    assert runs[0].peak_cache_bytes == runs[1].peak_cache_bytes
