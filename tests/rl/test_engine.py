"""run_episodes with stop strings that span several tokens (``"</search>"`` for SmolLM2's tokenizer): a turn ends
right after the token that completes its first stop string, whichever engine generated it."""

import torch

from lightning_llm.envs import Environment, EnvReply
from lightning_llm.rl import HFEngine, Sampling, run_episodes


class _EchoEnv(Environment):
    """Two turns; records each turn's text and answers a fixed observation."""

    max_turns = 2

    def __init__(self, stop_strings):
        self.stop_strings = tuple(stop_strings)
        self.turns: list[str] = []

    def reset(self, example):
        return {"turns": 0}

    def step(self, state, turn):
        self.turns.append(turn)
        state["turns"] += 1
        return EnvReply(" obs", done=state["turns"] >= self.max_turns)

    def reward(self, state, example, completion):
        return 0.0


class _ScriptedEngine:
    """Plays fixed token ids; has no ``stop_strings`` keyword (an engine written before they existed)."""

    def __init__(self, turns):
        self.turns, self.calls = turns, []

    def generate(self, input_ids, attention_mask, *, sampling, stop_token_ids, pad_id):
        self.calls.append(stop_token_ids)
        return torch.tensor([self.turns[len(self.calls) - 1]] * input_ids.shape[0])


def _prompt(tokenizer):
    enc = tokenizer(["Question:"], return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def test_multi_token_stop_string_cuts_the_turn(tiny_tokenizer):
    tok = tiny_tokenizer
    stop = "zq!"
    assert len(tok(stop, add_special_tokens=False)["input_ids"]) > 1  # really several tokens
    first = tok("ab zq! cd ef", add_special_tokens=False)["input_ids"]
    second = tok("gh", add_special_tokens=False)["input_ids"]
    engine = _ScriptedEngine([first, second])
    env = _EchoEnv([stop, "</answer>"])  # one multi-token, one single (added) token stop string
    ids, loss_mask, _ = run_episodes(engine, tok, *_prompt(tok), [None], sampling=Sampling(16), env=env)
    assert env.turns[0] == "ab zq!"  # cut right after the stop string, " cd ef" never generated
    trained = tok.decode(ids[0][loss_mask[0]], skip_special_tokens=False)
    assert trained == "ab zq!gh"
    # the single-token stop string stays on the fast path: a stop token id for the engine
    assert tok.convert_tokens_to_ids("</answer>") in engine.calls[0]


def test_hf_engine_stops_at_a_multi_token_stop_string(tiny_backbone):
    model, tok = tiny_backbone
    ids, mask = _prompt(tok)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    sampling = Sampling(max_new_tokens=16, temperature=1.0)

    def sample(engine, **kw):  # the same seed: the same tokens up to wherever generation stops
        torch.manual_seed(0)
        return engine.generate(ids, mask, sampling=sampling, stop_token_ids=[eos], pad_id=pad, **kw)[
            0
        ].tolist()

    free = sample(HFEngine(model))
    assert pad not in free and eos not in free  # 16 tokens, none of them the end
    # the first two consecutive tokens that decode to clean text (no partial UTF-8) are the stop string
    start = next(i for i in range(1, len(free) - 3) if "\ufffd" not in tok.decode(free[i : i + 2]))
    stop = tok.decode(free[start : start + 2])
    assert len(tok(stop, add_special_tokens=False)["input_ids"]) > 1
    cut = next(n for n in range(1, len(free) + 1) if stop in tok.decode(free[:n]))
    assert cut < len(free)

    engine = HFEngine(model, tok)
    # the engine itself stops there (generate(stop_strings=...)): nothing generated after it
    assert sample(engine, stop_strings=(stop,)) == free[:cut]
    env = _EchoEnv([stop])
    env.max_turns = 1
    torch.manual_seed(0)
    out, loss_mask, _ = run_episodes(engine, tok, ids, mask, [None], sampling=sampling, env=env)
    assert out[0][loss_mask[0]].tolist() == free[:cut]
    assert env.turns == [tok.decode(free[:cut])]


def test_a_model_stop_id_ends_the_turn_and_the_episode(tiny_tokenizer):
    """``stop_ids`` (the model's stop set) reach the engine and cut the turn; ending on one ends the episode."""
    tok = tiny_tokenizer
    end = tok.convert_tokens_to_ids("<|endoftext|>")  # an end id of the model that is not the tokenizer's eos
    words = tok("ab cd", add_special_tokens=False)["input_ids"]
    engine = _ScriptedEngine([[*words, end, *words]])
    env = _EchoEnv(["</answer>"])
    stops = [tok.eos_token_id, end]
    ids, loss_mask, _ = run_episodes(
        engine, tok, *_prompt(tok), [None], sampling=Sampling(16), env=env, stop_ids=stops
    )
    assert set(stops) <= set(engine.calls[0])
    assert env.turns == []  # the turn ended at the model's stop id: no observation, no second turn
    assert ids[0][loss_mask[0]].tolist() == [*words, end]
    _, no_env_mask, _ = run_episodes(
        _ScriptedEngine([[*words, end, *words]]),
        tok,
        *_prompt(tok),
        [None],
        sampling=Sampling(16),
        stop_ids=stops,
    )
    assert no_env_mask[0].tolist() == [True] * (len(words) + 1) + [False] * len(words)
