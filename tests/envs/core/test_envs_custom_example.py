"""The README's custom tool env: the code between the markers is in README.md verbatim (checked
here), passes check_env, is solved by the oracle, and is recorded and replayed with --verify
through the real CLI."""

# --- README example: begin ---
import gymnasium

from toolgym.envs import Call, Task, ToolEnv, ToolError, numeric, tool


class BankEnv(ToolEnv):
    """Move half of ana's money to bo, then say what bo has. Balances change every episode."""

    def __init__(self, **knobs):
        knobs.setdefault("grader", numeric(abs_tol=0.01))  # answers within a cent are right
        super().__init__(instructions="You run a bank.", tool_format="json", **knobs)

    @tool
    def balance(self, account: str) -> float:
        """The balance of an account."""
        if account not in self.state:
            raise ToolError(f"no account named {account!r}")
        return self.state[account]

    @tool
    def transfer(self, source: str, target: str, amount: float) -> str:
        """Move money from one account to another."""
        if {source, target} - self.state.keys() or not 0 < amount <= self.state[source]:
            raise ToolError("transfer refused")
        self.state.update({source: self.state[source] - amount, target: self.state[target] + amount})
        return f"moved {amount:.2f}"

    def new_task(self) -> Task:  # draws only from self.np_random: same seed, same task
        balances = {name: round(float(self.np_random.uniform(10, 500)), 2) for name in ("ana", "bo", "cy")}
        half = balances["ana"] / 2
        check = Call("balance", {"account": "ana"})
        moves = [check, Call("transfer", dict(source="ana", target="bo", amount=half))]
        question = "Move half of ana's money to bo. How much does bo have now?"
        return Task(question, round(balances["bo"] + half, 2), solution=moves, state=balances)

    def final_reward(self, grade):  # runs however the episode ends: was the money moved?
        return {"moved": 0.5 * (abs(self.state["bo"] - self.task.answer) < 0.01)}


gymnasium.register("bank/Bank-v0", entry_point=BankEnv)
# --- README example: end ---

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from gymnasium.utils.env_checker import check_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def example_source() -> str:
    text = Path(__file__).read_text()
    begin = text.index("# --- README example: begin ---\n") + len("# --- README example: begin ---\n")
    return text[begin : text.index("# --- README example: end ---")]


def test_readme_shows_this_example_verbatim_in_at_most_40_lines():
    source = example_source()
    assert source in (ROOT / "README.md").read_text()
    assert len(source.strip().splitlines()) <= 40


def test_custom_example_passes_check_env():
    env = gymnasium.make("bank/Bank-v0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)


@pytest.mark.parametrize("seed", range(20))
def test_custom_example_oracle_solves_it(seed):
    env = gymnasium.make("bank/Bank-v0")
    question, info = env.reset(seed=seed)
    assert question == info["question"] and isinstance(info["answer"], float)
    assert (
        '"name": "transfer"' in info["system_prompt"]
        and '"amount": {"type": "number"}' in info["system_prompt"]
    )
    total = 0.0
    for action in env.unwrapped.oracle_actions():
        obs, reward, terminated, truncated, info = env.step(action)
        total += reward
    assert (terminated, truncated, obs) == (True, False, "CORRECT")
    assert info["failure_mode"] == "success" and info["reward_components"]["moved"] == 0.5
    assert total == pytest.approx(1.7) == pytest.approx(sum(info["reward_components"].values()))


def test_typed_tools_validate_and_state_changes():
    env = BankEnv()
    env.reset(seed=3)
    ana = env.state["ana"]

    def call(name, **arguments):
        action = f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
        obs, _, _, _, info = env.step(action)
        return obs.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>"), info

    assert call("balance", account="ana")[0] == repr(ana)
    obs, info = call("transfer", source="ana", target="bo", amount="5")
    assert obs == "ERROR: argument `amount`: expected `float`, got `str`" and info["step_errors"] == [
        "bad_arguments"
    ]
    assert call("transfer", source="ana", target="bo")[0] == "ERROR: missing argument `amount`"
    env.reset(seed=3)
    assert (
        call("transfer", source="ana", target="bo", amount=1, memo="x")[0]
        == "ERROR: unexpected argument `memo`"
    )
    assert call("transfer", source="ana", target="zed", amount=1.0)[0] == "transfer refused"
    assert env.state["ana"] == ana  # refused calls changed nothing
    assert call("transfer", source="ana", target="bo", amount=1)[0] == "moved 1.00"
    assert env.state["ana"] == pytest.approx(ana - 1)
    # Unanswered: the final-state reward still runs (the money was moved, but not half of it).
    assert env.step("I give up.")[0].startswith("ERROR: no tool call and no answer")
    reward, info = env.abandon()
    assert reward == 0.0 and info["reward_components"]["moved"] == 0.0 and info["failure_mode"] == "no_answer"


def test_custom_example_records_with_the_oracle_and_replays_exactly(tmp_path):
    (tmp_path / "bank_env.py").write_text(example_source())
    out = tmp_path / "bank.jsonl"

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "toolgym.configs.cli", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )

    record = cli(
        "record", "--env", "bank/Bank-v0", "--env-module", "bank_env", "--policy", "oracle",
        "--p-malformed-call", "0.5", "--p-omit-tag", "0.3",
        "--tasks", "6", "--group-size", "2", "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert record.returncode == 0, record.stdout + record.stderr
    assert "recorded 12 episodes" in record.stdout, record.stdout
    replay = cli("replay", str(out), "--verify", "--summary-only", "--env-module", "bank_env")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "verify: 12/12 episodes replay exactly" in replay.stdout, replay.stdout
