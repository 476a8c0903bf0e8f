"""Two small OpenEnv environments served by openenv-core's own server (`create_app`, uvicorn), for
tests/envs/adapters/test_envs_openenv.py. Run one as `python openenv_servers.py guess|tools PORT`.

- guess: guess a number from 1 to 8 (the seed draws it). An action is {"message": "<text>"}.
  Its rubric has two named parts, `correct` (1.0 for the right number) and `valid` (-0.1 for a
  message that is no number); each step's observation reports them in `rubric_components`
  (the reset observation their names, as 0), and its reward is their sum. Messages `hang` (never answers) and `crash` (exits the server)
  exist to test failures.
- tools: an MCPEnvironment (FastMCP tools `add(a, b)` and `submit(answer)`): reset tells two
  numbers; `submit` with their sum ends the episode with reward 1.0 (0.0 for a wrong sum).
"""

from __future__ import annotations

import os
import random
import sys
import threading
from typing import Any

import uvicorn
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics import Rubric
from pydantic import Field

MAX_SESSIONS = 16


class GuessAction(Action):
    message: str = Field(description="the guess, a number from 1 to 8")


class GuessObservation(Observation):
    prompt: str = ""
    feedback: str = ""
    guesses: int = 0
    rubric_components: dict[str, float] = Field(default_factory=dict)


class _Correct(Rubric):
    def __init__(self) -> None:
        super().__init__()
        self.target = 0

    def forward(self, action: Any, observation: Any) -> float:
        text = action.message.strip()
        return 1.0 if text.isdigit() and int(text) == self.target else 0.0


class _Valid(Rubric):
    def forward(self, action: Any, observation: Any) -> float:
        return 0.0 if action.message.strip().isdigit() else -0.1


class GuessRubric(Rubric):
    def __init__(self) -> None:
        super().__init__()
        self.correct = _Correct()
        self.valid = _Valid()

    def forward(self, action: Any, observation: Any) -> float:
        return self.correct(action, observation) + self.valid(action, observation)


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__(rubric=GuessRubric())
        self._state = State()
        self._target = 0

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._reset_rubric()
        self._target = random.Random(seed).randint(1, 8)
        assert isinstance(self.rubric, GuessRubric)
        self.rubric.correct.target = self._target
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(
            prompt="Guess my number from 1 to 8. Reply with the number only.",
            rubric_components={name: 0.0 for name, _ in self.rubric.named_rubrics()},
        )

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        text = action.message.strip()
        if text == "hang":
            threading.Event().wait(600)
        if text == "crash":
            os._exit(3)
        self._state.step_count += 1
        observation = GuessObservation(guesses=self._state.step_count)
        reward = self._apply_rubric(action, observation)
        assert self.rubric is not None
        parts = {name: float(r.last_score or 0.0) for name, r in self.rubric.named_rubrics()}
        if not text.isdigit():
            feedback = "That is not a number."
        elif int(text) == self._target:
            feedback = "Correct!"
        else:
            feedback = "Higher." if int(text) < self._target else "Lower."
        observation.feedback = feedback
        observation.rubric_components = parts
        observation.reward = reward
        observation.done = feedback == "Correct!"
        return observation

    @property
    def state(self) -> State:
        return self._state


class ToolsEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("adder")
        self._numbers = (0, 0)

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool()
        def submit(answer: int) -> str:
            """Submit the sum of the two numbers; this ends the episode."""
            return f"submitted {answer}"

        super().__init__(mcp)
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        rng = random.Random(seed)
        self._numbers = (rng.randint(10, 99), rng.randint(10, 99))
        self._state = State(episode_id=episode_id, step_count=0)
        a, b = self._numbers
        return CallToolObservation(tool_name="", result=f"What is {a} + {b}? Use the tools; submit the sum.")

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(metadata={"error": f"unknown action {type(action).__name__}"})

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            observation.done = True
            observation.reward = 1.0 if action.arguments.get("answer") == sum(self._numbers) else 0.0
        return observation

    @property
    def state(self) -> State:
        return self._state


def main() -> None:
    kind, port = sys.argv[1], int(sys.argv[2])
    if kind == "guess":
        app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=MAX_SESSIONS)
    else:
        app = create_app(
            ToolsEnvironment, CallToolAction, CallToolObservation, max_concurrent_envs=MAX_SESSIONS
        )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
