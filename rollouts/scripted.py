"""A scripted policy that plays the env's oracle, with knobs for imperfection.

It takes the same path as a model: the runner renders the prompt, the policy returns TOKEN ids
(the renderer's `action_tokens` of the action text: encoded + `<|im_end|>` in ChatML, logprob 0.0
each), the runner gives the renderer's `action_text` of them to `env.step`, then renders the
observation delta. So tests, demos and the SFT
warm-start data (`toolgym record --policy oracle`) exercise the real rollout path.

How it knows the task: tokens alone do not say which seed an episode has (two episodes can show
the same question over different hidden state), so the oracle is a privileged expert.
`OraclePolicy` implements `EpisodePolicyFactory`: right after `env.reset` the runner calls
`for_episode(env, seed)`, which reads the env's `oracle_actions()` once, plans the
episode's script with an RNG seeded by the episode's sampling seed (so the G samples of a group
draw their knobs independently, and reruns repeat), and returns a per-episode `Policy` that
emits the script one action per `generate` call. Nothing else in the runner knows it is scripted.

The script comes from the env's oracle methods, declared on `TextEnv` (envs/core/text_env.py; a
plain gymnasium.Env's are read by name through `env_hooks`), so this module knows no env's action
grammar: `oracle_actions()` (the ideal actions, the last one the final answer),
`malformed_action(action)` (a fumbled version of an action) and `answer_action(answer, tagged)`.

Knobs (each drawn once per episode):
- p_skip_lookup: answer at once, without the oracle's earlier actions, with a guess. The guess is
  always wrong (the answer plus a random offset in 1..9) so the knob means exactly "skipped the
  tools and got it wrong". No effect when the oracle's only action is the answer.
- p_stop_early: stop one action short (the oracle's earlier actions but the last one, e.g. a
  SEE chain left one link early) and answer with a guess, always wrong like p_skip_lookup's. No
  effect with fewer than two earlier actions, or in an episode that already skips.
- guess: what the two knobs above answer with: None, the answer moved by a random 1..9 (for a
  number); a number, that number (or that number + 1 where it is the answer), like a
  demonstrator who guesses the middle of the range. A fixed guess is easy to imitate, so SFT's
  copy of a looked-up value is not drowned by noise in the guessed answers' tokens.
- p_malformed_call: per earlier action, first emit the env's `malformed_action` of it, which the
  env answers with an error, then the action itself (a recovery).
- p_omit_tag: the final answer is stated without the env's answer format
  (`answer_action(answer, tagged=False)`).
- p_wrong_note: for an env that takes notes (rollouts/context.py; its `wrong_note_actions`), play
  instead a demonstrator who notes a wrong word once and follows it to a wrong answer (the env's
  script; the other knobs do not apply to it). No effect on an env without notes.
- p_wrong_lookup: per lookup, for an env whose lookups are independent sub-tasks (its
  `wrong_lookup_actions`, e.g. Zorplex's list tier): look up a wrong word instead, and answer what
  was looked up (wrong). An episode with a wrong lookup plays the env's script; the other knobs do
  not apply to it. No effect on an env without the method's answer (None).
When the env keeps going after the script ends (e.g. after extra errors), the last action is
repeated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import gymnasium
import msgspec
import numpy as np
import torch

from ..agents.chat import Renderer
from ..agents.types import Completion, SamplingParams
from ..envs.core.text_env import env_hooks


class OracleConfig(msgspec.Struct, frozen=True):
    p_omit_tag: float = 0.0
    p_skip_lookup: float = 0.0
    p_malformed_call: float = 0.0
    p_stop_early: float = 0.0
    guess: int | None = None
    p_wrong_note: float = 0.0
    p_wrong_lookup: float = 0.0

    def __post_init__(self) -> None:
        for name in (field for field in self.__struct_fields__ if field.startswith("p_")):  # probabilities
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(
                    f"OracleConfig.{name} must be a probability in [0, 1], got {getattr(self, name)}"
                )


def plan_actions(env: gymnasium.Env, config: OracleConfig, rng: np.random.Generator) -> list[str]:
    """The episode's script: the oracle's actions of `env` (just reset) with the knobs applied.
    Raises what the env's oracle raises (NotImplementedError: it has none), or TypeError for a
    plain gymnasium.Env without the oracle methods."""
    hooks = env_hooks(env)
    oracle = list(hooks.oracle_actions())
    if not oracle:
        raise ValueError("the env's oracle returned no actions")
    calls = oracle[:-1]
    # Draw every knob every episode, so one knob's value does not shift the others' draws.
    skip = rng.random() < config.p_skip_lookup
    omit_tag = rng.random() < config.p_omit_tag
    offset = int(rng.integers(1, 10))
    malformed_flags = rng.random(len(calls)) < config.p_malformed_call
    stop_early = rng.random() < config.p_stop_early  # drawn after the older knobs: they keep their draws
    if config.p_wrong_note and rng.random() < config.p_wrong_note:
        wrong_note = hooks.wrong_note_actions(rng)
        if wrong_note:
            return list(wrong_note)
    if config.p_wrong_lookup:
        wrong_lookups = hooks.wrong_lookup_actions(rng, config.p_wrong_lookup)
        if wrong_lookups:
            return list(wrong_lookups)
    script: list[str] = []
    answer_action = hooks.answer_action
    guessed = wrong_answer(hooks.answer, offset, config.guess)
    if skip and calls:
        final = answer_action(guessed, tagged=not omit_tag)
    else:
        short = stop_early and len(calls) >= 2
        for call, bad in zip(calls[:-1] if short else calls, malformed_flags, strict=False):
            broken = hooks.malformed_action(call) if bad else None
            if broken is not None and broken != call:
                script.append(broken)
            script.append(call)
        if short:
            final = answer_action(guessed, tagged=not omit_tag)
        else:
            final = answer_action(hooks.answer, tagged=False) if omit_tag else oracle[-1]
    script.append(final)
    return script


def wrong_answer(answer: Any, offset: int, guess: int | None = None) -> Any:
    """A guess that is not `answer`: for a number, `guess` (+ 1 where that is the answer) or, with
    no `guess`, the answer moved by `offset` (>= 1); anything else a string."""
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        if guess is not None:
            return guess + 1 if guess == answer else guess
        return answer + offset
    return f"not {answer}"


class ScriptedEpisodePolicy:
    """Plays a fixed script, one action per `generate` call, as tokens. One per episode."""

    max_seq_len = None  # no bound of its own (agents/policy.py)

    def __init__(self, renderer: Renderer, script: Sequence[str], policy_version: int = 0):
        if not script:
            raise ValueError("ScriptedEpisodePolicy needs at least one action")
        self.renderer = renderer
        self.script = list(script)
        self.policy_version = policy_version
        self.turn = 0

    def completion(self, text: str, params: SamplingParams) -> Completion:
        tokens = self.renderer.action_tokens(text)
        finish = "stop"
        if len(tokens) > params.max_tokens:
            tokens, finish = tokens[: params.max_tokens], "length"
        return Completion(
            tokens=tokens,
            logprobs=[0.0] * len(tokens),
            finish_reason=finish,
            text=self.renderer.action_text(tokens),
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

    max_seq_len = None  # no bound of its own (agents/policy.py)

    def __init__(self, renderer: Renderer, config: OracleConfig | None = None, policy_version: int = 0):
        self.renderer = renderer
        self.config = config or OracleConfig()
        self.policy_version = policy_version

    @property
    def policy_id(self) -> str:
        c = self.config
        stop = f", p_stop_early={c.p_stop_early}" if c.p_stop_early else ""
        stop += f", guess={c.guess}" if c.guess is not None else ""
        stop += f", p_wrong_note={c.p_wrong_note}" if c.p_wrong_note else ""
        stop += f", p_wrong_lookup={c.p_wrong_lookup}" if c.p_wrong_lookup else ""
        return (
            f"oracle(p_omit_tag={c.p_omit_tag}, p_skip_lookup={c.p_skip_lookup}, "
            f"p_malformed_call={c.p_malformed_call}{stop})"
        )

    def for_episode(self, env: gymnasium.Env, seed: int) -> ScriptedEpisodePolicy:
        script = plan_actions(env, self.config, np.random.default_rng(seed))
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
