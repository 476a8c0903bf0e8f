"""Per-seat groups give each seat an unbiased gradient in mirror self-play; one group per task
mixing both seats does not.

The game: seat `first` picks a in {0, 1} (state 0), seat `second` sees it (state 1 + a) and picks
b; `first` wins with probability W[a][b] (reward +1, else -1) and `second` gets the opposite. Both
seats sample from one tabular softmax policy (mirror self-play). A seat's gradient is that of its
expected reward through its own decisions, the other seat's policy held fixed (autograd through
the exact enumeration, the other seat's probabilities detached). Matches are recorded as the
match runner records them (group id = task * 2 + seat), split into groups as `collect_batch`
splits them, scored by `score_group` (Dr. GRPO) and built into Episodes: per seat, the estimate
read off the Episodes' sampled tokens must match (G-1)/G of the seat's gradient (Dr. GRPO's mean
includes the episode itself) within 4 standard errors; grouped per task instead (both seats'
episodes in one group), the baseline holds the opponent's reward in the same match, which
depends on the seat's own move, and the same check fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from toolgym.agents.types import Completion
from toolgym.rollouts.batches import _split_groups
from toolgym.rollouts.episodes import trajectory_to_episodes
from toolgym.rollouts.scoring.advantages import AdvantageConfig, AdvantageEstimator
from toolgym.rollouts.scoring.scorer import score_group
from toolgym.rollouts.types import StopReason, Trajectory, Transition

W = np.array([[0.7, 0.2], [0.4, 0.9]])  # P(first wins | a, b)
STATE_TOKEN, ACTION_TOKEN = 100, 10
SEATS = ("first", "second")
G, TASKS = 4, 5_000
CONFIG = AdvantageConfig(estimator=AdvantageEstimator.DR_GRPO)


def policy(theta: np.ndarray) -> np.ndarray:
    pi = np.exp(theta - theta.max(axis=1, keepdims=True))
    return pi / pi.sum(axis=1, keepdims=True)


def seat_gradients(theta: np.ndarray) -> dict[str, np.ndarray]:
    """Each seat's exact gradient, the other seat's policy held fixed."""
    out = {}
    for seat in SEATS:
        t = torch.tensor(theta, requires_grad=True, dtype=torch.float64)
        pi = torch.softmax(t, dim=1)
        own, other = (pi[0], pi[1:].detach()) if seat == "first" else (pi[0].detach(), pi[1:])
        win = torch.tensor(W)
        value = (
            sum(own[a] * other[a, b] * (2 * win[a, b] - 1) for a in range(2) for b in range(2))
            if seat == "first"
            else sum(own[a] * other[a, b] * (1 - 2 * win[a, b]) for a in range(2) for b in range(2))
        )
        (grad,) = torch.autograd.grad(value, t)
        out[seat] = grad.numpy()
    return out


def episode(
    task: int, sample: int, seat: int, state: int, action: int, pi: np.ndarray, reward: float
) -> Trajectory:
    completion = Completion([ACTION_TOKEN + action], [float(np.log(pi[state, action]))], "stop")
    transition = Transition("", [STATE_TOKEN + state], completion, reward=reward, terminated=True)
    return Trajectory(
        env_id="game",
        env_kwargs={},
        task_seed=task,
        group_id=task * len(SEATS) + seat,  # the match runner's (task, seat) group id
        transitions=[transition],
        stop_reason=StopReason.ANSWERED,
        total_reward=reward,
        sample_index=sample,
        seat=SEATS[seat],
    )


def play(theta: np.ndarray, rng: np.random.Generator) -> list[Trajectory]:
    pi = policy(theta)
    played = []
    for task in range(TASKS):
        for sample in range(G):
            a = int(rng.random() >= pi[0, 0])
            b = int(rng.random() >= pi[1 + a, 0])
            won = 1.0 if rng.random() < W[a, b] else -1.0
            played.append(episode(task, sample, 0, 0, a, pi, won))
            played.append(episode(task, sample, 1, 1 + a, b, pi, -won))
    return played


def estimates(theta: np.ndarray, groups: list[list[Trajectory]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per seat: the mean over tasks of the seat's gradient estimate per episode, and its standard
    error."""
    pi = policy(theta)
    per_task: dict[str, dict[int, np.ndarray]] = {seat: {} for seat in SEATS}
    for group in groups:
        advantages, _ = score_group(group, CONFIG, train_on_infra_failures=False)
        for trajectory, advantage in zip(group, advantages, strict=True):
            for ep in trajectory_to_episodes(trajectory, advantage):
                for k, masked in enumerate(ep.loss_mask):
                    if not masked:
                        continue
                    state, action = ep.tokens[k - 1] - STATE_TOKEN, ep.tokens[k] - ACTION_TOKEN
                    score = np.zeros_like(theta)
                    score[state] = -pi[state]
                    score[state, action] += 1.0
                    total = per_task[trajectory.seat].setdefault(trajectory.task_seed, np.zeros_like(theta))
                    total += ep.advantages[k] * score / G
    out = {}
    for seat, tasks in per_task.items():
        samples = np.stack(list(tasks.values()))
        out[seat] = (samples.mean(axis=0), samples.std(axis=0, ddof=1) / np.sqrt(len(samples)))
    return out


def matches(mean: np.ndarray, stderr: np.ndarray, expected: np.ndarray) -> bool:
    """Within 4 standard errors per component (exactly, where a seat's tokens never touch it)."""
    return bool(np.all(np.abs(mean - expected) <= 4 * stderr + 1e-12))


@pytest.fixture(scope="module")
def setup():
    theta = np.array([[0.3, -0.2], [0.5, 0.0], [-0.4, 0.4]])
    return theta, play(theta, np.random.default_rng(0))


def test_per_seat_groups_give_each_seat_an_unbiased_gradient(setup):
    theta, played = setup
    exact = seat_gradients(theta)
    for seat, (mean, stderr) in estimates(theta, _split_groups(played)).items():
        expected = (G - 1) / G * exact[seat]
        assert stderr.max() < 0.1 * np.abs(expected).max(), (seat, stderr, expected)
        assert matches(mean, stderr, expected), (seat, mean, stderr, expected)


def test_one_group_per_task_mixing_the_seats_is_biased(setup):
    theta, played = setup
    by_task: dict[int, list[Trajectory]] = {}
    for t in played:
        by_task.setdefault(t.task_seed, []).append(t)
    exact = seat_gradients(theta)
    found = estimates(theta, list(by_task.values()))
    assert any(not matches(mean, stderr, (G - 1) / G * exact[seat]) for seat, (mean, stderr) in found.items())
