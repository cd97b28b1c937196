"""Replay files (JSON), exact re-simulation from a replay, and a renderer to PNG frames or a GIF.

A replay holds the rules, the seed, every decision's raw reply and the executor's outcomes, the per-tick log,
and entity frames. Because the simulation is deterministic, :func:`resimulate` plays the recorded replies
back through a fresh world and must reach the same end, without the agents (an LLM agent's match can be
checked without the LLM). Replays are data: loading one parses JSON and validates it; nothing in it is
executed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from lightning_llm.envs.rts.match import Agent, Intervention, MatchResult, play_match
from lightning_llm.envs.rts.observation import Observation
from lightning_llm.envs.rts.rules import Rules
from lightning_llm.envs.rts.world import KINDS, LOG_FIELDS

__all__ = ["REPLAY_FORMAT", "load_replay", "render_replay", "replay_dict", "resimulate", "save_replay"]

REPLAY_FORMAT = "lightning_llm.rts.replay/1"
_KEYS = (
    "format",
    "rules",
    "seed",
    "names",
    "winner",
    "ticks",
    "fields",
    "bases",
    "decisions",
    "frames",
    "log",
)


def replay_dict(result: MatchResult) -> dict[str, Any]:
    """The JSON-able replay of a match."""
    return {
        "format": REPLAY_FORMAT,
        "rules": result.rules.to_dict(),
        "seed": result.seed,
        "names": list(result.names),
        "winner": result.winner,
        "ticks": result.ticks,
        "fields": [list(f) for f in result.fields],
        "bases": [list(b) for b in result.bases],
        "interventions": [vars(iv) for iv in result.interventions],
        "decisions": result.decisions,
        "frames": result.frames,
        "log": {name: np.round(result.metric(name), 4).tolist() for name in LOG_FIELDS},
    }


def save_replay(result: MatchResult, path: str | Path) -> Path:
    """Write the replay of ``result`` as JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(replay_dict(result), separators=(",", ":")))
    return path


def load_replay(path: str | Path) -> dict[str, Any]:
    """Read and validate a replay file (raises ``ValueError`` naming what is wrong)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != REPLAY_FORMAT:
        raise ValueError(f"{path}: not a {REPLAY_FORMAT} replay")
    missing = [k for k in _KEYS if k not in data]
    if missing:
        raise ValueError(f"{path}: replay lacks {missing}")
    return data


class _Recorded(Agent):
    """Plays back one player's recorded replies, decision by decision."""

    def __init__(self, name: str, replies: dict[int, str]) -> None:
        self.name, self.replies = name, replies

    def act(self, obs: Observation) -> str:
        return self.replies.get(obs.tick, "")


def resimulate(replay: dict[str, Any], frame_every: int = 20) -> MatchResult:
    """Re-play a replay's recorded replies from its seed and rules; returns the new :class:`MatchResult`."""
    rules = Rules.from_dict(replay["rules"])
    agents = [
        _Recorded(
            replay["names"][p], {d["tick"]: d["reply"] for d in replay["decisions"] if d["player"] == p}
        )
        for p in (0, 1)
    ]
    interventions = [Intervention(**iv) for iv in replay.get("interventions", [])]
    return play_match(agents, rules, replay["seed"], interventions=interventions, frame_every=frame_every)


_COLORS = ((40, 110, 220), (220, 60, 50))
_FIELD = (230, 190, 40)


def render_replay(
    replay: dict[str, Any],
    out: str | Path,
    *,
    cell: int = 12,
    every: int = 1,
    perspective: int | None = None,
    gif_ms: int = 120,
) -> list[Path]:
    """Draw a replay's frames: ``out`` ending in ``.gif`` writes one animated GIF, otherwise ``out`` is a folder
    of ``frame_<tick>.png`` files. Units are discs, buildings squares (HQ larger), resource fields yellow.

    ``perspective`` (0 or 1) greys out what that player does not see and hides the enemies there — reconstructed
    from its entities' vision in the frame, so it is exact at frame ticks. Needs Pillow.
    """
    from PIL import Image, ImageDraw  # deferred: only rendering needs it

    rules = Rules.from_dict(replay["rules"])
    w, h = rules.width, rules.height
    vision = [rules.units[k].vision if k in rules.units else rules.buildings[k].vision for k in KINDS]
    frames = replay["frames"][::every]
    if not frames:
        raise ValueError("the replay has no frames (recorded with frame_every=0?)")
    gy, gx = np.mgrid[0:h, 0:w] + 0.5
    images = []
    for frame in frames:
        img = Image.new("RGB", (w * cell, h * cell + 16), (245, 245, 240))
        draw = ImageDraw.Draw(img)
        seen = None
        if perspective is not None and rules.fog_of_war:
            seen = np.zeros((h, w), dtype=bool)
            for _, owner, kind, x, y, _ in frame["entities"]:
                if owner == perspective:
                    seen |= (gx - x) ** 2 + (gy - y) ** 2 <= vision[kind] ** 2
            for yy, xx in zip(*np.nonzero(~seen), strict=True):
                draw.rectangle(
                    [xx * cell, yy * cell, (xx + 1) * cell - 1, (yy + 1) * cell - 1], fill=(190, 190, 190)
                )
        for fx, fy in replay["fields"]:
            draw.ellipse(
                [(fx - 0.6) * cell, (fy - 0.6) * cell, (fx + 0.6) * cell, (fy + 0.6) * cell], fill=_FIELD
            )
        for _, owner, kind, x, y, _ in frame["entities"]:
            if seen is not None and owner != perspective and not seen[min(int(y), h - 1), min(int(x), w - 1)]:
                continue  # the perspective player does not see it
            color = _COLORS[owner]
            if KINDS[kind] in rules.units:
                r = 0.35 * cell
                draw.ellipse([x * cell - r, y * cell - r, x * cell + r, y * cell + r], fill=color)
            else:
                r = (0.9 if KINDS[kind] == "hq" else 0.55) * cell
                draw.rectangle(
                    [x * cell - r, y * cell - r, x * cell + r, y * cell + r], outline=color, width=2
                )
        draw.text((4, h * cell + 2), f"tick {frame['tick']}  {' vs '.join(replay['names'])}", fill=(0, 0, 0))
        images.append(img)
    out = Path(out)
    if out.suffix.lower() == ".gif":
        out.parent.mkdir(parents=True, exist_ok=True)
        images[0].save(out, save_all=True, append_images=images[1:], duration=gif_ms, loop=0)
        return [out]
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for frame, img in zip(frames, images, strict=True):
        path = out / f"frame_{frame['tick']:05d}.png"
        img.save(path)
        paths.append(path)
    return paths
