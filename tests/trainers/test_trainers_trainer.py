"""Batching (shift, budget, sharding) and the one-process FSDP2 trainer."""

import copy
import math
import sys
from pathlib import Path

import msgspec
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainers_testlib import full_grads, full_params, random_episodes

from toolgym.agents.model.transformer import build_model, causal_lm_logprobs
from toolgym.rollouts.types import Episode
from toolgym.trainers.batching import make_micro_batches, shard_episodes, split_by_token_budget
from toolgym.trainers.config import OptimizerConfig, TrainerConfig
from toolgym.trainers.logprobs import token_logprobs
from toolgym.trainers.losses import LossConfig, LossNormaliser, TopKForwardKL, policy_loss
from toolgym.trainers.trainer import Trainer, lr_factor

torch.set_num_threads(1)


def _episode(tokens, mask, adv=1.0):
    return Episode(
        tokens=tokens,
        loss_mask=mask,
        sampler_logprobs=[-0.5 * m for m in mask],
        advantages=[adv * m for m in mask],
    )


def test_shift_is_applied_once_and_padding_is_on_the_right():
    episodes = [_episode([5, 6, 7, 8], [0, 0, 1, 1], 2.0), _episode([9, 10, 11], [1, 0, 1], -1.0)]
    (mb,) = make_micro_batches(episodes, token_budget=100, pad_token_id=3)
    assert mb.input_ids.tolist() == [[5, 6, 7], [9, 10, 3]]
    assert mb.targets.tolist() == [[6, 7, 8], [10, 11, 3]]
    # token 0's mask is dropped (nothing predicts it); position t carries token t+1's fields
    assert mb.loss_mask.tolist() == [[False, True, True], [False, True, False]]
    assert mb.advantages.tolist() == [[0.0, 2.0, 2.0], [0.0, -1.0, 0.0]]
    assert mb.sampler_logprobs.tolist() == [[0.0, -0.5, -0.5], [0.0, -0.5, 0.0]]
    assert mb.lengths.tolist() == [3, 2] and mb.episode_index.tolist() == [0, 1]


def test_micro_batches_carry_token_versions_and_the_trainer_reports_staleness():
    episodes = [_episode([5, 6, 7, 8], [0, 0, 1, 1], 2.0), _episode([9, 10, 11], [0, 1, 1], -1.0)]
    episodes[0].token_versions = [1, 1, 1, 2]  # the last turn's token sampled by a newer version
    episodes[1].policy_version = 2  # no per-token versions: all the episode's version
    (mb,) = make_micro_batches(episodes, token_budget=100)
    assert mb.versions.tolist() == [[1, 1, 2], [2, 2, 0]]  # shifted like the targets; 0 on padding
    trainer = _trainer("grpo")
    trainer.step = 3  # as if three updates were applied since: staleness 3 - version
    metrics = trainer._forward_backward(episodes, trainer.policy_loss, sharded=False)
    counts = [metrics[f"staleness_tokens_{b}_sum"] for b in ("s0", "s1", "s2", "s3plus")]
    assert counts == [0.0, 3.0, 1.0, 0.0]
    assert metrics["logprob_gap_mean_s1"] > 0 and metrics["logprob_gap_mean_s0"] == 0.0


def test_token_budget_groups_sorted_and_complete():
    lengths = [3, 50, 7, 7, 20, 1, 120, 8]
    groups = split_by_token_budget(lengths, token_budget=40)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(len(lengths)))
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 40
    assert [6] in groups and [1] in groups  # longer than the budget: alone, not cut
    with pytest.raises(ValueError, match="token_budget"):
        split_by_token_budget(lengths, 0)


def test_shard_episodes_partitions_and_balances():
    lengths = [30, 5, 17, 17, 2, 40, 9, 11, 23]
    shards = [shard_episodes(lengths, r, 3) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(lengths) // 2
    assert shard_episodes(lengths, 1, 3) == shards[1]  # deterministic
    assert shard_episodes([4], 1, 2) == []  # more ranks than episodes: some get none


def test_bad_episodes_are_clear_errors():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        make_micro_batches([_episode([1], [1])], 64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_micro_batches([_episode([1, 300], [0, 1])], 64, vocab_size=256)


def test_lr_schedule():
    warm = OptimizerConfig(warmup_steps=4, decay="linear", total_steps=14, min_lr_ratio=0.1)
    assert [lr_factor(s, warm) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(9, warm) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_factor(14, warm) == pytest.approx(0.1) and lr_factor(100, warm) == pytest.approx(0.1)
    cos = OptimizerConfig(decay="cosine", total_steps=10)
    assert lr_factor(5, cos) == pytest.approx(0.5) and lr_factor(10, cos) == pytest.approx(0.0)
    assert lr_factor(7, OptimizerConfig()) == 1.0
    with pytest.raises(ValueError, match="total_steps"):
        OptimizerConfig(decay="cosine")


def _trainer(loss="grpo", budget=160, lr=1e-3, **kw):
    config = TrainerConfig(
        loss=LossConfig(name=loss), micro_batch_tokens=budget, optimizer=OptimizerConfig(lr=lr), **kw
    )
    return Trainer(build_model("test", seed=0), config, device="cpu")


@pytest.mark.parametrize("loss", ["grpo", "dapo", "gspo"])
def test_micro_batched_gradient_equals_direct_full_batch(loss):
    episodes = random_episodes(9, seed=3)
    reference = build_model("test", seed=0)
    trainer = _trainer(loss, budget=90)  # several micro-batches
    metrics = trainer._forward_backward(episodes, trainer.policy_loss, sharded=False)
    assert metrics["num_micro_batches"] > 2

    (mb,) = make_micro_batches(episodes, 10_000)  # one batch, computed by hand
    logprobs = token_logprobs(reference(mb.input_ids), mb.targets)
    expected, _ = policy_loss(
        LossConfig(name=loss), logprobs, mb.sampler_logprobs, mb.advantages, mb.loss_mask
    )
    expected.backward()
    assert metrics["loss"] == pytest.approx(expected.item(), abs=1e-6)
    assert metrics["num_tokens"] == mb.loss_mask.sum().item()
    got = full_grads(trainer.model)
    for name, p in reference.named_parameters():
        assert (got[name] - p.grad).abs().max().item() <= 1e-6, name


def test_non_finite_loss_skips_the_update_and_keeps_weights():
    trainer = _trainer()
    good = random_episodes(6, seed=4)
    trainer.train_step(good)
    params, state = full_params(trainer.model), copy.deepcopy(trainer.optimizer.state_dict())
    last = good[-1]
    poisoned = Episode(
        tokens=last.tokens,
        loss_mask=last.loss_mask,
        sampler_logprobs=last.sampler_logprobs,
        advantages=[math.nan if m else 0.0 for m in last.loss_mask],
    )
    bad = [*good[:-1], poisoned]
    metrics = trainer.train_step(bad)
    assert metrics["skipped"] == 1.0 and not math.isfinite(metrics["loss"])
    assert trainer.step == 1 and trainer.skipped_steps == 1
    for name, value in full_params(trainer.model).items():
        assert torch.equal(value, params[name]), name
    after = trainer.optimizer.state_dict()
    for key, per_param in state["state"].items():
        for field, value in per_param.items():
            assert torch.equal(torch.as_tensor(after["state"][key][field]), torch.as_tensor(value))
    metrics = trainer.train_step(good)  # and training goes on
    assert metrics["skipped"] == 0.0 and trainer.step == 2


def test_sft_step_learns_the_masked_tokens():
    trainer = _trainer(lr=3e-3)
    episodes = random_episodes(4, seed=5, max_len=12)
    losses = [trainer.sft_step(episodes)["loss"] for _ in range(15)]
    assert losses[-1] < losses[0] - 1.0
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)  # random init: ~uniform over the vocab


def test_compute_logprobs_matches_the_model():
    trainer = _trainer()
    episodes = random_episodes(5, seed=6)
    got = trainer.compute_logprobs(episodes, temperature=0.8)
    reference = build_model("test", seed=0)
    for episode, row in zip(episodes, got, strict=True):
        tokens = torch.tensor([episode.tokens])
        expected = causal_lm_logprobs(reference, tokens, temperature=0.8)[0]
        assert row[0] == 0.0 and len(row) == len(episode.tokens)
        assert max(abs(a - b) for a, b in zip(row[1:], expected.tolist(), strict=True)) <= 1e-5


def test_bf16_mixed_precision_keeps_fp32_master_weights():
    episodes = random_episodes(6, seed=7)
    fp32 = _trainer(loss="dapo").train_step(episodes)
    trainer = _trainer(loss="dapo", precision="bf16")
    bf16 = trainer.train_step(episodes)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert bf16["skipped"] == 0.0 and math.isfinite(bf16["grad_norm"])
    assert bf16["loss"] == pytest.approx(fp32["loss"], abs=2e-2)
    assert bf16["sampler_kl_k1"] == pytest.approx(fp32["sampler_kl_k1"], abs=2e-2)


def test_one_process_trains_the_plain_model_and_bf16_computes_under_autocast():
    """FSDP2 in a world of one would only copy: the plain model trains in fp32 and in bf16, where
    the forward runs under autocast (bf16 matmuls, fp32 master weights and gradients)."""
    from torch.distributed.fsdp import FSDPModule

    fp32, bf16 = _trainer(loss="dapo"), _trainer(loss="dapo", precision="bf16")
    for trainer in (fp32, bf16):
        assert not any(isinstance(m, FSDPModule) for m in trainer.model.modules())
    out_dtypes = []
    last_linear = bf16.model.model.layers[-1].mlp.down_proj
    hook = last_linear.register_forward_hook(lambda m, args, out: out_dtypes.append(out.dtype))
    bf16._forward_backward(random_episodes(4, seed=2), bf16.policy_loss, sharded=False)
    hook.remove()
    assert out_dtypes and set(out_dtypes) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in bf16.model.parameters())
    fp32_logprobs = fp32.compute_logprobs(random_episodes(3, seed=4))
    bf16_logprobs = bf16.compute_logprobs(random_episodes(3, seed=4))
    for a, b in zip(fp32_logprobs, bf16_logprobs, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 5e-2


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_is_bf16_only_where_the_hardware_has_it(monkeypatch, native):
    """"auto" trains in bf16 where bf16 is native and in fp32 where it is emulated (on an
    AVX2-only CPU tens of times slower); an explicit "bf16" is kept there, with a warning."""
    import warnings

    import toolgym.trainers.distributed as distributed

    monkeypatch.setattr(distributed, "native_bf16", lambda device: native)
    auto = _trainer(loss="dapo", precision="auto")
    assert auto.precision == ("bf16" if native else "fp32") and auto._autocast is native
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forced = _trainer(loss="dapo", precision="bf16")
    assert forced.precision == "bf16" and forced._autocast
    emulated = [w for w in caught if "emulated" in str(w.message)]
    assert len(emulated) == (0 if native else 1)


def test_fsdp2_bf16_mixed_precision_matches_autocast(monkeypatch):
    """The FSDP2 bf16 policy (what a world of several ranks uses) gives the autocast path's loss."""
    from torch.distributed.fsdp import FSDPModule

    import toolgym.trainers.trainer as trainer_module
    from toolgym.trainers.distributed import fsdp_wrap

    episodes = random_episodes(6, seed=7)
    autocast = _trainer(loss="dapo", precision="bf16").train_step(episodes)
    monkeypatch.setattr(trainer_module, "shard_model", fsdp_wrap)
    trainer = _trainer(loss="dapo", precision="bf16")
    assert isinstance(trainer.model, FSDPModule)
    wrapped = trainer.train_step(episodes)
    assert wrapped["skipped"] == 0.0 and math.isfinite(wrapped["grad_norm"])
    assert wrapped["loss"] == pytest.approx(autocast["loss"], abs=2e-2)
    assert wrapped["grad_norm"] == pytest.approx(autocast["grad_norm"], rel=0.1)


def test_kl_to_reference_model_and_nothing_to_train():
    config = TrainerConfig(loss=LossConfig(name="grpo", kl_coef=0.1), micro_batch_tokens=128)
    with pytest.raises(ValueError, match="reference_model"):
        Trainer(build_model("test", seed=0), config, device="cpu")
    trainer = Trainer(
        build_model("test", seed=0), config, reference_model=build_model("test", seed=0), device="cpu"
    )
    metrics = trainer.train_step(random_episodes(4, seed=8))
    assert metrics["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # same weights before the first update
    second = trainer.train_step(random_episodes(4, seed=8))
    assert second["kl_ref"] > 0.0
    silent = [_episode([1, 2, 3], [0, 0, 0])]
    metrics = trainer.train_step(silent)
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0


def test_normaliser_counts_are_step_wide():
    episodes = random_episodes(7, seed=9)
    trainer = _trainer(budget=60)
    metrics = trainer._forward_backward(episodes, lambda mb, norm: _probe(trainer, mb, norm), False)
    assert metrics["norm_tokens_max"] == sum(sum(e.loss_mask[1:]) for e in episodes)


def _probe(trainer, mb, norm: LossNormaliser):
    loss = trainer._logits(mb, trainer.model).sum() * 0.0
    return loss, {"norm_tokens_max": torch.tensor(norm.num_tokens), "num_tokens": mb.loss_mask.sum().float()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_head_trains_as_the_whole_logits_do(precision):
    """TrainerConfig.fused_head scores only the trained positions, from the hidden states: the RL
    loss, its metrics and gradients, SFT's loss and accuracy and compute_logprobs are the whole
    logits' ones (a shared prefix and several micro-batches included)."""
    episodes = random_episodes(9, seed=11, shared_prefix=12)
    got = {}
    for fused in (True, False):
        trainer = _trainer("dapo", budget=150, precision=precision, fused_head=fused)
        rl = trainer._forward_backward(episodes, trainer.policy_loss, sharded=False)
        grads = full_grads(trainer.model)
        trainer.optimizer.zero_grad(set_to_none=True)
        sft = trainer.sft_step(episodes)
        got[fused] = rl, grads, sft, trainer.compute_logprobs(episodes)
    (rl, grads, sft, logprobs), (rl_ref, grads_ref, sft_ref, logprobs_ref) = got[True], got[False]
    assert rl["num_micro_batches"] > 1
    tol = 1e-5 if precision == "fp32" else 2e-2
    for key in ("loss", "entropy", "num_tokens"):
        assert rl[key] == pytest.approx(rl_ref[key], rel=tol, abs=tol), key
    for key in ("loss", "token_accuracy"):
        assert sft[key] == pytest.approx(sft_ref[key], rel=tol, abs=tol), key
    for name, grad in grads_ref.items():
        scale = grad.abs().max().item()
        assert (grads[name] - grad).abs().max().item() <= tol * max(scale, 1e-3) * 10, name
    for a, b in zip(logprobs, logprobs_ref, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= (1e-5 if precision == "fp32" else 5e-2)


def test_activation_checkpointing_gives_the_same_gradients_and_keeps_less():
    episodes = random_episodes(6, seed=12)
    got = {}
    for recompute in (True, False):
        trainer = _trainer("dapo", budget=10_000, activation_checkpointing=recompute)
        saved: list[int] = []

        def pack(t, saved=saved):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            metrics = trainer._forward_backward(episodes, trainer.policy_loss, sharded=False)
        got[recompute] = metrics, full_grads(trainer.model), sum(saved)
    (metrics, grads, kept), (metrics_ref, grads_ref, kept_ref) = got[True], got[False]
    assert metrics["loss"] == pytest.approx(metrics_ref["loss"], abs=1e-6)
    for name, grad in grads_ref.items():
        assert (grads[name] - grad).abs().max().item() <= 1e-6, name
    assert kept < kept_ref / 2  # the blocks' activations are recomputed, not kept
    with pytest.raises(ValueError, match="activation_checkpointing"):
        Trainer(torch.nn.Linear(2, 2), TrainerConfig(activation_checkpointing=True), device="cpu")


@pytest.mark.slow
def test_compiled_blocks_train_as_eager_ones():
    """trainer.compile (with and without activation checkpointing, a shared prefix in the batch):
    the same loss and gradients as eager blocks; scoring without grad stays eager."""
    episodes = random_episodes(6, seed=13, shared_prefix=10)
    reference = _trainer("dapo", budget=10_000)
    metrics_ref = reference._forward_backward(episodes, reference.policy_loss, sharded=False)
    grads_ref = full_grads(reference.model)
    for recompute in (False, True):
        trainer = _trainer("dapo", budget=10_000, compile=True, activation_checkpointing=recompute)
        metrics = trainer._forward_backward(episodes, trainer.policy_loss, sharded=False)
        assert metrics["loss"] == pytest.approx(metrics_ref["loss"], abs=1e-5)
        for name, grad in full_grads(trainer.model).items():
            assert (grad - grads_ref[name]).abs().max().item() <= 1e-5, name
    for got, want in zip(trainer.compute_logprobs(episodes), reference.compute_logprobs(episodes), strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def _with_teacher_top_k(episodes: list[Episode], k: int, vocab: int = 256, seed: int = 0) -> list[Episode]:
    """The episodes, all but the last with a teacher's top-k on their sampled tokens (a random
    distribution's k most likely tokens and their logprobs, best first)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, e in enumerate(episodes):
        if i == len(episodes) - 1:
            out.append(e)
            continue
        ids, lps = [], []
        for m in e.loss_mask:
            if not m:
                ids.append([]), lps.append([])
                continue
            values, top = torch.log_softmax(2 * torch.randn(vocab, generator=g), -1).topk(k)
            ids.append(top.tolist()), lps.append(values.tolist())
        out.append(msgspec.structs.replace(e, teacher_topk_ids=ids, teacher_topk_logprobs=lps))
    return out


@pytest.mark.parametrize("fused", [True, False], ids=["fused-head", "whole-logits"])
def test_the_top_k_forward_kl_trains_the_teachers_top_k_tokens(fused):
    """forward_kl_weight > 0: each micro-batch adds TopKForwardKL of the student's logprobs of the
    teacher's top-k (scored in the same pass as the targets): loss, metrics and gradients equal
    one batch computed by hand from whole logits, with a shared prefix, several micro-batches and
    an episode without top-k (it adds nothing)."""
    episodes = _with_teacher_top_k(random_episodes(7, seed=5, shared_prefix=6), k=3)
    config = TrainerConfig(loss=LossConfig(name="grpo"), micro_batch_tokens=120, fused_head=fused)
    trainer = Trainer(build_model("test", seed=0), config, device="cpu", forward_kl_weight=0.5)
    metrics = trainer._forward_backward(episodes, trainer.policy_loss, sharded=False)
    assert metrics["num_micro_batches"] > 1

    reference = build_model("test", seed=0)
    (mb,) = make_micro_batches(episodes, 10_000, share_prefix=False)
    assert mb.teacher_topk_ids is not None and mb.teacher_topk_logprobs is not None
    logp = torch.log_softmax(reference(mb.input_ids), -1)
    student = logp.gather(-1, mb.teacher_topk_ids)
    term = TopKForwardKL(0.5, student, mb.teacher_topk_logprobs)
    expected, parts = policy_loss(
        LossConfig(name="grpo"), logp.gather(-1, mb.targets[..., None])[..., 0], mb.sampler_logprobs,
        mb.advantages, mb.loss_mask, extra_terms=[term],
    )  # fmt: skip
    expected.backward()
    assert parts["forward_kl_topk"].item() > 0.1
    assert metrics["loss"] == pytest.approx(expected.item(), abs=1e-5)
    assert metrics["forward_kl_topk"] == pytest.approx(parts["forward_kl_topk"].item(), rel=1e-4)
    assert metrics["teacher_topk_mass"] == pytest.approx(parts["teacher_topk_mass"].item(), rel=1e-4)
    got = full_grads(trainer.model)
    for name, p in reference.named_parameters():
        assert (got[name] - p.grad).abs().max().item() <= 1e-5, name
    # without top-k in the batch the term is 0 and its metrics are still there; weight 0 is off
    plain = Trainer(build_model("test", seed=0), config, device="cpu", forward_kl_weight=0.5)
    bare = plain._forward_backward(episodes[-1:], plain.policy_loss, sharded=False)
    assert bare["forward_kl_topk"] == 0.0 and bare["teacher_topk_mass"] == 0.0
    off = Trainer(build_model("test", seed=0), config, device="cpu")
    assert "forward_kl_topk" not in off._forward_backward(episodes, off.policy_loss, sharded=False)
    with pytest.raises(ValueError, match="forward_kl_weight must be a finite number >= 0"):
        Trainer(build_model("test", seed=0), config, device="cpu", forward_kl_weight=-1.0)


def test_guided_episodes_train_with_the_trainers_own_logprobs_as_the_denominator():
    """An oracle's episode (Episode.guided) carries no sampler logprobs (0.0): the trainer puts its
    own in their place, so it trains as an episode whose sampler logprobs were the trainer's."""
    episodes = random_episodes(6, seed=8)
    own = _trainer("dapo").compute_logprobs(episodes, temperature=1.0)
    guided, reference = [], []
    for i, episode in enumerate(episodes):
        if i in (1, 4):
            zeros = [0.0] * len(episode.tokens)
            guided.append(msgspec.structs.replace(episode, sampler_logprobs=zeros, guided=True))
            scored = [lp if m else 0.0 for lp, m in zip(own[i], episode.loss_mask, strict=True)]
            reference.append(msgspec.structs.replace(episode, sampler_logprobs=scored))
        else:
            guided.append(episode)
            reference.append(episode)
    (mb,) = make_micro_batches(guided, 10_000)
    assert sorted(mb.guided[mb.episode_index.argsort()].tolist()) == [False] * 4 + [True] * 2
    assert make_micro_batches(reference, 10_000)[0].guided is None
    got_trainer, ref_trainer = _trainer("dapo"), _trainer("dapo")
    got = got_trainer._forward_backward(guided, got_trainer.policy_loss, sharded=False)
    expected = ref_trainer._forward_backward(reference, ref_trainer.policy_loss, sharded=False)
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    grads, ref_grads = full_grads(got_trainer.model), full_grads(ref_trainer.model)
    for name, grad in ref_grads.items():
        assert (grads[name] - grad).abs().max().item() <= 1e-6, name
    # the guided rows alone: ratio 1 exactly, nothing clipped, no sampler gap
    alone = _trainer("dapo")
    metrics = alone._forward_backward([guided[1], guided[4]], alone.policy_loss, sharded=False)
    assert metrics["logprob_gap_max"] == 0.0 and metrics["ratio_min"] == metrics["ratio_max"] == 1.0
    assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0.0
