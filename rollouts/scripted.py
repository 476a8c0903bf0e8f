"""A scripted policy that plays the env's oracle, with knobs for imperfection.

It takes the same path as a model: the runner renders the prompt, the policy returns TOKEN ids
(the action text encoded + `<|im_end|>`, logprob 0.0 each), the runner decodes nothing and gives
`completion.text` to `env.step`, then renders the observation delta. So tests, demos and the SFT
warm-start data (`toolgym record --policy oracle`) exercise the real rollout path.

How it knows the task: tokens alone do not say which seed or table an episode has (two Zorplex
episodes can show the same question over different tables), so the oracle is a privileged
expert. `OraclePolicy` implements `EpisodePolicyFactory`: right after `env.reset` the runner
calls `for_episode(env, seed)`, which reads `env.unwrapped.oracle_actions()` once, plans the
episode's script with an RNG seeded by the episode's sampling seed (so the G samples of a group
draw their knobs independently, and reruns repeat), and returns a per-episode `Policy` that
emits the script one action per `generate` call. Nothing else in the runner knows it is scripted.

Knobs (each drawn once per episode):
- p_skip_lookup: answer at once, without the tool calls, with a guess. The guess is always wrong
  (the answer plus a random offset in 1..9) so the knob means exactly "skipped the tools and got
  it wrong". No effect when the oracle makes no tool calls (e.g. SumDigits).
- p_malformed_call: per tool call, first emit a malformed version of it (`LOOKUP[apple]` ->
  `LOOKUP(apple)`), which the env answers with an error, then the correct call (a recovery).
- p_omit_tag: the final answer is stated without the tag: "The answer is 42.".
When the env keeps going after the script ends (e.g. after extra errors), the last action is
repeated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import gymnasium
import msgspec
import numpy as np
import torch

from ..agents.chat import ChatRenderer
from ..agents.types import Completion, SamplingParams

_ANSWER_RE = re.compile(r"^\[ANSWER\]\s*(-?\d+)\s*$")
_CALL_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\[([^\[\]\n]*)\]")


class OracleConfig(msgspec.Struct, frozen=True):
    p_omit_tag: float = 0.0
    p_skip_lookup: float = 0.0
    p_malformed_call: float = 0.0

    def __post_init__(self) -> None:
        for name in ("p_omit_tag", "p_skip_lookup", "p_malformed_call"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(
                    f"OracleConfig.{name} must be a probability in [0, 1], got {getattr(self, name)}"
                )


def malformed(action: str) -> str:
    """The first tool call in `action` with parentheses instead of brackets: a malformed call."""
    return _CALL_RE.sub(r"\1(\2)", action, count=1)


def plan_actions(oracle: Sequence[str], config: OracleConfig, rng: np.random.Generator) -> list[str]:
    """The episode's script: the oracle's actions with the knobs applied."""
    if not oracle:
        raise ValueError("the env's oracle returned no actions")
    match = _ANSWER_RE.match(oracle[-1])
    if match is None:
        raise ValueError(f"the oracle's last action must be '[ANSWER] <n>', got {oracle[-1]!r}")
    answer = int(match.group(1))
    calls = list(oracle[:-1])
    # Draw every knob every episode, so one knob's value does not shift the others' draws.
    skip = rng.random() < config.p_skip_lookup
    omit_tag = rng.random() < config.p_omit_tag
    guess = answer + int(rng.integers(1, 10))
    malformed_flags = rng.random(len(calls)) < config.p_malformed_call
    script: list[str] = []
    if skip and calls:
        answer = guess
    else:
        for call, bad in zip(calls, malformed_flags, strict=True):
            broken = malformed(call)
            if bad and broken != call:
                script.append(broken)
            script.append(call)
    script.append(f"The answer is {answer}." if omit_tag else f"[ANSWER] {answer}")
    return script


class ScriptedEpisodePolicy:
    """Plays a fixed script, one action per `generate` call, as tokens. One per episode."""

    def __init__(self, renderer: ChatRenderer, script: Sequence[str], policy_version: int = 0):
        if not script:
            raise ValueError("ScriptedEpisodePolicy needs at least one action")
        self.renderer = renderer
        self.script = list(script)
        self.policy_version = policy_version
        self.turn = 0

    def completion(self, text: str, params: SamplingParams) -> Completion:
        tokens = [*self.renderer.encode(text), self.renderer.im_end_id]
        finish = "stop"
        if len(tokens) > params.max_tokens:
            tokens, finish = tokens[: params.max_tokens], "length"
        return Completion(
            tokens=tokens,
            logprobs=[0.0] * len(tokens),
            finish_reason=finish,
            text=self.renderer.decode(tokens, skip_special_tokens=True),
            policy_version=self.policy_version,
        )

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        text = self.script[min(self.turn, len(self.script) - 1)]
        self.turn += 1
        return [self.completion(text, params) for _ in prompts for _ in range(params.n)]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        raise TypeError("a scripted policy has no weights to load")

    def close(self) -> None:
        pass


class OraclePolicy:
    """The env's oracle as a policy (an `EpisodePolicyFactory` for the rollout runner)."""

    def __init__(self, renderer: ChatRenderer, config: OracleConfig | None = None, policy_version: int = 0):
        self.renderer = renderer
        self.config = config or OracleConfig()
        self.policy_version = policy_version

    @property
    def policy_id(self) -> str:
        c = self.config
        return f"oracle(p_omit_tag={c.p_omit_tag}, p_skip_lookup={c.p_skip_lookup}, p_malformed_call={c.p_malformed_call})"

    def for_episode(self, env: gymnasium.Env, seed: int) -> ScriptedEpisodePolicy:
        oracle = getattr(env.unwrapped, "oracle_actions", None)
        if oracle is None:
            raise TypeError(
                f"{type(env.unwrapped).__name__} has no oracle_actions(); the oracle cannot play it"
            )
        script = plan_actions(oracle(), self.config, np.random.default_rng(seed))
        return ScriptedEpisodePolicy(self.renderer, script, self.policy_version)

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        raise TypeError(
            "OraclePolicy plays with the env's oracle, so it needs the episode's env: run it through "
            "RolloutRunner (which calls for_episode(env, seed) after each reset)"
        )

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        raise TypeError("the oracle policy has no weights to load")

    def close(self) -> None:
        pass
