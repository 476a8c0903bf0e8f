"""The opponents a self-play learner is matched against, and everyone's Elo rating.

    OpponentPool
      members: the game's bots and other checkpoints (fixed) + snapshots of the learner
               ("step_<version>", every `every` versions, the newest `size` kept);
               agents/weight_sets.py serves weights through the learner's own policy,
               swapping them per phase of requests
      sample(rng)        uniform | latest | prioritised (by the learner's loss rate against each)
      record(name, s)    a finished game, the learner's score s (win 1, draw 0.5, loss 0):
                         Elo of the learner and that member, the member's tallies
      metrics()          selfplay/elo (the learner), selfplay/elo/<member>, selfplay/pool_size,
                         selfplay/games/<member> this step ... (logged each step: the curves)

Elo (base 10, scale 400, `k` per game, everyone starts at 1000); a new snapshot enters at the
learner's rating when it was taken. Prioritised sampling weighs each member by the learner's
loss rate against it, (losses + draws/2 + 1) / (games + 2), so a new member is tried and the
ones that still beat the learner are played most (prioritised fictitious self-play's "hard"
weighting).

Snapshots are saved to `directory/<name>.safetensors` (one file each, deleted when the member
leaves the pool); `state()` / `restore(state)` carry the pool through a checkpoint: a resume whose
member file is gone is a one-line error naming it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

import msgspec
import torch
from safetensors.torch import load_file, save_file

from ...agents.weight_sets import WeightSets

SAMPLING: Final = ("uniform", "latest", "prioritised")
INITIAL_RATING: Final = 1000.0


def elo_expected(rating: float, other: float) -> float:
    """The expected score of a player rated `rating` against one rated `other`."""
    return 1.0 / (1.0 + 10.0 ** ((other - rating) / 400.0))


class Member(msgspec.Struct, kw_only=True):
    """One opponent: a bot of the game, a snapshot of the learner at `version`, or another
    checkpoint."""

    name: str
    kind: str  # "bot" | "snapshot" | "checkpoint"
    version: int = 0
    rating: float = INITIAL_RATING
    games: int = 0
    learner_score: float = 0.0  # the learner's summed score against it (win 1, draw 0.5)


class PoolState(msgspec.Struct, kw_only=True):
    """What a checkpoint keeps of the pool (meta.json's data position)."""

    learner_rating: float
    members: list[Member]


class PoolError(RuntimeError):
    """The pool cannot be restored (a snapshot's file is missing)."""


class OpponentPool:
    """Bots and snapshots of the learner to play against, with ratings (module doc)."""

    def __init__(
        self,
        bots: Sequence[str] = (),
        *,
        weights: WeightSets | None = None,
        directory: Path | None = None,
        every: int = 10,
        size: int = 4,
        sampling: str = "uniform",
        elo_k: float = 32.0,
    ) -> None:
        if sampling not in SAMPLING:
            raise ValueError(f"pool sampling must be one of {SAMPLING}, got {sampling!r}")
        if every < 1 or size < 0:
            raise ValueError(f"pool every must be >= 1 and size >= 0, got every={every}, size={size}")
        if size and weights is None:
            raise ValueError("snapshots need the WeightSets that serve them")
        self.weights, self.directory = weights, directory
        self.every, self.size, self.sampling, self.elo_k = every, size, sampling, elo_k
        self.learner_rating = INITIAL_RATING
        self.members: dict[str, Member] = {name: Member(name=name, kind="bot") for name in bots}
        self._step_games: dict[str, list[float]] = {}

    # ---- members --------------------------------------------------------------------------
    def snapshots(self) -> list[Member]:
        return [m for m in self.members.values() if m.kind == "snapshot"]

    def due(self, version: int) -> bool:
        """Whether the learner at `version` is snapshotted (every `every` versions, from 0)."""
        return self.size > 0 and version % self.every == 0 and f"step_{version}" not in self.members

    def add_snapshot(self, version: int) -> str:
        """The live weights at `version` become member `step_<version>` (rated as the learner is
        now); the oldest snapshot leaves when there are more than `size`."""
        assert self.weights is not None
        name = f"step_{version}"
        tensors = self.weights.tensors("live")
        self.weights.add(name, tensors.items(), version)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = self._file(name).with_suffix(".partial")  # renamed whole: never a torn file
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial))
            partial.replace(self._file(name))
        self.members[name] = Member(name=name, kind="snapshot", version=version, rating=self.learner_rating)
        while len(self.snapshots()) > self.size:
            self._drop(self.snapshots()[0].name)
        return name

    def add_checkpoint(self, name: str, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A fixed member from another checkpoint's weights (the policy's model and tokenizer:
        configs/checks.py checks them); never leaves the pool, its file is the checkpoint's own."""
        if name in self.members:
            raise ValueError(f"pool member {name!r} exists already")
        if self.weights is None:
            raise ValueError("checkpoint members need the WeightSets that serve them")
        self.weights.add(name, named_tensors, 0)
        self.members[name] = Member(name=name, kind="checkpoint")

    def _drop(self, name: str) -> None:
        del self.members[name]
        if self.weights is not None:
            self.weights.remove(name)
        if self.directory is not None:
            self._file(name).unlink(missing_ok=True)

    def _file(self, name: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{name}.safetensors"

    # ---- sampling and results ---------------------------------------------------------------
    def sample(self, rng: random.Random) -> str:
        """An opponent's name, drawn as `sampling` says (module doc)."""
        members = list(self.members.values())
        if not members:
            raise RuntimeError("the opponent pool is empty (no bots and no snapshot yet)")
        if self.sampling == "latest":
            snapshots = self.snapshots()
            return max(snapshots, key=lambda m: m.version).name if snapshots else rng.choice(members).name
        if self.sampling == "uniform":
            return rng.choice(members).name
        weights = [(m.games - m.learner_score + 1.0) / (m.games + 2.0) for m in members]
        return rng.choices(members, weights=weights)[0].name

    def record(self, name: str, learner_score: float) -> None:
        """A finished game against `name`: the learner scored `learner_score` (1, 0.5 or 0)."""
        member = self.members.get(name)
        if member is None:  # left the pool while its game was played
            return
        delta = self.elo_k * (learner_score - elo_expected(self.learner_rating, member.rating))
        self.learner_rating += delta
        member.rating -= delta
        member.games += 1
        member.learner_score += learner_score
        self._step_games.setdefault(name, []).append(learner_score)

    def metrics(self) -> dict[str, float]:
        """The ratings now and this step's games per member (reset by the call)."""
        out = {
            "selfplay/elo": self.learner_rating,
            "selfplay/pool_size": float(len(self.members)),
            "selfplay/snapshots": float(len(self.snapshots())),
        }
        for member in self.members.values():
            out[f"selfplay/elo/{member.name}"] = member.rating
        games = [s for scores in self._step_games.values() for s in scores]
        if games:
            out["selfplay/learner_score"] = sum(games) / len(games)
        for name, scores in self._step_games.items():
            out[f"selfplay/games/{name}"] = float(len(scores))
        self._step_games = {}
        return out

    # ---- checkpoints ------------------------------------------------------------------------
    def state(self) -> dict:
        return msgspec.to_builtins(
            PoolState(learner_rating=self.learner_rating, members=list(self.members.values()))
        )

    def restore(self, state: Mapping) -> None:
        """The pool a checkpoint saved: ratings, tallies and the snapshots (read from their files
        into the WeightSets); PoolError naming a snapshot whose file is gone."""
        saved = msgspec.convert(state, PoolState)
        for member in self.snapshots():
            self._drop(member.name)
        members = {}
        for member in saved.members:
            if member.kind != "snapshot" and member.name not in self.members:
                continue  # a bot or checkpoint this run's config no longer names
            if member.kind == "snapshot":
                path = self._file(member.name) if self.directory is not None else None
                if path is None or not path.is_file():
                    raise PoolError(
                        f"self-play pool member {member.name!r}: its weights file {path} is missing "
                        "(the checkpoint's pool cannot be rebuilt without it)"
                    )
                assert self.weights is not None
                self.weights.add(member.name, load_file(str(path)).items(), member.version)
            members[member.name] = member
        for name, member in self.members.items():  # bots the config names but the checkpoint did not
            members.setdefault(name, member)
        self.members = members
        self.learner_rating = saved.learner_rating


__all__ = ["SAMPLING", "Member", "OpponentPool", "PoolError", "PoolState", "elo_expected"]
