"""toolgym/BFCL-v0: registration, the oracle on all 800 multi-turn tasks, every ground-truth call
needed (a sample; tools/bfcl_check.py does all), the conversation's user turns and named turn
criteria, held-out functions, positional ground truth, the pinned date, and bad input (an unknown
class, a wrongly typed argument) costing only that episode or call."""

import datetime
import importlib
import inspect
import json
import subprocess
import sys

import gymnasium
import pytest

pytest.importorskip("bfcl_eval")
pytest.importorskip("mpmath")

from toolgym.envs import list_envs
from toolgym.envs.adapters import bfcl
from toolgym.envs.adapters.bfcl import (
    ACCEPTED_WITHOUT,
    ADDED_FUNCTIONS,
    CATEGORIES,
    TURN_END,
    BFCLEnv,
    BFCLTaskError,
    actions_without,
    play,
)
from toolgym.envs.tools.typed import Call
from toolgym.rollouts.metrics import batch_metrics
from toolgym.rollouts.recording.format import RecordingReader

ENV_ID = "toolgym/BFCL-v0"


def test_registered_with_its_knobs():
    envs = list_envs()
    assert envs[ENV_ID]["category"] == "base"
    env = gymnasium.make(ENV_ID, category="miss_param").unwrapped
    assert isinstance(env, BFCLEnv)
    assert env.category == "miss_param" and len(env.tasks) == 200
    with pytest.raises(ValueError, match="category must be one of"):
        BFCLEnv("nope")
    with pytest.raises(ValueError, match="brackets format cannot write"):
        BFCLEnv(tool_format="brackets")


@pytest.mark.parametrize("tool_format", ["pythonic", "qwen3_coder", "llama3_json", "mistral"])
def test_the_oracle_in_every_family_format(tool_format):
    env = BFCLEnv("miss_func", tool_format=tool_format)
    for seed in range(0, 200, 5):
        env.reset(seed=seed)
        assert play(env, env.oracle_actions()), (tool_format, seed)


@pytest.mark.parametrize("category", CATEGORIES)
def test_oracle_solves_every_task(category):
    env = BFCLEnv(category)
    failed = []
    for seed in range(len(env.tasks)):
        env.reset(seed=seed)
        if not play(env, env.oracle_actions()):
            failed.append(env.state.task_id)
    assert failed == []


@pytest.mark.parametrize("category", CATEGORIES)
def test_dropping_any_ground_truth_call_fails(category):
    env = BFCLEnv(category)
    for seed in [*range(0, 200, 9), 113]:
        env.reset(seed=seed)
        for drop in range(env.task.needed_tool_calls):
            env.reset(seed=seed)
            passed = play(env, actions_without(env, drop))
            assert passed == ((env.state.task_id, drop) in ACCEPTED_WITHOUT), (env.state.task_id, drop)


def test_a_conversation_of_user_turns_graded_per_turn():
    env = BFCLEnv("base")
    observation, info = env.reset(seed=0)
    conversation = env.state
    assert observation == conversation.messages[0] and "Move 'final_report.pdf'" in observation
    assert "that ends your turn" in info["system_prompt"]
    actions = env.oracle_actions()
    assert actions[1] == TURN_END and actions[-1] == TURN_END
    rewards, infos = [], []
    for action in actions:
        observation, reward, terminated, truncated, info = env.step(action)
        rewards.append(reward)
        infos.append(info)
    assert terminated and not truncated and observation == "CORRECT"
    # the first turn's end: the user speaks again, the turn's three criteria passed
    assert infos[1]["observation_role"] == "user"
    assert infos[1]["bfcl_turn"] == {
        "turn": 0, "checked": True, "turn_calls": True, "turn_state": True, "turn_response": True
    }  # fmt: skip
    components = infos[-1]["reward_components"]
    for name in ("turn_calls", "turn_state", "turn_response"):
        assert components[name] == pytest.approx(env.turn_reward / 3)
    assert components["correct"] == 1.0
    assert sum(rewards) == pytest.approx(sum(components.values()))
    assert infos[-1]["metrics"]["success"] == 1.0 and infos[-1]["failure_mode"] == "success"


def test_a_turn_without_the_calls_fails_the_task():
    env = BFCLEnv("base")
    env.reset(seed=0)
    observation, _, _, _, info = env.step(TURN_END)
    assert observation == env.state.messages[1]
    assert info["bfcl_turn"]["turn_calls"] is False and info["bfcl_turn"]["turn_state"] is False
    actions = env.oracle_actions()[2:]  # the later turns played right
    assert not play(env, actions)
    assert env.state.failed == [0, 1, 2, 3]  # the state stays behind the ground truth's


def test_a_wrongly_typed_argument_costs_that_call_only():
    env = BFCLEnv("base")
    env.reset(seed=0)
    bad = env.format.render_call(env.tools["CD"], Call("cd", {"folder": 5}))
    observation, _, terminated, truncated, info = env.step(bad)
    assert info["step_errors"] == ["bad_arguments"] and not (terminated or truncated)
    assert "argument `folder`: expected `string`, got `integer`" in observation
    assert env.state.results == []  # never ran
    assert play(env, env.oracle_actions())


def test_a_task_of_an_unknown_class_fails_that_episode_only():
    env = BFCLEnv("base")
    entry, truth = env.tasks[0]
    env.tasks = [({**entry, "id": "multi_turn_base_x", "involved_classes": ["NoSuchAPI"]}, truth), *env.tasks]
    with pytest.raises(BFCLTaskError) as raised:
        env.reset(seed=0)
    assert "'NoSuchAPI' is not one this env runs" in str(raised.value) and "\n" not in str(raised.value)
    env.reset(seed=1)
    assert play(env, env.oracle_actions())


def test_held_out_functions_are_described_at_their_turn():
    env = BFCLEnv("miss_func")
    _, info = env.reset(seed=0)
    assert env.state.missed == {3: ["sort"]}
    assert "sort" not in [spec["function"]["name"] for spec in env.tool_specs]
    assert '"name": "sort"' not in info["system_prompt"]
    actions = env.oracle_actions()
    ends = [i for i, a in enumerate(actions) if a == TURN_END]
    for action in actions[: ends[2] + 1]:  # to the end of turn 2
        observation, *_ = env.step(action)
    assert observation.endswith(ADDED_FUNCTIONS)
    assert json.loads(observation.splitlines()[0])["function"]["name"] == "sort"
    assert "sort" in [spec["function"]["name"] for spec in env.tool_specs]


def test_positional_ground_truth_arguments_are_named():
    env = BFCLEnv("base")
    env.reset(seed=0)
    calls = [c for step in env.task.solution if not isinstance(step, str) for c in step]
    assert Call("sort", {"file_name": "final_report.pdf"}) in calls


def test_a_ground_truth_call_against_its_doc_widens_that_task_tool():
    env = BFCLEnv("base")
    env.reset(seed=173)
    assert env.tools["CLOSE_TICKET"].parameters["properties"]["ticket_id"]["type"] == ["integer", "string"]
    env.reset(
        seed=next(s for s in range(200) if "TicketAPI" in env.tasks[s][0]["involved_classes"] and s != 173)
    )
    assert env.tools["CLOSE_TICKET"].parameters["properties"]["ticket_id"]["type"] == "integer"


def test_travel_dates_are_pinned_and_the_library_left_alone():
    travel = bfcl.simulated_class("TravelAPI")()
    travel._load_scenario({"user_first_name": "Ana", "user_last_name": "Lee"})
    # 17 on the pinned date (2024-09-01), an adult on any date after 2024-10-01
    result = travel.verify_traveler_information("Ana", "Lee", "2006-10-01", "US1234")
    assert result["verification_status"] is False and "18" in result["verification_failure"]
    library = importlib.import_module(
        "bfcl_eval.eval_checker.multi_turn_eval.func_source_code.travel_booking"
    )
    assert library.datetime is datetime.datetime


def test_same_seed_same_transcript_and_no_eval():
    transcripts = []
    for _ in range(2):
        env = BFCLEnv("long_context")
        observations = [env.reset(seed=5)[0]]
        observations += [env.step(a)[0] for a in env.oracle_actions()]
        transcripts.append(observations)
    assert transcripts[0] == transcripts[1]
    source = inspect.getsource(bfcl).replace("literal_eval(", "")
    assert "eval(" not in source and "exec(" not in source


def test_the_check_script_passes_a_category(capsys):
    from toolgym.tools.bfcl_check import main

    assert main(["--category", "miss_param"]) == 0
    assert "miss_param: 200 tasks, 1140 calls left out one at a time, 0 problems" in capsys.readouterr().out


# ---- accuracy per category (category="all", info metric_group) -----------------------------


def test_all_interleaves_the_categories_and_names_each_as_the_metric_group():
    env = gymnasium.make(ENV_ID, category="all").unwrapped
    assert isinstance(env, BFCLEnv) and len(env.tasks) == 800
    for seed in (0, 1, 2, 3, 5, 799):
        env.reset(seed=seed)
        category = CATEGORIES[seed % 4]
        assert env.state.task_id == f"multi_turn_{category}_{seed // 4}"
        *_, info = env.step(env.oracle_actions()[0])
        assert info["metric_group"] == category


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "toolgym.configs.cli", *args], capture_output=True, text=True, timeout=600
    )


_LIMITS = ("--max-turns", "100", "--max-tokens-per-turn", "4096", "--max-tokens-per-episode", "100000")


@pytest.mark.slow
def test_eval_reports_the_oracle_accuracy_per_category(tmp_path):
    out = tmp_path / "eval.json"
    result = _cli(
        "eval", "--env", ENV_ID, "--env-kwargs", '{"category": "all"}', "--policy", "oracle",
        "--tasks", "8", "--examples", "0", "--out", str(out), *_LIMITS,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = json.loads(out.read_text())["metrics"]
    for category in CATEGORIES:
        assert metrics[f"eval/by_group/{category}/episodes"] == 2.0
        assert metrics[f"eval/by_group/{category}/success"] == 1.0
        assert f"by_group/{category}/success" in result.stdout  # the console summary lists them


@pytest.mark.slow
def test_recorded_episodes_summarised_per_category(tmp_path):
    # an oracle that skips its calls half the time fails those tasks: the categories differ
    out = tmp_path / "bfcl.jsonl"
    result = _cli(
        "record", "--env", ENV_ID, "--env-kwargs", '{"category": "all"}', "--policy", "oracle",
        "--p-skip-lookup", "0.5", "--tasks", "16", "--out", str(out), "--no-progress", *_LIMITS,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    trajectories = list(RecordingReader(out))
    assert len(trajectories) == 16
    wins: dict[str, list[float]] = {c: [] for c in CATEGORIES}
    for t in trajectories:
        last = next(tr.info["metrics"] for tr in reversed(t.transitions) if "metrics" in tr.info)
        wins[CATEGORIES[t.task_seed % 4]].append(last["success"])
    assert 0 < sum(map(sum, wins.values())) < 16
    m = batch_metrics(trajectories, prefix="")
    for category, found in wins.items():
        assert m[f"by_group/{category}/episodes"] == len(found) > 0
        assert m[f"by_group/{category}/success"] == pytest.approx(sum(found) / len(found))
