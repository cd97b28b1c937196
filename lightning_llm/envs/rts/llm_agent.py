"""An LLM agent for any causal-LM backbone: a prompted state summary in, grammar-constrained intents out.

The model sees a chat-templated prompt (the rules of the intent language as a system message, the
:meth:`Observation.summary` as the user message) and writes up to ``max_intents`` lines. Decoding is
*constrained* to the intent language: every valid intent line (:func:`all_intents`, each followed by a newline)
is tokenised once into a prefix tree, and at each step only the tokens that continue some valid line are
allowed (greedy, or sampled at ``temperature``), so every line the model writes parses — even an untrained
model plays legal moves. ``wait()`` ends the decision early. One forward pass over the prompt, then one
token at a time with the KV cache.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lightning_llm.backbones import apply_chat_template
from lightning_llm.envs.rts.intents import all_intents
from lightning_llm.envs.rts.match import Agent
from lightning_llm.envs.rts.observation import Observation
from lightning_llm.envs.rts.rules import Rules

__all__ = ["SYSTEM_PROMPT", "LLMAgent"]

SYSTEM_PROMPT = (
    "You command player {player} in a real-time strategy game. Every {interval} ticks you give up to {budget} "
    "orders, one per line, from: expand() | build(refinery|barracks|factory|tower) | "
    "train(infantry|rocket|tank|scout, 1-{max_train}) | attack(region) | defend() | retreat() | "
    "scout(region) | wait(). Regions: nw n ne w c e sw s se."
)


class _Trie:
    __slots__ = ("children", "text")

    def __init__(self) -> None:
        self.children: dict[int, _Trie] = {}
        self.text: str | None = None  # set on the node that completes a line


class LLMAgent(Agent):
    """Plays with a causal LM under grammar-constrained decoding.

    Args:
        model: A backbone name or path (loaded with :func:`~lightning_llm.backbones.load_backbone`), or a model.
        tokenizer: Required when ``model`` is a model object.
        max_intents: Lines per decision (capped by ``Rules.intents_per_decision``).
        temperature: 0 is greedy; otherwise sampling over the allowed tokens with a per-match seeded generator.
        system_prompt: Template with ``{player}``, ``{interval}``, ``{budget}``, ``{max_train}``.
        name: The agent's name in arenas and replays.
    """

    def __init__(
        self,
        model: str | nn.Module = "tiny",
        tokenizer: Any | None = None,
        *,
        max_intents: int = 2,
        temperature: float = 0.0,
        system_prompt: str = SYSTEM_PROMPT,
        name: str = "llm",
    ) -> None:
        if isinstance(model, str):
            from lightning_llm.backbones import load_backbone

            model, tokenizer = load_backbone(model)
        if tokenizer is None:
            raise ValueError("LLMAgent needs the tokenizer of a model object")
        if max_intents < 1 or temperature < 0:
            raise ValueError("LLMAgent needs max_intents >= 1 and temperature >= 0")
        self.model, self.tokenizer = model, tokenizer
        self.max_intents, self.temperature = max_intents, temperature
        self.system_prompt, self.name = system_prompt, name
        self._trie: _Trie | None = None
        self._trie_rules: Rules | None = None
        self._player = 0
        self._generator = torch.Generator().manual_seed(0)

    def reset(self, player: int, rules: Rules, seed: int) -> None:
        self._player = player
        self._generator = torch.Generator().manual_seed(seed)
        if self._trie is None or self._trie_rules != rules:
            self._trie, self._trie_rules = self._build_trie(rules), rules

    def _build_trie(self, rules: Rules) -> _Trie:
        root = _Trie()
        for intent in all_intents(rules):
            line = f"{intent}\n"
            node = root
            for token in self.tokenizer.encode(line, add_special_tokens=False):
                node = node.children.setdefault(token, _Trie())
            node.text = str(intent)
        return root

    def prompt_ids(self, obs: Observation) -> list[int]:
        """The chat-templated prompt for one decision, as token ids."""
        system = self.system_prompt.format(
            player=obs.player,
            interval=obs.rules.decision_interval,
            budget=obs.rules.intents_per_decision,
            max_train=obs.rules.max_train,
        )
        messages = [{"role": "system", "content": system}, {"role": "user", "content": obs.summary()}]
        text = apply_chat_template(self.tokenizer, messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    @torch.no_grad()
    def act(self, obs: Observation) -> str:
        if self._trie is None or self._trie_rules != obs.rules:
            self._trie, self._trie_rules = self._build_trie(obs.rules), obs.rules
        # deferred: importing the game must not import transformers
        from lightning_llm.backbones import eval_mode

        device = next(self.model.parameters()).device
        with eval_mode(self.model):
            ids = torch.tensor([self.prompt_ids(obs)], device=device)
            # transformers >= 5.3 names the KV cache ``cache`` (argument and output), earlier ``past_key_values``
            cache_arg = (
                "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
            )
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)  # only the last position
            past, logits = getattr(out, cache_arg), out.logits[0, -1].float()
            lines: list[str] = []
            for _ in range(min(self.max_intents, obs.rules.intents_per_decision)):
                node = self._trie
                while node.text is None:
                    allowed = list(node.children)
                    token = allowed[self._pick(logits[torch.tensor(allowed, device=device)])]
                    node = node.children[token]
                    step = torch.tensor([[token]], device=device)
                    out = self.model(input_ids=step, use_cache=True, **{cache_arg: past})
                    past, logits = getattr(out, cache_arg), out.logits[0, -1].float()
                lines.append(node.text)
                if node.text == "wait()":
                    break
        return "\n".join(lines)

    def _pick(self, logits: torch.Tensor) -> int:
        if self.temperature == 0 or len(logits) == 1:
            return int(logits.argmax())
        probs = torch.softmax(logits / self.temperature, -1).cpu()
        return int(torch.multinomial(probs, 1, generator=self._generator))
