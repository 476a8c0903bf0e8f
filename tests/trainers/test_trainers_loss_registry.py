"""The loss registry: a new loss is one entry; every loss has defaults and documented metrics."""

import sys
from pathlib import Path

import msgspec
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainers_testlib import full_grads, random_episodes

from toolgym.agents.model.transformer import build_model
from toolgym.trainers.config import OptimizerConfig, TrainerConfig
from toolgym.trainers.losses import (
    BATCH_METRICS,
    LOSSES,
    RATIO_METRICS,
    EntropyBonus,
    KLPenalty,
    LossConfig,
    Objective,
    ObjectiveTerm,
    SequenceMask,
    TokenInputs,
    TokenTIS,
    TopKForwardKL,
    combine_metrics,
    finish_metrics,
    loss_names,
    loss_table,
    policy_loss,
    register_loss,
)
from toolgym.trainers.losses.objectives import PPOClip
from toolgym.trainers.trainer import Trainer

torch.set_num_threads(1)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "training.md"


class DoubledReinforce(Objective):
    """A toy loss: twice REINFORCE's per-token term, with one metric of its own."""

    def per_token(self, x: TokenInputs) -> ObjectiveTerm:
        ratio, clipped = torch.ones_like(x.logp), torch.zeros_like(x.mask)
        scale = torch.tensor(2.0, dtype=x.logp.dtype)
        return ObjectiveTerm(-scale * x.adv * x.logp, ratio, clipped, clipped, {"toy_scale": scale})


@pytest.fixture
def toy_loss():
    loss = register_loss(
        DoubledReinforce(
            "toy",
            "-2 A * logp",
            {"eps_low": 0.0, "eps_high": 0.0, "aggregation": "token-mean"},
            {**RATIO_METRICS, "toy_scale": "the toy's factor on REINFORCE"},
        )
    )
    try:
        yield loss
    finally:
        LOSSES.pop("toy")


def _step(loss_name):
    config = TrainerConfig(
        loss=LossConfig(name=loss_name), micro_batch_tokens=120, optimizer=OptimizerConfig(lr=1e-3)
    )
    trainer = Trainer(build_model("test", seed=0), config, device="cpu")
    episodes = random_episodes(6, seed=4)
    first = trainer._forward_backward(episodes, trainer.policy_loss, sharded=False)
    grads = full_grads(trainer.model)
    trainer.optimizer.zero_grad(set_to_none=True)
    return first, grads, trainer.train_step(episodes), trainer


def test_a_new_loss_is_one_entry_and_trains(toy_loss):
    assert "toy" in loss_names()
    config = LossConfig(name="toy")
    assert (config.eps_low, config.eps_high, config.aggregation) == (0.0, 0.0, "token-mean")
    toy, toy_grads, step, trainer = _step("toy")
    plain, plain_grads, _, _ = _step("reinforce")
    # twice REINFORCE: the loss and every gradient exactly doubled (x2 is exact in binary)
    assert toy["loss"] == 2 * plain["loss"] and toy["toy_scale"] == 2.0
    for name, grad in plain_grads.items():
        assert torch.equal(toy_grads[name], 2 * grad), name
    assert step["skipped"] == 0.0 and trainer.step == 1
    with pytest.raises(ValueError, match="registered already"):
        register_loss(DoubledReinforce("toy", "again", dict(toy_loss.defaults)))


def test_register_loss_refuses_a_loss_without_defaults_or_documented_metrics():
    with pytest.raises(ValueError, match="no default"):
        register_loss(DoubledReinforce("bad", "x", {"eps_low": 0.0}))
    with pytest.raises(ValueError, match="document"):
        register_loss(
            DoubledReinforce("bad", "x", {"eps_low": 0.0, "eps_high": 0.0, "aggregation": "token-mean"}, {})
        )
    assert "bad" not in LOSSES


def test_config_names_are_the_registry_s():
    with pytest.raises(ValueError, match="must be one of"):
        LossConfig(name="toy")  # not registered here
    for name in loss_names():
        assert msgspec.convert({"name": name}, LossConfig).name == name
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"name": "ppo"}, LossConfig)


NULLABLE = {
    f
    for f, default in zip(LossConfig.__struct_fields__, LossConfig.__struct_defaults__, strict=True)
    if default is None
}
TERM_METRICS = {
    **TokenTIS.metrics,
    **SequenceMask.metrics,
    **KLPenalty.metrics,
    **TopKForwardKL.metrics,
    **EntropyBonus.metrics,
    **BATCH_METRICS,
}


@pytest.mark.parametrize("name", loss_names())
def test_every_loss_has_defaults_and_documented_metrics(name):
    loss = LOSSES[name]
    assert {"eps_low", "eps_high", "aggregation"} <= set(loss.defaults) <= NULLABLE
    config = LossConfig(name=name)
    assert all(getattr(config, field) == value for field, value in loss.defaults.items())
    assert loss.summary and f"`{name}`" in DOCS.read_text()
    # every metric the loss reports, with every term on, is documented (and the docs name the
    # loss's own ones)
    documented = {**TERM_METRICS, **loss.metrics}
    assert all(isinstance(text, str) and text for text in documented.values())
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 5, generator=g) > 0.3
    sampler = -torch.rand(3, 5, generator=g)
    logp = (sampler + 0.1 * torch.randn(3, 5, generator=g)).requires_grad_(True)
    dual_clip = 2.0 if isinstance(loss, PPOClip) else None
    full = LossConfig(
        name=name, tis_cap=2.0, seq_mask="sequence", kl_coef=0.1, entropy_coef=0.01, dual_clip=dual_clip
    )
    _, metrics = policy_loss(
        full,
        logp,
        sampler,
        torch.randn(3, 5, generator=g),
        mask,
        ref_logprobs=sampler - 0.1,
        entropy=torch.rand(3, 5, generator=g),
        staleness=torch.randint(0, 5, (3, 5), generator=g),
    )
    reported = finish_metrics(combine_metrics([{k: v.item() for k, v in metrics.items()}]))
    assert set(reported) <= set(documented), set(reported) - set(documented)
    for key in set(loss.metrics) - set(RATIO_METRICS):
        assert key in DOCS.read_text(), key


def test_the_docs_table_of_losses_is_the_registry_s():
    assert loss_table() in DOCS.read_text()
