"""YaRN RoPE (rope_type "yarn") against transformers, from its own config classes with random
weights at tiny shapes (no download), on sequences longer than original_max_position_embeddings:
the cos/sin tables equal to transformers' `_compute_yarn_parameters` times its attention factor,
logits within 1e-4 in float32 (OLMo 3 with YaRN on its full-attention layers and default RoPE on its
sliding ones, as published; Qwen2/3, Llama, Mistral), TorchEngine's greedy generation
token-identical to transformers' over 40 tokens, config.json read and written back in the form
transformers' config classes read, and the mixes still refused."""

from __future__ import annotations

import msgspec
import pytest
import torch
from parity_testlib import hf_greedy, ours_from, ragged_batch

from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.checkpoint import save_hf_checkpoint
from toolgym.agents.model.config import ModelConfig, YarnScaling
from toolgym.agents.model.transformer import Transformer, rope_cos_sin
from toolgym.agents.types import SamplingParams

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

ORIGINAL = 16  # original_max_position_embeddings: the ragged batch's rows run to 41 tokens
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=None, eos_token_id=2)  # fmt: skip
WINDOW = 5
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL}
# The published Olmo-3-1025-7B's YaRN (its explicit attention_factor = 0.1 * ln 8 + 1).
OLMO_YARN = YARN | {"beta_fast": 32, "beta_slow": 1, "attention_factor": 1.2079441541679836}
# Llama with the optional fields: no truncation, attention factor from mscale / mscale_all_dim.
LLAMA_YARN = YARN | {"factor": 4.0, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5,
                     "truncate": False}  # fmt: skip
OLMO3_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def hf_config(case: str):
    """transformers' own config of each tested variant (tiny)."""
    if case == "olmo3-published":  # YaRN on the full-attention layer, default RoPE on the sliding ones
        rope = {"full_attention": OLMO_YARN | {"rope_theta": 5e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}  # fmt: skip
        return transformers.Olmo3Config(**SHAPE, num_hidden_layers=4, sliding_window=WINDOW,
                                        layer_types=OLMO3_LAYERS, rope_parameters=rope)  # fmt: skip
    if case == "olmo3-both":  # the same YaRN on both layer types
        rope = {kind: YARN | {"rope_theta": 1e4} for kind in ("full_attention", "sliding_attention")}
        return transformers.Olmo3Config(**SHAPE, num_hidden_layers=4, sliding_window=WINDOW,
                                        layer_types=OLMO3_LAYERS, rope_parameters=rope)  # fmt: skip
    if case == "qwen3":
        return transformers.Qwen3Config(**SHAPE, num_hidden_layers=2, tie_word_embeddings=False,
                                        rope_parameters=YARN | {"rope_theta": 1e4})  # fmt: skip
    if case == "qwen2":  # the older flat form: rope_theta beside rope_scaling
        return transformers.Qwen2Config(**SHAPE, num_hidden_layers=2, rope_theta=1e4, rope_scaling=dict(YARN))
    if case == "llama":
        return transformers.LlamaConfig(
            **SHAPE, num_hidden_layers=2, rope_parameters=LLAMA_YARN | {"rope_theta": 1e4}
        )
    if case == "mistral":
        return transformers.MistralConfig(**SHAPE, num_hidden_layers=2, sliding_window=None,
                                          rope_parameters=YARN | {"rope_theta": 1e4, "factor": 2.0})  # fmt: skip
    raise KeyError(case)


CASES = ["olmo3-published", "olmo3-both", "qwen3", "qwen2", "llama", "mistral"]


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


@pytest.mark.parametrize(
    "rope",
    [
        YARN,
        OLMO_YARN,
        LLAMA_YARN,
        YARN | {"factor": 1.0},  # no attention factor (1.0) and every frequency its own
        YARN | {"attention_factor": 0.5, "beta_fast": 8, "truncate": True},
    ],
)
def test_tables_are_transformers_yarn_frequencies_and_attention_factor(rope: dict) -> None:
    """cos / sin over 0..299 = cos / sin of positions x transformers' inv_freq, times its
    attention factor (sin sign-folded in its first half)."""
    config = transformers.Qwen2Config(**SHAPE, rope_parameters=rope | {"rope_theta": 1e4})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    scaling = ModelConfig.from_hf_dict(config.to_dict()).rope_scaling
    assert isinstance(scaling, YarnScaling) and scaling.attention_scaling == attention_factor
    positions = torch.arange(300)
    cos, sin = rope_cos_sin(positions, 32, 1e4, torch.float32, scaling)
    angles = positions[:, None].float() * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    assert torch.allclose(cos, emb.cos() * attention_factor, atol=1e-6, rtol=0)
    assert torch.allclose(sin[:, 16:], (emb.sin() * attention_factor)[:, 16:], atol=1e-6, rtol=0)
    assert torch.allclose(sin[:, :16], -(emb.sin() * attention_factor)[:, :16], atol=1e-6, rtol=0)
    default_cos, _ = rope_cos_sin(positions, 32, 1e4, torch.float32)
    if rope["factor"] > 1:  # the scaling changes the tables
        assert (cos - default_cos).abs().max() > 1e-2


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_past_the_original_context(tmp_path, case: str) -> None:
    hf = hf_model(case)
    ours = ours_from(hf, tmp_path)
    config = ours.config
    assert isinstance(config.rope_scaling, YarnScaling)
    assert config.rope_scaling.original_max_position_embeddings == ORIGINAL
    tokens, mask = ragged_batch(config.vocab_size)  # rows of 41, 30 and 17 tokens
    assert tokens.shape[1] > ORIGINAL
    with torch.no_grad():
        theirs = hf(tokens, attention_mask=mask).logits
        mine = ours(tokens)
    valid = mask.bool()
    assert mine[valid].abs().max() > 1.0
    assert (mine[valid] - theirs[valid]).abs().max().item() <= 1e-4
    # The scaling matters: the same weights with default RoPE give other logits.
    plain = Transformer(msgspec.structs.replace(config, rope_scaling=None)).eval()
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        unscaled = plain(tokens)
    assert (unscaled[valid] - theirs[valid]).abs().max().item() > 1e-2


def test_olmo3_sliding_layers_keep_default_rope() -> None:
    """The published layout: only the full-attention layer rotates with YaRN."""
    config = ModelConfig.from_hf_dict(hf_config("olmo3-published").to_dict())
    assert config.rope_local_base_freq == 5e5 and config.rope_theta == 5e5
    assert [config.layer_rope_local(i) for i in range(4)] == [True, True, False, True]
    both = ModelConfig.from_hf_dict(hf_config("olmo3-both").to_dict())
    assert both.rope_local_base_freq is None and not any(both.layer_rope_local(i) for i in range(4))


@pytest.mark.parametrize("case", ["olmo3-published", "qwen3"])
def test_engine_greedy_matches_transformers_greedy(tmp_path, case: str) -> None:
    """Prompts of 5 and 13 tokens, then 40 decode steps, past original_max_position_embeddings."""
    hf = hf_model(case, seed=1)
    ours = ours_from(hf, tmp_path)
    prompts = [[3, 17, 90, 4, 55], [101, 7, 7, 64, 2, 33, 12, 80, 9, 5, 44, 6, 1]]
    engine = TorchEngine(ours, max_batch_size=2, max_seq_len=96, device="cpu", dtype=torch.float32)
    completions = engine.generate_sync(prompts, SamplingParams(max_tokens=40, temperature=0.0))
    for prompt, completion in zip(prompts, completions, strict=True):
        assert len(prompt) + 40 > ORIGINAL
        assert list(completion.tokens) == hf_greedy(hf, prompt, 40)


@pytest.mark.parametrize("case", CASES)
def test_config_json_round_trip_in_transformers_form(tmp_path, case: str) -> None:
    """Ours read from transformers' config.json and written back: transformers' config class reads
    the same RoPE from ours, and we read ours back as the same config; the checkpoint directory
    loads in transformers with the same logits."""
    theirs = hf_config(case)
    config = ModelConfig.from_hf_dict(theirs.to_dict())
    written = config.to_hf_dict()
    assert ModelConfig.from_hf_dict(written) == config
    reread = type(theirs)(**written)
    assert reread.rope_parameters == theirs.rope_parameters
    hf = hf_model(case, seed=3)
    ours = ours_from(hf, tmp_path)
    save_hf_checkpoint(ours, ours.config, tmp_path / "ours")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    tokens, _ = ragged_batch(config.vocab_size, (33,))
    with torch.no_grad():
        assert (loaded(tokens).logits - ours(tokens)).abs().max().item() <= 1e-4


def test_published_olmo3_forms_read_as_the_named_shape() -> None:
    """Olmo-3-1025-7B's config.json (transformers 4.57's flat rope_theta / rope_scaling) and
    transformers 5's per-layer-type form both read as `olmo-3-7b`'s RoPE."""
    named = ModelConfig.named("olmo-3-7b")
    written = named.to_hf_dict()
    assert written["rope_parameters"]["full_attention"]["rope_type"] == "yarn"
    assert written["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 5e5}
    flat = {k: v for k, v in written.items() if k != "rope_parameters"}
    flat |= {"rope_theta": 5e5, "rope_scaling": OLMO_YARN | {"original_max_position_embeddings": 8192}}
    assert ModelConfig.from_hf_dict(flat) == named
    hf_form = transformers.Olmo3Config(**flat).to_dict()
    assert ModelConfig.from_hf_dict(hf_form) == named
    assert (
        transformers.Olmo3Config(**written).rope_parameters
        == transformers.Olmo3Config(**flat).rope_parameters
    )


def test_toml_override_table_is_yarn() -> None:
    base = dict(SHAPE, num_hidden_layers=2, model_type="qwen3")
    config = ModelConfig(**base, rope_scaling={"rope_type": "yarn", "factor": 4.0,  # type: ignore[arg-type]
                                                "original_max_position_embeddings": 16})  # fmt: skip
    assert config.rope_scaling == YarnScaling(factor=4.0, original_max_position_embeddings=16)


def test_mixes_and_other_families_are_refused_in_one_line() -> None:
    full_default = {"rope_type": "default", "rope_theta": 1e4}
    olmo = hf_config("olmo3-both").to_dict()
    refused = [
        (olmo | {"rope_parameters": {"full_attention": full_default, "sliding_attention": YARN | {"rope_theta": 1e4}}},
         "different RoPE per layer type"),
        (olmo | {"rope_parameters": {"full_attention": YARN | {"rope_theta": 1e4},
                                     "sliding_attention": YARN | {"rope_theta": 1e4, "factor": 2.0}}},
         "different RoPE per layer type"),
        (olmo | {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0},
                                     "sliding_attention": full_default}},
         "rope_type='linear' on the full_attention layers"),
        (ModelConfig(**SHAPE, num_hidden_layers=2, model_type="olmo2").to_hf_dict()
         | {"rope_parameters": YARN | {"rope_theta": 1e4}}, "rope_type='yarn'"),
        (ModelConfig(**SHAPE, num_hidden_layers=4, model_type="smollm3").to_hf_dict()
         | {"rope_scaling": dict(YARN)}, "rope_type='yarn'"),
    ]  # fmt: skip
    for d, message in refused:
        with pytest.raises(ValueError, match=message) as error:
            ModelConfig.from_hf_dict(d)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"rope_scaling \(yarn\) is not a smollm3 field"):
        ModelConfig(**SHAPE, num_hidden_layers=2, model_type="smollm3",
                    rope_scaling=YarnScaling(factor=2.0, original_max_position_embeddings=16))  # fmt: skip
