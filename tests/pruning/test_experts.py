"""MoE expert pruning: RaGEP and baselines select, prune consistently, and the pruned model runs and reloads."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_llm.backbones import build_tiny_moe, load_backbone, load_tokenizer
from lightning_llm.backbones.moe import load_moe
from lightning_llm.callbacks import ExpertPruning
from lightning_llm.pruning import (
    METHODS,
    SELECTIONS,
    MoELayerStats,
    ScoredSelection,
    collect_moe_statistics,
    effective_rank,
    layer_budgets,
    moe_blocks,
    naee_reconstruction_error,
    prune_experts,
    select_experts,
)

TEXTS = [
    "What is 12 + 7? The answer is 19.",
    "Count the words in this short sentence please.",
    "the cat sat on the mat and looked at the dog",
    "<think>3 times 4 is 12</think><answer>12</answer>",
]


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def moe_dir(request, tmp_path_factory, _isolated_home):
    directory = tmp_path_factory.mktemp(request.param)
    return build_tiny_moe(
        directory, request.param, num_experts=6, top_k=2, layers=2, hidden=32, expert_intermediate=48
    )


@pytest.fixture(scope="module")
def calibration(moe_dir):
    _, tokenizer = load_backbone(str(moe_dir))
    return [tokenizer(TEXTS, return_tensors="pt", padding=True)]


def _logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def _assert_consistent(model):
    blocks = moe_blocks(model)
    counts = set()
    for block in blocks.values():
        n = block.gate.weight.shape[0]
        assert block.experts.gate_up_proj.shape[0] == block.experts.down_proj.shape[0] == n
        assert block.gate.num_experts == block.experts.num_experts == n
        assert block.gate.top_k <= n
        counts.add(n)
    config = model.config
    count = getattr(config, "num_local_experts", None) or config.num_experts
    assert count == max(counts)
    assert config.num_experts_per_tok <= min(counts)


@pytest.mark.parametrize("method", METHODS)
def test_keep_ratio_one_leaves_logits_exactly_equal(moe_dir, calibration, method):
    model, _ = load_backbone(str(moe_dir))
    before = _logits(model, calibration[0])
    kept = ExpertPruning(method, keep_ratio=1.0).prune(model, calibration)
    assert all(v == list(range(6)) for v in kept.values())
    assert torch.equal(_logits(model, calibration[0]), before)


@pytest.mark.parametrize("method", METHODS)
def test_pruned_model_runs_saves_and_reloads(moe_dir, calibration, method, tmp_path):
    model, tokenizer = load_backbone(str(moe_dir))
    pruner = ExpertPruning(method, keep_ratio=0.5)
    kept = pruner.prune(model, calibration)
    assert sum(len(v) for v in kept.values()) == 6  # round(0.5 * 2 layers * 6 experts)
    assert all(len(v) >= 2 for v in kept.values())  # at least the router's top_k
    _assert_consistent(model)
    logits = _logits(model, calibration[0])
    assert torch.isfinite(logits).all()
    out = model.generate(calibration[0]["input_ids"][:1], max_new_tokens=4, do_sample=False)
    assert out.shape[1] == calibration[0]["input_ids"].shape[1] + 4
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = load_moe(tmp_path)
    _assert_consistent(reloaded)
    assert torch.equal(_logits(reloaded, calibration[0]), logits)
    if model.config.expert_pruning["uniform"]:  # one count per layer: the plain HF path rebuilds it too
        plain = AutoModelForCausalLM.from_pretrained(tmp_path)
        assert torch.equal(_logits(plain, calibration[0]), logits)
    assert pruner.state_dict()["kept"] == kept


def test_non_uniform_layers_and_top_k_cap_reload(moe_dir, calibration, tmp_path):
    model, _ = load_backbone(str(moe_dir))
    prune_experts(model, {0: [0, 2, 3, 5], 1: [4]})  # layer 1 keeps fewer experts than top_k=2
    _assert_consistent(model)
    assert model.config.num_experts_per_tok == 1
    assert model.config.expert_pruning == {"kept": {"0": [0, 2, 3, 5], "1": [4]}, "uniform": False}
    prune_experts(model, {0: [1, 3]})  # pruning again records original indices
    assert model.config.expert_pruning["kept"] == {"0": [2, 5], "1": [4]}
    logits = _logits(model, calibration[0])
    model.save_pretrained(tmp_path)
    reloaded = load_moe(tmp_path)
    assert torch.equal(_logits(reloaded, calibration[0]), logits)
    # load_backbone recognises the non-uniform record and goes through load_moe
    load_tokenizer(str(moe_dir)).save_pretrained(tmp_path)
    via_backbone, _ = load_backbone(str(tmp_path))
    assert torch.equal(_logits(via_backbone, calibration[0]), logits)


def test_router_rows_follow_their_experts(moe_dir):
    model, _ = load_backbone(str(moe_dir))
    block = moe_blocks(model)[1]
    gate, up, down = (
        t.detach().clone() for t in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)
    )
    prune_experts(model, {1: [5, 1, 3]})
    assert torch.equal(block.gate.weight, gate[[1, 3, 5]])
    assert torch.equal(block.experts.gate_up_proj, up[[1, 3, 5]])
    assert torch.equal(block.experts.down_proj, down[[1, 3, 5]])


def test_effective_rank_of_known_spectra():
    assert effective_rank(torch.ones(4)) == pytest.approx(4.0)
    assert effective_rank(torch.tensor([2.0, 0.0, 0.0])) == pytest.approx(1.0)
    p = torch.tensor([0.75, 0.25])
    assert effective_rank(torch.tensor([3.0, 1.0])) == pytest.approx(math.exp(-(p * p.log()).sum().item()))
    assert effective_rank(torch.diag(torch.tensor([3.0, 1.0, 0.0]))) == pytest.approx(
        effective_rank(torch.tensor([3.0, 1.0]))
    )
    with pytest.raises(ValueError, match="all-zero"):
        effective_rank(torch.zeros(3, 3))


def test_layer_budgets_sum_to_the_total_within_bounds():
    assert layer_budgets({0: 1.0, 1: 3.0}, {0: 8, 1: 8}, 0.5) == {0: 2, 1: 6}
    assert layer_budgets({0: 0.1, 1: 10.0}, {0: 8, 1: 8}, 0.5, min_experts=2) == {0: 2, 1: 6}
    assert layer_budgets({0: 1.0, 1: 100.0}, {0: 4, 1: 4}, 0.75) == {0: 2, 1: 4}  # layer 1 capped
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        layers = int(torch.randint(1, 7, (1,), generator=generator))
        counts = {i: int(torch.randint(2, 17, (1,), generator=generator)) for i in range(layers)}
        scores = {i: float(torch.rand(1, generator=generator)) * 10 for i in range(layers)}
        ratio = float(torch.rand(1, generator=generator)) * 0.9 + 0.1
        budgets = layer_budgets(scores, counts, ratio, min_experts=2)
        expected = max(
            math.floor(ratio * sum(counts.values()) + 0.5), sum(min(2, c) for c in counts.values())
        )
        assert sum(budgets.values()) == expected
        assert all(min(2, counts[i]) <= budgets[i] <= counts[i] for i in counts)
    # Largest remainders: 3 layers with equal scores share 4 as 2, 1, 1 (ties to the lower layer).
    assert layer_budgets(dict.fromkeys(range(3), 1.0), dict.fromkeys(range(3), 4), 4 / 12) == {
        0: 2,
        1: 1,
        2: 1,
    }


def _toy_stats() -> MoELayerStats:
    """Expert 0 writes into e1..e4, expert 1 duplicates it at 0.9x, expert 2 writes into e5..e8 at 0.5x."""
    generator = torch.Generator().manual_seed(0)
    tokens, hidden = 64, 8
    base = torch.zeros(tokens, hidden)
    base[:, :4] = torch.randn(tokens, 4, generator=generator)
    other = torch.zeros(tokens, hidden)
    other[:, 4:] = torch.randn(tokens, 4, generator=generator)
    outputs = torch.stack([base, 0.9 * base, 0.5 * other])
    return MoELayerStats(
        router_logits=torch.zeros(tokens, 3),
        top_k_index=torch.arange(3).repeat(tokens, 1),
        top_k_weights=torch.full((tokens, 3), 1 / 3),
        expert_outputs=outputs,
    )


def test_ragep_prefers_an_orthogonal_expert_over_a_duplicate():
    stats = _toy_stats()
    assert select_experts("ragep", stats, 2) == [0, 2]
    assert select_experts("reap", stats, 2) == [0, 1]  # energy alone keeps the duplicate
    assert select_experts("ragep", stats, 2, alpha=0.0) == [0, 1]


def test_select_experts_dispatches_through_the_registry(monkeypatch):
    assert tuple(SELECTIONS) == METHODS

    class LastExperts(ScoredSelection):
        name = "last"

        def score(self, stats):
            return torch.arange(stats.num_experts, dtype=torch.float64)

    monkeypatch.setitem(SELECTIONS, "last", LastExperts)
    assert select_experts("last", _toy_stats(), 2) == [1, 2]
    with pytest.raises(ValueError, match="do not apply"):
        select_experts("reap", _toy_stats(), 2, alpha=0.5)
    with pytest.raises(ValueError, match="unknown method"):
        select_experts("magnitude", _toy_stats(), 2)


def test_naee_reconstructs_no_worse_than_frequency(moe_dir, calibration):
    model, _ = load_backbone(str(moe_dir))
    for stats in collect_moe_statistics(model, calibration).values():
        for budget in (2, 3, 4):
            naee = naee_reconstruction_error(stats, select_experts("naee", stats, budget))
            freq = naee_reconstruction_error(stats, select_experts("frequency", stats, budget))
            assert naee <= freq + 1e-12
        assert naee_reconstruction_error(stats, range(stats.num_experts)) == pytest.approx(0.0, abs=1e-10)


def test_statistics_skip_padding(moe_dir, calibration):
    model, _ = load_backbone(str(moe_dir))
    stats = collect_moe_statistics(model, calibration)
    tokens = int(calibration[0]["attention_mask"].sum())
    assert all(s.num_tokens == tokens and s.expert_outputs.shape[:2] == (6, tokens) for s in stats.values())


def test_callback_prunes_at_fit_end(moe_dir, quiet_trainer, tmp_path):
    from lightning_llm.datamodules import ChatSFTDataModule
    from lightning_llm.modules.causal_lm import CausalLMModule

    module = CausalLMModule(str(moe_dir), save_dir=str(tmp_path))
    data = ChatSFTDataModule(task="arithmetic", num_train=8, num_val=0, batch_size=4)
    pruner = ExpertPruning("ragep", keep_ratio=0.5, calibration=2)
    quiet_trainer(max_steps=1, callbacks=[pruner]).fit(module, datamodule=data)
    assert sum(len(v) for v in pruner.kept.values()) == 6
    assert set(pruner.state_dict()) >= {"kept", "budgets", "eranks"}
    _assert_consistent(module.model)
    reloaded = load_moe(tmp_path)  # CausalLMModule saved after the callback pruned
    _assert_consistent(reloaded)
    restored = ExpertPruning("ragep")
    restored.load_state_dict(pruner.state_dict())
    assert restored.kept == pruner.kept


def test_errors(tiny_backbone, moe_dir):
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="keep_ratio"):
            ExpertPruning("ragep", keep_ratio=bad)
        with pytest.raises(ValueError, match="keep_ratio"):
            layer_budgets({0: 1.0}, {0: 4}, bad)
    with pytest.raises(ValueError, match="unknown method"):
        ExpertPruning("magnitude")
    with pytest.raises(ValueError, match="calibration"):
        ExpertPruning("ragep", calibration=0)
    dense, _ = tiny_backbone
    with pytest.raises(ValueError, match="no sparse MoE block"):
        ExpertPruning("ragep").prune(dense, [torch.ones(1, 4, dtype=torch.long)])
    with pytest.raises(ValueError, match="no sparse MoE block"):
        prune_experts(dense, {0: [0]})
    model, _ = load_backbone(str(moe_dir))
    with pytest.raises(ValueError, match="expert indices"):
        prune_experts(model, {0: [0, 6]})
    with pytest.raises(ValueError, match="at least one"):
        prune_experts(model, {0: []})
    with pytest.raises(ValueError, match="not an MoE layer"):
        prune_experts(model, {5: [0]})
    with pytest.raises(ValueError, match="budget"):
        select_experts("ragep", _toy_stats(), 4)


def test_ragep_options_and_input_rank_source(moe_dir, calibration):
    model, _ = load_backbone(str(moe_dir))
    pruner = ExpertPruning(
        "ragep", keep_ratio=0.5, rank_source="input", ragep_kwargs={"alpha": 0.5, "subspace_energy": 0.8}
    )
    kept = pruner.prune(model, calibration)
    assert sum(len(v) for v in kept.values()) == 6
    assert set(pruner.eranks) == {0, 1} and all(r >= 1.0 for r in pruner.eranks.values())
    with pytest.raises(ValueError, match="ragep_kwargs"):
        ExpertPruning("reap", ragep_kwargs={"alpha": 0.5})


def test_calibration_strings_are_tokenized(moe_dir):
    from types import SimpleNamespace

    model, tokenizer = load_backbone(str(moe_dir))
    pruner = ExpertPruning("frequency", keep_ratio=0.5, calibration=TEXTS[:2])
    batches = pruner.calibration_batches(None, SimpleNamespace(tokenizer=tokenizer))
    assert [b["input_ids"].shape[0] for b in batches] == [1, 1]
    kept = pruner.prune(model, batches)
    assert [len(v) for v in kept.values()] == [3, 3]
