"""What is OLMo's own among the native families (OLMo 3 `olmo3`, OLMo 2 `olmo2`): its config.json
forms, defaults and refusals, the published shape's parameter count (transformers' count), and the
backend's refusal of fused layers. Its parity with transformers (logits, greedy generation, training
and SFT steps, checkpoints both ways, PEFT adapters) is tested as cases of
tests/agents/model/test_model_families.py, whose tiny configs these tests read."""

from __future__ import annotations

import pytest
import torch
from test_model_families import OLMO_SHAPE, WINDOW, hf_config, per_type_rope

from toolgym.agents.engine.backend import select_backend
from toolgym.agents.kernels.packed_linear import packing_available
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import Transformer

transformers = pytest.importorskip("transformers")


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
    published_form = transformers.Olmo3Config(**OLMO_SHAPE, num_hidden_layers=4, rope_scaling=yarn).to_dict()
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
