"""Hypothesis fuzzing of the model-family tool-call formats (llama3_json, mistral, pythonic,
qwen3_coder), as tests/envs/core/test_envs_fuzz.py does for brackets and json.

Parsing: any str (random Unicode, every dialect's markers glued together, calls rendered in the
dialect and then cut, doubled, retyped, with raw tokens such as 1e400, NaN, unbalanced quotes,
Python expressions and deep nesting where a value goes) never raises and gives the same result
twice. Envs: >= 10,000 such actions per format against typed multi-argument tools and Zorplex
never raise from `step`, keep rewards finite and info strict JSON, end within their limits, and
replay exactly in a fresh env."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typed_bank_env import TypedEnv  # tests/envs/tools

from toolgym.envs import Call, ZorplexEnv
from toolgym.envs.tasks.zorplex import DIFFICULTIES
from toolgym.envs.tools.call_formats import get_format

FAMILY = ("llama3_json", "mistral", "pythonic", "qwen3_coder")
KINDS = {"answer", "calls", "bad_call", "mixed", "other", "empty"}
MARKERS = (
    "<|python_tag|>", "<|python_start|>", "<|python_end|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
    "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", ">",
    "[ANSWER]", "[ANSWER] 42", '{"name": ', '"parameters": ', '"arguments": ', "{", "}", "[", "]", "(",
    ")", ";", ",", "=", '"', "'", "\\", "\n", " ", "<|im_end|>", "<tool_response>",
)  # fmt: skip
RAW = (
    "1e400", "-1e400", "NaN", "Infinity", "nan", "inf", "9" * 5000, "0x1c", "1_000", "+3", ".5", "True",
    "true", "null", "None", "__import__('os')", "1 + 2", "{1, 2}", "b'x'", "...", "lambda: 0", "x",
    "[" * 300, "(" * 300, "{" * 300, '"', "'", '"""', "\\", "\\u0000", "\\ud800", "f'{x}'", "*a", "**k",
)  # fmt: skip
SENTINEL = "@@RAW@@"
MEGA_MARK = "@@MEGA@@"
MEGA = (("".join(MARKERS + RAW) + "x" * 200) * 200)[: 1 << 20]  # 1 MiB of markers and raw tokens
BIG_ACTIONS = 2 << 20

NAMES = (
    "balance",
    "transfer",
    "note",
    "audit",
    "rate",
    "submit",
    "lookup",
    "getkey",
    "fetch",
    "FOO",
    "",
    "a.b",
)
PARAMS = ("account", "source", "target", "amount", "memo", "text", "times", "loud", "accounts", "depth",
          "currency", "period", "answer", "word", "key", "x", "", "1bad", "a b")  # fmt: skip
leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(("ana", "bo", "cy", "eur", "quick", SENTINEL, MEGA_MARK, *MARKERS)),
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=8),
)
value = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(PARAMS), inner, max_size=3)), max_leaves=5)  # fmt: skip
a_call = st.tuples(st.sampled_from(NAMES), st.dictionaries(st.sampled_from(PARAMS), value, max_size=4))
MUTATIONS = ("none", "none", "none", "cut", "drop", "double", "answer", "prefix", "swap")
mutation = st.tuples(
    st.sampled_from(MUTATIONS), st.integers(0, 10_000), st.sampled_from(RAW), st.sampled_from(MARKERS)
)
SWAPS = (("parameters", "params"), ("arguments", "args"), ("[ARGS]", "[ARG]"), ("</parameter>", ""),
         ("</function>", "</func>"), ("=", ":"), ('"', "'"), ("[TOOL_CALLS]", "[TOOL_CALL]"), ("(", "["))  # fmt: skip


def rendered(fmt, parts):
    """A call rendered in `fmt`, a raw token where the sentinel value went, then maybe broken."""
    (name, arguments), (how, at, raw, marker) = parts
    text = get_format(fmt).render_call(None, Call(name, arguments))
    for quoted in (json.dumps(SENTINEL), repr(SENTINEL), SENTINEL):
        text = text.replace(quoted, raw)
    if how == "cut":
        text = text[: at % (len(text) + 1)]
    elif how == "drop" and text:
        at %= len(text)
        text = text[:at] + text[at + 1 :]
    elif how == "double":
        text = f"{text}{marker}{text}"
    elif how == "answer":
        text = f"{text}\n[ANSWER] {raw}"
    elif how == "prefix":
        text = marker + text
    elif how == "swap":
        old, new = SWAPS[at % len(SWAPS)]
        text = text.replace(old, new, 1)
    return text


def actions(fmt):
    piece = st.one_of(
        st.tuples(a_call, mutation).map(lambda p: rendered(fmt, p)),
        st.sampled_from(MARKERS + RAW),
        st.text(max_size=8),
    )
    return st.one_of(
        st.tuples(a_call, mutation).map(lambda p: rendered(fmt, p)),
        st.lists(piece, min_size=2, max_size=4).map("\n".join),
        st.lists(piece, min_size=2, max_size=6).map("".join),
        st.text(max_size=40),
        st.sampled_from(("[ANSWER] 1.5", "The answer is 7.", "", "[ANSWER] ana")),
    )


ACTIONS = {fmt: actions(fmt) for fmt in FAMILY}
TOOLS = TypedEnv(tool_format="qwen3_coder").tools


def check_parse(fmt, text):
    format_ = get_format(fmt)
    near_miss = format_.near_miss(TOOLS)
    action = format_.parse(text, near_miss)
    assert action == format_.parse(text, near_miss)
    assert action.kind in KINDS and isinstance(action.reason, str)
    if action.kind == "calls":
        assert action.calls is not None
        for call in action.calls:
            assert isinstance(call.name, str) and (call.error is None) == (call.message == "")
            tool = TOOLS.get(call.name.upper())
            if call.error is None and tool is not None:
                format_.arguments(tool, call)  # typing a call's values never raises either
    format_.malformed(text)


@pytest.mark.parametrize("fmt", FAMILY)
@settings(max_examples=800, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_parsing_never_raises_on_any_text(fmt, data):
    text = data.draw(
        st.one_of(ACTIONS[fmt], st.text(), st.binary().map(lambda b: b.decode("utf-8", "replace")))
    )
    check_parse(fmt, text.replace(MEGA_MARK, "m"))


HUGE = (
    MEGA, "[" * 100_000, "{" * 100_000, "[f(x=" + "[" * 100_000, "[f(x=1)]" + " " * (1 << 20) + "x",
    "[f(x=1)," * 100_000, "[a" * 500_000, "[TOOL_CALLS]" * 50_000, "[TOOL_CALLS]a" * 50_000,
    "a[ARGS]" * 100_000, '{"name": "a"}; ' * 20_000, '{"name":' * 100_000, "<tool_call>" * 100_000,
    "<tool_call><function=a>" * 50_000, "<tool_call><function=a>" + "<parameter=x>" * 50_000 + "</function></tool_call>",
)  # fmt: skip


@pytest.mark.parametrize("fmt", FAMILY)
def test_a_huge_or_deeply_nested_action_parses_in_linear_time(fmt):
    # each text is 0.5 to 2 MiB: a parser that rescans the rest of the text per marker would take
    # minutes on one of them (a regex `<tool_call>(.*?)</tool_call>` over unclosed tags does)
    for text in HUGE:
        check_parse(fmt, text)


# ---- envs: step never raises, the books balance, replay is exact --------------------------------

ACTIONS_PER_EXAMPLE = 25
EXAMPLES = 400  # 400 x 25 = 10,000 actions per format
FAILURE_MODES = {"success", "wrong_format", "wrong_answer", "tool_spam", "no_answer", "goal_not_met"}
END_REASONS = {"answered", "no_tool_call", "max_turns", "parse_error"}
ORACLE_MARK = "@@ORACLE@@"
MEGA_BUDGET = 20


def env_factories(fmt):
    return [
        lambda: TypedEnv(tool_format=fmt),
        lambda: TypedEnv(tool_format=fmt, answer_tool="submit"),
        lambda: TypedEnv(tool_format=fmt, max_consecutive_errors=None, max_tool_calls=3, max_turns=8),
        lambda: TypedEnv(tool_format=fmt, max_action_chars=BIG_ACTIONS, accept_untagged_answer=False),
        lambda: TypedEnv(tool_format=fmt, max_turns=1, error_penalty=0.5),
        *[lambda t=t: ZorplexEnv(tier=t, tool_format=fmt) for t in DIFFICULTIES],
        lambda: ZorplexEnv(
            tier="multi_step", tool_format=fmt, answer_tool="submit", max_action_chars=BIG_ACTIONS
        ),
    ]


ENVS = {fmt: [(make, make()) for make in env_factories(fmt)] for fmt in FAMILY}


def check_step(env, result, total):
    obs, reward, terminated, truncated, info = result
    assert obs in env.observation_space
    assert type(reward) is float and math.isfinite(reward)
    assert type(terminated) is bool and type(truncated) is bool and not (terminated and truncated)
    json.dumps(info, allow_nan=False)
    components = info["reward_components"]
    assert all(type(v) is float and math.isfinite(v) for v in components.values())
    assert total == pytest.approx(sum(components.values()), abs=1e-9)
    assert 1 <= info["turn"] <= env.max_turns and info["tool_calls"] <= env.max_tool_calls
    done = terminated or truncated
    limit = env.max_consecutive_errors
    if info["turn"] == env.max_turns or (limit is not None and info["consecutive_errors"] >= limit):
        assert done, "the episode must end within its turn and error limits"
    if done:
        assert info["failure_mode"] in FAILURE_MODES and info["end_reason"] in END_REASONS
        assert sum(info["error_counts"].values()) == info["errors"]
    return done


def play(env, seed, texts, check):
    transcript = [env.reset(seed=seed)]
    total, turn, episodes = 0.0, 0, 0
    for text in texts:
        if ORACLE_MARK in text:
            oracle = env.oracle_actions()
            text = text.replace(ORACLE_MARK, oracle[min(turn, len(oracle) - 1)])
        result = env.step(text)
        transcript.append(result)
        turn += 1
        total += result[1]
        done = check_step(env, result, total) if check else result[2] or result[3]
        if done:
            episodes += 1
            transcript.append(env.reset())
            total, turn = 0.0, 0
    return transcript, episodes


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FAMILY)
def test_adversarial_actions_never_raise_and_replay_exactly(fmt):
    counted = {"actions": 0, "episodes": 0, "mega": 0}

    def expand(text):
        while MEGA_MARK in text:
            counted["mega"] += 1
            text = text.replace(MEGA_MARK, MEGA if counted["mega"] <= MEGA_BUDGET else MEGA[:300], 1)
        return text

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )
    @given(
        config=st.integers(0, len(ENVS[fmt]) - 1),
        seed=st.integers(0, 2**32 - 1),
        texts=st.lists(
            st.one_of(ACTIONS[fmt], st.just(ORACLE_MARK)),
            min_size=ACTIONS_PER_EXAMPLE,
            max_size=ACTIONS_PER_EXAMPLE,
        ),
    )
    def run(config, seed, texts):
        make, env = ENVS[fmt][config]
        texts = [expand(t) for t in texts]
        transcript, episodes = play(env, seed, texts, check=True)
        assert play(make(), seed, texts, check=False)[0] == transcript
        counted["actions"] += len(texts)
        counted["episodes"] += episodes

    run()
    assert counted["actions"] >= 10_000
    assert counted["episodes"] >= 100
