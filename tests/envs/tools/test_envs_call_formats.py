"""The model-family tool-call formats (harmony, llama3_json, mistral, pythonic, qwen3_coder): what each reads,
the error each gives for what it cannot read, calls rendered and parsed back exactly, and envs
that play their oracle and answer every mistake with a counted error in each format."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typed_bank_env import TypedEnv  # tests/envs/tools

from toolgym.envs import Call, ZorplexEnv
from toolgym.envs.tasks.zorplex import DIFFICULTIES
from toolgym.envs.tools.call_formats import (
    FORMATS,
    HarmonyFormat,
    Llama3JsonFormat,
    MistralFormat,
    PythonicFormat,
    QwenXmlFormat,
    get_format,
    near_miss_pattern,
)

FAMILY = ("harmony", "llama3_json", "mistral", "pythonic", "qwen3_coder")
NEAR_MISS = near_miss_pattern(["lookup", "convert"], r"[\[(]")


def parsed(fmt, text):
    """(kind, answer, [(name, arguments)] of the readable calls, the reason or error messages)."""
    action = get_format(fmt).parse(text, NEAR_MISS)
    calls = action.calls or []
    readable = [(c.name, c.arguments) for c in calls if c.error is None]
    errors = " | ".join([action.reason] + [c.message for c in calls if c.error is not None]).strip(" |")
    return action.kind, action.answer, readable, errors


def test_the_formats_are_registered_by_name():
    assert set(FAMILY) | {"brackets", "json"} == set(FORMATS)
    assert [type(get_format(f)) for f in FAMILY] == [
        HarmonyFormat,
        Llama3JsonFormat,
        MistralFormat,
        PythonicFormat,
        QwenXmlFormat,
    ]
    with pytest.raises(ValueError, match="llama3_json"):
        get_format("llama")


CAT = {"word": "cat"}


@pytest.mark.parametrize(
    ("fmt", "text", "kind", "calls", "error"),
    [
        # ---- harmony: commentary messages to functions.NAME, the answer in the final message
        ("harmony", ' to=functions.lookup<|channel|>commentary <|constrain|>json<|message|>{"word": "cat"}', "calls", [("lookup", CAT)], ""),
        ("harmony", '<|channel|>analysis<|message|>think [ANSWER] 1<|end|><|start|>assistant<|channel|>commentary to=functions.lookup json<|message|>{"word": "cat"}', "calls", [("lookup", CAT)], ""),
        ("harmony", ' to=functions.a<|channel|>commentary<|message|>{}<|end|><|start|>assistant to=functions.b<|channel|>commentary<|message|>"{\\"x\\": 1}"', "calls", [("a", {}), ("b", {"x": 1})], ""),
        ("harmony", ' to=functions.lookup<|channel|>commentary json<|message|>{"word": ', "calls", [], "not valid JSON"),
        ("harmony", ' to=functions.lookup<|channel|>commentary json<|message|>["cat"]', "calls", [], "not a JSON object"),
        ("harmony", ' to=functions.a<|channel|>commentary<|message|>{"x": NaN}', "calls", [], "not valid JSON"),
        ("harmony", ' to=functions.a<|channel|>commentary<|message|>{} and more', "calls", [], "not valid JSON"),
        ("harmony", ' to=functions.a<|channel|>commentary<|message|>""', "calls", [], "not a JSON object"),
        ("harmony", " to=browser.search<|channel|>commentary<|message|>{}", "calls", [], "a message to 'browser.search'"),
        ("harmony", ' to=functions.a<|channel|>commentary<|message|>{}<|end|><|start|>assistant<|channel|>final<|message|>[ANSWER] 3', "mixed", [], ""),
        ("harmony", "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>[ANSWER] 42", "answer", [], ""),
        ("harmony", "<|channel|>analysis<|message|>[ANSWER] 42", "empty", [], ""),
        ("harmony", "<|channel|>final<|message|>The answer is 42.", "other", [], ""),
        ("harmony", "[ANSWER] 42", "answer", [], ""),
        ("harmony", '{"name": "lookup", "arguments": {}}', "bad_call", [], "commentary message to functions"),
        ("harmony", "lookup(cat)", "bad_call", [], "commentary message to functions"),
        ("harmony", "no idea", "other", [], ""),
        ("harmony", "<|channel|>commentary photo=functions.x<|message|>{}", "empty", [], ""),
        # ---- llama3_json: the whole message is the call
        ("llama3_json", '{"name": "lookup", "parameters": {"word": "cat"}}', "calls", [("lookup", CAT)], ""),
        ("llama3_json", '  <|python_tag|>{"name": "lookup", "arguments": {"word": "cat"}}', "calls", [("lookup", CAT)], ""),
        ("llama3_json", '{"name": "lookup", "parameters": "{\\"word\\": \\"cat\\"}"}', "calls", [("lookup", CAT)], ""),
        ("llama3_json", '{"name": "a"}; {"name": "b", "parameters": {"x": 1}};', "calls", [("a", {}), ("b", {"x": 1})], ""),
        ("llama3_json", '{"name": "lookup", "parameters": {"word": "cat"}', "calls", [], "not valid JSON"),
        ("llama3_json", '{"name": "a"}; {"name": ', "calls", [("a", {})], "not valid JSON"),
        ("llama3_json", '{"name": "a", "parameters": {}, "arguments": {}}', "calls", [], "parameters and arguments"),
        ("llama3_json", '{"tool": "lookup"}', "calls", [], 'a tool call is {"name"'),
        ("llama3_json", '{"name": "a", "parameters": {"x": NaN}}', "calls", [], "NaN is not JSON"),
        ("llama3_json", '{"name": "a", "parameters": {"x": 1e400}}', "calls", [], "out of range"),
        ("llama3_json", '{"name": "a"} and then some', "calls", [("a", {})], "text after the tool call"),
        ("llama3_json", '{"name": "a"}\n[ANSWER] 5', "mixed", [], ""),
        ("llama3_json", 'Let me call {"name": "lookup"}', "bad_call", [], "the whole message"),
        ("llama3_json", "<|python_tag|>lookup.call(word='cat')", "bad_call", [], "<|python_tag|> is followed"),
        ("llama3_json", "[ANSWER] 42", "answer", [], ""),
        ("llama3_json", "lookup(cat)", "bad_call", [], ""),
        ("llama3_json", "<tool_call>{}</tool_call>", "bad_call", [], ""),
        ("llama3_json", "The answer is 42.", "other", [], ""),
        ("llama3_json", " \n", "empty", [], ""),
        # ---- mistral: [TOOL_CALLS] and a JSON list, or name[ARGS]{...} per call
        ("mistral", '[TOOL_CALLS][{"name": "lookup", "arguments": {"word": "cat"}}]', "calls", [("lookup", CAT)], ""),
        ("mistral", 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {}, "id": "abc123def"}, {"name": "b"}]', "calls", [("a", {}), ("b", {})], ""),
        ("mistral", '[TOOL_CALLS]lookup[ARGS]{"word": "cat"}', "calls", [("lookup", CAT)], ""),
        ("mistral", '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[CALL_ID]x1y2z3[ARGS]{"k": [1]}', "calls", [("a", {}), ("b", {"k": [1]})], ""),
        ("mistral", '[TOOL_CALLS]{"name": "a", "arguments": {}}', "calls", [("a", {})], ""),
        ("mistral", "[TOOL_CALLS]", "calls", [], "with no call after it"),
        ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {', "calls", [], "not valid JSON"),
        ("mistral", '[TOOL_CALLS]lookup{"word": "cat"}', "calls", [], "[TOOL_CALLS] is followed by"),
        ("mistral", '[TOOL_CALLS][{"name": "a"}] trailing', "calls", [("a", {})], "text after the tool call"),
        ("mistral", '[TOOL_CALLS][{"name": "a"}] [ANSWER] 3', "mixed", [], ""),
        ("mistral", '[ANSWER] 3 [TOOL_CALLS][{"name": "a"}]', "mixed", [], ""),
        ("mistral", '[{"name": "lookup", "arguments": {}}]', "bad_call", [], "starts with [TOOL_CALLS]"),
        ("mistral", "lookup[ARGS]{}", "bad_call", [], "starts with [TOOL_CALLS]"),
        ("mistral", "[ANSWER] -7", "answer", [], ""),
        ("mistral", "convert(1, km)", "bad_call", [], ""),
        ("mistral", "no idea", "other", [], ""),
        # ---- pythonic: a Python list of calls, literals only
        ("pythonic", '[lookup(word="cat")]', "calls", [("lookup", CAT)], ""),
        (
            "pythonic",
            "[convert(value=-1.5, unit='km', tags=('a', 'b'), opts={'x': None, 'y': [True, 2]}), ping()]",
            "calls",
            [("convert", {"value": -1.5, "unit": "km", "tags": ["a", "b"], "opts": {"x": None, "y": [True, 2]}}), ("ping", {})],
            "",
        ),
        ("pythonic", '<|python_start|>[lookup(word="cat")]<|python_end|>', "calls", [("lookup", CAT)], ""),
        ("pythonic", '<|python_tag|>[lookup(word="cat")]', "calls", [("lookup", CAT)], ""),
        ("pythonic", '[lookup("cat")]', "calls", [], "arguments go by name"),
        ("pythonic", "[lookup(word=cat)]", "calls", [], "cat is a name, not a literal"),
        ("pythonic", "[lookup(word=true)]", "calls", [], "write True"),
        ("pythonic", "[lookup(word=__import__('os').system('x'))]", "calls", [], "is not a literal"),
        ("pythonic", "[lookup(word=1 + 2)]", "calls", [], "binop is not a literal"),
        ("pythonic", "[lookup(word={1, 2})]", "calls", [], "a set is not a JSON value"),
        ("pythonic", "[lookup(word=1e400)]", "calls", [], "not a finite number"),
        ("pythonic", "[lookup(word=b'x')]", "calls", [], "bytes is not a JSON value"),
        ("pythonic", "[lookup(**kw)]", "calls", [], "**arguments"),
        ("pythonic", "[os.system(cmd='x')]", "calls", [], "does not call a tool by its name"),
        ("pythonic", "[lookup(word='a'), 3]", "calls", [("lookup", {"word": "a"})], "element 2 of the list is not a call"),
        ("pythonic", "[lookup(word='a', word='b')]", "calls", [], "argument word given twice"),
        ("pythonic", "[lookup(word='cat')", "bad_call", [], "'[' was never closed at line 1, column 1"),
        ("pythonic", "[lookup(word='cat')] [ANSWER] 4", "mixed", [], ""),
        ("pythonic", "I will call [lookup(word='cat')]", "bad_call", [], "the whole message"),
        ("pythonic", "lookup(word='cat')", "bad_call", [], ""),
        ("pythonic", "[ANSWER] 4", "answer", [], ""),
        ("pythonic", "[1, 2]", "other", [], ""),
        ("pythonic", "", "empty", [], ""),
        # ---- qwen3_coder: XML, values as text (typed later by the tool's schema)
        (
            "qwen3_coder",
            "<tool_call>\n<function=lookup>\n<parameter=word>\ncat\n</parameter>\n</function>\n</tool_call>",
            "calls",
            [("lookup", CAT)],
            "",
        ),
        (
            "qwen3_coder",
            "<tool_call><function=a><parameter=x>  1 </parameter><parameter=y>\n\nz\n\n</parameter></function></tool_call>"
            "\n<tool_call><function=b></function></tool_call>",
            "calls",
            [("a", {"x": "  1 ", "y": "\nz\n"}), ("b", {})],
            "",
        ),
        ("qwen3_coder", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>', "calls", [], "JSON in a <tool_call> block"),
        ("qwen3_coder", "<tool_call><parameter=x>1</parameter></tool_call>", "calls", [], "no <function=NAME>"),
        ("qwen3_coder", "<tool_call><function=a><parameter=x>1</parameter></tool_call>", "calls", [], "without </function>"),
        ("qwen3_coder", "<tool_call><function=a><parameter=x>1</function></tool_call>", "calls", [], "without </parameter>"),
        ("qwen3_coder", "<tool_call><function=a>x=1</function></tool_call>", "calls", [], "text between the parameters"),
        ("qwen3_coder", "<tool_call><function=a></function> b</tool_call>", "calls", [], "text outside <function="),
        (
            "qwen3_coder",
            "<tool_call><function=a><parameter=x>1</parameter><parameter=x>2</parameter></function></tool_call>",
            "calls",
            [],
            "given twice",
        ),
        ("qwen3_coder", "<tool_call><function=a></function>", "calls", [], "<tool_call> without </tool_call>"),
        ("qwen3_coder", "<tool_call><function=a></function></tool_call> [ANSWER] 1", "mixed", [], ""),
        ("qwen3_coder", "<function=a></function>", "bad_call", [], ""),
        ("qwen3_coder", '{"name": "lookup", "arguments": {}}', "bad_call", [], ""),
        ("qwen3_coder", "lookup[cat]", "bad_call", [], ""),
        ("qwen3_coder", "[ANSWER] 1.5", "answer", [], ""),
        ("qwen3_coder", "hmm", "other", [], ""),
    ],
)  # fmt: skip
def test_each_format_reads_its_dialect_and_says_what_is_wrong(fmt, text, kind, calls, error):
    got_kind, _, got_calls, got_error = parsed(fmt, text)
    assert (got_kind, got_calls) == (kind, calls)
    assert error in got_error if error else got_error == ""


@pytest.mark.parametrize("fmt", FAMILY)
def test_the_answer_tag_reads_as_in_every_format(fmt):
    assert parsed(fmt, "[ANSWER]: 28 or 29\nbecause")[:2] == ("answer", "28 or 29")


# ---- the schema types the XML format's text values ------------------------------------------------

XML_TOOLS = TypedEnv(tool_format="qwen3_coder").tools


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("note.text", "42", "42"),  # a string parameter keeps the text as it is
        ("note.text", " null ", " null "),
        ("note.times", " 3\n", 3),
        ("note.loud", "true", True),
        ("note.loud", "False", False),
        ("transfer.amount", "12.5", 12.5),
        ("transfer.memo", "null", None),  # a string that may be null
        ("transfer.memo", "none", "none"),
        ("audit.accounts", '["ana", "bo"]', ["ana", "bo"]),
        ("audit.depth", "full", "full"),  # an enum of strings
        ("rate.period", '{"days": 3}', {"days": 3}),
        ("rate.period", "null", None),
        ("note.times", "three", "three"),  # no JSON: the text, which the type check refuses
    ],
)
def test_xml_values_take_the_types_of_the_tool_schema(name, text, value):
    tool_name, param = name.split(".")
    call = QwenXmlFormat().parse(
        f"<tool_call><function={tool_name}><parameter={param}>{text}</parameter></function></tool_call>", None
    )
    arguments, strict = QwenXmlFormat().arguments(XML_TOOLS[tool_name.upper()], call.calls[0])
    assert arguments == {param: value} and strict
    assert type(arguments[param]) is type(value)


def test_an_xml_value_of_the_wrong_type_is_a_bad_argument_naming_it():
    env = TypedEnv(tool_format="qwen3_coder")
    env.reset(seed=0)
    call = "<tool_call><function=note><parameter=text>hi</parameter><parameter=times>three</parameter></function></tool_call>"
    obs, _, _, _, info = env.step(call)
    assert info["step_errors"] == ["bad_arguments"] and "times" in obs


# ---- round trips: an env's calls rendered in the dialect parse back exactly -------------------------

NO_SURROGATES = st.characters(blacklist_categories=("Cs",))
text = st.one_of(
    st.text(NO_SURROGATES, max_size=12),
    st.sampled_from(
        ['"', "'", "\\", "\n", "[ANSWER] 1", "]", "[", "{", "}", "<tool_call>", "); x(", "\\u0000"]
    ),
)
finite = st.floats(allow_nan=False, allow_infinity=False)
CALLS = {
    "balance": st.fixed_dictionaries({"account": text}),
    "transfer": st.fixed_dictionaries(
        {"source": text, "target": text, "amount": finite}, optional={"memo": st.one_of(st.none(), text)}
    ),
    "note": st.fixed_dictionaries({"text": text}, optional={"times": st.integers(-(2**70), 2**70), "loud": st.booleans()}),
    "audit": st.fixed_dictionaries(
        {"accounts": st.lists(text, max_size=3)}, optional={"depth": st.sampled_from(["quick", "full"])}
    ),
    "rate": st.fixed_dictionaries(
        {"currency": st.sampled_from(["eur", "usd"])},
        optional={
            "period": st.one_of(
                st.none(), st.fixed_dictionaries({"days": st.integers(-5, 10**6)}, optional={"start": text})
            )
        },
    ),
}  # fmt: skip
env_call = st.sampled_from(sorted(CALLS)).flatmap(lambda n: CALLS[n].map(lambda a: Call(n, a)))
ROUND_TRIP_ENVS = {fmt: TypedEnv(tool_format=fmt) for fmt in ("json", *FAMILY)}
# What a dialect cannot carry in a value, as its own parsers read it: the end markers (no escape
# exists), and `null` for a string that may be null in the XML (it reads as None).
CANNOT_CARRY = {
    "harmony": ("<|end|>", "<|start|>", "<|call|>", "<|return|>", "<|message|>"),
    "json": ("</tool_call>",),
    "mistral": ("[TOOL_CALLS]",),
    "qwen3_coder": ("</tool_call>", "</parameter>"),
}


def carried(fmt, call):
    values = json.dumps(call.arguments, ensure_ascii=False)
    if any(marker in values for marker in CANNOT_CARRY.get(fmt, ())):
        return False
    return not (fmt == "qwen3_coder" and call.arguments.get("memo") == "null")


@pytest.mark.parametrize("fmt", sorted(ROUND_TRIP_ENVS))
@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(env_call, min_size=1, max_size=3))
def test_rendered_calls_parse_back_exactly(fmt, calls):
    env = ROUND_TRIP_ENVS[fmt]
    calls = [c for c in calls if carried(fmt, c)]
    if not calls:
        return
    text = env.format.render_calls(env.tools, calls)
    action = env.format.parse(text, env._near_miss)
    assert action.kind == "calls", (text, action)
    assert [c.error for c in action.calls] == [None] * len(calls), (text, action)
    for call, read in zip(calls, action.calls, strict=True):
        tool = env.tools[call.name.upper()]
        arguments, strict = env.format.arguments(tool, read)
        assert read.name == tool.name and arguments == call.arguments, text
        tool.validate(arguments, strict=strict)  # the env's own check takes them


# ---- envs in each format: the oracle wins, mistakes are counted errors ------------------------------


@pytest.mark.parametrize("fmt", FAMILY)
@pytest.mark.parametrize("answer_tool", [None, "submit"])
def test_zorplex_and_a_typed_env_play_their_oracle_in_each_format(fmt, answer_tool):
    envs = [ZorplexEnv(tier=t, tool_format=fmt, answer_tool=answer_tool) for t in DIFFICULTIES]
    for env in [*envs, TypedEnv(tool_format=fmt, answer_tool=answer_tool)]:
        for seed in range(3):
            env.reset(seed=seed)
            for action in env.oracle_actions():
                obs, _, terminated, _, info = env.step(action)
                assert info["step_errors"] == [], (action, obs)
            assert terminated and obs == "CORRECT" and info["metrics"]["success"] == 1.0


@pytest.mark.parametrize("fmt", FAMILY)
def test_every_mistake_is_a_counted_error_and_a_fumbled_call_a_malformed_one(fmt):
    env = TypedEnv(tool_format=fmt, max_consecutive_errors=None, max_turns=50)
    env.reset(seed=1)
    for mistake in env.mistaken_actions():
        if mistake == "[ANSWER]":
            continue
        _, reward, terminated, _, info = env.step(mistake)
        assert len(info["step_errors"]) == 1 and reward < 0 and not terminated, (mistake, info["step_errors"])
    call = env.oracle_actions()[0]
    fumbled = env.malformed_action(call)
    assert fumbled is not None and fumbled != call
    assert env.step(fumbled)[4]["step_errors"] == ["malformed_call"]
    assert env.malformed_action("just text") is None


@pytest.mark.parametrize("fmt", FAMILY)
def test_the_error_for_a_call_outside_the_dialect_shows_the_dialect(fmt):
    env = TypedEnv(tool_format=fmt)
    env.reset(seed=0)
    example = env.format.call_example(env._tool_list[0])
    for other in ("BALANCE[ana]", "balance(account='ana')", "<tool_call>\n<function=balance>\n</function>"):
        if get_format(fmt).parse(other, env._near_miss).kind == "calls":
            continue  # the dialect's own call shape
        obs, _, _, _, info = env.step(other)
        assert info["step_errors"] == ["malformed_call"] and example in obs, (other, obs)
        env.reset(seed=0)


@pytest.mark.parametrize("fmt", FAMILY)
def test_several_calls_in_one_turn_run_in_order(fmt):
    env = TypedEnv(tool_format=fmt)
    env.reset(seed=0)
    calls = [Call("note", {"text": "a"}), Call("note", {"text": "b", "times": 2})]
    _, _, _, _, info = env.step(env.format.render_calls(env.tools, calls))
    assert info["tool_results"] == ["a", "bb"] and info["tool_calls"] == 2


@pytest.mark.parametrize(
    ("fmt", "shape"),
    [
        ("llama3_json", '{"name": <tool name>, "parameters": <JSON object>}'),
        ("mistral", '[TOOL_CALLS][{"name": <tool name>, "arguments": <JSON object>}]'),
        ("pythonic", "[func_name1(param1=value1, param2=value2), func_name2(param=value)]"),
        ("qwen3_coder", "<tool_call>\n<function=NAME>\n<parameter=NAME>\nvalue\n</parameter>"),
    ],
)
def test_the_system_prompt_teaches_the_dialect_and_a_template_gets_tools_where_it_teaches_it(fmt, shape):
    env = TypedEnv(tool_format=fmt)
    _, info = env.reset(seed=0)
    assert shape in env.system_prompt and '"name": "transfer"' in env.system_prompt
    assert ("tools" in info) == (fmt != "pythonic")  # Llama's stock templates teach JSON calls
