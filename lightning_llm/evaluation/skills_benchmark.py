"""An offline testbed for benchmark-compression methods: a multi-skill multiple-choice benchmark and a population
of ~20 tiny causal LMs of different width, depth, data mixture and training length.

Coreset methods (:mod:`lightning_llm.evaluation.repcore`) need many *models* evaluated on many *items*, with
correctness that varies across both. Here that is built from scratch on a CPU in about a minute:

* :func:`skills_benchmark` — five skills (``add`` 2-4 digits with a one-digit sum, ``max`` / ``min`` of a list,
  ``first`` digit of a list, ``count`` the occurrences of a digit), each at three difficulty levels (more operands,
  longer lists). Every answer is one digit; an item offers
  it among four digit choices, scored by comparing the choices' log-probabilities after the prompt (one forward
  per item, exact: no parsing of generations).
* :class:`PopulationRecipe` / :func:`load_population` — ``len(architectures)`` training runs of Llama-style
  decoders on the embedded tiny tokenizer, each with its own skill mixture (a seeded Dirichlet draw, so skills
  differ across runs), checkpointed at several step counts (so strength differs along a run): 5 runs x 4
  checkpoints = 20 models by default. Training is deterministic from the recipe and the checkpoints are cached
  as safetensors under ``lightning_llm_home()``, so tests, tutorial and benchmark share one build.
* :func:`population_results` — hidden states and correctness of every population model on a list of items
  (cached through :func:`~lightning_llm.evaluation.repcore.extract_hidden_states` and
  :func:`~lightning_llm.evaluation.repcore.score_multiple_choice`).

Training prompts are drawn from the same generators with other seeds; some coincide with benchmark prompts (the
prompt space of the easy levels is small). That is harmless here: the population is a source of models with
diverse skill profiles, not a measurement of generalisation.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from lightning_llm.backbones import lightning_llm_home, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "SKILLS",
    "MultipleChoiceItem",
    "PopulationMember",
    "PopulationRecipe",
    "PopulationResults",
    "load_population",
    "population_results",
    "skills_benchmark",
]


@dataclass(frozen=True)
class MultipleChoiceItem:
    """One benchmark item: the model is correct iff ``choices[answer]`` is its most likely continuation."""

    prompt: str
    choices: tuple[str, ...]
    answer: int
    skill: str
    difficulty: int


def _digits(rng: np.random.Generator, n: int) -> list[int]:
    return [int(d) for d in rng.integers(0, 10, size=n)]


def _add(rng: np.random.Generator, level: int) -> tuple[str, int]:
    total = int(rng.integers(0, 10))  # 2-4 operands with a one-digit sum: a random composition of it
    cuts = np.sort(rng.integers(0, total + 1, size=level))
    xs = np.diff(np.concatenate([[0], cuts, [total]])).tolist()
    return "add " + " ".join(map(str, xs)), total


def _max(rng: np.random.Generator, level: int) -> tuple[str, int]:
    xs = _digits(rng, 2 * level + 1)  # 3, 5, 7 digits
    return "max " + " ".join(map(str, xs)), max(xs)


def _min(rng: np.random.Generator, level: int) -> tuple[str, int]:
    xs = _digits(rng, 2 * level + 1)
    return "min " + " ".join(map(str, xs)), min(xs)


def _first(rng: np.random.Generator, level: int) -> tuple[str, int]:
    xs = _digits(rng, 2 * level + 1)  # the further back the first digit, the harder the lookup
    return "first " + " ".join(map(str, xs)), xs[0]


def _count(rng: np.random.Generator, level: int) -> tuple[str, int]:
    target = int(rng.integers(0, 10))
    xs = [target if rng.random() < 0.3 else int(rng.integers(0, 10)) for _ in range(2 * level + 1)]
    return f"count {target} in {' '.join(map(str, xs))}", xs.count(target)


#: The skills and their generators ``(rng, level in 1..3) -> (prompt stem, answer digit)``.
SKILLS: dict[str, Callable[[np.random.Generator, int], tuple[str, int]]] = {
    "add": _add,
    "max": _max,
    "min": _min,
    "first": _first,
    "count": _count,
}
_LEVELS = (1, 2, 3)


def _draw(rng: np.random.Generator, skill: str, level: int) -> tuple[str, int]:
    stem, answer = SKILLS[skill](rng, level)
    return f"{stem} =", answer


def skills_benchmark(num_items: int = 400, seed: int = 0, num_choices: int = 4) -> list[MultipleChoiceItem]:
    """``num_items`` items, skills and levels in equal shares (round-robin), a pure function of the arguments.

    Each item's choices are its answer digit and ``num_choices - 1`` other digits, in a seeded random order.
    """
    if num_items < 1:
        raise ValueError(f"num_items must be >= 1, got {num_items}")
    if not 2 <= num_choices <= 10:
        raise ValueError(f"num_choices must be in [2, 10] (answers are single digits), got {num_choices}")
    rng = np.random.default_rng(seed)
    cells = [(skill, level) for skill in SKILLS for level in _LEVELS]
    items = []
    for i in range(num_items):
        skill, level = cells[i % len(cells)]
        prompt, answer = _draw(rng, skill, level)
        others = rng.permutation([d for d in range(10) if d != answer])[: num_choices - 1]
        choices = [answer, *others.tolist()]
        order = rng.permutation(num_choices)
        items.append(
            MultipleChoiceItem(
                prompt=prompt,
                choices=tuple(str(choices[j]) for j in order),
                answer=int(np.flatnonzero(order == 0)[0]),
                skill=skill,
                difficulty=level,
            )
        )
    return items


# ----------------------------------------------------------------------------------------------- population


@dataclass(frozen=True)
class PopulationRecipe:
    """Everything that determines the model population; any change changes the cache key.

    Attributes:
        architectures: ``(hidden_size, num_layers)`` of each training run (head dimension 16, MLP 2.75x).
        checkpoints: training steps at which each run is saved as a population member.
        batch_size, lr: AdamW training on the answer token only (cross-entropy over the full vocabulary).
        mixture_concentration: Dirichlet concentration of each run's skill mixture (low = specialised runs).
        seed: seeds the mixtures, the training data and the initialisations.
    """

    version: int = 1
    architectures: tuple[tuple[int, int], ...] = ((24, 1), (32, 1), (32, 2), (48, 2), (64, 1))
    checkpoints: tuple[int, ...] = (50, 150, 300, 600)
    batch_size: int = 32
    lr: float = 3e-3
    mixture_concentration: float = 1.0
    seed: int = 0

    def key(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        return f"skills-population-v{self.version}-{digest}"

    def mixtures(self) -> np.ndarray:
        """``[runs, skills]`` skill mixture of each training run."""
        rng = np.random.default_rng([self.seed, 1])
        return rng.dirichlet([self.mixture_concentration] * len(SKILLS), size=len(self.architectures))


@dataclass
class PopulationMember:
    """A trained population model; ``name`` identifies it (and keys its cached hidden states)."""

    name: str
    model: PreTrainedModel
    hidden_size: int
    num_layers: int
    steps: int
    mixture: tuple[float, ...]


def _config(hidden: int, layers: int, vocab: int, tokenizer: PreTrainedTokenizerBase):
    from transformers import LlamaConfig

    heads = max(hidden // 16, 1)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(2.75 * hidden),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _training_batches(
    recipe: PopulationRecipe, run: int, tokenizer: PreTrainedTokenizerBase
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids [S, B, T], last prompt position [S, B], answer token [S, B])`` for all steps of a run."""
    rng = np.random.default_rng([recipe.seed, 2, run])
    steps, batch = max(recipe.checkpoints), recipe.batch_size
    names = list(SKILLS)
    skills = rng.choice(len(names), size=steps * batch, p=recipe.mixtures()[run])
    levels = rng.choice(_LEVELS, size=steps * batch)
    drawn = [_draw(rng, names[s], int(level)) for s, level in zip(skills, levels, strict=True)]
    encoded = tokenizer([prompt for prompt, _ in drawn], add_special_tokens=False)["input_ids"]
    digit_ids = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    width = max(map(len, encoded))
    ids = torch.full((steps * batch, width), tokenizer.pad_token_id, dtype=torch.long)
    for i, row in enumerate(encoded):
        ids[i, : len(row)] = torch.tensor(row)
    last = torch.tensor([len(row) - 1 for row in encoded])
    answers = torch.tensor([digit_ids[a] for _, a in drawn])
    return ids.view(steps, batch, width), last.view(steps, batch), answers.view(steps, batch)


def _train_run(
    recipe: PopulationRecipe, run: int, tokenizer: PreTrainedTokenizerBase, directory: Path
) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    hidden, layers = recipe.architectures[run]
    vocab = -(-len(tokenizer) // 64) * 64
    config = _config(hidden, layers, vocab, tokenizer)
    ids, last, answers = _training_batches(recipe, run, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed * 1000 + run)
        model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    rows = torch.arange(recipe.batch_size)
    model.train()
    for step in range(1, max(recipe.checkpoints) + 1):
        # Right padding and causal attention: positions up to the last prompt token never see the padding.
        out = model.model(input_ids=ids[step - 1])
        h = out.last_hidden_state[rows, last[step - 1]]
        loss = torch.nn.functional.cross_entropy(model.lm_head(h), answers[step - 1])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step in recipe.checkpoints:
            name = f"run{run}-h{hidden}-l{layers}-s{step}"
            state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
            state.pop("lm_head.weight", None)  # tied to the embedding
            save_file(state, str(directory / f"{name}.safetensors"))
            (directory / f"{name}.json").write_text(config.to_json_string())


def _population_dir(recipe: PopulationRecipe, tokenizer: PreTrainedTokenizerBase) -> Path:
    target = lightning_llm_home() / recipe.key()
    manifest = target / "manifest.json"
    if manifest.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, as the tiny backbone does: a crash leaves only a temp dir.
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        for run in range(len(recipe.architectures)):
            _train_run(recipe, run, tokenizer, staging)
        (staging / "manifest.json").write_text(json.dumps({"recipe": asdict(recipe)}, indent=2))
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            if not manifest.is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_population(recipe: PopulationRecipe | None = None) -> list[PopulationMember]:
    """The population's models (eval mode), trained on first use and cached; ordered by run, then step.

    Building the default recipe takes about a minute on one CPU thread.
    """
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    recipe = recipe or PopulationRecipe()
    if not recipe.architectures or not recipe.checkpoints or min(recipe.checkpoints) < 1:
        raise ValueError("a population needs at least one architecture and positive checkpoint steps")
    tokenizer = load_tokenizer("tiny")
    directory = _population_dir(recipe, tokenizer)
    mixtures = recipe.mixtures()
    members = []
    for run, (hidden, layers) in enumerate(recipe.architectures):
        for steps in sorted(recipe.checkpoints):
            name = f"run{run}-h{hidden}-l{layers}-s{steps}"
            config = LlamaConfig.from_json_file(str(directory / f"{name}.json"))
            model = LlamaForCausalLM(config)
            model.load_state_dict(load_file(str(directory / f"{name}.safetensors")), strict=False)
            model.tie_weights()
            model.eval()
            members.append(
                PopulationMember(
                    name=f"{recipe.key()}/{name}",
                    model=model,
                    hidden_size=hidden,
                    num_layers=layers,
                    steps=steps,
                    mixture=tuple(float(p) for p in mixtures[run]),
                )
            )
    return members


@dataclass
class PopulationResults:
    """Per-model results on a list of items.

    Attributes:
        names: model names, one per row.
        hidden_states: per model ``[items, hidden_size]`` (widths differ across models).
        correctness: ``[models, items]`` bool.
    """

    names: list[str]
    hidden_states: list[torch.Tensor]
    correctness: torch.Tensor

    @property
    def scores(self) -> torch.Tensor:
        """Full-benchmark accuracy of each model, ``[models]``."""
        return self.correctness.float().mean(1)


def population_results(
    items: Sequence[MultipleChoiceItem],
    members: Sequence[PopulationMember] | None = None,
    *,
    pooling: str = "mean",
    layer: int = -1,
    batch_size: int = 64,
) -> PopulationResults:
    """Hidden states and multiple-choice correctness of each member on ``items`` (cached on disk)."""
    from lightning_llm.evaluation.repcore import extract_hidden_states, score_multiple_choice

    members = load_population() if members is None else members
    tokenizer = load_tokenizer("tiny")
    prompts = [item.prompt for item in items]
    hidden, correct = [], []
    for member in members:
        hidden.append(
            extract_hidden_states(
                member.model,
                tokenizer,
                prompts,
                pooling=pooling,  # type: ignore[arg-type]
                layer=layer,
                batch_size=batch_size,
                model_id=member.name,
            )
        )
        correct.append(
            score_multiple_choice(
                member.model,
                tokenizer,
                prompts,
                [item.choices for item in items],
                [item.answer for item in items],
                batch_size=batch_size,
                model_id=member.name,
            )
        )
    return PopulationResults([m.name for m in members], hidden, torch.stack(correct))
