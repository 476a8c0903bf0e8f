"""Hugging Face checkpoint directories in and out: config.json + safetensors (single or sharded).

A directory written by `save_hf_checkpoint` loads in transformers (`Qwen2ForCausalLM` /
`Qwen3ForCausalLM.from_pretrained(dir)`) and in vLLM, and any HF Qwen2/Qwen3 directory loads
here. tokenizer.json is read by agents/tokenizer.py, not here; we only copy it and write the
small tokenizer_config.json that transformers/vLLM want beside it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .config import ModelConfig
from .families import FAMILIES
from .moe import fuse_experts, split_experts
from .transformer import Transformer

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Keys some HF checkpoints carry that hold nothing we need (recomputed buffers).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def text_model(d: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """config.json's text model and the prefix its weights carry: a multimodal checkpoint whose
    `text_config` is a native family that names it (`Family.multimodal`) reads as that text
    model, tie_word_embeddings as the checkpoint sets it; anything else is (d, None)."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        return d, None
    fam = FAMILIES.get(str(text.get("model_type")))
    if fam is None or fam.multimodal is None or fam.multimodal[0] != d.get("model_type"):
        return d, None
    tie = d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "tie_word_embeddings": tie}, fam.multimodal[1]


def _read_config(path: str | Path) -> tuple[ModelConfig, str | None]:
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no config.json at {file}")
    d, prefix = text_model(json.loads(file.read_text()))
    return ModelConfig.from_hf_dict(d), prefix


def load_config(path: str | Path) -> ModelConfig:
    """ModelConfig from `path/config.json` (or a config.json path); a multimodal checkpoint's
    text model where its family reads one (`text_model`)."""
    return _read_config(path)[0]


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [directory / name for name in sorted(set(weight_map.values()))]
    elif (directory / SAFETENSORS_FILE).is_file():
        files = [directory / SAFETENSORS_FILE]
    else:
        raise FileNotFoundError(
            f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {directory} (only safetensors weights are supported)"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{SAFETENSORS_INDEX} names shard files that do not exist: {missing}")
    return files


def read_safetensors(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in a checkpoint directory, shard by shard, on CPU."""
    for file in _safetensors_files(Path(directory)):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                yield name, f.get_tensor(name)


def read_model(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A checkpoint's ModelConfig and its model's tensors under the text model's HF names (a
    multimodal checkpoint's text weights alone, `text_model`), recomputed buffers left out."""
    config, prefix = _read_config(directory)
    read = {name: tensor for name, tensor in read_safetensors(directory) if not name.endswith(_IGNORED_SUFFIXES)}
    if prefix is not None:
        read = {
            ("model." + name.removeprefix(prefix) if name.startswith(prefix) else name): tensor
            for name, tensor in read.items()
            if name.startswith(prefix) or name == "lm_head.weight"
        }
    return config, read


def load_hf_checkpoint(
    directory: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Transformer:
    """Build a Transformer from a HF directory (config.json + model.safetensors or a sharded
    model.safetensors.index.json). Missing, unexpected or wrongly shaped tensors raise."""
    directory = Path(directory)
    config, read = read_model(directory)
    with torch.device("meta"):
        model = Transformer(config)
    expected = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in fuse_experts(read).items():  # per-expert tensors stacked (agents/model/moe.py)
        if name not in expected:
            raise ValueError(f"{directory}: unexpected tensor {name!r} for a {config.model_type} model")
        if tuple(tensor.shape) != tuple(expected[name]):
            raise ValueError(
                f"{directory}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the config says {tuple(expected[name])}"
            )
        state[name] = tensor.to(device=device, dtype=dtype)
    if config.tie_word_embeddings:
        # HF drops lm_head.weight when tied; if present it must equal the embedding.
        lm_head = state.pop("lm_head.weight", None)
        if lm_head is not None and not torch.equal(lm_head, state.get("model.embed_tokens.weight", lm_head)):
            raise ValueError(f"{directory}: tie_word_embeddings is true but lm_head.weight != embed_tokens")
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(
            f"{directory}: checkpoint is missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model


def hf_state_dict(
    model: nn.Module | Mapping[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """The tensors a HF checkpoint holds: our state_dict minus the tied lm_head, a mixture of
    experts' stacked experts as HF's per-expert tensors."""
    state = dict(model.state_dict() if isinstance(model, nn.Module) else model)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    # (a model run through transformers brings its own config, which names no native family)
    return split_experts(state, config.family.moe_style if isinstance(config, ModelConfig) else "qwen3_moe")


def hf_named_tensors(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for weight sync into a policy (skips the tied lm_head; a mixture of
    experts' stacked experts as HF's per-expert tensors)."""
    tied = model.config.tie_word_embeddings
    for name, param in model.named_parameters():  # named_parameters already skips duplicates
        if tied and name == "lm_head.weight":
            continue
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            yield from split_experts({name: param.detach()}, model.config.family.moe_style).items()
            continue
        yield name, param.detach()


def save_hf_checkpoint(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    config: ModelConfig,
    directory: str | Path,
    tokenizer_path: str | Path | None = None,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    eos_token: str | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write config.json + model.safetensors (or shards + index when `max_shard_bytes` is set).

    With `tokenizer_path` (a tokenizer.json), copy it and write a minimal tokenizer_config.json
    (eos_token: `eos_token`, else <|im_end|> or <|endoftext|> if the vocabulary has them) so
    transformers' AutoTokenizer and vLLM load the directory; `chat_template` (a template's text)
    goes into it, so they render chats as the policy was trained to. `dtype` casts (default: as
    stored).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in hf_state_dict(model_or_state_dict, config).items():
        tensor = tensor.detach().to("cpu")
        state[name] = (tensor.to(dtype) if dtype is not None else tensor).contiguous()
    stored_dtype = next(iter(state.values())).dtype
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(stored_dtype), indent=2) + "\n")
    for stale in (directory / SAFETENSORS_FILE, directory / SAFETENSORS_INDEX):
        stale.unlink(missing_ok=True)
    if max_shard_bytes is None:
        save_file(state, directory / SAFETENSORS_FILE, metadata={"format": "pt"})
    else:
        _save_sharded(state, directory, max_shard_bytes)
    if tokenizer_path is not None:
        _write_tokenizer(Path(tokenizer_path), directory, eos_token, chat_template)
    return directory


def _save_sharded(state: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(
    tokenizer_path: Path, directory: Path, eos_token: str | None, chat_template: str | None = None
) -> None:
    if tokenizer_path.is_dir():
        tokenizer_path = tokenizer_path / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {tokenizer_path}")
    target = directory / "tokenizer.json"
    if tokenizer_path.resolve() != target.resolve():
        shutil.copyfile(tokenizer_path, target)
    specials = {t["content"] for t in json.loads(tokenizer_path.read_text()).get("added_tokens", [])}
    if eos_token is None:
        eos_token = next((t for t in ("<|im_end|>", "<|endoftext|>") if t in specials), None)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "pad_token": "<|endoftext|>" if "<|endoftext|>" in specials else eos_token,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


__all__ = [
    "hf_named_tensors",
    "hf_state_dict",
    "load_config",
    "load_hf_checkpoint",
    "read_safetensors",
    "save_hf_checkpoint",
]
