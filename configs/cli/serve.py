"""`toolgym serve`: a checkpoint as the OpenAI-compatible endpoint (rollouts/endpoint/server.py),
which also answers vLLM's `prompt_logprobs` from the same checkpoint in float32
(rollouts/endpoint/prompt_logprobs.py): an on-policy distillation teacher (`distill.teacher =
"http://host:port/v1"`)."""

from __future__ import annotations

from typing import Any

from ...agents.tokenizer import tokenizer_fingerprint
from ...rollouts.endpoint.capture import ENDPOINT_ENV_ID
from ...rollouts.endpoint.prompt_logprobs import PromptScorer
from ...rollouts.endpoint.server import EndpointConfig, PolicyServer
from ...rollouts.recording.format import RecordingHeader, RecordingWriter
from ..assembly.parts import ORACLE, load_policy, policy_renderer


def serve_command(
    console: Any,
    policy_spec: str,
    tokenizer_path: str,
    chat_template: str = "",
    config: EndpointConfig | None = None,
    record: str | None = None,
) -> int:
    """`toolgym serve`: a checkpoint directory served by the torch engine until interrupted;
    with `record`, every finished or (at shutdown) incomplete conversation is appended there."""
    if policy_spec == ORACLE:
        raise ValueError("--policy must be a checkpoint directory (the oracle plays envs, not conversations)")
    renderer = policy_renderer(policy_spec, tokenizer_path, chat_template)
    policy, policy_id = load_policy(policy_spec, renderer)
    writer = None
    if record:
        header = RecordingHeader(
            tokenizer_fingerprint=tokenizer_fingerprint(renderer.tokenizer),
            env_id=ENDPOINT_ENV_ID,
            policy_id=policy_id,
        )
        writer = RecordingWriter(record, header)
    scorer = PromptScorer(policy_spec, lambda token: renderer.decode([token]))
    server = PolicyServer(policy, renderer, config, writer, scorer)
    try:
        server.run(lambda url: console.print(f"serving {policy_id} at {url} (Ctrl+C stops)", soft_wrap=True))
    finally:
        policy.close()
        if writer is not None:
            writer.close()
    captured = server.captures.finished
    console.print(f"stopped: {captured} conversations captured ({server.captures.incomplete} incomplete)")
    return 0
