"""The non-Qwen native families (Llama 3.x, Mistral, SmolLM3, Gemma 3 text, OLMo 3, OLMo 2)
against transformers, built from its own config classes with random weights at tiny shapes (no
download): logits on a ragged batch within 1e-4 in float32, TorchEngine's greedy generation
token-identical to transformers' greedy over 64 tokens, checkpoint directories both ways, one
training step's loss and gradient norm, the Trainer's SFT step, a PEFT adapter of ours loaded by
`peft` onto transformers' model, with sliding windows (Mistral's on every layer, Gemma 3's and
OLMo 3's per layer) far shorter than the sequences; and what is refused (vLLM's kernels for a
windowed model, packed layers without RoPE or for Gemma's blocks, an unknown model_type). OLMo's
config.json forms and backend refusals are tests/agents/model/test_model_olmo.py's."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch
from parity_testlib import hf_greedy, ours_from, peft_logits, ragged_batch

from toolgym.agents.engine.backend import select_backend
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.kernels.packed_linear import packing_available
from toolgym.agents.model.attention import sliding_causal_mask
from toolgym.agents.model.checkpoint import load_config, load_hf_checkpoint, save_hf_checkpoint
from toolgym.agents.model.config import ModelConfig, RopeScaling
from toolgym.agents.model.families import FAMILIES
from toolgym.agents.model.transformer import Transformer, causal_lm_logprobs, rope_cos_sin
from toolgym.agents.types import SamplingParams
from toolgym.rollouts.types import Episode
from toolgym.trainers.config import TrainerConfig
from toolgym.trainers.trainer import Trainer

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5)  # fmt: skip
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)  # fmt: skip
OLMO_SHAPE = SHAPE | dict(pad_token_id=None, eos_token_id=2)  # OLMo's configs: no pad token
WINDOW = 5  # OLMo 3's sliding window


def per_type_rope(theta: float) -> dict:
    """OLMo 3's rope_parameters: the same default RoPE on both layer types."""
    return {
        kind: {"rope_type": "default", "rope_theta": theta}
        for kind in ("full_attention", "sliding_attention")
    }


def hf_config(case: str):
    """transformers' own config of each tested variant (tiny)."""
    if case == "llama3-tied":
        return transformers.LlamaConfig(**SHAPE, num_hidden_layers=2, tie_word_embeddings=True,
                                        rope_parameters=LLAMA3_ROPE)  # fmt: skip
    if case == "llama-untied-bias":
        return transformers.LlamaConfig(**SHAPE, num_hidden_layers=2, tie_word_embeddings=False,
                                        attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4})  # fmt: skip
    if case == "llama-headdim":  # head_dim from config, not hidden_size // heads
        return transformers.LlamaConfig(
            **(SHAPE | {"head_dim": 48}), num_hidden_layers=2, tie_word_embeddings=False
        )
    if case == "mistral":
        return transformers.MistralConfig(**SHAPE, num_hidden_layers=2, sliding_window=None)
    if case == "mistral-window":  # a window every sequence here passes
        return transformers.MistralConfig(**SHAPE, num_hidden_layers=2, sliding_window=6)
    if case == "gemma3":  # sliding layers of window 5 (RoPE base 1e4) around a global one (1e6)
        return transformers.Gemma3TextConfig(
            **SHAPE, num_hidden_layers=4, sliding_window=5, query_pre_attn_scalar=24, bos_token_id=2,
            eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        )  # fmt: skip
    if case == "smollm3":
        return transformers.SmolLM3Config(**SHAPE, num_hidden_layers=4, tie_word_embeddings=True,
                                          bos_token_id=1, eos_token_id=2, pad_token_id=None,
                                          rope_parameters={"rope_type": "default", "rope_theta": 2e6})  # fmt: skip
    if case == "olmo3":  # window-5 layers around a full one, untied, RoPE base 1e4 on both types
        return transformers.Olmo3Config(
            **OLMO_SHAPE, num_hidden_layers=4, sliding_window=WINDOW, rope_parameters=per_type_rope(1e4),
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        )  # fmt: skip
    if case == "olmo3-bias-tied":  # q/k/v/o biases, tied embeddings, the default layer types
        return transformers.Olmo3Config(**OLMO_SHAPE, num_hidden_layers=4, sliding_window=WINDOW,
                                        attention_bias=True, tie_word_embeddings=True,
                                        rope_parameters=per_type_rope(2e5))  # fmt: skip
    if case == "olmo2":
        return transformers.Olmo2Config(**OLMO_SHAPE, num_hidden_layers=2, attention_bias=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e4})  # fmt: skip
    if case == "qwen3-moe":  # 4 experts, 2 a token, renormalised; the middle layer dense
        return transformers.Qwen3MoeConfig(
            **SHAPE, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        )  # fmt: skip
    if case == "qwen3-moe-sparse-step":  # experts on every second layer, 3 of 8 a token, not renormalised
        return transformers.Qwen3MoeConfig(
            **SHAPE, num_hidden_layers=4, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
            decoder_sparse_step=2, tie_word_embeddings=True, attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        )  # fmt: skip
    if case == "gpt-oss":  # window-5 layers alternating with full ones, sinks, 4 experts, 2 a token
        return transformers.GptOssConfig(
            **SHAPE, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
            tie_word_embeddings=False, swiglu_limit=0.5,  # a limit the random activations pass
            rope_parameters={"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        )  # fmt: skip
    raise KeyError(case)


CASES = [
    "llama3-tied",
    "llama-untied-bias",
    "llama-headdim",
    "mistral",
    "mistral-window",
    "smollm3",
    "gemma3",
    "olmo3",
    "olmo3-bias-tied",
    "olmo2",
    "qwen3-moe",
    "qwen3-moe-sparse-step",
    "gpt-oss",
]
# The models whose sliding windows the test sequences pass, and their windows layer by layer (None:
# a full-attention layer).
LAYER_WINDOWS = {
    "mistral-window": [6, 6],
    "gemma3": [5, None, 5, 5],
    "olmo3": [WINDOW, WINDOW, None, WINDOW],
    "olmo3-bias-tied": [WINDOW, WINDOW, WINDOW, None],  # Olmo3Config's default: every fourth layer full
    "gpt-oss": [WINDOW, None, WINDOW, None],
}
WINDOWED = list(LAYER_WINDOWS)
# OLMo's blocks: norms after attention and after the MLP (none before), q/k norms over the whole
# projection; the model's own layers, never fused ones.
OLMO = ["olmo3", "olmo3-bias-tied", "olmo2"]
# The models a training step and the Trainer's SFT step are checked on.
TRAINED = ["llama3-tied", "mistral", "smollm3", "olmo2", "qwen3-moe", *WINDOWED]
# The spread of the random norm weights around their center: OLMo's cases keep the 0.15 of every
# other weight (their parity was established with it).
NORM_SPREAD = {"olmo3": 0.15, "olmo3-bias-tied": 0.15, "olmo2": 0.15}


def hf_model(case: str, seed: int = 0):
    """A transformers model of `case` with non-trivial random weights (random norms and biases too)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(case), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms scale by 1 + weight
                center = 0.0 if case == "gemma3" else 1.0
                p.copy_(center + NORM_SPREAD.get(case, 0.3) * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_on_a_ragged_batch(tmp_path, case: str) -> None:
    hf = hf_model(case)
    ours = ours_from(hf, tmp_path)
    config = ours.config
    assert config.model_type == hf.config.model_type
    if case in OLMO:  # no norm before attention; q_norm over all heads' queries at once
        assert "input_layernorm" not in dict(ours.named_modules())["model.layers.0"]._modules
        assert ours.model.layers[0].self_attn.q_norm.weight.shape == (4 * 32,)
    tokens, mask = ragged_batch(config.vocab_size)
    with torch.no_grad():
        theirs = hf(tokens, attention_mask=mask).logits
        mine = ours(tokens)  # causal: right padding is harmless
    valid = mask.bool()
    assert mine[valid].abs().max() > 1.0
    assert (mine[valid] - theirs[valid]).abs().max().item() <= 1e-4
    if config.windowed:  # the window binds: attending over everything gives other logits past it
        window = config.sliding_window
        assert window is not None
        full = Transformer(msgspec.structs.replace(config, sliding_window=1000)).eval()
        full.load_state_dict(ours.state_dict())
        with torch.no_grad():
            unwindowed = full(tokens)
        assert torch.allclose(mine[:, :window], unwindowed[:, :window], atol=1e-6, rtol=0)
        assert (mine[0, window:] - unwindowed[0, window:]).abs().amax(-1).min() > 1e-3


@pytest.mark.parametrize(
    "case", ["llama3-tied", "llama-untied-bias", "mistral", "smollm3", "olmo2", "qwen3-moe", *WINDOWED]
)
def test_engine_greedy_matches_transformers_greedy(tmp_path, case: str) -> None:
    """Prompts longer than the windowed models' windows (a prefill's band), then 64 decode steps
    past them."""
    hf = hf_model(case, seed=1)
    ours = ours_from(hf, tmp_path)
    prompts = [[3, 17, 90, 4, 55], [101, 7, 7, 64, 2, 33, 12, 80, 9, 5, 44, 6, 1]]
    engine = TorchEngine(ours, max_batch_size=2, max_seq_len=96, device="cpu", dtype=torch.float32)
    if case in OLMO:  # its own blocks (linears packed where oneDNN is), never fused layers
        assert engine.backend.own_layers and not engine.backend.fused
    completions = engine.generate_sync(prompts, SamplingParams(max_tokens=64, temperature=0.0))
    for prompt, completion in zip(prompts, completions, strict=True):
        assert list(completion.tokens) == hf_greedy(hf, prompt, 64)


@pytest.mark.parametrize(
    "case",
    ["llama3-tied", "llama-untied-bias", "mistral", "smollm3", "olmo2", "qwen3-moe", "qwen3-moe-sparse-step", *WINDOWED],
)
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
    assert written["architectures"] == [FAMILIES[ours.config.model_type].architecture] == [type(hf).__name__]
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


@pytest.mark.parametrize("case", TRAINED)
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


@pytest.mark.parametrize("case", TRAINED)
def test_trainer_sft_step_matches_transformers(tmp_path, case: str) -> None:
    """The Trainer's SFT step (masked token-mean cross-entropy) on a family's model: its loss and
    gradient norm (before clipping) are transformers' on the same batch."""
    hf = hf_model(case, seed=4)
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
        trained[i, p:n] = 1  # token t is trained, predicted at position t - 1
    hf.train()
    logprobs = torch.log_softmax(hf(tokens, attention_mask=mask).logits[:, :-1].float(), -1)
    picked = logprobs.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    target = trained[:, 1:].float()
    loss = -(picked * target).sum() / target.sum()
    loss.backward()
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in hf.parameters()]).item()
    assert abs(metrics["loss"] - loss.item()) <= 1e-4
    assert abs(metrics["grad_norm"] - grad_norm) <= 1e-4 * max(1.0, grad_norm)


def test_llama3_rope_frequencies_are_transformers(tmp_path) -> None:
    hf = hf_model("llama3-tied")
    config = ours_from(hf, tmp_path).config
    assert config.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=64)  # fmt: skip
    positions = torch.arange(200)
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta, torch.float32, config.rope_scaling)
    hf_cos, hf_sin = hf.model.rotary_emb(torch.zeros(1), positions[None])
    assert (cos - hf_cos[0]).abs().max() <= 1e-5
    half = config.head_dim // 2
    assert (sin[:, half:] - hf_sin[0, :, half:]).abs().max() <= 1e-5  # ours folds rotate_half's sign into sin
    plain, _ = rope_cos_sin(positions, config.head_dim, config.rope_theta, torch.float32)
    assert not torch.allclose(cos, plain)  # the scaling changes the long wavelengths


@pytest.mark.parametrize("case", WINDOWED)
def test_the_window_binds_and_is_transformers_band(tmp_path, case: str) -> None:
    """The windowed models' logits differ from the same weights attending over everything (the
    windows bind), and the band is transformers': a query at p sees p - window + 1 .. p."""
    hf = hf_model(case)
    ours = ours_from(hf, tmp_path)
    config = ours.config
    assert [config.layer_window(i) for i in range(config.num_hidden_layers)] == LAYER_WINDOWS[case]
    if case == "gemma3":
        assert config.rope_local_base_freq == 1e4
    full = Transformer(msgspec.structs.replace(config, sliding_window=1000)).eval()  # a window never reached
    full.load_state_dict(ours.state_dict())
    tokens, _ = ragged_batch(config.vocab_size, (30,))
    window = config.sliding_window
    assert window is not None
    with torch.no_grad():
        windowed, unwindowed = ours(tokens), full(tokens)
    # No query reaches past the window yet (the banded and the causal attention round apart by a
    # few float32 ulps: up to 1.07e-6 on logits of ~4 on an AVX-512 EPYC).
    assert torch.allclose(windowed[:, :window], unwindowed[:, :window], atol=1e-5, rtol=0)
    assert (windowed[:, window:] - unwindowed[:, window:]).abs().amax(-1).min() > 1e-3
    mask = sliding_causal_mask(4, 6, 3, "cpu")  # queries at 2..5 over keys 0..5
    assert mask.long().tolist() == [
        [1, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
    ]


@pytest.mark.parametrize(("case", "key_layout"), [(c, k) for c in WINDOWED for k in ("sd", "ds")])
def test_engine_windowed_prefix_and_continue_match_transformers(tmp_path, case: str, key_layout) -> None:
    """The engine's other forwards with bands, over either key layout (SDPA or batched-matmul
    decode): prompts sharing a prefix longer than the window (prefilled once), a later prefill
    reusing the stored prefix, and a conversation's next turn continuing its kept k/v: each
    greedy completion is transformers'."""
    hf = hf_model(case, seed=5)
    ours = ours_from(hf, tmp_path)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(1, 128, (20,), generator=g).tolist()
    prompts = [prefix + torch.randint(1, 128, (n,), generator=g).tolist() for n in (3, 9, 5)]
    backend = select_backend(ours.config, "cpu", torch.float32, key_layout=key_layout)
    engine = TorchEngine(
        ours, max_batch_size=3, max_seq_len=128, device="cpu", dtype=torch.float32, backend=backend
    )
    params = SamplingParams(max_tokens=24, temperature=0.0)
    first = engine.generate_sync(prompts, params)
    assert engine.stats.shared_prefix_tokens > 0
    for prompt, completion in zip(prompts, first, strict=True):
        assert list(completion.tokens) == hf_greedy(hf, prompt, 24)
    shared = engine.stats.shared_prefix_tokens
    (again,) = engine.generate_sync([[*prefix, 7, 8, 9, 10]], params)  # the stored prefix
    assert engine.stats.shared_prefix_tokens > shared
    assert list(again.tokens) == hf_greedy(hf, [*prefix, 7, 8, 9, 10], 24)
    follow_up = [*prompts[1], *first[1].tokens, 11, 12, 13]
    (turn,) = engine.generate_sync([follow_up], params)
    assert engine.stats.history_tokens > 0
    assert list(turn.tokens) == hf_greedy(hf, follow_up, 24)


def test_windowed_models_refuse_what_cannot_window_them() -> None:
    base = SHAPE | {"num_hidden_layers": 2}
    mistral = ModelConfig(**base, model_type="mistral", sliding_window=8)
    assert mistral.windowed and [mistral.layer_window(i) for i in range(2)] == [8, 8]
    backend = select_backend(mistral, "cpu", torch.float32)
    assert backend.kernels == "torch" and backend.attention == "torch"
    with pytest.raises(ValueError, match=r"sliding-window layers.*vLLM"):
        select_backend(mistral, "cpu", torch.float32, kernels="vllm")
    gemma = ModelConfig.from_hf_dict(hf_config("gemma3").to_dict())
    backend = select_backend(gemma, "cpu", torch.float32)
    assert backend.own_layers and not backend.fused and backend.kernels == "torch"
    assert backend.packed == packing_available(torch.device("cpu"))  # its own blocks, linears packed
    with pytest.raises(ValueError, match="Gemma 3's blocks"):
        select_backend(gemma, "cpu", torch.float32, fused_layers=True)
    plain = Transformer(ModelConfig(**base, model_type="mistral", sliding_window=None))
    packed = select_backend(plain.config, "cpu", torch.float32, pack_weights=True)
    with pytest.raises(ValueError, match="Gemma 3's blocks"):  # a backend chosen for another model
        TorchEngine(Transformer(gemma), max_batch_size=1, max_seq_len=32, backend=packed)
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig(**base, model_type="llama", sliding_window=8)
    with pytest.raises(ValueError, match="layer_types is not a mistral field"):
        ModelConfig(**base, model_type="mistral", sliding_window=8, layer_types=("full_attention",) * 2)


def test_layers_without_rope_run_on_the_models_own_layers() -> None:
    config = ModelConfig(**SHAPE, num_hidden_layers=4, model_type="smollm3", no_rope_layers=(1, 1, 1, 0))
    assert [config.layer_rope(i) for i in range(4)] == [True, True, True, False]
    backend = select_backend(config, "cpu", torch.float32)
    assert backend.own_layers and not backend.fused
    with pytest.raises(ValueError, match="without RoPE"):
        select_backend(config, "cpu", torch.float32, fused_layers=True)
    # HF's default when config.json has none: every 4th layer without RoPE.
    d = config.to_hf_dict()
    del d["no_rope_layers"]
    assert ModelConfig.from_hf_dict(d).no_rope_layers == (1, 1, 1, 0)


def test_overrides_as_plain_tables_and_lists() -> None:
    """A config override from TOML gives rope_scaling as a table and no_rope_layers as a list."""
    base = SHAPE | {"num_hidden_layers": 2}
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    llama = ModelConfig(**base, model_type="llama", rope_scaling={"rope_type": "llama3", **scaling})  # type: ignore[arg-type]
    assert llama.rope_scaling == RopeScaling(**scaling)
    smol = ModelConfig(**base, model_type="smollm3", no_rope_layers=[1, 0])  # type: ignore[arg-type]
    assert smol.no_rope_layers == (1, 0) and hash(smol)


def test_unknown_model_type_names_the_native_families(tmp_path) -> None:
    d = ModelConfig.named("test").to_hf_dict() | {"model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError) as error:
        load_config(tmp_path)
    message = str(error.value)
    assert "\n" not in message and "'gpt2'" in message
    assert all(name in message for name in ("qwen2", "qwen3", "llama", "mistral", "smollm3"))


@pytest.mark.parametrize(
    ("model_type", "change", "message"),
    [
        ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type='dynamic'"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("smollm3", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        ("mistral", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type='llama3'"),
    ],
)
def test_unsupported_family_features_are_refused(model_type: str, change: dict, message: str) -> None:
    d = ModelConfig(**SHAPE, num_hidden_layers=1, model_type=model_type).to_hf_dict() | change  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


def test_gemma3_config_json_forms_and_refusals() -> None:
    """transformers 5's per-layer-type rope_parameters and the older flat fields (rope_theta,
    rope_local_base_freq, sliding_window_pattern without layer_types) read the same; soft-capping,
    bidirectional attention and linear RoPE scaling are refused in one line."""
    theirs = hf_config("gemma3").to_dict()
    config = ModelConfig.from_hf_dict(theirs)
    assert (config.rope_theta, config.rope_local_base_freq, config.query_pre_attn_scalar) == (1e6, 1e4, 24)
    assert config.pad_token_id == 0 and config.tie_word_embeddings
    flat = config.to_hf_dict()
    assert flat["hidden_activation"] == "gelu_pytorch_tanh" and "rope_parameters" not in flat
    assert ModelConfig.from_hf_dict(flat) == config
    del flat["layer_types"]
    pattern = ModelConfig.from_hf_dict(flat | {"sliding_window_pattern": 2})
    assert pattern.layer_types == ("sliding_attention", "full_attention") * 2
    assert ModelConfig.named("gemma-3-1b").num_params() == 999_885_952  # the published count
    refused = [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope_type='linear'"),
        ({"hidden_activation": "silu"}, "hidden_act"),
    ]
    for change, message in refused:
        with pytest.raises(ValueError, match=message) as error:
            ModelConfig.from_hf_dict(flat | change)
        assert "\n" not in str(error.value)
    linear = transformers.Gemma3TextConfig(
        **SHAPE, num_hidden_layers=2, rope_scaling={"rope_type": "linear", "factor": 8.0}
    )
    with pytest.raises(ValueError, match="rope_type='linear'"):
        ModelConfig.from_hf_dict(linear.to_dict())


def test_gpt_oss_config_json_forms_and_refusals() -> None:
    """transformers' GptOssConfig reads as gpt-oss's experts (its count, width, routing and
    clamped SwiGLU), alternating windows and YaRN, and writes back the same; the published
    20b shape has the published parameter count; quantized experts are refused in one line, as
    are vLLM's kernels, which take no attention sinks, even for a model without windows."""
    theirs = transformers.GptOssConfig(num_hidden_layers=4).to_dict()
    config = ModelConfig.from_hf_dict(theirs)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 4, 2880)
    assert (config.swiglu_alpha, config.swiglu_limit, config.sliding_window) == (1.702, 7.0, 128)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2 and config.attention_bias
    assert config.rope_scaling is not None and config.rope_scaling.to_hf_dict()["factor"] == 32.0
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    assert ModelConfig.named("gpt-oss-20b").num_params() == 20_914_757_184  # the published count
    with pytest.raises(ValueError, match="quantized weights") as error:
        ModelConfig.from_hf_dict(theirs | {"quantization_config": {"quant_method": "mxfp4"}})
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="moe_intermediate_size must equal it"):  # config.json has one width
        msgspec.structs.replace(ModelConfig.named("test-gpt-oss"), moe_intermediate_size=64)
    with pytest.raises(ValueError, match="swiglu_alpha and swiglu_limit are not qwen3_moe fields"):
        msgspec.structs.replace(ModelConfig.named("test-qwen3-moe"), swiglu_alpha=1.0, swiglu_limit=7.0)
    full = msgspec.structs.replace(
        ModelConfig.named("test-gpt-oss"), layer_types=("full_attention", "full_attention")
    )
    assert not full.windowed
    assert select_backend(full, "cpu", torch.float32).attention == "torch"
    with pytest.raises(ValueError, match="attention sinks"):
        select_backend(full, "cpu", torch.float32, kernels="vllm")


@pytest.mark.parametrize(
    "case", ["llama3-tied", "llama-untied-bias", "mistral-window", "smollm3", "olmo3", "olmo2", "gpt-oss"]
)
def test_peft_loads_our_adapter_onto_transformers(tmp_path, case: str) -> None:
    """An adapter trained here (every target), saved in PEFT's layout, gives our logits on
    transformers' model of the family (the window, the layers without RoPE and OLMo's q/k
    projections under their whole-projection norms included)."""
    pytest.importorskip("peft")
    # gpt-oss's MLPs are experts (stacked tensors, not linears): LoRA on its attention projections
    lora = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]} if case == "gpt-oss" else {}
    base_logits, mine, theirs = peft_logits(hf_model(case, seed=6), tmp_path, **lora)
    assert (mine - base_logits).abs().max() > 1e-3  # the adapters matter
    assert (theirs - mine).abs().max().item() <= 1e-4
