"""Fakes for rollouts tests: a toy tool env (independent of toolgym.envs) and scripted test
policies. Imported by test files as `rollouts_fakes` (the tests dir is on sys.path)."""

import asyncio
import re

import gymnasium
import numpy as np

from toolgym.agents.types import Completion, SamplingParams

TOY_ENV_ID = "rolloutstest/Toy-v0"
SETTLING_ENV_ID = "rolloutstest/SettlingToy-v0"


class ToyEnv(gymnasium.Env):
    """Call LOOKUP[magic], then answer `[ANSWER] n`. Knobs make reset/step raise for some seeds,
    or return a bad output: bad_outputs {seed: (turn, field, value)} replaces `field` (observation,
    reward, terminated, info, system_prompt, reward_components) with `value` at that turn (0: reset);
    numpy_info puts numpy values and an object into every step's info."""

    metadata = {"render_modes": []}  # noqa: RUF012

    def __init__(
        self, fail_reset_seeds=(), fail_step_seeds=(), max_turns=5, bad_outputs=None, numpy_info=False
    ):
        self.action_space = gymnasium.spaces.Text(4096)
        self.observation_space = gymnasium.spaces.Text(4096)
        self.fail_reset_seeds, self.fail_step_seeds = set(fail_reset_seeds), set(fail_step_seeds)
        self.max_turns = max_turns
        self.bad_outputs = bad_outputs or {}
        self.numpy_info = numpy_info

    def _corrupt(self, observation, reward, terminated, info):
        turn, field, value = self.bad_outputs.get(self.seed, (None, None, None))
        if turn != self.turn:
            return observation, reward, terminated, info
        if field in ("system_prompt", "reward_components"):
            return observation, reward, terminated, {**info, field: value}
        out = {"observation": observation, "reward": reward, "terminated": terminated, "info": info}
        return tuple({**out, field: value}.values())

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed in self.fail_reset_seeds:
            raise RuntimeError("reset exploded")
        self.seed, self.turn, self.calls, self.errors = seed, 0, 0, 0
        self.answer = int(self.np_random.integers(0, 1000))
        info = {"system_prompt": "Use LOOKUP[magic].", "answer": self.answer}
        observation, _, _, info = self._corrupt("What is the magic number?", 0.0, False, info)
        return observation, info

    def step(self, action):
        observation, reward, terminated, truncated, info = self._step(action)
        observation, reward, terminated, info = self._corrupt(observation, reward, terminated, info)
        return observation, reward, terminated, truncated, info

    def oracle_actions(self):
        return ["LOOKUP[magic]", f"[ANSWER] {self.answer}"]

    def malformed_action(self, action):
        return action.replace("[", "(").replace("]", ")") if action.startswith("LOOKUP[") else None

    def answer_action(self, answer, tagged=True):
        return f"[ANSWER] {answer}" if tagged else f"The answer is {answer}."

    def _step(self, action):
        self.turn += 1
        if self.seed in self.fail_step_seeds and self.turn == 2:
            raise ValueError("tool exploded")
        info = {"turn": self.turn}
        tagged = re.search(r"\[ANSWER\]\s*(-?\d+)", action)
        untagged = re.search(r"answer is (-?\d+)", action)
        if tagged or untagged:
            correct = int((tagged or untagged).group(1)) == self.answer
            components = {"correct": float(correct), "format": 0.2 if tagged else 0.0}
            mode = "success" if correct and tagged else ("wrong_format" if correct else "wrong_answer")
            info.update(end_reason="answered", failure_mode=mode)
            return "graded", sum(components.values()), True, False, self._info(info, components)
        if "LOOKUP[magic]" in action:
            self.calls += 1
            obs = f"LOOKUP[magic] = {self.answer}"
        else:
            self.errors += 1
            obs = "ERROR: no tool call and no answer."
        if self.turn >= self.max_turns:
            info.update(end_reason="max_turns", failure_mode="no_answer")
            return obs, 0.0, False, True, self._info(info, {"correct": 0.0, "format": 0.0})
        return obs, 0.0, False, False, self._info(info, {"correct": 0.0, "format": 0.0})

    def _info(self, info, components):
        metrics = {
            "accuracy": float(components["correct"] > 0),
            "tag_rate": float(components["format"] > 0),
            "tool_calls": self.calls,
            "env_errors": self.errors,
        }
        info = {
            **info,
            "tool_calls": self.calls,
            "errors": self.errors,
            "reward_components": components,
            "metrics": metrics,
        }
        if self.numpy_info:  # what Gymnasium envs often return
            info.update(
                tool_calls=np.int64(self.calls),
                reward_components={k: np.float32(v) for k, v in components.items()},
            )
            info.update(scores=np.arange(3) / 2, flag=np.bool_(True), handle=Handle(), at=(1, 2))
        return info


class Handle:
    def __repr__(self):
        return "Handle()"


class SettlingToyEnv(ToyEnv):
    """ToyEnv with the optional `abandon()`: an episode the runner cuts costs `incorrect_reward`
    (component "correct"). abandon_output replaces its (reward, info); abandon_fails raises."""

    def __init__(self, incorrect_reward=-1.0, abandon_output=None, abandon_fails=False, **kw):
        super().__init__(**kw)
        self.incorrect_reward = incorrect_reward
        self.abandon_output, self.abandon_fails = abandon_output, abandon_fails

    def abandon(self):
        if self.abandon_fails:
            raise RuntimeError("abandon exploded")
        if self.abandon_output is not None:
            return self.abandon_output
        components = {"correct": self.incorrect_reward, "format": 0.0}
        return self.incorrect_reward, self._info({"failure_mode": "no_answer"}, components)


if TOY_ENV_ID not in gymnasium.registry:
    gymnasium.register(id=TOY_ENV_ID, entry_point=ToyEnv, disable_env_checker=True)
if SETTLING_ENV_ID not in gymnasium.registry:
    gymnasium.register(id=SETTLING_ENV_ID, entry_point=SettlingToyEnv, disable_env_checker=True)


class TextPolicy:
    """Says the same text every turn (as tokens + <|im_end|>); records every request's params."""

    max_seq_len = None

    def __init__(self, renderer, text="LOOKUP[magic]", finish_on_limit=True, delay=0.0, fail=False):
        self.renderer, self.text, self.delay, self.fail = renderer, text, delay, fail
        self.policy_version = 3
        self.requests: list[tuple[list[list[int]], SamplingParams]] = []
        self.in_flight = self.max_in_flight = 0

    async def generate(self, prompts, params):
        self.requests.append((prompts, params))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if self.fail:
                raise RuntimeError("CUDA fell over")
        finally:
            self.in_flight -= 1
        tokens = [*self.renderer.encode(self.text), self.renderer.im_end_id]
        finish = "stop"
        if len(tokens) > params.max_tokens:
            tokens, finish = tokens[: params.max_tokens], "length"
        lps = [-0.5] * len(tokens)
        return [Completion(tokens, lps, finish, self.renderer.decode(tokens, True), 3) for _ in prompts]

    def load_weights(self, named_tensors, version):
        pass

    def close(self):
        pass


class PerSeedPolicy:
    """An EpisodePolicyFactory that gives seeds in `special` their own policy, the rest `default`."""

    max_seq_len = None

    def __init__(self, default, special):
        self.default, self.special, self.policy_version = default, special, 0

    def for_episode(self, env, seed):
        return self.special.get(env.unwrapped.seed, self.default)

    async def generate(self, prompts, params):
        raise AssertionError("the runner must use for_episode")

    def load_weights(self, named_tensors, version):
        pass

    def close(self):
        pass
