"""On-policy distillation's scoring: the per-token advantage against a hand-computed reverse KL
(through a context rewrite's split into two training sequences), a teacher equal to the sampler
giving exactly 0, the teacher's padded batch agreeing with each sequence scored alone, the
tokenizer check, and a failing teacher's groups dropped, then the run stopped."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from toolgym.agents.model.checkpoint import save_hf_checkpoint
from toolgym.agents.model.config import NAMED_CONFIGS, ModelConfig
from toolgym.agents.model.transformer import build_model, causal_lm_logprobs
from toolgym.agents.tokenizer import tokenizer_fingerprint
from toolgym.agents.types import Completion
from toolgym.rollouts.batches import BatchAssembler, BatchConfig, _score
from toolgym.rollouts.episodes import build_episodes
from toolgym.rollouts.scoring.advantages import AdvantageConfig, AdvantageEstimator
from toolgym.rollouts.scoring.distill import (
    TEACHER_LOGPROBS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
    DistillConfig,
    reverse_kl_metrics,
)
from toolgym.rollouts.scoring.scorer import score_group
from toolgym.rollouts.scoring.teacher import Teacher, TeacherError
from toolgym.rollouts.types import CONTEXT_REWRITE, SEQUENCE_START, StopReason, Trajectory, Transition

VOCAB = 400  # the tokenizer fixture's


def transition(obs: list[int], act: list[int], lps: list[float], teacher=None, restart=False) -> Transition:
    info = {SEQUENCE_START: True, CONTEXT_REWRITE: True} if restart else {}
    if teacher is not None:
        info[TEACHER_LOGPROBS] = teacher
    return Transition("obs", obs, Completion(act, lps, "stop", "act"), info=info)


def flat(advantage) -> list[float]:
    return [x for turn in advantage for x in turn]


def trajectory(transitions: list[Transition], reward: float, sample: int = 0) -> Trajectory:
    return Trajectory(
        env_id="test", env_kwargs={}, task_seed=1, group_id=5, transitions=transitions,
        stop_reason=StopReason.ANSWERED, total_reward=reward, sample_index=sample,
    )  # fmt: skip


def test_the_advantage_is_the_hand_computed_reverse_kl_on_each_sampled_token():
    # Episode 0: two turns, the second a context rewrite (a training sequence of its own).
    a = trajectory(
        [
            transition([1, 2, 3], [10, 11], [-0.5, -1.0], teacher=[-0.25, -2.0]),
            transition(
                [4, 5, 6, 7], [12, 13, 14], [-0.1, -0.2, -0.3], teacher=[-0.1, -0.7, 0.0], restart=True
            ),
        ],
        reward=1.0,
    )
    b = trajectory([transition([1, 2, 3], [20], [-2.0], teacher=[-1.0])], reward=0.0, sample=1)
    config = AdvantageConfig(estimator=AdvantageEstimator.DR_GRPO)
    distill = DistillConfig(teacher="t", weight=0.5, reward_weight=2.0)
    advantages, informative = score_group([a, b], config, train_on_infra_failures=False, distill=distill)
    # dr_grpo: rewards 1, 0 -> +0.5, -0.5; each token adds 0.5 * (teacher - sampler)
    expected_a = [
        [2 * 0.5 + 0.5 * 0.25, 2 * 0.5 + 0.5 * -1.0],
        [2 * 0.5 + 0.0, 2 * 0.5 - 0.25, 2 * 0.5 + 0.15],
    ]
    assert informative
    assert [len(turn) for turn in advantages[0]] == [2, 3]  # type: ignore[arg-type]
    assert flat(advantages[0]) == pytest.approx(flat(expected_a)) and flat(advantages[1]) == pytest.approx(
        [2 * -0.5 + 0.5 * 1.0]
    )
    episodes, stats = build_episodes([a, b], advantages)
    assert stats.built == 3  # the rewrite split episode 0 in two
    first, second, other = episodes
    assert first.advantages == pytest.approx([0, 0, 0, *expected_a[0]])
    assert second.advantages == pytest.approx([0, 0, 0, 0, *expected_a[1]])
    assert other.advantages == pytest.approx([0, 0, 0, -0.5])
    for e in episodes:  # the advantage sits exactly on the sampled tokens
        assert all((m == 1) or adv == 0 for m, adv in zip(e.loss_mask, e.advantages, strict=True))
    # pure OPD: A_t = logp_teacher - logp_sampler, and the metrics' reverse KL is its negation
    pure, _ = score_group([a, b], config, train_on_infra_failures=False, distill=DistillConfig(teacher="t"))
    assert flat(pure[1]) == pytest.approx([1.0])
    kl = reverse_kl_metrics([a, b])
    tokens = [-0.25, 1.0, 0.0, 0.5, -0.3, -1.0]  # sampler - teacher
    assert kl["distill/reverse_kl_mean"] == pytest.approx(sum(tokens) / 6)
    assert kl["distill/reverse_kl_turn0"] == pytest.approx((-0.25 + 1.0 - 1.0) / 3)
    assert kl["distill/reverse_kl_turn1"] == pytest.approx((0.0 + 0.5 - 0.3) / 3)


def test_an_episode_the_teacher_did_not_score_is_refused_not_given_a_zero_log_ratio():
    a = trajectory([transition([1, 2], [3, 4], [-0.1, -0.2], teacher=[-0.1])], 1.0)
    with pytest.raises(ValueError, match="2 sampled tokens but teacher logprobs: 1 values"):
        score_group([a], AdvantageConfig(), train_on_infra_failures=False, distill=DistillConfig(teacher="t"))


def test_distill_config_errors():
    with pytest.raises(ValueError, match=r"distill\.weight must be a finite number >= 0"):
        DistillConfig(weight=-1.0)
    with pytest.raises(ValueError, match="both 0"):
        DistillConfig(teacher="t", weight=0.0, reward_weight=0.0)
    with pytest.raises(ValueError, match=r"max_consecutive_failures must be >= 1"):
        DistillConfig(max_consecutive_failures=0)


def write_checkpoint(directory: Path, tokenizer: Tokenizer, seed: int = 0) -> Path:
    config = ModelConfig(**{**NAMED_CONFIGS["test"], "vocab_size": VOCAB})
    model = build_model(config, seed=seed)
    tokenizer_file = directory.parent / f"{directory.name}-tokenizer.json"
    tokenizer.save(str(tokenizer_file))
    return save_hf_checkpoint(model, config, directory, tokenizer_path=tokenizer_file)


def sequences_group() -> list[Trajectory]:
    """Two episodes of different lengths, one with a rewrite; sampler logprobs to be filled in."""
    return [
        trajectory(
            [
                transition([1, 2, 3, 4], [50, 51, 52], [0.0] * 3),
                transition([5, 6], [53, 54], [0.0] * 2),
                transition([7, 8, 9], [55], [0.0], restart=True),
            ],
            1.0,
        ),
        trajectory([transition([1, 2, 3, 4, 10, 11, 12, 13], [60, 61], [0.0] * 2)], 0.0, sample=1),
    ]


def test_a_teacher_equal_to_the_sampler_gives_exactly_zero_and_its_batch_matches_each_alone(
    tmp_path, tokenizer
):
    directory = write_checkpoint(tmp_path / "teacher", tokenizer)
    fingerprint = tokenizer_fingerprint(tokenizer)
    distill = DistillConfig(teacher=str(directory))
    teacher = Teacher(distill, student_fingerprint=fingerprint, temperature=0.7)
    group = sequences_group()
    assert teacher.annotate(group) is None
    # each sequence scored alone by the model agrees with the padded batch
    model = teacher.model
    first = [1, 2, 3, 4, 50, 51, 52, 5, 6, 53, 54]
    alone = causal_lm_logprobs(model, torch.tensor([first]), 0.7)[0].tolist()
    got = group[0].transitions[0].info[TEACHER_LOGPROBS] + group[0].transitions[1].info[TEACHER_LOGPROBS]
    assert got == pytest.approx([alone[i - 1] for i in (4, 5, 6, 9, 10)], abs=1e-5)
    rewrite = causal_lm_logprobs(model, torch.tensor([[7, 8, 9, 55]]), 0.7)[0].tolist()
    assert group[0].transitions[2].info[TEACHER_LOGPROBS] == pytest.approx([rewrite[2]], abs=1e-5)
    assert all(
        math.isfinite(x) and x < 0 for t in group for tr in t.transitions for x in tr.info[TEACHER_LOGPROBS]
    )
    # a sampler that computes exactly as the teacher (the student's own checkpoint): zero KL advantage
    for t in group:
        for tr in t.transitions:
            tr.action.logprobs = list(tr.info[TEACHER_LOGPROBS])
    student = Teacher(distill, student_fingerprint=fingerprint, temperature=0.7)
    assert student.annotate(group) is None  # re-scored: the same values
    advantages, informative = score_group(
        group, AdvantageConfig(), train_on_infra_failures=False, distill=distill
    )
    assert advantages == [[[0.0] * 3, [0.0] * 2, [0.0]], [[0.0] * 2]] and not informative
    assert reverse_kl_metrics(group)["distill/reverse_kl_mean"] == 0.0


def test_a_checkpoint_teachers_top_k_is_its_models_and_episodes_carry_it_on_sampled_tokens(
    tmp_path, tokenizer
):
    """distill.top_k = 3: the teacher's top-k ids and logprobs at each sampled position are
    torch.topk of the model's log_softmax(logits / T) there (its batch vs each sequence alone,
    through a rewrite's own sequence); the Episode builder puts them on exactly the sampled
    tokens of each training sequence."""
    directory = write_checkpoint(tmp_path / "teacher", tokenizer)
    distill = DistillConfig(teacher=str(directory), top_k=3)
    assert distill.forward_kl == 1.0 and DistillConfig(top_k=3).forward_kl == 0.0
    teacher = Teacher(distill, student_fingerprint=tokenizer_fingerprint(tokenizer), temperature=0.7)
    group = sequences_group()
    assert teacher.annotate(group) is None

    def top(tokens: list[int], at: list[int]) -> tuple[list, list]:
        with torch.no_grad():
            logp = torch.log_softmax(teacher.model(torch.tensor([tokens]))[0] / 0.7, -1)
        values, ids = logp[[p - 1 for p in at]].topk(3)
        return ids.tolist(), values.tolist()

    ids, values = top([1, 2, 3, 4, 50, 51, 52, 5, 6, 53, 54], [4, 5, 6, 9, 10])
    first, second, rewrite = group[0].transitions
    assert first.info[TEACHER_TOPK_IDS] + second.info[TEACHER_TOPK_IDS] == ids
    got = first.info[TEACHER_TOPK_LOGPROBS] + second.info[TEACHER_TOPK_LOGPROBS]
    assert [x for row in got for x in row] == pytest.approx([x for row in values for x in row], abs=1e-5)
    assert rewrite.info[TEACHER_TOPK_IDS] == top([7, 8, 9, 55], [3])[0]
    for t in group:
        for tr in t.transitions:
            tr.action.logprobs = list(tr.info[TEACHER_LOGPROBS])
    advantages, _ = score_group(group, AdvantageConfig(), train_on_infra_failures=False, distill=distill)
    episodes, _ = build_episodes(group, advantages)
    assert len(episodes) == 3
    for episode, turns in zip(episodes, [[first, second], [rewrite], group[1].transitions], strict=True):
        expected = [
            row for tr in turns for row in [[]] * len(tr.observation_tokens) + tr.info[TEACHER_TOPK_IDS]
        ]
        assert episode.teacher_topk_ids == expected
        assert [bool(row) for row in episode.teacher_topk_logprobs] == [bool(m) for m in episode.loss_mask]
    with pytest.raises(ValueError, match=r"distill\.top_k must be in 0\.\.20"):
        DistillConfig(top_k=21)
    with pytest.raises(ValueError, match=r"needs distill\.forward_kl_weight > 0"):
        DistillConfig(top_k=2, forward_kl_weight=0.0)


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line_naming_both(tmp_path, tokenizer):
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.train_from_iterator(
        ["a different corpus entirely"] * 10,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False),
    )
    directory = write_checkpoint(tmp_path / "teacher", other)
    ours, theirs = tokenizer_fingerprint(tokenizer), tokenizer_fingerprint(other)
    with pytest.raises(TeacherError) as info:
        Teacher(DistillConfig(teacher=str(directory)), student_fingerprint=ours)
    message = str(info.value)
    assert "\n" not in message and ours[:16] in message and theirs[:16] in message


def test_a_failing_teacher_drops_its_groups_and_stops_the_run_after_the_limit(tmp_path, tokenizer):
    directory = write_checkpoint(tmp_path / "teacher", tokenizer)
    distill = DistillConfig(teacher=str(directory), max_consecutive_failures=2)
    teacher = Teacher(distill, student_fingerprint=tokenizer_fingerprint(tokenizer))
    config = BatchConfig(groups_per_batch=2)

    def bad() -> list[Trajectory]:  # a token outside the teacher's vocabulary: its forward raises
        return [trajectory([transition([1, 2], [VOCAB + 7], [-1.0])], 1.0), sequences_group()[1]]

    assembler = BatchAssembler(config, distill=True)
    scored = _score(bad(), config, teacher)
    assert "outside the teacher's vocabulary" in scored.failure and scored.teacher_s > 0
    group = bad()
    assembler.offer(group, scored.advantages, scored.informative, failure=scored.failure)
    assert not any(TEACHER_LOGPROBS in tr.info for t in group for tr in t.transitions)
    good = sequences_group()
    for t in good:  # sampled at random by no one: any logprobs will do
        for tr in t.transitions:
            tr.action.logprobs = [-1.0] * len(tr.action.tokens)
    ok = _score(good, config, teacher)  # a success resets the count
    assert ok.failure == "" and teacher.consecutive_failures == 0
    assembler.offer(good, ok.advantages, ok.informative, teacher_s=ok.teacher_s)
    batch = assembler.result(2)
    assert batch.metrics["batch/groups_scoring_failed"] == 1.0 and batch.kept == [
        True,
        True,
        False,
        False,
    ]  # kept first
    assert len(batch.episodes) == 3 and all(any(a != 0 for a in e.advantages) for e in batch.episodes)
    assert math.isfinite(batch.metrics["distill/reverse_kl_mean"]) and batch.metrics["distill/teacher_s"] > 0
    assert _score(bad(), config, teacher).failure  # 1 in a row
    with pytest.raises(
        TeacherError, match=r"failed 2 groups in a row \(distill.max_consecutive_failures = 2\)"
    ):
        _score(bad(), config, teacher)
