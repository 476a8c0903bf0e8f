"""The README's custom tool env (the code between the markers is pasted there verbatim)."""

# --- README example: begin ---
import gymnasium

from toolgym.envs import Task, Tool, ToolEnv


class WeatherEnv(ToolEnv):
    """How much warmer is one city than another today? Temperatures change every episode."""

    CITIES = ("oslo", "lima", "cairo", "perth", "quito")

    def __init__(self, **knobs):
        temp = Tool("TEMP", "today's temperature in a city", self.temp, arg="city")
        example = (
            "User: How much warmer is lima than oslo?\n"
            "Assistant: TEMP[lima]\nTool: TEMP[lima] = 18\n"
            "Assistant: TEMP[oslo]\nTool: TEMP[oslo] = -2\nAssistant: [ANSWER] 20"
        )
        super().__init__(
            tools=[temp], instructions="Answer questions about the weather.", example=example, **knobs
        )

    def temp(self, city: str) -> str:
        return str(self.temps[city.lower()]) if city.lower() in self.temps else "UNKNOWN_CITY"

    def new_task(self) -> Task:
        rng = self.np_random  # the env's seeded RNG: same seed, same task
        self.temps = {city: int(rng.integers(-20, 40)) for city in self.CITIES}
        a, b = rng.permutation(self.CITIES)[:2].tolist()
        answer = self.temps[a] - self.temps[b]
        return Task(
            f"How much warmer is {a} than {b}?", answer, (f"TEMP[{a}]", f"TEMP[{b}]", f"[ANSWER] {answer}")
        )


gymnasium.register("my/Weather-v0", entry_point=WeatherEnv)
# --- README example: end ---

import warnings  # noqa: E402

import pytest  # noqa: E402
from gymnasium.utils.env_checker import check_env  # noqa: E402


def test_custom_example_passes_check_env():
    env = gymnasium.make("my/Weather-v0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)


@pytest.mark.parametrize("seed", range(20))
def test_custom_example_oracle_solves_it(seed):
    env = gymnasium.make("my/Weather-v0")
    question, info = env.reset(seed=seed)
    assert (
        question == info["question"] and "TEMP[city]: today's temperature in a city" in info["system_prompt"]
    )
    total = 0.0
    for action in env.unwrapped.oracle_actions():
        obs, reward, terminated, truncated, info = env.step(action)
        total += reward
    assert (terminated, truncated, obs) == (True, False, "CORRECT")
    assert info["failure_mode"] == "success" and total == pytest.approx(1.2)


def test_custom_example_tool_results_and_negative_answers():
    env = WeatherEnv()
    env.reset(seed=3)
    assert env.step("temp['Oslo'] TEMP[atlantis]")[0].splitlines() == [
        f"TEMP[Oslo] = {env.temps['oslo']}",
        "TEMP[atlantis] = UNKNOWN_CITY",
    ]
    answers = set()
    for seed in range(50):
        env.reset(seed=seed)
        answers.add(env.answer)
        *_, info = env.step(f"[ANSWER] {env.answer}")
        assert info["reward_components"]["correct"] == 1.0
    assert min(answers) < 0 < max(answers)
