"""OLMo 3 (`olmo3`) and OLMo 2 (`olmo2`) against transformers, built from its own config classes
with random weights at tiny shapes (no download): logits on a ragged batch within 1e-4 in float32
(OLMo 3's window far shorter than the sequences), TorchEngine's greedy generation token-identical
to transformers' over 64 tokens, one training step's loss and gradient norm, checkpoint
directories both ways, a PEFT adapter of ours loaded by `peft` onto transformers' model; and what is
refused (YaRN, different RoPE per layer type, packed or fused layers)."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch
from parity_testlib import hf_greedy, ours_from, peft_logits, ragged_batch

from toolgym.agents.engine.backend import select_backend
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.kernels.packed_linear import packing_available
from toolgym.agents.model.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import Transformer, causal_lm_logprobs
from toolgym.agents.types import SamplingParams
from toolgym.rollouts.types import Episode
from toolgym.trainers.config import TrainerConfig
from toolgym.trainers.trainer import Trainer

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=None, eos_token_id=2)  # fmt: skip
WINDOW = 5


def per_type_rope(theta: float) -> dict:
    return {
        kind: {"rope_type": "default", "rope_theta": theta}
        for kind in ("full_attention", "sliding_attention")
    }


def hf_config(case: str):
    """transformers' own config of each tested variant (tiny)."""
    if case == "olmo3":  # window-5 layers around a full one, untied, RoPE base 1e4 on both types
        return transformers.Olmo3Config(
            **SHAPE, num_hidden_layers=4, sliding_window=WINDOW, rope_parameters=per_type_rope(1e4),
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        )  # fmt: skip
    if case == "olmo3-bias-tied":  # q/k/v/o biases, tied embeddings, the default layer types
        return transformers.Olmo3Config(**SHAPE, num_hidden_layers=4, sliding_window=WINDOW, attention_bias=True,
                                        tie_word_embeddings=True, rope_parameters=per_type_rope(2e5))  # fmt: skip
    if case == "olmo2":
        return transformers.Olmo2Config(**SHAPE, num_hidden_layers=2, attention_bias=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e4})  # fmt: skip
    raise KeyError(case)


CASES = ["olmo3", "olmo3-bias-tied", "olmo2"]


def hf_model(case: str, seed: int = 0):
    """A transformers model of `case` with non-trivial random weights (random norms and biases too)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(case), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            center = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(center + 0.15 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_on_a_ragged_batch(tmp_path, case: str) -> None:
    hf = hf_model(case)
    ours = ours_from(hf, tmp_path)
    config = ours.config
    assert config.model_type == hf.config.model_type
    assert "input_layernorm" not in dict(ours.named_modules())["model.layers.0"]._modules
    assert ours.model.layers[0].self_attn.q_norm.weight.shape == (4 * 32,)  # the whole projection
    tokens, mask = ragged_batch(config.vocab_size)
    with torch.no_grad():
        theirs = hf(tokens, attention_mask=mask).logits
        mine = ours(tokens)  # causal: right padding is harmless
    valid = mask.bool()
    assert mine[valid].abs().max() > 1.0
    assert (mine[valid] - theirs[valid]).abs().max().item() <= 1e-4
    if config.windowed:  # the window binds: attending over everything gives other logits past it
        full = Transformer(msgspec.structs.replace(config, sliding_window=1000)).eval()
        full.load_state_dict(ours.state_dict())
        with torch.no_grad():
            unwindowed = full(tokens)
        assert torch.allclose(mine[:, :WINDOW], unwindowed[:, :WINDOW], atol=1e-6, rtol=0)
        assert (mine[0, WINDOW:] - unwindowed[0, WINDOW:]).abs().amax(-1).min() > 1e-3


@pytest.mark.parametrize("case", CASES)
def test_engine_greedy_matches_transformers_greedy(tmp_path, case: str) -> None:
    """Prompts longer than OLMo 3's window, then 64 decode steps past it."""
    hf = hf_model(case, seed=1)
    ours = ours_from(hf, tmp_path)
    prompts = [[3, 17, 90, 4, 55], [101, 7, 7, 64, 2, 33, 12, 80, 9, 5, 44, 6, 1]]
    engine = TorchEngine(ours, max_batch_size=2, max_seq_len=96, device="cpu", dtype=torch.float32)
    assert engine.backend.own_layers and not engine.backend.fused  # its blocks, linears packed
    completions = engine.generate_sync(prompts, SamplingParams(max_tokens=64, temperature=0.0))
    for prompt, completion in zip(prompts, completions, strict=True):
        assert list(completion.tokens) == hf_greedy(hf, prompt, 64)


@pytest.mark.parametrize("case", CASES)
def test_training_step_loss_and_grad_norm_match_transformers(tmp_path, case: str) -> None:
    """The same masked token-mean NLL on the same ragged batch: loss, global gradient norm and
    every parameter's gradient."""
    hf = hf_model(case, seed=3)
    ours = ours_from(hf, tmp_path)
    hf.train()
    ours.train()
    tokens, mask = ragged_batch(ours.config.vocab_size, seed=3)
    target_mask = mask[:, 1:].float()

    def loss_of(logprobs: torch.Tensor) -> torch.Tensor:
        return -(logprobs * target_mask).sum() / target_mask.sum()

    loss_ours = loss_of(causal_lm_logprobs(ours, tokens))
    logits = hf(tokens, attention_mask=mask).logits[:, :-1].float()
    loss_hf = loss_of(torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1))
    loss_ours.backward()
    loss_hf.backward()
    assert abs(loss_ours.item() - loss_hf.item()) <= 1e-4
    norm_ours = torch.nn.utils.get_total_norm([p.grad for p in ours.parameters()])
    norm_hf = torch.nn.utils.get_total_norm([p.grad for p in hf.parameters()])
    assert abs(norm_ours.item() - norm_hf.item()) <= 1e-4 * max(1.0, norm_hf.item())
    grads_hf = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.allclose(p.grad, grads_hf[name].grad, atol=1e-4, rtol=1e-3), name


def test_trainer_sft_step_matches_transformers(tmp_path) -> None:
    """The Trainer's SFT step on OLMo 3: its loss and gradient norm are transformers'."""
    hf = hf_model("olmo3", seed=4)
    ours = ours_from(hf, tmp_path)
    tokens, mask = ragged_batch(ours.config.vocab_size, seed=4)
    lengths, prompts = mask.sum(1).tolist(), [3, 8, 5]
    episodes = [
        Episode(tokens=tokens[i, :n].tolist(), loss_mask=[0] * p + [1] * (n - p), sampler_logprobs=[0.0] * n,
                advantages=[0.0] * n)
        for i, (n, p) in enumerate(zip(lengths, prompts, strict=True))
    ]  # fmt: skip
    metrics = Trainer(ours, TrainerConfig(), device="cpu").sft_step(episodes)
    trained = torch.zeros_like(mask)
    for i, (n, p) in enumerate(zip(lengths, prompts, strict=True)):
        trained[i, p:n] = 1
    hf.train()
    logprobs = torch.log_softmax(hf(tokens, attention_mask=mask).logits[:, :-1].float(), -1)
    picked = logprobs.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    target = trained[:, 1:].float()
    loss = -(picked * target).sum() / target.sum()
    loss.backward()
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in hf.parameters()]).item()
    assert abs(metrics["loss"] - loss.item()) <= 1e-4
    assert abs(metrics["grad_norm"] - grad_norm) <= 1e-4 * max(1.0, grad_norm)


@pytest.mark.parametrize("case", CASES)
def test_save_load_round_trip_and_transformers_reads_ours(tmp_path, case: str) -> None:
    hf = hf_model(case, seed=2)
    ours = ours_from(hf, tmp_path)
    save_hf_checkpoint(ours, ours.config, tmp_path / "ours")
    back = load_hf_checkpoint(tmp_path / "ours")
    assert back.config == ours.config
    assert list(back.state_dict()) == list(ours.state_dict()) == list(hf.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(back.state_dict().values(), ours.state_dict().values(), strict=True)
    )
    if ours.config.tie_word_embeddings:
        assert back.lm_head.weight is back.model.embed_tokens.weight
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["architectures"] == [type(hf).__name__]
    reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(reread) is type(hf)
    for field in (
        "layer_types",
        "sliding_window",
        "rope_parameters",
        "attention_bias",
        "tie_word_embeddings",
    ):
        assert getattr(reread.config, field, None) == getattr(hf.config, field, None), field
    tokens, _ = ragged_batch(ours.config.vocab_size, (23,))
    with torch.no_grad():
        assert (reread(tokens).logits - hf(tokens).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("case", ["olmo3", "olmo2"])
def test_peft_loads_our_adapter_onto_transformers(tmp_path, case: str) -> None:
    """An adapter trained here (every target, the q/k projections under their whole-projection
    norms included), saved in PEFT's layout, gives our logits on transformers' model."""
    pytest.importorskip("peft")
    base_logits, mine, theirs = peft_logits(hf_model(case, seed=6), tmp_path)
    assert (mine - base_logits).abs().max() > 1e-3  # the adapters matter
    assert (theirs - mine).abs().max().item() <= 1e-4


def test_config_json_forms_defaults_and_refusals() -> None:
    """OLMo 3's per-layer-type rope_parameters and the older flat fields read the same; a missing
    layer_types is Olmo3Config's default (every fourth layer full); the published YaRN form reads."""
    theirs = hf_config("olmo3").to_dict()
    config = ModelConfig.from_hf_dict(theirs)
    assert (config.rope_theta, config.sliding_window, config.rms_norm_eps) == (1e4, WINDOW, 1e-5)
    assert [config.layer_window(i) for i in range(4)] == [WINDOW, WINDOW, None, WINDOW]
    written = config.to_hf_dict()
    assert written["rope_parameters"] == per_type_rope(1e4)
    assert ModelConfig.from_hf_dict(written) == config
    flat = {k: v for k, v in written.items() if k not in ("rope_parameters", "layer_types")}
    defaulted = ModelConfig.from_hf_dict(flat)
    assert defaulted.rope_theta == 1e4
    assert defaulted.layer_types == ("sliding_attention",) * 3 + ("full_attention",)
    olmo2 = ModelConfig.from_hf_dict(hf_config("olmo2").to_dict())
    assert olmo2.layer_types is None and not olmo2.windowed and olmo2.attention_bias
    published = ModelConfig.named("olmo-3-7b")
    assert published.num_params() == 7_298_011_136  # transformers' count of this shape
    assert ModelConfig.from_hf_dict(published.to_hf_dict()) == published
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "beta_fast": 32,
            "beta_slow": 1, "attention_factor": 1.2079441541679836}  # fmt: skip
    for d, message in [(flat | {"hidden_act": "gelu"}, "hidden_act")]:
        with pytest.raises(ValueError, match=message) as error:
            ModelConfig.from_hf_dict(d)
        assert "\n" not in str(error.value)
    # transformers' own reading of the published form (a flat rope_scaling onto the full layers) is
    # read, YaRN on the full layers (the mixes still refused: tests/agents/model/test_model_yarn.py)
    published_form = transformers.Olmo3Config(**SHAPE, num_hidden_layers=4, rope_scaling=yarn).to_dict()
    scaling = ModelConfig.from_hf_dict(published_form).rope_scaling
    assert scaling is not None and scaling.factor == 8.0


def test_transformers_counts_the_published_shape() -> None:
    """olmo-3-7b's parameter count is transformers' for the same config (built on the meta device)."""
    config = ModelConfig.named("olmo-3-7b")
    hf_cfg = transformers.AutoConfig.for_model(**config.to_hf_dict())
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    assert sum(p.numel() for p in hf.parameters()) == config.num_params()
    with torch.device("meta"):
        ours = Transformer(config)
    assert sum(p.numel() for p in ours.parameters()) == config.num_params()


def test_fused_layers_are_refused_in_one_line_and_packing_keeps_its_blocks() -> None:
    config = ModelConfig.from_hf_dict(hf_config("olmo3").to_dict())
    backend = select_backend(config, "cpu", torch.float32)
    assert backend.own_layers and not backend.fused and backend.kernels == "torch"
    with pytest.raises(ValueError, match="OLMo's blocks") as error:
        select_backend(config, "cpu", torch.float32, fused_layers=True)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="sliding-window layers"):
        select_backend(config, "cpu", torch.float32, kernels="vllm")
    olmo2 = ModelConfig.from_hf_dict(hf_config("olmo2").to_dict())
    if packing_available(torch.device("cpu")):
        packed = select_backend(olmo2, "cpu", torch.float32, pack_weights=True)
        assert packed.packed and packed.own_layers and "own, oneDNN-packed linears" in packed.describe()
