"""vLLM's paged CPU attention as the float32 cache's attention (agents/kernels/paged_attention.py):
it writes a decode step's k/v where torch's "ds" decode writes them and attends to what each row
may see, in every mode the cache has (decode, prefill after a prefix, the kept last query,
continue after a history); slots of any length (padded to the kernel's blocks); any thread."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from agents_testlib import make_model, require_vllm_cpu_kernels

from toolgym.agents.engine.backend import select_backend
from toolgym.agents.engine.cache_attention import Forwards
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.engine.kv_cache import KVCache
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import causal_lm_logprobs
from toolgym.agents.types import SamplingParams

CONFIG = ModelConfig.named("test")
HEADS, KV_HEADS, D = CONFIG.num_attention_heads, CONFIG.num_key_value_heads, CONFIG.head_dim


def caches(slots: int, seq: int) -> dict[str, KVCache]:
    """A float32 "ds" cache of each: vLLM's paged attention and torch's batched matmuls."""
    require_vllm_cpu_kernels()
    made = {
        name: KVCache(
            CONFIG, slots, seq, select_backend(CONFIG, "cpu", torch.float32, key_layout="ds", kernels=name)
        )
        for name in ("vllm", "torch")
    }
    assert made["vllm"].backend.attention == "vllm-paged" and made["torch"].backend.attention == "torch"
    return made


def fill(made: dict[str, KVCache], generator: torch.Generator) -> None:
    """The same random k/v in every cache (and the same in the first 5 positions of every slot: a
    prefix), so anything the kernel reads that it should not changes its output."""
    k_all = torch.randn(made["torch"].k.shape, generator=generator)
    v_all = torch.randn(made["torch"].v.shape, generator=generator)
    k_all[..., :5], v_all[..., :5, :] = k_all[:, :1, ..., :5], v_all[:, :1, ..., :5, :]
    for cache in made.values():
        cache.k.copy_(k_all)
        cache.v.copy_(v_all)


def reference(cache: KVCache, layer: int, slot: int, q_rows: torch.Tensor, length: int, causal_from: int):
    """float64 attention of queries [H, n, D] over slot positions 0..length-1 of a "ds" cache, query j
    seeing positions up to causal_from + j."""
    keys = cache.k[layer, slot, :, :, :length].transpose(-1, -2).double()
    values = cache.v[layer, slot, :, :length].double()
    mask = torch.arange(length)[None, :] <= causal_from + torch.arange(q_rows.shape[1])[:, None]
    return F.scaled_dot_product_attention(q_rows.double(), keys, values, attn_mask=mask, enable_gqa=True)


def test_decode_writes_and_attends_like_torchs() -> None:
    # Rows at position 0, at the slot's last position and in between, slots filled out of order of
    # length; the positions after each row's own hold values that would swamp the result if read.
    made = caches(slots=5, seq=32)
    generator = torch.Generator().manual_seed(0)
    fill(made, generator)
    positions = torch.tensor([3, 0, 31, 7])
    for row, position in enumerate(positions.tolist()):
        for cache in made.values():
            cache.k[:, row, ..., position + 1 :] = 1e4
            cache.v[:, row, :, position + 1 :] = 1e4
    before = made["vllm"].k.clone(), made["vllm"].v.clone()
    steps = {
        name: Forwards(cache, CONFIG).decode(positions, span=int(positions.max()) + 1)
        for name, cache in made.items()
    }
    n = len(positions)
    for layer in range(CONFIG.num_hidden_layers):
        q = torch.randn(n, HEADS, 1, D, generator=generator)
        k, v = (
            torch.randn(n, KV_HEADS, 1, D, generator=generator),
            torch.randn(n, KV_HEADS, 1, D, generator=generator),
        )
        got, torchs = steps["vllm"].attend(layer, q, k, v), steps["torch"].attend(layer, q, k, v)
        cache = made["vllm"]
        assert torch.equal(cache.k[layer], made["torch"].k[layer])
        assert torch.equal(cache.v[layer], made["torch"].v[layer])
        for row, position in enumerate(positions.tolist()):
            assert torch.equal(cache.k[layer, row, :, :, position], k[row, :, 0])
            expected = reference(cache, layer, row, q[row], position + 1, causal_from=position)
            torch.testing.assert_close(got[row].double(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, torchs, atol=1e-5, rtol=1e-5)
    # The other slot and the prefix store are untouched.
    assert torch.equal(made["vllm"].k[:, n:], before[0][:, n:])
    assert torch.equal(made["vllm"].v[:, n:], before[1][:, n:])


def test_new_tokens_attend_after_prefixes_and_histories() -> None:
    # A prefill after a 5-token prefix whose rows fill 2, 1 and 2 slots (n samples), then its kept
    # last queries; a continue after histories of 4, 0 and 25 positions with 3, 5 and 7 new tokens
    # (padded to 7: the third row ends at its slot's last position, where padding would run past).
    made = caches(slots=6, seq=32)
    generator = torch.Generator().manual_seed(1)
    fill(made, generator)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731

    def attend_both(start, q, k, v, layer):
        outputs = []
        for cache in made.values():
            outputs.append(start(Forwards(cache, CONFIG)).attend(layer, q, k, v))
        assert torch.equal(made["vllm"].k, made["torch"].k) and torch.equal(made["vllm"].v, made["torch"].v)
        return outputs, made["vllm"]

    source_rows, keep = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([6, 3, 4])
    start = lambda forwards: forwards.prefill(7, 1, source_rows, prefix_len=5, keep=keep)  # noqa: E731
    q, k, v = randn(3, HEADS, 7, D), randn(3, KV_HEADS, 7, D), randn(3, KV_HEADS, 7, D)
    (got, torchs), cache = attend_both(start, q, k, v, layer=0)
    for row, slot in enumerate([1, 3, 4]):  # the first slot each row filled
        expected = reference(cache, 0, slot, q[row], 12, causal_from=5)
        torch.testing.assert_close(got[row].double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, torchs, atol=1e-5, rtol=1e-5)
    q_kept = randn(3, HEADS, 1, D)  # the last layer: one query per row, at keep[row]
    (got, torchs), cache = attend_both(start, q_kept, randn(3, KV_HEADS, 7, D), randn(3, KV_HEADS, 7, D), 1)
    for row, slot in enumerate([1, 3, 4]):
        position = 5 + int(keep[row])
        expected = reference(cache, 1, slot, q_kept[row], position + 1, causal_from=position)
        torch.testing.assert_close(got[row].double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, torchs, atol=1e-5, rtol=1e-5)

    history, own = [4, 0, 25], [3, 5, 7]
    start = lambda forwards: forwards.continue_(0, history, own)  # noqa: E731
    q, k, v = randn(3, HEADS, 7, D), randn(3, KV_HEADS, 7, D), randn(3, KV_HEADS, 7, D)
    (got, torchs), cache = attend_both(start, q, k, v, layer=0)
    for row in range(3):
        n = own[row]  # padding queries' outputs are never read (the paged kernel leaves them zero)
        expected = reference(cache, 0, row, q[row, :, :n], history[row] + n, causal_from=history[row])
        torch.testing.assert_close(got[row, :, :n].double(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[row, :, :n], torchs[row, :, :n], atol=1e-5, rtol=1e-5)
    q_kept = randn(3, HEADS, 1, D)
    (got, _), cache = attend_both(start, q_kept, randn(3, KV_HEADS, 7, D), randn(3, KV_HEADS, 7, D), 1)
    for row in range(3):
        end = history[row] + own[row]
        expected = reference(cache, 1, row, q_kept[row], end, causal_from=end - 1)
        torch.testing.assert_close(got[row].double(), expected, atol=1e-5, rtol=1e-5)


def test_slots_are_padded_to_the_kernels_blocks_and_the_engine_samples_the_models_logprobs() -> None:
    # 40 positions a sequence: the slots hold 64 (the kernel reads a slot as one block of a
    # multiple of 32); the context limit stays 40.
    require_vllm_cpu_kernels()
    model = make_model()
    prompts = [[(5 * i + j) % 250 + 1 for j in range(length)] for i, length in enumerate([3, 30, 12])]
    with TorchEngine(model, max_batch_size=4, max_seq_len=40) as engine:
        assert engine.cache.backend.attention == "vllm-paged"
        assert engine.cache.k.shape[-1] == engine.cache.v.shape[-2] == 64
        completions = engine.generate_sync(prompts, SamplingParams(max_tokens=64, seed=3))
    for prompt, completion in zip(prompts, completions, strict=True):
        assert len(prompt) + len(completion.tokens) == 40 and completion.finish_reason == "length"
        with torch.no_grad():
            expected = causal_lm_logprobs(model, torch.tensor([prompt + completion.tokens]))[
                0, len(prompt) - 1 :
            ]
        assert (torch.tensor(completion.logprobs) - expected).abs().max().item() <= 1e-5


def test_a_thread_that_never_ran_torch_decodes() -> None:
    # The kernel's schedule is made for OpenMP's thread count; in a fresh thread that count is
    # OpenMP's default until torch first sets it to torch's own (in the forward's first GEMM, after
    # Forwards.decode made the schedule). With torch at one thread, the schedule was made for two and
    # the kernel refused to run ("thread_num (2 vs. 1)").
    made = caches(slots=2, seq=32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result: list = []

        def decode() -> None:
            step = Forwards(made["vllm"], CONFIG).decode(torch.tensor([3, 9]), span=10)
            torch.get_num_threads()  # what the forward's first GEMM does before the attention
            zeros = torch.zeros(2, KV_HEADS, 1, D)
            result.append(step.attend(0, torch.randn(2, HEADS, 1, D), zeros, zeros))

        worker = threading.Thread(target=decode)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert len(result) == 1 and result[0].shape == (2, HEADS, 1, D)
