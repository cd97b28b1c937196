"""The RTS benchmark: rules, strict intents, budget, determinism and replays, presets, ratings, steerability."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_llm.envs.rts import (
    PRESETS,
    Agent,
    BalancedAgent,
    Game,
    Intent,
    IntentError,
    LLMAgent,
    PassiveAgent,
    RandomAgent,
    RTSArena,
    Rules,
    RushAgent,
    TurtleAgent,
    World,
    all_intents,
    bradley_terry,
    elo,
    load_replay,
    parse_intent,
    parse_intents,
    play_match,
    render_replay,
    replay_dict,
    resimulate,
    rules_preset,
    save_replay,
    steerability,
)
from lightning_llm.envs.rts.world import KINDS

# ----------------------------------------------------------------------------------------------- rules


def test_rules_round_trip_and_validation():
    rules = rules_preset("expensive_tanks")
    assert Rules.from_dict(json.loads(json.dumps(rules.to_dict()))) == rules
    with pytest.raises(ValueError, match="victory"):
        Rules(victory="king")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="units must define"):
        Rules(units={"infantry": Rules().units["infantry"]})
    with pytest.raises(ValueError, match="unknown rule fields"):
        Rules.from_dict({"gravity": 9.8})
    with pytest.raises(ValueError, match="unknown rules preset"):
        rules_preset("moon")


# ----------------------------------------------------------------------------------------------- intents


def test_parse_intent_normalises_and_round_trips():
    assert parse_intent("  Train( Tank ,3 ) ") == Intent("train", ("tank", 3))
    assert parse_intent("attack(NE)") == Intent("attack", ("ne",))
    for intent in all_intents():
        assert parse_intent(str(intent)) == intent
    assert len(all_intents()) == len(set(all_intents()))


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("attack ne", "not of the form"),
        ("fly(ne)", "unknown verb"),
        ("attack()", "takes 1 argument"),
        ("train(tank)", "takes 2 argument"),
        ("train(dragon, 2)", "unknown unit"),
        ("train(tank, 0)", "outside 1..5"),
        ("train(tank, 2.5)", "not a plain word"),
        ("train(tank, x)", "not a positive integer"),
        ("build(hq)", "unknown building"),
        ("scout(moon)", "unknown region"),
        ("attack(__import__('os'))", "not of the form"),
        ("expand()" + " " * 100, "longer than"),
    ],
)
def test_malformed_intent_rejected_with_reason(line, reason):
    with pytest.raises(IntentError, match=reason) as err:
        parse_intent(line)
    assert err.value.reason


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40))
def test_any_text_parses_or_is_rejected_with_a_reason(text):
    try:
        intent = parse_intent(text)
    except IntentError as err:
        assert err.reason
    else:
        assert parse_intent(str(intent)) == intent


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(all_intents()),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=8),
)
def test_corrupted_argument_is_rejected(intent, junk):
    if not intent.args:
        line = f"{intent.verb}({junk})"  # an argument where none is taken
    else:
        args = [str(a) for a in intent.args]
        args[0] = junk
        line = f"{intent.verb}({', '.join(args)})"
    try:
        parsed = parse_intent(line)
    except IntentError as err:
        assert err.reason
    else:  # the junk happened to be a valid value: then it must be one
        assert parsed.args[0] == junk


def test_parse_intents_collects_valid_lines_and_errors():
    intents, errors = parse_intents("expand()\n\nnonsense\ntrain(infantry, 2); attack(c)")
    assert [str(i) for i in intents] == ["expand()", "train(infantry, 2)", "attack(c)"]
    assert [e.line for e in errors] == ["nonsense"]


# ----------------------------------------------------------------------------------------------- executor


def test_intent_budget_is_enforced():
    world = World(Rules(intents_per_decision=2), seed=0)
    outcomes = world.execute(0, [Intent("wait")] * 5)
    assert [o.status for o in outcomes] == ["ok", "ok", "rejected", "rejected", "rejected"]
    assert all("over budget" in o.reason for o in outcomes[2:])

    class Spammer(Agent):
        name = "spammer"

        def act(self, obs):
            return "\n".join(["train(infantry, 1)", "build(barracks)"] * 4)

    result = play_match([Spammer(), PassiveAgent()], Rules(max_ticks=200), seed=0, frame_every=0)
    for decision in (d for d in result.decisions if d["player"] == 0):
        executed = [o for o in decision["outcomes"] if "over budget" not in o[2]]
        assert len(executed) <= Rules().intents_per_decision
        assert len(decision["outcomes"]) == 8


def test_executor_explains_what_it_cannot_do():
    world = World(Rules(start_credits=200), seed=0)
    assert (
        world.execute(0, [Intent("train", ("infantry", 2))])[0].reason == "infantry needs a finished barracks"
    )
    assert "requires a finished barracks" in world.execute(0, [Intent("build", ("factory",))])[0].reason
    assert world.execute(0, [Intent("build", ("barracks",))])[0].status == "ok"
    assert "costs 150" in world.execute(0, [Intent("build", ("barracks",))])[0].reason
    assert world.execute(0, [Intent("scout", ("c",))])[0].reason == "no scout"
    for _ in range(Rules().buildings["barracks"].build_ticks):
        world.step()
    outcome = world.execute(0, [Intent("train", ("infantry", 5))])[0]
    assert outcome.status == "partial" and "credits" in outcome.reason


def test_counters_decide_a_duel():
    """A tank beats an infantryman (1.8x) and loses to a pair of rockets (2x against tanks)."""

    def duel(attackers: list[str], defender: str) -> bool:
        world = World(Rules(), seed=0)
        for kind in attackers:
            world._spawn(0, KINDS.index(kind), 15.0, 16.0)
        world._spawn(1, KINDS.index(defender), 17.0, 16.0)
        for _ in range(400):
            world.step()
        alive = world.entities()
        return any(world.owner[s] == 0 and world.kind[s] < 4 for s in alive) and not any(
            world.owner[s] == 1 and world.kind[s] < 4 for s in alive
        )

    assert duel(["tank"], "infantry")
    assert not duel(["infantry"], "tank")
    assert duel(["rocket", "rocket"], "tank")


def test_fog_of_war_hides_distant_enemies():
    for fog in (True, False):
        world = World(Rules(fog_of_war=fog), seed=0)
        world._spawn(1, KINDS.index("tank"), 16.0, 16.0)  # mid-map, out of the HQs' sight
        world.step()
        seen = [k for k, _ in world.observe(0).visible_enemies]
        assert ("tank" in seen) is (not fog)
        assert world.observe(0).visible_fraction < 0.3 if fog else world.observe(0).visible_fraction == 1.0


# ----------------------------------------------------------------------------------------------- determinism


def test_identical_seeds_give_identical_replays_and_resimulation(tmp_path):
    rules = Rules(max_ticks=800)
    a = replay_dict(play_match([BalancedAgent(), RandomAgent()], rules, seed=3))
    b = replay_dict(play_match([BalancedAgent(), RandomAgent()], rules, seed=3))
    assert json.dumps(a) == json.dumps(b)
    assert World(rules, seed=4).map.fields != World(rules, seed=3).map.fields

    path = save_replay(play_match([BalancedAgent(), RandomAgent()], rules, seed=3), tmp_path / "m.json")
    loaded = load_replay(path)
    again = replay_dict(resimulate(loaded))
    assert again["frames"] == a["frames"] and again["winner"] == a["winner"] and again["log"] == a["log"]

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match=r"not a lightning_llm\.rts\.replay"):
        load_replay(bad)


def test_log_and_summary_are_consistent():
    result = play_match([BalancedAgent(), RushAgent()], seed=0, frame_every=100)
    assert result.log.shape == (result.ticks, 2, 9)
    visible = result.metric("visible")
    assert ((visible[:-1] > 0) & (visible[:-1] <= 1)).all()  # at the last tick the loser has nothing left
    assert (np.diff(result.metric("spent"), axis=0) >= 0).all()
    assert (np.diff(result.metric("explored"), axis=0) >= 0).all()
    summary = result.summary()
    assert summary["winner"] == result.winner
    assert summary["balanced"]["loss_ratio"] < summary["rush"]["loss_ratio"]


def test_render_replay(tmp_path):
    replay = replay_dict(
        play_match([RushAgent(), PassiveAgent()], Rules(max_ticks=120), seed=0, frame_every=40)
    )
    gif = render_replay(replay, tmp_path / "m.gif", cell=4)
    pngs = render_replay(replay, tmp_path / "frames", cell=4, perspective=0)
    assert gif[0].stat().st_size > 0 and len(pngs) == len(replay["frames"])


# ----------------------------------------------------------------------------------------------- presets


def _tanks(result, player):
    return result.produced[player]["tank"]


def test_each_rule_preset_changes_what_it_should():
    assert set(PRESETS) == {
        "standard", "rich", "scarce", "expensive_tanks", "glass_cannon", "fortress", "no_fog", "annihilation",
        "blitz",
    }  # fmt: skip

    def play(preset, agents):
        return play_match([a() for a in agents], rules_preset(preset), seed=0, frame_every=0)

    econ = {p: play(p, (BalancedAgent, RushAgent)) for p in ("standard", "rich", "scarce", "expensive_tanks")}
    spent = {p: econ[p].metric("spent")[-1] for p in econ}
    assert (spent["rich"] > spent["standard"]).all() and (spent["scarce"] < spent["standard"]).all()
    assert _tanks(econ["expensive_tanks"], 0) < _tanks(econ["standard"], 0)

    siege = {p: play(p, (RushAgent, PassiveAgent)) for p in ("standard", "glass_cannon", "fortress", "blitz")}
    assert all(siege[p].winner == 0 for p in ("standard", "glass_cannon", "fortress"))
    assert siege["glass_cannon"].ticks < siege["standard"].ticks < siege["fortress"].ticks
    assert siege["blitz"].ticks == 600 < siege["standard"].ticks

    world = World(rules_preset("no_fog"), seed=0)
    assert world.observe(0).visible_fraction == 1.0

    for preset, over in (("standard", True), ("annihilation", False)):
        world = World(rules_preset(preset), seed=0)
        world._spawn(1, KINDS.index("infantry"), 28.0, 3.0)  # player 1 keeps a unit
        world.hp[world.entities(1)[0]] = 0.0  # and loses its HQ
        world.hp[world.entities(1)[0]] = -1.0
        world.step()
        assert world.over is over


# ----------------------------------------------------------------------------------------------- ratings


def test_elo_and_bradley_terry_recover_known_strengths_from_sampled_games():
    strength = {"a": 8.0, "b": 4.0, "c": 2.0, "d": 1.0}
    rng = random.Random(0)
    games = []
    for x in strength:
        for y in strength:
            if x < y:
                for _ in range(60):
                    p = strength[x] / (strength[x] + strength[y])
                    games.append(Game(x, y, x if rng.random() < p else y, 0, 0))
    rng.shuffle(games)
    names = list(strength)
    bt = bradley_terry(games, names, prior=0.0)
    assert sorted(names, key=lambda n: -bt[n]) == names
    # log2 of the strength ratio is one "doubling" = 400 log10(2) ~ 120 Elo points
    assert bt["a"] - bt["d"] == pytest.approx(3 * 400 * np.log10(2), rel=0.25)
    assert sorted(names, key=lambda n: -elo(games, names)[n]) == names


def test_arena_elo_recovers_the_order_of_scripted_agents(tmp_path):
    """Balanced beats the rush (it expands, counters infantry with tanks and defends first), and the rush beats an
    agent that does nothing: the arena's Elo and Bradley–Terry ratings must say so."""
    agents = {"passive": PassiveAgent, "balanced": BalancedAgent, "rush": RushAgent}
    result = RTSArena(agents, games_per_pair=4, seed=0, replay_dir=tmp_path).run()
    table = result.table()
    assert [r["agent"] for r in table] == ["balanced", "rush", "passive"]
    bt = result.bradley_terry(bootstrap=50)
    assert bt["balanced"].value > bt["rush"].value > bt["passive"].value
    ratings = result.elo(bootstrap=50)
    assert ratings["balanced"].low > ratings["passive"].high
    assert all(g.ticks <= Rules().max_ticks for g in result.games)
    replays = sorted(tmp_path.glob("*.json"))
    assert len(replays) == len(result.games) == 12
    first = load_replay(replays[0])
    assert first["names"] == [result.games[0].first, result.games[0].second]


# ----------------------------------------------------------------------------------------------- steerability


def test_steerability_separates_an_obedient_agent_from_a_stubborn_one():
    kwargs = dict(
        seeds=(0,), instructions=("attack", "expand", "scout"), rules=replace(Rules(), max_ticks=900)
    )
    obedient = steerability(BalancedAgent, RushAgent, **kwargs)
    stubborn = steerability(lambda: BalancedAgent(follow_instructions=False), RushAgent, **kwargs)
    assert obedient.score >= 0.6
    assert stubborn.score == pytest.approx(0.0)
    assert all(v == 1.0 for v in obedient.instructed.values())


# ----------------------------------------------------------------------------------------------- LLM agent


def test_llm_agent_plays_legal_moves_under_constrained_decoding(tiny_backbone):
    model, tokenizer = tiny_backbone
    rules = Rules(max_ticks=200)
    greedy = play_match([LLMAgent(model, tokenizer), TurtleAgent()], rules, seed=0, frame_every=0)
    mine = [d for d in greedy.decisions if d["player"] == 0]
    assert len(mine) == 4
    for decision in mine:
        intents, errors = parse_intents(decision["reply"], rules)
        assert not errors and 1 <= len(intents) <= 2
        assert not any("not of the form" in o[2] or "unknown" in o[2] for o in decision["outcomes"])
    sampled = [
        [d["reply"] for d in play_match([LLMAgent(model, tokenizer, temperature=1.0), TurtleAgent()], rules,
                                         seed=0, frame_every=0).decisions if d["player"] == 0]
        for _ in range(2)
    ]  # fmt: skip
    assert sampled[0] == sampled[1]  # seeded per match
    assert len({r for r in sampled[0]}) > 1
