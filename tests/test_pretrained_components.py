"""Every LightningModule and callback of the library runs on the real pretrained model ``smollm2-135m``.

The shipped configs run through the real CLI (``fit --config ... --trainer.fast_dev_run=true``) with the backbone
swapped for SmolLM2-135M-Instruct and the data, batch and generation sizes shrunk so that each run is one step
(outputs under ``tmp_path``); the pieces that are not LightningModules (steering, the RTS ``LLMAgent``, DualGraph's
``CallableBackend``) are called through their Python API on the session's shared model. This is the check that
nothing assumes the tiny backbone's sizes, vocabulary or special tokens (SmolLM2: hidden 576, 30 layers, a 49k
BPE vocabulary in which ``"</search>"`` is three tokens, pad == eos).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytestmark = pytest.mark.pretrained

CONFIGS = Path(__file__).parents[1] / "configs"
SMOLLM2 = "smollm2-135m"
GEMMA3 = "gemma3-270m"
NUM_LAYERS = 30  # SmolLM2-135M's decoder layers

#: Shrunk sizes for every config: one step of tiny batches, short generations.
DATA = {"num_train": 8, "num_val": 2, "batch_size": 2}
MODEL = {"group_size": 2, "max_new_tokens": 8}
CALLBACKS = {
    "SFTWarmup": {"batch_size": 2, "lr": 1.0e-5},  # the configs' 3e-3 (tiny) wrecks SmolLM2 in one step
    "TaskAccuracy": {"num_examples": 2, "max_new_tokens": 8, "batch_size": 2},
    "SafetyEvaluation": {"num_examples": 2, "samples": 1, "max_new_tokens": 8},
    "GrammarKLMonitor": {"num_sentences": 4, "batch_size": 4},
    "LayerwiseProbe": {"num_sentences": 8},
}


def _fit(
    name: str,
    tmp_path: Path,
    *,
    backbone: str = SMOLLM2,
    model: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    callbacks: dict[str, dict[str, Any]] | None = None,
    extra_callbacks: Sequence[dict[str, Any]] = (),
    edit: Callable[[dict[str, Any]], None] | None = None,
):
    """Run ``configs/{name}.yaml`` on ``backbone`` through the CLI (one fast-dev-run step); returns the CLI object.

    ``model`` / ``data`` / ``callbacks`` (by class name) update init_args after the shared shrinking; ``edit``
    changes the loaded config in place last."""
    from lightning_llm.cli import run_cli

    config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    model_args, data_args = config["model"]["init_args"], config["data"]["init_args"]
    for args in (model_args, data_args):  # the module's backbone, and an activation DataModule's
        if "model" in args:
            args["model"] = backbone
    assert model_args.get("model") == backbone or data_args.get("model") == backbone
    data_args.update({k: v for k, v in DATA.items() if k in data_args})  # only the sizes a config sets
    model_args.update({k: v for k, v in MODEL.items() if k in model_args})
    data_args.update(data or {})
    model_args.update(model or {})
    trainer = config["trainer"]
    trainer["callbacks"] = trainer.get("callbacks", []) + list(extra_callbacks)
    for callback in trainer["callbacks"]:
        short = callback["class_path"].rsplit(".", 1)[-1]
        args = callback.setdefault("init_args", {})
        args.update({k: v for k, v in CALLBACKS.get(short, {}).items() if k in args})
        args.update((callbacks or {}).get(short, {}))
    trainer["default_root_dir"] = str(tmp_path / "run")
    if edit is not None:
        edit(config)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return run_cli(["fit", "--config", str(path), "--trainer.fast_dev_run=true"])


def _check_export(cli, save_dir: Path) -> None:
    """A fast dev run leaves ``save_dir`` alone; the module's export itself works on SmolLM2 and reloads."""
    from lightning_llm.backbones import load_backbone

    assert not save_dir.exists()
    written = cli.model.save_pretrained(save_dir.parent / "export")
    assert (written / "config.json").exists()
    model, _ = load_backbone(str(written))
    assert model.config.hidden_size == cli.model.model.config.hidden_size


def _callback(cli, name: str):
    return next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == name)


def _enter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp_path`` as the working directory (configs write relative run directories)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-llm"])  # the CLI reads its arguments from args= only
    return tmp_path


@pytest.fixture
def run_dir(tmp_path, monkeypatch, smollm2_dir):
    """A fresh working directory with SmolLM2 in the cache."""
    return _enter(tmp_path, monkeypatch)


# --------------------------------------------------------------------------------------------- RL (GRPO)


def test_grpo_with_warmup_clip_b_and_entropy_monitor(run_dir):
    cli = _fit(
        "grpo_arithmetic",
        run_dir,
        # the monitor measures the entropy change at the second pass; the 'format' reward and the task's format
        # stated in the system prompt give the group's completions different rewards (nonzero advantages)
        model={"ppo_epochs": 2, "group_size": 4, "rewards": ["task", "format"]},
        data={"system_prompt": "task"},
        extra_callbacks=[{"class_path": "lightning_llm.callbacks.EntropyDynamicsMonitor"}],
    )
    metrics = cli.trainer.callback_metrics
    assert metrics["train/frac_reward_zero_std"] < 1  # some group's rewards differ: a real policy gradient
    assert {"train/Clip_B/clipped_frac", "train/entropy_delta_measured"} <= set(metrics)
    assert cli.model.hparams.model == SMOLLM2 and cli.trainer.global_step == 2  # ppo_epochs updates
    assert _callback(cli, "SFTWarmup").steps_done == 1
    _check_export(cli, run_dir / "runs/grpo_arithmetic/model")


def test_multi_turn_search_grpo_with_llds(run_dir):
    """``</search>`` and ``</answer>`` are several tokens for SmolLM2: turns end on their decoded text."""
    cli = _fit(
        "grpo_search_llds",
        run_dir,
        model={"mini_batches": 2, "ppo_epochs": 1, "env_kwargs": {"top_k": 1, "max_turns": 2}},
    )
    assert cli.trainer.global_step >= 1
    assert len(cli.model.tokenizer("</search>", add_special_tokens=False)["input_ids"]) > 1


def test_multi_token_stop_string_ends_a_smollm2_turn(smollm2):
    """Greedy SmolLM2 continues the pattern with ``</search> <search>New York</search>``: the turn is cut right
    after the first ``</search>`` (three tokens), with or without the engine stopping early."""
    from lightning_llm.envs import Environment, EnvReply
    from lightning_llm.rl import HFEngine, Sampling, run_episodes

    class OneTurn(Environment):
        stop_strings, max_turns = ("</search>", "</answer>"), 1

        def reset(self, example):
            return []

        def step(self, state, turn):
            state.append(turn)
            return EnvReply(None, done=True)

        def reward(self, state, example, completion):
            return 0.0

    model, tok = smollm2
    enc = tok(["<search>Paris</search> <search>Rome</search> <search>Berlin"], return_tensors="pt")
    greedy = Sampling(max_new_tokens=12, temperature=0.0)
    for engine in (HFEngine(model, tok), HFEngine(model)):  # stops at the string / generates all 12 tokens
        env = OneTurn()
        ids, loss_mask, states = run_episodes(
            engine, tok, enc["input_ids"], enc["attention_mask"], [None], sampling=greedy, env=env
        )
        assert states == [["</search>"]]
        assert tok.decode(ids[0][loss_mask[0]]) == "</search>"


def test_twenty_questions_grpo_with_delta_belief(run_dir):
    def two_turns(config):
        config["model"]["init_args"]["env"]["init_args"]["max_turns"] = 2

    cli = _fit("delta_belief", run_dir, edit=two_turns)
    assert cli.trainer.global_step == 1


def test_grpo_with_length_awareness(run_dir):
    cli = _fit("larft", run_dir, model={"mini_batches": 1, "ppo_epochs": 1})
    assert cli.trainer.global_step >= 1


def test_grpo_with_recontextualization(run_dir):
    cli = _fit("recontext", run_dir)
    assert cli.trainer.global_step == 1


def test_grpo_on_forecasting(run_dir):
    cli = _fit("forecasting", run_dir, data={"max_length": 192, "max_chunks": 1, "val_chunks": 1})
    assert cli.trainer.global_step == 1


# ------------------------------------------------------------------------------------ DPO, SFT, LoRA


def test_dpo_with_safety_evaluation(run_dir):
    cli = _fit("dpo_honeypot", run_dir, data={"max_length": 64})
    assert cli.trainer.global_step == 1
    _check_export(cli, run_dir / "runs/dpo_honeypot/model")


def test_sft_with_lora_restart_and_update_rank(run_dir):
    cli = _fit(
        "sft_tiny",
        run_dir,
        model={"lora": {"r": 2, "alpha": 4.0, "target_modules": ["q_proj", "v_proj"]}},
        extra_callbacks=[
            {"class_path": "lightning_llm.callbacks.LoRARestart", "init_args": {"interval": 1}},
            {"class_path": "lightning_llm.callbacks.UpdateRankMonitor", "init_args": {"every": 1}},
        ],
    )
    assert _callback(cli, "LoRARestart").restarts == 1
    _check_export(cli, run_dir / "runs/sft_tiny/model")


def test_lora_with_scalora(run_dir):
    cli = _fit("scalora", run_dir, callbacks={"ScaLoRA": {"rank_every": 1}})
    assert cli.trainer.global_step == 1


def test_pcfg_monitors(run_dir):
    """PCFG terminals are single letters, one byte-level token in SmolLM2's vocabulary too."""
    cli = _fit("pcfg", run_dir)
    assert cli.trainer.global_step == 1


# ------------------------------------------------------------------------ SAE, IndexMem, LT, quantization


@pytest.mark.parametrize(
    ("backbone", "layer", "hidden"), [(SMOLLM2, 15, 576), (GEMMA3, 9, 640)], ids=[SMOLLM2, GEMMA3]
)
def test_sae_on_harvested_activations(backbone, layer, hidden, request, tmp_path, monkeypatch):
    request.getfixturevalue("smollm2_dir" if backbone == SMOLLM2 else "gemma3_dir")
    cli = _fit(
        "sae_fast",
        _enter(tmp_path, monkeypatch),
        backbone=backbone,
        data={
            "layer": layer,
            "max_length": 64,
            "num_tokens": 128,
            "batch_size": 64,
            "harvest_batch_size": 4,
            "buffer_size": 128,
        },
        model={"init_sample_tokens": 64, "expansion": 2},
    )
    assert cli.model.hparams.d_in == hidden  # the backbone's hidden size, read from the harvest
    assert cli.trainer.global_step == 1


def test_indexmem(run_dir):
    cli = _fit("indexmem", run_dir, data={"max_length": 128})
    assert cli.trainer.global_step == 1


def test_latent_thoughts_tuning(run_dir):
    cli = _fit("lt_tuning", run_dir)
    assert cli.model.tokenizer.convert_tokens_to_ids("<thinking>") == len(cli.model.tokenizer) - 1
    assert cli.model.model.get_input_embeddings().weight.shape[0] == len(cli.model.tokenizer)


def test_trellis_quantization_of_one_layer(run_dir):
    """Proteus on ``model.layers.0.self_attn.q_proj`` only (every other linear layer skipped by name)."""
    others = ["k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    skip = ["lm_head", *others, *(str(i) for i in range(1, NUM_LAYERS))]
    cli = _fit("proteus", run_dir, callbacks={"TrellisQuantization": {"skip": skip}})
    assert _callback(cli, "TrellisQuantization").quantized_layers == ["model.layers.0.self_attn.q_proj"]
    assert not (run_dir / "runs/proteus/quantized").exists()  # a fast dev run writes no export


def test_expert_pruning_refuses_a_dense_model(run_dir):
    """SmolLM2 is dense: RAGEP's ExpertPruning cannot apply and says so."""
    with pytest.raises(ValueError, match="no sparse MoE block"):
        _fit("ragep", run_dir)


# ------------------------------------------------------------------------------------- Python APIs


@pytest.fixture(scope="module")
def smollm2_module(smollm2, smollm2_dir):
    """A ``CausalLMModule`` around the session's SmolLM2 (no second load); used for evaluation only."""
    from lightning_llm.modules import CausalLMModule

    module = CausalLMModule(model=smollm2_dir)
    module.model = smollm2[0]
    return module


def test_steering_vector_trained_and_applied(smollm2, smollm2_module, quiet_trainer):
    """A diff-mean vector at layer 15 of 30: as a context manager around ``generate``, and as a callback that
    steers ``trainer.validate`` only."""
    from torch.utils.data import DataLoader

    from lightning_llm.callbacks import ActivationSteering, train_steering_vector

    model, tok = smollm2
    pairs = [("I love this, it is wonderful", "I hate this, it is terrible"), ("What a joy", "What a pain")]
    layer = 15
    vector = train_steering_vector(model, tok, pairs, layer=layer)
    assert vector.shape == (576,) and torch.isfinite(vector).all()
    enc = tok(["The weather today is"], return_tensors="pt")
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        plain = model.generate(**enc, **gen)
        with ActivationSteering(vector, layer=layer, multiplier=8.0).attach(model):
            steered = model.generate(**enc, **gen)
        assert torch.equal(model.generate(**enc, **gen), plain)  # hooks removed: the model is as before
    assert steered.shape == plain.shape

    batch = {**enc, "labels": enc["input_ids"].clone()}
    loader = DataLoader([batch], batch_size=None)
    steering = ActivationSteering(vector, layer=layer, multiplier=8.0)
    losses = [
        quiet_trainer(callbacks=callbacks, limit_val_batches=1).validate(
            smollm2_module, loader, verbose=False
        )[0]
        for callbacks in ([], [steering])
    ]
    assert losses[0]["val/loss"] != pytest.approx(losses[1]["val/loss"])
    assert not steering.active and not model.training


def test_rts_llm_agent_plays_legal_moves(smollm2):
    from dataclasses import replace

    from lightning_llm.envs.rts import LLMAgent, Rules, TurtleAgent, parse_intents, play_match

    model, tok = smollm2
    rules = replace(Rules(), max_ticks=Rules().decision_interval)  # one decision per player
    match = play_match([LLMAgent(model, tok), TurtleAgent()], rules, seed=0, frame_every=0)
    mine = [d for d in match.decisions if d["player"] == 0]
    assert mine
    for decision in mine:
        intents, errors = parse_intents(decision["reply"], rules)
        assert not errors and 1 <= len(intents) <= 2


def test_dualgraph_callable_backend_over_causal_lm_generate(smollm2, smollm2_module):
    from lightning_llm.evaluation.dualgraph import (
        CallableBackend,
        LLMExtractor,
        LLMPlanner,
        synthetic_research_world,
    )
    from lightning_llm.evaluation.dualgraph.graphs import KnowledgeGraph

    model, _ = smollm2
    # CausalLMModule.generate on the session's model (it leaves the model's mode as found)
    backend = CallableBackend(lambda prompts: smollm2_module.generate(prompts, max_new_tokens=8))
    world = synthetic_research_world(0)
    answers = backend.complete(["Name one planet.", "Say hello."])
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    triples = LLMExtractor(backend, sorted({r for _, r, _ in world.truth})).extract(world.docs[:2])
    assert len(triples) == 2  # one list per document, every triple checked against its text
    outline = world.outline()
    queries = LLMPlanner(backend).plan(KnowledgeGraph(), outline, set(), 0)
    assert queries and all(isinstance(q, str) for q in queries)
    assert not model.training


# ------------------------------------------------------------------------------- the second architecture


@pytest.fixture
def gemma3_run_dir(tmp_path, monkeypatch, gemma3_dir):
    """As ``run_dir``, with Gemma 3 270M in the cache."""
    return _enter(tmp_path, monkeypatch)


def test_gemma3_grpo_with_warmup_clip_b_and_entropy_monitor(gemma3_run_dir):
    """GRPO on Gemma 3: shared-prefix passes on its hybrid sliding/global mask, the system text folded into the
    first user turn, rollouts ending at ``<end_of_turn>``, the fused head over 262k tokens."""
    cli = _fit(
        "grpo_arithmetic",
        gemma3_run_dir,
        backbone=GEMMA3,
        model={"ppo_epochs": 2, "group_size": 4, "rewards": ["task", "format"]},
        data={"system_prompt": "task"},
        extra_callbacks=[{"class_path": "lightning_llm.callbacks.EntropyDynamicsMonitor"}],
    )
    metrics = cli.trainer.callback_metrics
    assert {"train/Clip_B/clipped_frac", "train/entropy_delta_measured"} <= set(metrics)
    assert cli.model.hparams.model == GEMMA3 and cli.trainer.global_step == 2
    assert cli.model.stop_token_ids == [1, 106]  # <eos>, <end_of_turn>
    _check_export(cli, gemma3_run_dir / "runs/grpo_arithmetic/model")


def test_gemma3_sft_with_lora(gemma3_run_dir):
    cli = _fit(
        "sft_tiny",
        gemma3_run_dir,
        backbone=GEMMA3,
        model={"lora": {"r": 2, "alpha": 4.0, "target_modules": ["q_proj", "v_proj"]}},
    )
    assert cli.trainer.global_step == 1
    _check_export(cli, gemma3_run_dir / "runs/sft_tiny/model")


def test_gemma3_dpo(gemma3_run_dir):
    cli = _fit("dpo_honeypot", gemma3_run_dir, backbone=GEMMA3, data={"max_length": 64})
    assert cli.trainer.global_step == 1
