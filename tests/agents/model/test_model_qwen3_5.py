"""Qwen3.5's hybrid decoder (agents/model/linear_attention.py, families/qwen3_5.py) against
transformers' Qwen3_5ForCausalLM, built from its own config class with random weights at a tiny
shape (no download): the chunked gated delta rule equals the token-at-a-time one (any chunk size,
from any state), logits on a ragged batch longer than a chunk within 1e-4 in float32, checkpoints
both ways, one training step's loss and gradients, the Trainer on such a model (its shared-prefix
batching off), a PEFT adapter loaded by `peft`, the published shape's parameter count, and what
is refused (the fields on other families). The torch engine keeps each slot's recurrent state:
its greedy decode is transformers' over 64 tokens with a prefix computed once and one reused
from the prefix store, a seeded sample is the same whatever batch it shares (slot moves, n
samples of one prefill), and its logprobs are the trainer's."""

from __future__ import annotations

import pytest
import torch
from parity_testlib import hf_greedy, ours_from, peft_logits, ragged_batch

from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.checkpoint import save_hf_checkpoint
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.linear_attention import gated_delta_chunked, gated_delta_recurrent
from toolgym.agents.model.lora import LINEAR_ATTENTION_TARGETS, LORA_TARGETS
from toolgym.agents.model.transformer import build_model, causal_lm_logprobs
from toolgym.agents.types import SamplingParams
from toolgym.rollouts.types import Episode
from toolgym.trainers.config import TrainerConfig
from toolgym.trainers.trainer import Trainer

transformers = pytest.importorskip("transformers")


def hf_model(tie: bool = False, layer_types: list[str] | None = None):
    """transformers' Qwen3.5 text model at a tiny shape: three Gated DeltaNet layers (2 key heads
    serving 4 value heads), then a gated full-attention layer rotating a quarter of each head;
    the norms and decay parameters moved off their initial values."""
    config = transformers.Qwen3_5TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, tie_word_embeddings=tie, layer_types=layer_types,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    )  # fmt: skip
    torch.manual_seed(1)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name or "conv1d" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _rule_inputs(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, H, dk, dv = 2, 3, 8, 6
    q = torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=g), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=g), dim=-1)
    v = torch.randn(B, T, H, dv, generator=g)
    decay = -torch.rand(B, T, H, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    return q, k, v, decay, beta, torch.randn(B, H, dk, dv, generator=g)


@pytest.mark.parametrize(("T", "chunk"), [(150, 64), (64, 64), (7, 64), (33, 4)])
def test_the_chunked_rule_is_the_recurrent_one(T, chunk):
    q, k, v, decay, beta, state = _rule_inputs(T)
    for start in (None, state):
        step_out, step_state = gated_delta_recurrent(q, k, v, decay, beta, start)
        out, final = gated_delta_chunked(q, k, v, decay, beta, start, chunk=chunk)
        torch.testing.assert_close(out, step_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(final, step_state, atol=2e-5, rtol=1e-4)
    # A sequence split in two, the second half from the first's state, is the whole sequence.
    half = T // 2
    first, middle = gated_delta_chunked(
        q[:, :half], k[:, :half], v[:, :half], decay[:, :half], beta[:, :half], chunk=chunk
    )
    second, end = gated_delta_chunked(
        q[:, half:], k[:, half:], v[:, half:], decay[:, half:], beta[:, half:], middle, chunk=chunk
    )
    whole, whole_end = gated_delta_chunked(q, k, v, decay, beta, chunk=chunk)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(end, whole_end, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers_on_a_ragged_batch_longer_than_a_chunk(tmp_path, tie):
    hf = hf_model(tie)
    ours = ours_from(hf, tmp_path)
    assert [ours.config.layer_linear(i) for i in range(4)] == [True, True, True, False]
    assert ours.config.rotary_dim == 8
    tokens, mask = ragged_batch(128, (100, 70, 9))
    with torch.no_grad():
        expected = hf(tokens, attention_mask=mask).logits
        got = ours(tokens)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=1e-4)


def test_a_multimodal_checkpoint_reads_as_its_text_model(tmp_path):
    """Qwen3.5 as published: Qwen3_5ForConditionalGeneration (model_type "qwen3_5"), the text
    model under `model.language_model.*` beside a vision tower. It loads as the text model (the
    tower unread) with transformers' text logits, and a pool opponent's sync reads the same."""
    from toolgym.agents.model.checkpoint import load_config, load_hf_checkpoint
    from toolgym.configs.assembly.loop import checkpoint_weights

    text = hf_model().config.to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=1)  # fmt: skip
    torch.manual_seed(3)
    hf = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    ).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    hf.save_pretrained(tmp_path / "mm")
    config = load_config(tmp_path / "mm")
    assert config.model_type == "qwen3_5_text" and config.layer_linear(0) and not config.tie_word_embeddings
    ours = load_hf_checkpoint(tmp_path / "mm")
    tokens, _ = ragged_batch(128, (90,))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(input_ids=tokens).logits, atol=1e-4, rtol=1e-4)
    names = {n for n, _ in checkpoint_weights(str(tmp_path / "mm"))}
    assert names == {n for n, _ in ours.named_parameters()}  # text names; no model.visual.*


def test_checkpoints_both_ways(tmp_path):
    hf = hf_model(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    ours = ours_from(hf, tmp_path)
    assert ours.config.layer_types == ("linear_attention", "full_attention") * 2
    save_hf_checkpoint(ours, ours.config, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back).__name__ == "Qwen3_5ForCausalLM"
    assert back.config.layer_types == list(ours.config.layer_types)
    tokens, _ = ragged_batch(128, (80,))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, ours(tokens), atol=1e-5, rtol=1e-5)


def test_a_training_step_matches_transformers(tmp_path):
    hf = hf_model().train()
    ours = ours_from(hf, tmp_path).train()
    tokens, _ = ragged_batch(128, (90,))
    loss_hf = -transformers_logprobs(hf, tokens).mean()
    loss_ours = -causal_lm_logprobs(ours, tokens).mean()
    torch.testing.assert_close(loss_ours, loss_hf, atol=1e-5, rtol=1e-5)
    loss_hf.backward()
    loss_ours.backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, theirs[name].grad, atol=1e-5, rtol=1e-3, msg=name)


def transformers_logprobs(hf, tokens: torch.Tensor) -> torch.Tensor:
    logits = hf(tokens).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def test_the_trainer_computes_each_row_whole():
    """Episodes that share a prompt: the Trainer does not attend to the prefix as k/v (the linear
    layers' state is not k/v); its logprobs are the plain forward's, and a step trains."""
    model = build_model("test-qwen3.5", seed=0)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (40,), generator=g).tolist()
    episodes = []
    for i in range(4):
        tail = torch.randint(0, 256, (10 + 3 * i,), generator=g).tolist()
        mask = [0] * len(prompt) + [1] * len(tail)
        episodes.append(
            Episode(prompt + tail, mask, [-5.0 * m for m in mask], [float(i % 2) * m for m in mask])
        )
    trainer = Trainer(model, TrainerConfig(micro_batch_tokens=4096))
    assert trainer.config.share_prefix and not trainer._share_prefix
    got = trainer.compute_logprobs(episodes)
    for episode, row in zip(episodes, got, strict=True):
        with torch.no_grad():
            expected = causal_lm_logprobs(model, torch.tensor([episode.tokens]))[0]
        torch.testing.assert_close(torch.tensor(row[1:]), expected, atol=1e-5, rtol=1e-5)
    metrics = trainer.train_step(episodes)
    assert metrics["grad_norm"] > 0 and metrics["skipped"] == 0.0


@pytest.mark.parametrize("linear_layers", [False, True], ids=["attention+mlp", "with-deltanet"])
def test_peft_loads_our_adapter_onto_transformers(tmp_path, linear_layers):
    targets = list(LORA_TARGETS) + (list(LINEAR_ATTENTION_TARGETS) if linear_layers else [])
    base, ours, theirs = peft_logits(hf_model(), tmp_path, target_modules=targets)
    assert (ours - base).abs().max() > 1e-3  # the adapters change the output
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_the_published_shape_has_transformers_parameter_count():
    with torch.device("meta"):
        hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig())
    assert ModelConfig.named("qwen3.5-9b").num_params() == sum(p.numel() for p in hf.parameters())
    ours = build_model("test-qwen3.5")
    assert sum(p.numel() for p in ours.parameters()) == ModelConfig.named("test-qwen3.5").num_params()


def _prompts(seed: int, vocab: int, tails=(5, 40, 1)) -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(0, vocab, (30,), generator=g).tolist()
    return common, [common + torch.randint(0, vocab, (n,), generator=g).tolist() for n in tails]


def test_engine_greedy_matches_transformers_from_a_shared_and_a_stored_prefix(tmp_path):
    hf = hf_model()
    engine = TorchEngine(ours_from(hf, tmp_path), max_batch_size=8, max_seq_len=256)
    assert engine.cache.history_capacity == 0 and engine.backend.attention == "torch"
    common, prompts = _prompts(0, 128)
    greedy = SamplingParams(max_tokens=64, temperature=0)
    for prompt, completion in zip(prompts, engine.generate_sync(prompts, greedy), strict=True):
        assert completion.tokens == hf_greedy(hf, prompt, 64)
    assert engine.stats.shared_prefix_tokens == 2 * 30  # computed once for three prompts
    later = [[*common, 3, 4], [*common[:20], 5]]  # the whole stored prefix; a part of it (recomputed)
    for prompt in later:
        (completion,) = engine.generate_sync([prompt], greedy)
        assert completion.tokens == hf_greedy(hf, prompt, 64)
    assert engine.stats.shared_prefix_tokens == 3 * 30


def test_engine_samples_alike_whatever_the_batch_and_logprobs_are_the_trainers():
    model = build_model("test-qwen3.5", seed=0)
    _, prompts = _prompts(1, 256, (3, 17, 9))
    params = SamplingParams(max_tokens=24, n=3, seed=11, stop_token_ids=tuple(range(3, 256, 16)))
    together = TorchEngine(model, max_batch_size=4, max_seq_len=128).generate_sync(prompts, params)
    alone = TorchEngine(model, max_batch_size=1, max_seq_len=128, share_prefixes=False)
    one_by_one = [c for prompt in prompts for c in alone.generate_sync([prompt], params)]
    assert [c.tokens for c in together] == [c.tokens for c in one_by_one]
    assert len({len(c.tokens) for c in together}) > 1  # samples finished at different steps
    episodes = []
    for i, completion in enumerate(together):
        prompt = prompts[i // 3]
        mask = [0] * len(prompt) + [1] * len(completion.tokens)
        episodes.append(
            Episode(
                prompt + completion.tokens, mask, [0.0] * len(prompt) + completion.logprobs, [0.0] * len(mask)
            )
        )
    trainer = Trainer(model, TrainerConfig())
    for episode, row in zip(episodes, trainer.compute_logprobs(episodes, temperature=1.0), strict=True):
        mask = torch.tensor(episode.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(
            torch.tensor(row)[mask], torch.tensor(episode.sampler_logprobs)[mask], atol=1e-4, rtol=1e-4
        )


def test_what_is_refused():
    base = ModelConfig.named("test-qwen3.5")
    fields = msgspec_fields(base)
    with pytest.raises(ValueError, match="must be a multiple of linear_num_key_heads"):
        ModelConfig(**(fields | {"linear_num_value_heads": 3}))
    with pytest.raises(ValueError, match="qwen3_5_text needs linear_num_key_heads"):
        ModelConfig(**(fields | {"linear_conv_kernel_dim": 0}))
    qwen3 = msgspec_fields(ModelConfig.named("test-qwen3"))
    with pytest.raises(ValueError, match="are not qwen3 fields"):
        ModelConfig(**(qwen3 | {"linear_num_key_heads": 2}))
    with pytest.raises(ValueError, match="partial_rotary_factor is not a qwen3 field"):
        ModelConfig(**(qwen3 | {"partial_rotary_factor": 0.5}))
    with pytest.raises(ValueError, match="linear_attention layers are not a gemma3_text field"):
        gemma = msgspec_fields(ModelConfig.named("test-gemma3"))
        ModelConfig(**(gemma | {"layer_types": ("linear_attention", "full_attention", "sliding_attention")}))


def msgspec_fields(config: ModelConfig) -> dict:
    import msgspec

    return msgspec.structs.asdict(config)
