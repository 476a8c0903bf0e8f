"""The mixture-of-experts MLP's own parts (agents/model/moe.py); its parity with transformers'
Qwen3-MoE is tests/agents/model/test_model_families.py's (cases qwen3-moe*): the grouped matmul's
two paths agree (values and gradients, empty experts included), checkpoints' per-expert tensors
fuse and split back, the config's refusals, and the published shape's parameter count."""

from __future__ import annotations

import pytest
import torch

from toolgym.agents.model import moe
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import build_model


def _groups(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([3, 0, 5, 1, 0, 7])  # two experts get no rows
    x = torch.randn(int(counts.sum()), 16, generator=g)
    weight = torch.randn(len(counts), 24, 16, generator=g)
    return x, weight, counts


def _reference(x, weight, counts):
    rows, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows.append(x[start : start + n] @ weight[e].T)
        start += n
    return torch.cat(rows)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "padded-bmm"])
def test_grouped_matmul_is_each_groups_matmul(monkeypatch, grouped):
    if not grouped:
        monkeypatch.setattr(moe, "_grouped_mm_fits", lambda x, w: False)
    else:
        assert moe._grouped_mm_fits(*_groups()[:2])
    x, weight, counts = _groups()
    xs, ws = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    xr, wr = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = moe.grouped_matmul(xs, ws, counts)
    expected = _reference(xr, wr, counts)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(xs.grad, xr.grad)
    torch.testing.assert_close(ws.grad, wr.grad)
    assert ws.grad is not None and ws.grad[1].abs().sum() == 0 and ws.grad[4].abs().sum() == 0


@pytest.mark.parametrize("name", ["test-qwen3-moe", "test-gpt-oss"])
def test_the_block_runs_alike_on_both_paths_and_under_bf16_autocast(monkeypatch, name):
    model = build_model(name, seed=0)
    tokens = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        grouped = model(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(tokens)
        monkeypatch.setattr(moe, "_grouped_mm_fits", lambda x, w: False)
        padded = model(tokens)
    torch.testing.assert_close(grouped, padded, atol=1e-5, rtol=1e-5)
    assert (low.float() - grouped).abs().max() < 0.1


def test_checkpoint_experts_fuse_and_split_back():
    state = {n: t for n, t in build_model("test-qwen3-moe", seed=0).state_dict().items()}
    split = moe.split_experts(state)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in split
    assert not any(n.endswith(".gate_up_proj") for n in split)
    back = moe.fuse_experts(split)
    assert list(back) != [] and set(back) == set(state)
    assert all(torch.equal(back[n], state[n]) for n in state)
    del split["model.layers.0.mlp.experts.2.down_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: .* experts 0\.\.3"):
        moe.fuse_experts(split)


def test_config_refusals_and_the_published_shape():
    base = ModelConfig.named("test-qwen3-moe")
    for change, message in [
        ({"model_type": "qwen3"}, "num_experts .* is not a qwen3 field"),
        ({"num_experts": 0}, "qwen3_moe needs num_experts >= 1"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok <= num_experts"),
        ({"mlp_only_layers": (2,)}, "mlp_only_layers layers 0..1"),
    ]:
        with pytest.raises(ValueError, match=message):
            ModelConfig(**{**{f: getattr(base, f) for f in base.__struct_fields__}, **change})
    assert [base.layer_moe(i) for i in range(2)] == [True, False]
    big = ModelConfig.named("qwen3-30b-a3b")
    assert 30.4e9 < big.num_params() < 30.6e9  # Qwen3-30B-A3B: 30.5B in all
    assert ModelConfig.from_hf_dict(big.to_hf_dict()) == big


def test_the_load_balancing_loss_is_transformers_and_the_trainer_adds_it():
    """`load_balancing_loss` equals transformers' load_balancing_loss_func (with and without a
    mask); the Trainer logs it as `router_aux` for a MoE model and, with router_aux_coef, adds it
    to the loss: the loss and the router's gradient are those of the policy loss plus coef x aux."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from toolgym.rollouts.types import Episode
    from toolgym.trainers.config import TrainerConfig
    from toolgym.trainers.losses import LossConfig
    from toolgym.trainers.trainer import Trainer

    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(12, 4, generator=g) for _ in range(2)]
    mask = torch.tensor([1.0] * 9 + [0.0] * 3)
    for m in (None, mask):
        theirs = load_balancing_loss_func(tuple(logits), 4, 2, None if m is None else m[None])
        assert moe.load_balancing_loss(logits, 2, m).item() == pytest.approx(float(theirs), rel=1e-6)

    episodes = [
        Episode(tokens=[5, 9, 33, 7, 12, 40, 41], loss_mask=[0, 0, 0, 1, 1, 1, 1],
                sampler_logprobs=[0.0, 0.0, 0.0, -5.5, -5.6, -5.4, -5.5], advantages=[0, 0, 0, 1.0, 1.0, 1.0, 1.0]),
        Episode(tokens=[5, 9, 3, 70, 2], loss_mask=[0, 0, 1, 1, 1],
                sampler_logprobs=[0.0, 0.0, -5.5, -5.5, -5.5], advantages=[0, 0, -1.0, -1.0, -1.0]),
    ]  # fmt: skip
    grads, results = {}, {}
    for coef in (0.0, 0.5):
        trainer = Trainer(
            build_model("test-qwen3-moe", seed=0), TrainerConfig(loss=LossConfig(name="grpo", router_aux_coef=coef)),
            device="cpu",
        )  # fmt: skip
        results[coef] = trainer._forward_backward(episodes, trainer.policy_loss, sharded=False)
        grads[coef] = trainer.model.model.layers[0].mlp.gate.weight.grad.clone()
    assert (
        results[0.0]["router_aux"] == pytest.approx(results[0.5]["router_aux"])
        and results[0.0]["router_aux"] > 1.0
    )
    assert results[0.5]["loss"] == pytest.approx(
        results[0.0]["loss"] + 0.5 * results[0.0]["router_aux"], rel=1e-5
    )
    # by hand: the same batch's aux over its real positions, its gradient on the first router
    model = build_model("test-qwen3-moe", seed=0)
    router = model.model.layers[0].mlp
    router.keep_router_logits = True
    ids = torch.zeros(2, 6, dtype=torch.long)
    ids[0, :6], ids[1, :4] = torch.tensor(episodes[0].tokens[:-1]), torch.tensor(episodes[1].tokens[:-1])
    model(ids)
    real = torch.tensor([[1] * 6, [1] * 4 + [0] * 2]).bool()
    aux = moe.load_balancing_loss([router.router_logits], 2, real)
    (0.5 * aux).backward()
    torch.testing.assert_close(grads[0.5] - grads[0.0], router.gate.weight.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["test-qwen3-moe", "test-gpt-oss", "test-gpt-oss+lora"])
def test_a_moe_model_trains_through_the_cli(tmp_path, name):
    """`toolgym train` with a Qwen3-MoE or gpt-oss model: the engine samples from it, the trainer
    steps it (with the load-balancing loss) and the weights sync back each step, then it exports
    as HF's checkpoint (per-expert tensors; gpt-oss's stacked) that loads back. "+lora": LoRA on
    q_proj and the experts (the router trains nothing then: the adapters sync, merged)."""
    from safetensors.torch import load_file

    from toolgym.agents.model.checkpoint import load_hf_checkpoint
    from toolgym.configs.cli.main import main as cli_main
    from toolgym.trainers.metrics_log import read_metrics

    run_dir = tmp_path / "run"
    overrides = [
        f"run.run_dir={run_dir}", "run.steps=2", "run.plot=false", f"model.name={name}",
        "model.overrides.vocab_size=1024",
        "sft.enabled=false", "policy.max_seq_len=256", "rollout.group_size=2", "rollout.max_turns=2",
        "rollout.max_tokens_per_turn=8", "rollout.max_tokens_per_episode=24", "batch.groups_per_batch=2",
        "batch.dynamic_sampling=false", "trainer.loss.router_aux_coef=0.01", "eval.num_tasks=2",
        "eval.samples_per_task=1", "logging.progress_bar=false",
    ]  # fmt: skip
    name, lora = name.removesuffix("+lora"), name.endswith("+lora")
    overrides[3] = f"model.name={name}"
    if lora:
        # an entropy bonus: a gradient whatever the (all-zero) rewards of a random model
        overrides += ["policy.lora.rank=2", 'policy.lora.target_modules=["q_proj", "experts"]',
                      "trainer.loss.entropy_coef=0.01"]  # fmt: skip
    assert (
        cli_main(["train", "zorplex_tiny", "--no-progress", *(a for o in overrides for a in ("--set", o))])
        == 0
    )
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["train/router_aux"] >= 1.0 and r["train/skipped"] == 0 for r in train)
    if lora:
        adapter = load_file(run_dir / "final_adapter" / "adapter_model.safetensors")
        assert any(".mlp.experts.base_layer.lora_B.weight" in k for k in adapter)
        assert any(v.abs().sum() > 0 for k, v in adapter.items() if ".experts.lora_B." in k)  # trained
    exported = load_hf_checkpoint(run_dir / "final_model")
    assert exported.config.num_experts == 4 and exported.model.layers[0].mlp.experts.gate_up_proj.shape == (
        4,
        64,
        64,
    )
