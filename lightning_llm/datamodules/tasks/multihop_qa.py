"""Multi-hop QA over a seeded fictional knowledge base: the offline stand-in for Search-R1's NQ/HotpotQA.

"In which country was Tamur born?" needs two searches: Tamur's document says she was born in Velo, Velo's
says it is in Ramia. Names are made up from syllables, so no model can answer from memory: retrieval is
necessary, which is what makes the task a test of learning to search.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

from lightning_llm.datamodules.tasks import Example, Task, register_task
from lightning_llm.envs.search import SearchEnvironment, final_answer
from lightning_llm.text import exact_match
from lightning_llm.types import Doc

#: Search-R1's instruction (``make_prefix`` of its data scripts, typos included); ``instruction=True`` uses it.
SEARCH_R1_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
    "by <search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: "
)

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_CODAS = ("", "", "", "n", "r", "l", "s")  # a final consonant on some names: more names, same length range
_OCCUPATIONS = ("painter", "poet", "farmer", "doctor", "singer", "sailor", "teacher", "baker")
#: Words of the documents and questions; a name equal to one ("River", "Baker") would match every document
#: that uses the word, so names avoid them.
_TEMPLATE_WORDS = frozenset(
    " ".join(_OCCUPATIONS).split()
    + "a an the is in of by it its who was which what does city country capital river flows through flow "
    "company founded founder based born where find".split()
)


class _Relation(NamedTuple):
    """A fact type: ``question`` asks it of a subject, ``goal`` names what is sought, ``fact`` states it."""

    question: str
    goal: Callable[[str], str]
    fact: Callable[[str, str], str]


_RELATIONS = {
    "born_in": _Relation(
        "In which city was {} born?", lambda s: f"where {s} was born", lambda s, o: f"{s} was born in {o}"
    ),
    "in_country": _Relation(
        "In which country is {}?", lambda s: f"the country of {s}", lambda s, o: f"{s} is in {o}"
    ),
    "capital": _Relation(
        "What is the capital of {}?",
        lambda s: f"the capital of {s}",
        lambda s, o: f"The capital of {s} is {o}",
    ),
    "flows_through": _Relation(
        "Which city does the {} flow through?",
        lambda s: f"where the {s} flows",
        lambda s, o: f"The {s} flows through {o}",
    ),
    "founded_by": _Relation(
        "Who founded {}?", lambda s: f"the founder of {s}", lambda s, o: f"{s} was founded by {o}"
    ),
    "based_in": _Relation(
        "In which city is {} based?", lambda s: f"where {s} is based", lambda s, o: f"{s} is based in {o}"
    ),
}

#: Two-hop questions: (first relation, second relation) → question about the first subject.
_TWO_HOPS = {
    ("founded_by", "born_in"): "In which city was the founder of {} born?",
    ("born_in", "in_country"): "In which country was {} born?",
    ("flows_through", "in_country"): "Through which country does the {} flow?",
    ("based_in", "in_country"): "In which country is {} based?",
}


class _KnowledgeBase(NamedTuple):
    docs: list[Doc]
    facts: dict[str, dict[str, str]]  # relation → subject → object


@register_task
@dataclass(frozen=True)
class MultiHopQATask(Task):
    """Questions about a fictional world whose answers need ``hops`` searches of its knowledge base.

    The world (``num_entities`` countries, cities, rivers, people and companies, one short document each) is
    a pure function of ``seed``; :meth:`generate`'s own seed only picks questions, so training and validation
    sets drawn with different seeds ask about the same world, and :class:`~lightning_llm.envs.SearchEnvironment`
    built with ``task="multihop_qa"`` and the same parameters (or ``task=this_task``) searches it.

    Facts: a city is in a country, a country has a capital (one of its cities), a river flows through a
    city, a person was born in a city, a company was founded by a person and is based in a city. Questions
    (``hops=1``) ask one fact of an entity by name; ``hops=2`` questions chain two (the founder's birthplace,
    a person's country of birth, a river's country, a company's country), each fact in another document.

    The reference completion plays the protocol with the environment's real observations (top 3, defaults):
    per hop ``<think>goal</think><search>entity name</search>`` and the retrieved ``<information>``, then
    ``<think>fact</think><answer>gold</answer>``, so SFT on it teaches the format and to copy the bridge
    entity out of the retrieved text. ``metadata`` holds the titles of the documents the answer needs
    (``titles``, also the reference queries), the ``(start, end)`` character spans of the observations in
    the completion (``observation_spans``: text a loss should mask, as RL does), ``corpus_id`` and the
    world's ``seed`` and ``num_entities``. A 2-hop world has about ``0.8 * num_entities`` distinct questions
    (1-hop: ``1.2 *``); keep ``num_val`` well below that, as validation prompts are held out of training.

    The verifier is exact match (SQuAD normalisation) of the last ``<answer>`` the model wrote.

    Args:
        num_entities: Documents in the knowledge base, 10 to 2000 (default 200: 16 countries, 50 cities,
            20 rivers, 33 companies, 81 people).
        hops: Searches a question needs, 1 or 2.
        seed: Seed of the knowledge base (not of the questions: that is :meth:`generate`'s).
        instruction: Prefix each question with Search-R1's instruction (for pretrained instruct models; a
            model trained from scratch learns the format from the reference completions and needs no words).
    """

    name = "multihop_qa"

    num_entities: int = 200
    hops: int = 2
    seed: int = 0
    instruction: bool = False

    def __post_init__(self) -> None:
        if not 10 <= self.num_entities <= 2000:
            raise ValueError(f"multihop_qa: num_entities must be in [10, 2000], got {self.num_entities}")
        if self.hops not in (1, 2):
            raise ValueError(f"multihop_qa: hops must be 1 or 2, got {self.hops}")

    @property
    def corpus_id(self) -> str:
        """Names the knowledge base; an environment refuses examples of another one."""
        return f"{self.name}(num_entities={self.num_entities}, seed={self.seed})"

    def documents(self) -> list[Doc]:
        """The knowledge base, one document per entity, titled by the entity's name."""
        return list(self._kb.docs)

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        chains = list(_TWO_HOPS) if self.hops == 2 else [(relation,) for relation in _RELATIONS]
        examples = []
        for _ in range(n):
            chain = rng.choice(chains)
            subject = rng.choice(list(self._kb.facts[chain[0]]))
            examples.append(self._example(chain, subject))
        return examples

    def score(self, completion: str, example: Example) -> float:
        return exact_match(final_answer(completion), [example.answer])

    def make_env(self, **kwargs: Any) -> SearchEnvironment:
        """A :class:`~lightning_llm.envs.SearchEnvironment` over this task's knowledge base (``kwargs``: its
        ``top_k``, ``max_turns``...); it refuses examples from another knowledge base (``corpus_id``)."""
        return SearchEnvironment(self.documents(), corpus_id=self.corpus_id, **kwargs)

    # --------------------------------------------------------------------------------------- internals

    @cached_property
    def _kb(self) -> _KnowledgeBase:
        return _build_knowledge_base(self.num_entities, self.seed)

    @cached_property
    def _env(self) -> SearchEnvironment:
        return self.make_env()

    @cached_property
    def _examples(self) -> dict[tuple[tuple[str, ...], str], Example]:
        return {}

    def _example(self, chain: tuple[str, ...], subject: str) -> Example:
        """The question ``chain`` asks of ``subject``, with its reference completion (cached: it searches)."""
        key = (chain, subject)
        if key in self._examples:
            return self._examples[key]
        question = (_TWO_HOPS[chain] if len(chain) == 2 else _RELATIONS[chain[0]].question).format(subject)
        state = self._env.reset(Example(question, "", ""))
        completion, titles, spans, entity, thought = "", [], [], subject, ""
        for relation in chain:
            turn = (
                f"<think>{thought}Find {_RELATIONS[relation].goal(entity)}.</think><search>{entity}</search>"
            )
            completion += turn
            observation = self._env.step(state, turn).observation or ""
            spans.append((len(completion), len(completion) + len(observation)))
            completion += observation
            titles.append(entity)
            found = self._kb.facts[relation][entity]
            thought = _RELATIONS[relation].fact(entity, found) + ". "
            entity = found
        completion += f"<think>{thought.strip()}</think><answer>{entity}</answer>"
        prompt = (SEARCH_R1_INSTRUCTION if self.instruction else "") + question
        example = Example(
            prompt=prompt,
            completion=completion,
            answer=entity,
            metadata={
                "task": self.name,
                "relations": chain,
                "titles": tuple(titles),
                "observation_spans": tuple(spans),
                "corpus_id": self.corpus_id,
                "seed": self.seed,
                "num_entities": self.num_entities,
            },
        )
        self._examples[key] = example
        return example


def _build_knowledge_base(num_entities: int, seed: int) -> _KnowledgeBase:
    """A small world: entity counts in fixed proportions, every relation drawn uniformly from ``seed``."""
    rng = random.Random(seed)
    n_countries = max(2, num_entities // 12)
    n_cities = max(n_countries, num_entities // 4)
    n_rivers = max(1, num_entities // 10)
    n_companies = max(1, num_entities // 6)
    names = unique_names(rng, num_entities)
    countries, names = names[:n_countries], names[n_countries:]
    cities, names = names[:n_cities], names[n_cities:]
    rivers, names = names[:n_rivers], names[n_rivers:]
    companies, people = names[:n_companies], names[n_companies:]

    # Every country gets a city first (its capital), the other cities go anywhere.
    in_country = {
        city: countries[i] if i < n_countries else rng.choice(countries) for i, city in enumerate(cities)
    }
    capital = {country: cities[i] for i, country in enumerate(countries)}
    flows_through = {river: rng.choice(cities) for river in rivers}
    born_in = {person: rng.choice(cities) for person in people}
    occupation = {person: rng.choice(_OCCUPATIONS) for person in people}
    founded_by = {company: rng.choice(people) for company in companies}
    based_in = {company: rng.choice(cities) for company in companies}

    docs = [Doc(k, f"{k} is a country. Its capital is {capital[k]}.") for k in countries]
    docs += [Doc(c, f"{c} is a city in {in_country[c]}.") for c in cities]
    docs += [Doc(r, f"The {r} river flows through {flows_through[r]}.") for r in rivers]
    docs += [Doc(p, f"{p} is a {occupation[p]} born in {born_in[p]}.") for p in people]
    docs += [
        Doc(o, f"{o} is a company founded by {founded_by[o]}, based in {based_in[o]}.") for o in companies
    ]
    facts = {
        "born_in": born_in,
        "in_country": in_country,
        "capital": capital,
        "flows_through": flows_through,
        "founded_by": founded_by,
        "based_in": based_in,
    }
    return _KnowledgeBase(docs, facts)


def unique_names(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct capitalised names of two consonant-vowel syllables and an optional final consonant."""
    names: dict[str, None] = {}  # insertion-ordered set
    while len(names) < n:
        name = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(2)) + rng.choice(_CODAS)
        if name not in _TEMPLATE_WORDS:
            names[name.capitalize()] = None
    return list(names)
