"""Command-line settings -> parts: the renderer and the policy a command's `--policy`,
`--tokenizer` and `--chat-template` name (`toolgym record`, `eval`, `serve`).
"""

from __future__ import annotations

import os
from pathlib import Path

from ...agents.chat import ChatRenderer, Renderer
from ...agents.policy import Policy
from ...agents.tokenizer import load_tokenizer
from ...rollouts.scripted import OracleConfig, OraclePolicy

ORACLE = "oracle"


def load_renderer(
    policy_spec: str, tokenizer_path: str | os.PathLike, chat_template: str | os.PathLike[str] = ""
) -> Renderer:
    """The renderer for a policy: a checkpoint directory's own tokenizer.json if it has one; plain
    ChatML, or the chat template of `chat_template` (a tokenizer_config.json or .jinja file; one
    that cannot be used raises ChatTemplateError, a ValueError naming the file)."""
    own = Path(policy_spec) / "tokenizer.json"
    tokenizer = load_tokenizer(own if policy_spec != ORACLE and own.is_file() else tokenizer_path)
    if not chat_template:
        return ChatRenderer(tokenizer)
    from ...agents.chat_template import TemplateRenderer, load_chat_template

    return TemplateRenderer(tokenizer, load_chat_template(chat_template))


def load_policy(
    policy_spec: str, renderer: Renderer, oracle: OracleConfig | None = None, device: str = "cpu"
) -> tuple[Policy, str]:
    """`oracle` (the env's scripted oracle with `oracle` knobs) or a Hugging Face checkpoint
    directory served by the torch engine. Returns the policy and an id for recording headers."""
    if policy_spec == ORACLE:
        policy = OraclePolicy(renderer, oracle)
        return policy, policy.policy_id
    path = Path(policy_spec)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--policy must be 'oracle' or a checkpoint directory with config.json, got {policy_spec}"
        )
    from ...agents.engine.engine import TorchEngine
    from ...agents.model.checkpoint import load_hf_checkpoint

    model = load_hf_checkpoint(path, device=device)
    return TorchEngine(model, tokenizer=renderer.tokenizer), f"checkpoint:{path.resolve()}"

