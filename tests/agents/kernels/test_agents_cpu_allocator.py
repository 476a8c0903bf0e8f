"""agents/kernels/cpu_allocator.py: glibc malloc keeps freed memory, so the engine's large CPU temporaries
stop paying page faults; a process that chose its allocator is left alone."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest
import torch

import toolgym.agents.engine.backend as backend_module
import toolgym.agents.engine.engine as engine_module
from toolgym.agents.kernels import cpu_allocator
from toolgym.agents.model.transformer import build_model

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only"
)

# A bf16 RMSNorm of a bench-3m prefill's activations: the minor page faults it costs once warm,
# first with glibc's mmap threshold pinned at its initial 128 KiB (untuned glibc moves it with the
# allocation history, so its faults vary from run to run: 0-4,000 a call were seen), then after
# keep_freed_memory().
FAULTS = """
import ctypes, resource, torch
import torch.nn.functional as F
from toolgym.agents.kernels.cpu_allocator import M_MMAP_THRESHOLD, keep_freed_memory

def faults_per_norm():
    x = torch.randn(64, 128, 256).bfloat16()
    for _ in range(3):
        F.rms_norm(x, (256,), None, 1e-6)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        F.rms_norm(x, (256,), None, 1e-6)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10

assert ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 << 10) == 1
pinned = faults_per_norm()
assert keep_freed_memory()
print(pinned, faults_per_norm())
"""


@glibc
def test_freed_temporaries_are_reused_without_page_faults() -> None:
    # 4 MB of bf16 in, fp32 temporaries of 8 MB: each a fresh mmap (~2,000 pages) when pinned.
    # A fresh process: the setting is process-wide, and this one may have made it already.
    out = subprocess.run(
        [sys.executable, "-c", FAULTS], capture_output=True, text=True, check=True, timeout=120
    )
    pinned, tuned = map(float, out.stdout.split())
    assert pinned > 1000
    assert tuned < pinned / 20


@pytest.mark.parametrize(
    "environment",
    [
        {"TOOLGYM_MALLOC_TUNING": "0"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
    ],
)
def test_an_allocator_the_process_chose_is_left_alone(monkeypatch, environment) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: pytest.fail("mallopt called"))
    cpu_allocator.keep_freed_memory.cache_clear()
    try:
        assert cpu_allocator.keep_freed_memory() is False
    finally:
        cpu_allocator.keep_freed_memory.cache_clear()


def test_a_cpu_engine_sets_it_and_a_gpu_one_does_not(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(backend_module, "keep_freed_memory", lambda: calls.append(1) or True)
    with engine_module.TorchEngine(build_model("test", seed=0), max_batch_size=1, max_seq_len=16):
        pass
    assert calls == [1]
    if torch.cuda.is_available():
        with engine_module.TorchEngine(
            build_model("test", seed=0), max_batch_size=1, max_seq_len=16, device="cuda"
        ):
            pass
        assert calls == [1]
