r"""Probabilistic context-free grammars in Chomsky normal form and their exact quantities.

"Transformers and PCFGs" (ICML 2026) trains a transformer on sentences sampled from a PCFG and compares what it
learns with the grammar's exact quantities: the inside probabilities of spans, and the exact next-token
distribution :math:`p_G(a \mid w_{1:t})` from prefix probabilities, end of sentence included. :class:`PCFG` holds
a grammar as two tensors and computes both, batched and in log space, plus seeded sampling and Viterbi parses;
:class:`~lightning_llm.metrics.GrammarKL` scores a model against it and
:class:`~lightning_llm.datamodules.PCFGDataModule` serves its sentences as language-model batches.

A grammar in CNF has binary rules :math:`A \to B\,C` and terminal rules :math:`A \to a`, with
:math:`\sum_{B,C} P(A \to B C) + \sum_a P(A \to a) = 1` for every non-terminal :math:`A`. The inside
probability of a span is

.. math::

    \beta_A(i, i+1) = P(A \to w_i), \qquad
    \beta_A(i, j) = \sum_{i<k<j} \sum_{B,C} P(A \to B C)\, \beta_B(i, k)\, \beta_C(k, j),

and :math:`P(w) = \beta_S(0, |w|)`. Sampling caps the sentence length at ``max_length`` by rejection, so the
distribution the data actually follows is :math:`P(w \mid |w| \le N)`; :meth:`PCFG.next_token_logprobs` is exact
for that capped distribution (it sums over every continuation that keeps the sentence within the cap).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["PCFG", "Constituent"]

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class Constituent:
    """A labelled span ``[start, end)`` of word positions (0-based, end exclusive) of a parse tree."""

    start: int
    end: int
    label: int


class PCFG:
    r"""A probabilistic context-free grammar in Chomsky normal form.

    Args:
        nonterminals: Names of the non-terminals; ``start`` names (or indexes) the start symbol.
        terminals: Names of the terminals (the "words"; a
            :class:`~lightning_llm.datamodules.PCFGDataModule` maps each to one token).
        binary: ``[N, N, N]`` tensor, ``binary[A, B, C] = P(A -> B C)``.
        emission: ``[N, V]`` tensor, ``emission[A, a] = P(A -> a)``.
        start: The start symbol, by name or index.

    Every row must be a distribution: ``binary[A].sum() + emission[A].sum() == 1`` (to 1e-6). Probabilities are
    kept in float64, since sentence probabilities of long sentences are tiny; all dynamic programmes run in log
    space.
    """

    def __init__(
        self,
        nonterminals: Sequence[str],
        terminals: Sequence[str],
        binary: Tensor,
        emission: Tensor,
        start: str | int = 0,
    ) -> None:
        self.nonterminals = [str(name) for name in nonterminals]
        self.terminals = [str(name) for name in terminals]
        n, v = len(self.nonterminals), len(self.terminals)
        if n == 0 or v == 0:
            raise ValueError(f"a grammar needs non-terminals and terminals (got {n} and {v})")
        for kind, names in (("non-terminal", self.nonterminals), ("terminal", self.terminals)):
            if len(set(names)) != len(names):
                raise ValueError(f"duplicate {kind} names in {names}")
        if set(self.nonterminals) & set(self.terminals):
            raise ValueError(
                f"names used as both terminal and non-terminal: {set(self.nonterminals) & set(self.terminals)}"
            )
        binary = torch.as_tensor(binary, dtype=torch.float64)
        emission = torch.as_tensor(emission, dtype=torch.float64)
        if binary.shape != (n, n, n):
            raise ValueError(f"binary must have shape {(n, n, n)}, got {tuple(binary.shape)}")
        if emission.shape != (n, v):
            raise ValueError(f"emission must have shape {(n, v)}, got {tuple(emission.shape)}")
        if (
            (binary < 0).any()
            or (emission < 0).any()
            or not (binary.isfinite().all() and emission.isfinite().all())
        ):
            raise ValueError("rule probabilities must be finite and non-negative")
        totals = binary.flatten(1).sum(1) + emission.sum(1)
        bad = (totals - 1).abs() > 1e-6
        if bad.any():
            row = int(bad.nonzero()[0])
            raise ValueError(
                f"the rules of {self.nonterminals[row]!r} sum to {float(totals[row]):.6f}, not 1 "
                "(use PCFG.from_rules(..., normalize=True) to rescale)"
            )
        self.start = self.nonterminals.index(start) if isinstance(start, str) else int(start)
        if not 0 <= self.start < n:
            raise ValueError(f"start index {start} out of range for {n} non-terminals")
        self.binary, self.emission = binary, emission
        self._log_binary = binary.log()
        self._log_emission = emission.log()
        # P(A -> B C) as [B, A*C] and as [C, A*B], for contracting either child first (see _log_bilinear).
        self._binary_b = binary.permute(1, 0, 2).reshape(len(self.nonterminals), -1)
        self._binary_c = binary.permute(2, 0, 1).reshape(len(self.nonterminals), -1)
        self._sampler = self._sampling_tables()
        self._wild: Tensor | None = None

    # ------------------------------------------------------------------------------------------- building

    @property
    def num_nonterminals(self) -> int:
        return len(self.nonterminals)

    @property
    def num_terminals(self) -> int:
        """V; the end-of-sentence symbol of :meth:`next_token_logprobs` is column V."""
        return len(self.terminals)

    @classmethod
    def from_rules(
        cls,
        rules: Iterable[tuple[str, Sequence[str], float]],
        start: str = "S",
        *,
        normalize: bool = False,
    ) -> PCFG:
        """Build a grammar from ``(lhs, rhs, probability)`` rules, e.g. ``("S", ("NP", "VP"), 1.0)``.

        A right-hand side of two symbols is a binary rule (both must be non-terminals, i.e. left-hand sides of
        some rule); one symbol that is not a non-terminal is a terminal rule. Anything else is not CNF and is
        rejected. ``normalize=True`` rescales each non-terminal's rules to sum to one.
        """
        rules = [(str(lhs), tuple(str(s) for s in rhs), float(p)) for lhs, rhs, p in rules]
        if not rules:
            raise ValueError("no rules given")
        nonterminals = list(dict.fromkeys(lhs for lhs, _, _ in rules))
        if start not in nonterminals:
            raise ValueError(f"start symbol {start!r} has no rules")
        nonterminals.remove(start)
        nonterminals.insert(0, start)
        index = {name: i for i, name in enumerate(nonterminals)}
        terminals: list[str] = []
        for number, (lhs, rhs, p) in enumerate(rules):
            where = f"rule {number} ({lhs} -> {' '.join(rhs)})"
            if p < 0 or not math.isfinite(p):
                raise ValueError(f"{where}: probability must be finite and >= 0, got {p}")
            if len(rhs) == 2:
                missing = [s for s in rhs if s not in index]
                if missing:
                    raise ValueError(
                        f"{where}: {missing} have no rules; a binary rule needs two non-terminals"
                    )
            elif len(rhs) == 1:
                if rhs[0] in index:
                    raise ValueError(f"{where}: a unary rule A -> B is not in Chomsky normal form")
                if rhs[0] not in terminals:
                    terminals.append(rhs[0])
            else:
                raise ValueError(f"{where}: a CNF rule has one terminal or two non-terminals on the right")
        n, v = len(nonterminals), len(terminals)
        binary, emission = torch.zeros(n, n, n, dtype=torch.float64), torch.zeros(n, v, dtype=torch.float64)
        for lhs, rhs, p in rules:
            if len(rhs) == 2:
                binary[index[lhs], index[rhs[0]], index[rhs[1]]] += p
            else:
                emission[index[lhs], terminals.index(rhs[0])] += p
        if normalize:
            totals = binary.flatten(1).sum(1) + emission.sum(1)
            if (totals <= 0).any():
                raise ValueError(
                    f"{nonterminals[int((totals <= 0).nonzero()[0])]!r} has only zero-probability rules"
                )
            binary, emission = binary / totals[:, None, None], emission / totals[:, None]
        return cls(nonterminals, terminals, binary, emission, start=0)

    def rules(self) -> list[tuple[str, tuple[str, ...], float]]:
        """The non-zero rules as ``(lhs, rhs, probability)``; ``PCFG.from_rules(g.rules())`` rebuilds ``g``."""
        out = []
        for a in range(self.num_nonterminals):
            for b, c in self.binary[a].nonzero().tolist():
                out.append(
                    (
                        self.nonterminals[a],
                        (self.nonterminals[b], self.nonterminals[c]),
                        float(self.binary[a, b, c]),
                    )
                )
            for t in self.emission[a].nonzero().flatten().tolist():
                out.append((self.nonterminals[a], (self.terminals[t],), float(self.emission[a, t])))
        return out

    def save_json(self, path: str | Path) -> None:
        """Write ``{"start": ..., "rules": [{"lhs", "rhs", "prob"}, ...]}`` (read back with :meth:`from_json`)."""
        rules = [{"lhs": lhs, "rhs": list(rhs), "prob": p} for lhs, rhs, p in self.rules()]
        Path(path).write_text(json.dumps({"start": self.nonterminals[self.start], "rules": rules}, indent=1))

    @classmethod
    def from_json(cls, path: str | Path) -> PCFG:
        """Read a grammar written by :meth:`save_json` (or by hand); errors name the file and the rule."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: cannot read a grammar: {err}") from err
        if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
            raise ValueError(f'{path}: expected an object {{"start": ..., "rules": [...]}}')
        rules = []
        for number, rule in enumerate(data["rules"]):
            if not isinstance(rule, dict) or not {"lhs", "rhs", "prob"} <= set(rule):
                raise ValueError(f"{path}: rule {number} needs the keys lhs, rhs and prob, got {rule!r}")
            if not isinstance(rule["rhs"], list) or not isinstance(rule["prob"], (int, float)):
                raise ValueError(f"{path}: rule {number}: rhs must be a list and prob a number, got {rule!r}")
            rules.append((rule["lhs"], rule["rhs"], rule["prob"]))
        try:
            return cls.from_rules(rules, start=data.get("start", "S"))
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err

    @classmethod
    def random(
        cls,
        num_nonterminals: int = 9,
        num_terminals: int = 12,
        *,
        binary_rules: int = 3,
        terminal_rules: int = 3,
        binary_mass: float = 0.8,
        start_binary_mass: float = 1.0,
        levels: int | None = 5,
        seed: int = 0,
    ) -> PCFG:
        r"""A random grammar, deterministic in ``seed``.

        Each non-terminal gets ``binary_rules`` random binary rules sharing ``binary_mass`` of its probability and
        ``terminal_rules`` terminal rules sharing the rest (Dirichlet(1) weights within each group); the start
        symbol S expands with ``start_binary_mass``.

        The defaults give the layered grammar of the tutorial and ``configs/pcfg.yaml``: 5 levels (S, then two
        non-terminals per level), sentences of 1-16 words, about 10 on average.

        - ``levels=None``: children are any non-terminals. A binary mass below 1/2 keeps the grammar
          *consistent* (subcritical: derivations end with probability 1); sentences are mostly short.
        - ``levels=L``: a layered, hierarchical grammar (as in the synthetic CFGs of "Physics of Language
          Models"): S is level 0, the other non-terminals are split evenly over levels 1..L-1, the children of a
          level-l symbol are both from level l+1, and the last level only emits words. Any binary mass is
          consistent (depth is at most L) and sentence lengths run up to :math:`2^{L-1}`; structure is nested
          in L - 1 layers, which n-gram models cannot capture.
        """
        if num_nonterminals < 1 or num_terminals < 1:
            raise ValueError("need at least one non-terminal and one terminal")
        if not 1 <= terminal_rules <= num_terminals:
            raise ValueError(f"terminal_rules must be in [1, num_terminals], got {terminal_rules}")
        for name, mass in (("binary_mass", binary_mass), ("start_binary_mass", start_binary_mass)):
            if not 0 <= mass <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {mass}")
        n, v = num_nonterminals, num_terminals
        if levels is None:
            if binary_mass >= 0.5 or start_binary_mass == 1:
                raise ValueError(
                    "without levels, binary_mass must be < 0.5 and start_binary_mass < 1 (consistency)"
                )
            level = [0] * n
            children = [list(range(n))] * n
        else:
            if not 2 <= levels <= n:
                raise ValueError(f"levels must be in [2, num_nonterminals], got {levels}")
            level = [0, *(1 + (i * (levels - 1)) // (n - 1) for i in range(n - 1))]
            children = [[b for b in range(n) if level[b] == level[a] + 1] for a in range(n)]
        gen = torch.Generator().manual_seed(seed)
        binary, emission = torch.zeros(n, n, n, dtype=torch.float64), torch.zeros(n, v, dtype=torch.float64)
        for a in range(n):
            mass = start_binary_mass if a == 0 else binary_mass
            kids = torch.tensor(children[a], dtype=torch.long)
            count = min(binary_rules, len(kids) ** 2)
            if count == 0:
                mass = 0.0
            if mass > 0:
                pairs = torch.randperm(len(kids) ** 2, generator=gen)[:count]
                weights = -torch.rand(count, generator=gen, dtype=torch.float64).log()
                binary[a, kids[pairs // len(kids)], kids[pairs % len(kids)]] = mass * weights / weights.sum()
            if mass < 1:
                words = torch.randperm(v, generator=gen)[:terminal_rules]
                weights = -torch.rand(terminal_rules, generator=gen, dtype=torch.float64).log()
                emission[a, words] = (1 - mass) * weights / weights.sum()
        nonterminals = ["S", *(f"N{i}" for i in range(1, n))]
        terminals = [chr(ord("a") + i) if i < 26 else f"t{i}" for i in range(v)]
        return cls(nonterminals, terminals, binary, emission)

    # ------------------------------------------------------------------------------------------- sampling

    def _sampling_tables(self) -> list[tuple[list[float], list[tuple[int, ...]]]]:
        tables = []
        for a in range(self.num_nonterminals):
            outcomes: list[tuple[int, ...]] = [tuple(bc) for bc in self.binary[a].nonzero().tolist()]
            weights = [float(self.binary[a, b, c]) for b, c in outcomes]
            words = self.emission[a].nonzero().flatten().tolist()
            outcomes += [(w,) for w in words]
            weights += [float(self.emission[a, w]) for w in words]
            cumulative = list(itertools.accumulate(weights))
            tables.append(([c / cumulative[-1] for c in cumulative], outcomes))
        return tables

    def sample(self, n: int, *, max_length: int, seed: int = 0) -> list[list[int]]:
        """``n`` sentences (lists of terminal indices) of at most ``max_length`` words, by rejection.

        Derivations are expanded left to right and abandoned as soon as the words emitted plus the symbols
        still pending exceed ``max_length`` (each pending symbol yields at least one word), so the result follows
        exactly :math:`P(w \\mid |w| \\le N)`. Deterministic in ``seed``.
        """
        if n < 0 or max_length < 1:
            raise ValueError(f"need n >= 0 and max_length >= 1, got {n} and {max_length}")
        rng = random.Random(seed)
        tables = self._sampler
        out: list[list[int]] = []
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 1000 * max(n, 1) + 10_000:
                raise RuntimeError(
                    f"the grammar produced only {len(out)} of {n} sentences within max_length={max_length} in "
                    f"{attempts} attempts; raise max_length"
                )
            words: list[int] = []
            stack = [self.start]
            while stack:
                cumulative, outcomes = tables[stack.pop()]
                outcome = outcomes[min(bisect.bisect_right(cumulative, rng.random()), len(outcomes) - 1)]
                if len(outcome) == 2:
                    stack += (outcome[1], outcome[0])  # left child expanded first
                else:
                    words.append(outcome[0])
                if len(words) + len(stack) > max_length:
                    break
            else:
                out.append(words)
        return out

    # ------------------------------------------------------------------------------------ inside algorithm

    def _log_bilinear(self, left: Tensor, right: Tensor) -> Tensor:
        r""":math:`\log \sum_{B,C} P(A \to B C)\, e^{l_B} e^{r_C}` for every ``A``, broadcasting leading dims.

        Stable in log space: each side is shifted by its max before the (linear) contraction.
        """
        shift_l = left.amax(-1, keepdim=True)
        shift_r = right.amax(-1, keepdim=True)
        shift_l = torch.where(shift_l.isfinite(), shift_l, torch.zeros_like(shift_l))
        shift_r = torch.where(shift_r.isfinite(), shift_r, torch.zeros_like(shift_r))
        left, right = (left - shift_l).exp(), (right - shift_r).exp()
        n = self.num_nonterminals
        # Contract the rule tensor with the smaller side first (one side often broadcasts over the other).
        if left.numel() <= right.numel():
            mixed = (left @ self._binary_b).unflatten(-1, (n, n))  # [..., A, C]
            total = torch.einsum("...ac,...c->...a", mixed, right)
        else:
            mixed = (right @ self._binary_c).unflatten(-1, (n, n))  # [..., A, B]
            total = torch.einsum("...ab,...b->...a", mixed, left)
        return total.log() + shift_l + shift_r

    def _emissions(self, sentences: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor, int]:
        """Log emission vectors ``[B, T, N]`` (-inf past each sentence's end), lengths, and T."""
        lengths = torch.tensor([len(s) for s in sentences])
        if (lengths < 1).any():
            raise ValueError("sentences must have at least one word")
        length = int(lengths.max())
        ids = torch.zeros(len(sentences), length, dtype=torch.long)
        for row, sentence in zip(ids, sentences, strict=True):
            if any(not 0 <= w < self.num_terminals for w in sentence):
                raise ValueError(f"terminal index out of range [0, {self.num_terminals}) in {list(sentence)}")
            row[: len(sentence)] = torch.as_tensor(list(sentence), dtype=torch.long)
        emis = self._log_emission.T[ids]  # [B, T, N]
        emis = emis.masked_fill(torch.arange(length)[None, :, None] >= lengths[:, None, None], _NEG_INF)
        return emis, lengths, length

    def log_inside(self, sentences: Sequence[Sequence[int]]) -> Tensor:
        r"""Inside chart ``[B, T, T+1, N]``: entry ``[b, i, l, A]`` is :math:`\log \beta_A(i, i+l)` of sentence b.

        Spans running past a sentence's end are -inf. Vectorised over sentences, start positions and split points.
        """
        emis, _, length = self._emissions(sentences)
        chart = torch.full(
            (len(sentences), length, length + 1, self.num_nonterminals), _NEG_INF, dtype=torch.float64
        )
        chart[:, :, 1] = emis
        for span in range(2, length + 1):
            starts = length - span + 1
            splits = torch.arange(1, span)
            left = chart[:, :starts, 1:span]  # [B, S, k, N]: spans (i, i+k)
            right = chart[:, torch.arange(starts)[:, None] + splits, span - splits]  # spans (i+k, i+span)
            chart[:, :starts, span] = self._log_bilinear(left, right).logsumexp(2)
        return chart

    def log_prob(self, sentences: Sequence[Sequence[int]], *, max_length: int | None = None) -> Tensor:
        r""":math:`\log P(w)` of each sentence, or :math:`\log P(w \mid |w| \le N)` with ``max_length=N``."""
        chart = self.log_inside(sentences)
        lengths = torch.tensor([len(s) for s in sentences])
        out = chart[torch.arange(len(sentences)), 0, lengths, self.start]
        if max_length is not None:
            if int(lengths.max()) > max_length:
                raise ValueError(f"a sentence is longer than max_length={max_length}")
            out = out - self.log_length_probs(max_length)[1:].logsumexp(0)
        return out

    def _wildcard(self, max_length: int) -> Tensor:
        r"""``[max_length+1, N]``: :math:`\log \sum_{|u| = m} \beta_A(u)`, the probability that A yields m words."""
        if self._wild is None or self._wild.shape[0] <= max_length:
            wild = torch.full((max_length + 1, self.num_nonterminals), _NEG_INF, dtype=torch.float64)
            wild[1] = self.emission.sum(1).log()
            for m in range(2, max_length + 1):
                k = torch.arange(1, m)
                wild[m] = self._log_bilinear(wild[k], wild[m - k]).logsumexp(0)
            self._wild = wild
        return self._wild[: max_length + 1]

    def log_length_probs(self, max_length: int) -> Tensor:
        """``[max_length+1]``: log P(|w| = n) for n = 0..max_length under the uncapped grammar (n = 0 is -inf)."""
        return self._wildcard(max_length)[:, self.start]

    # ------------------------------------------------------------------------------- next-token distribution

    def next_token_logprobs(
        self, sentences: Sequence[Sequence[int]], *, max_length: int, batch_size: int = 32
    ) -> list[Tensor]:
        r"""Exact :math:`\log p_G(x \mid w_{1:t})` for every prefix of every sentence, under the length cap.

        Returns one ``[|w|+1, V+1]`` tensor per sentence: row ``t`` is the distribution after the first ``t``
        words over the V terminals and end of sentence (column V). With :math:`N` = ``max_length``,

        .. math::

            p(a \mid w_{1:t}) = \frac{\sum_{m \ge 0,\ t+1+m \le N} P(w_{1:t}\, a\, \ast^m)}{D_t}, \qquad
            p(\mathrm{eos} \mid w_{1:t}) = \frac{P(w_{1:t})}{D_t},

        where :math:`\ast^m` is any m words and :math:`D_t` is the sum of all numerators, so every row sums to
        one exactly. The inside probability :math:`Y` of a span made of fixed words :math:`w_{i:t}`, a free last
        word a and m wildcard words obeys, splitting after q fixed words or before the last m - m'' wildcards,

        .. math::

            Y(i, t, m, a) = \sum_{q=1}^{t-i} \beta(w_{i:i+q}) \otimes Y(i+q, t, m, a)
                + \sum_{m''=0}^{m-1} Y(i, t, m'', a) \otimes W(m - m''),

        with :math:`\otimes` the binary-rule combination and :math:`W(m)` the wildcard inside; it costs
        :math:`O(T^2 N\,(T + N)\,V\,|\mathcal N|^3)` per sentence, batched over ``batch_size`` sentences.
        """
        if any(len(s) > max_length for s in sentences):
            raise ValueError(f"a sentence is longer than max_length={max_length}")
        return _by_length_chunks(
            sentences, batch_size, lambda chunk: self._next_token_chunk(chunk, max_length)
        )

    def _next_token_chunk(self, sentences: Sequence[Sequence[int]], cap: int) -> list[Tensor]:
        # The recurrence runs in linear space (far cheaper than log-space products), made safe by scaling every
        # fixed word w by s_w = 1 / max_A P(A -> w): a quantity over fixed words w_i..w_{t-1} carries the factor
        # prod s_w of exactly those words, whichever way it was built, so all numerators of one prefix t share
        # it and it cancels in the normalisation. Span values then stay within a few orders of magnitude of 1.
        log_chart = self.log_inside(sentences)  # [B, T, T+1, N]
        lengths = [len(s) for s in sentences]
        batch, length = log_chart.shape[0], log_chart.shape[1]
        n, v = self.num_nonterminals, self.num_terminals
        log_scale = -self._log_emission.amax(0)  # [V]
        padded = torch.zeros(batch, length, dtype=torch.float64)
        for row, sentence in zip(padded, sentences, strict=True):
            row[: len(sentence)] = log_scale[list(sentence)]
        cum = torch.cat([torch.zeros(batch, 1, dtype=torch.float64), padded.cumsum(1)], 1)  # [B, T+1]
        ends = (torch.arange(length)[:, None] + torch.arange(length + 1)[None, :]).clamp_max(length)
        span_scale = cum[:, ends] - cum[:, :length, None]  # [B, i, q]: sum of log s over w_i..w_{i+q-1}
        chart = (log_chart + span_scale[..., None]).exp()  # -inf (impossible or past the end) -> 0
        chart_c = (chart @ self._binary_b).unflatten(-1, (n, n))  # [B, i, q, A, C]: sum_B P(A -> B C) beta_B
        wild = self._wildcard(cap).exp()  # [cap+1, N]
        wild_c = (wild @ self._binary_c).unflatten(-1, (n, n))  # [m, A, B]: sum_C P(A -> B C) W_C(m)
        free = self.emission.T  # [V, N]: the free word a, emitted by A (unscaled, like the wildcards)
        max_wild = cap - 1  # m wildcards after the free word: t + 1 + m <= cap
        # y[p][m]: [B, T+1-p, V, N], the scaled inside of (w_i .. w_{i+p-1}, a, *^m) for starts i = 0..T-p.
        y: list[list[Tensor | None]] = [[None] * (max_wild + 1) for _ in range(length + 1)]
        for m in range(max_wild + 1):
            for p in range(length + 1):
                if p + 1 + m > cap:
                    continue
                starts = length + 1 - p
                total = free.expand(batch, starts, v, n).clone() if p == 0 and m == 0 else 0
                if p >= 1:
                    # Split after q fixed words: beta(w_i..w_{i+q-1}) (x) Y(i+q, t, m), summed over q.
                    left = chart_c[:, :starts, 1 : p + 1]
                    right = torch.stack([y[p - q][m][:, q : q + starts] for q in range(1, p + 1)], 2)
                    total = total + torch.einsum("bsqac,bsqvc->bsva", left, right)
                if m >= 1:
                    # Split before the last m - m'' wildcards: Y(i, t, m'') (x) W(m - m''), summed over m''.
                    left = torch.stack([y[p][k] for k in range(m)], 2)  # [B, S, m'', V, B]
                    total = total + torch.einsum("bskvx,kax->bsva", left, wild_c[m - torch.arange(m)])
                y[p][m] = total
        results = []
        for b, size in enumerate(lengths):
            rows = []
            for t in range(size + 1):
                ms = [y[t][m][b, 0, :, self.start] for m in range(max_wild + 1) if t + 1 + m <= cap]
                words = torch.stack(ms).sum(0) if ms else torch.zeros(v, dtype=torch.float64)
                eos = chart[b, 0, t, self.start] if t >= 1 else torch.tensor(0.0, dtype=torch.float64)
                rows.append(torch.cat([words, eos.view(1)]))
            table = torch.stack(rows)
            norm = table.sum(-1, keepdim=True)
            if not (norm > 0).all() or not norm.isfinite().all():
                raise ValueError(f"sentence {list(sentences[b])} is not a prefix of the grammar's language")
            results.append((table / norm).log())
        return results

    # ------------------------------------------------------------------------------------------ parsing

    def viterbi(
        self, sentences: Sequence[Sequence[int]], *, batch_size: int = 32
    ) -> list[tuple[float, list[Constituent]]]:
        """Most probable parse of each sentence: ``(log probability, constituents)``, root first.

        Every node of the tree is a :class:`Constituent`; preterminals are the length-1 spans. A sentence the
        grammar cannot derive raises a ValueError.
        """
        return _by_length_chunks(sentences, batch_size, self._viterbi_chunk)

    def _viterbi_chunk(self, sentences: Sequence[Sequence[int]]) -> list[tuple[float, list[Constituent]]]:
        emis, lengths, length = self._emissions(sentences)
        batch, n = len(sentences), self.num_nonterminals
        best = torch.full((batch, length, length + 1, n), _NEG_INF, dtype=torch.float64)
        back = torch.zeros((batch, length, length + 1, n, 3), dtype=torch.long)  # split, B, C
        best[:, :, 1] = emis
        for span in range(2, length + 1):
            starts = length - span + 1
            splits = torch.arange(1, span)
            left = best[:, :starts, 1:span]  # [B, S, k, N]
            right = best[:, torch.arange(starts)[:, None] + splits, span - splits]
            score = (
                self._log_binary[None, None, None] + left[..., None, :, None] + right[..., None, None, :]
            )  # [B, S, k, A, B, C]
            score = score.permute(0, 1, 3, 2, 4, 5).flatten(3)  # [B, S, A, k*B*C]
            value, arg = score.max(-1)
            best[:, :starts, span] = value
            k, rest = arg // (n * n), arg % (n * n)
            back[:, :starts, span] = torch.stack([k + 1, rest // n, rest % n], -1)
        out = []
        for b in range(batch):
            size = int(lengths[b])
            logp = float(best[b, 0, size, self.start])
            if logp == _NEG_INF:
                raise ValueError(f"the grammar cannot derive sentence {list(sentences[b])}")
            nodes, todo = [], [(0, size, self.start)]
            while todo:
                i, span, a = todo.pop(0)
                nodes.append(Constituent(i, i + span, a))
                if span > 1:
                    k, left, right = back[b, i, span, a].tolist()
                    todo += [(i, k, left), (i + k, span - k, right)]
            out.append((logp, nodes))
        return out


def _by_length_chunks(
    sentences: Sequence[Sequence[int]], batch_size: int, run: Callable[[list[Sequence[int]]], list[Any]]
) -> list[Any]:
    """``run`` over chunks of similar length (padding to the chunk's longest is what costs), in input order."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    out: list[Any] = [None] * len(sentences)
    for first in range(0, len(order), batch_size):
        chunk = order[first : first + batch_size]
        for i, result in zip(chunk, run([sentences[i] for i in chunk]), strict=True):
            out[i] = result
    return out
