"""At the start of `toolgym train`, the env's tool-call format is set against the policy's chat
template: a family's format with a template that has no tools block (or plain ChatML) is a
warning naming both; a template that teaches another format than the env's is a note with the
--set that matches it; nothing when they agree, nor for brackets without a tools block (the seed
experiment). Neither stops the run. The template read is the one the run renders with (model.path's
own when policy.chat_template is unset); `toolgym record` and `eval` print the same lines, naming
their flags."""

from __future__ import annotations

from pathlib import Path

from toolgym.configs.checks import tool_format_notes
from toolgym.configs.cli.main import main

# A ChatML template without a tools block (it is handed tools and never writes them).
NO_TOOLS = """{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# A ChatML template that writes its tools and teaches Qwen3-Coder's XML calls (as Qwen3-Coder's
# template does: <function=NAME> and <parameter=NAME> inside <tool_call>), each tool result a
# user turn of <tool_response>.
QWEN3_CODER_LIKE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n<function>\\n<name>' ~ tool.function.name ~ '</name>\\n</function>' }}{%- endfor %}
    {{- '\\n</tools>\\n\\nTo call a function reply with:\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first and tools %}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# shop_tiny (Shop-v0, json calls by default, the shipped qwen2.5-style template), cut to one RL
# step of one small group on a tiny random model: no SFT, no eval, no checkpoint, no export.
SMALL = [
    "run.steps=1", "run.export_hf=false", "run.plot=false", "sft.enabled=false",
    "model.name='test'", "model.overrides={vocab_size=1024}", "policy.max_batch_size=8",
    "rollout.group_size=2", "batch.groups_per_batch=1", "batch.dynamic_sampling=false",
    "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0",
    "checkpoint.every_steps=0", "checkpoint.at_end=false",
]  # fmt: skip


def start_lines(tmp_path: Path, capsys, *overrides: str, preset: str = "shop_tiny") -> list[str]:
    """`toolgym train PRESET` with SMALL and `overrides`: it runs to the end (exit code 0); the
    warning and note lines it printed about tool-call formats."""
    args = ["train", preset, "--no-progress", "--set", f"run.run_dir='{tmp_path / 'run'}'"]
    for item in [*SMALL, *overrides]:
        args += ["--set", item]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "done in" in out, out + err
    return [line for line in (out + err).splitlines() if "tool" in line and line.startswith(("warning:", "note:"))]


def template(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return f"policy.chat_template='{path}'"


def test_a_family_format_on_a_template_without_tools_is_a_warning_naming_both(tmp_path, capsys):
    path = tmp_path / "no_tools.jinja"
    (line,) = start_lines(
        tmp_path, capsys, "env.kwargs.tool_format='mistral'", template(tmp_path, path.name, NO_TOOLS)
    )
    assert line == (
        f"warning: env.kwargs.tool_format = 'mistral', but the chat template of model 'test' ({path}) "
        "has no tools block: the model is never shown the tools in that format (only the env's "
        "system prompt describes them)"
    )


def test_a_family_format_on_plain_chatml_is_a_warning(tmp_path, capsys):
    # Shop-v0 speaks json by default; plain ChatML writes no tools
    (line,) = start_lines(tmp_path, capsys, "policy.chat_template=''")
    assert line.startswith("warning: toolgym/Shop-v0's tool_format is 'json' (its default), but model 'test' ")
    assert "plain ChatML" in line and "no tools block" in line


def test_a_template_that_speaks_another_format_gets_a_note_with_the_setting(tmp_path, capsys):
    path = tmp_path / "coder.jinja"
    (line,) = start_lines(tmp_path, capsys, template(tmp_path, path.name, QWEN3_CODER_LIKE))
    assert line == (
        f"note: the chat template of model 'test' ({path}) speaks 'qwen3_coder' tool calls; "
        "toolgym/Shop-v0's tool_format is 'json' (its default) "
        "(--set env.kwargs.tool_format=qwen3_coder to match)"
    )


def test_brackets_on_a_template_with_tools_gets_the_note(tmp_path, capsys):
    (line,) = start_lines(tmp_path, capsys, "env.kwargs.tool_format='brackets'")
    assert line.startswith("note: the chat template of model 'test' (")
    assert line.endswith(
        "speaks 'json' tool calls; env.kwargs.tool_format = 'brackets' (--set env.kwargs.tool_format=json to match)"
    )


def test_matching_formats_and_brackets_without_tools_are_silent(tmp_path, capsys):
    assert start_lines(tmp_path / "a", capsys) == []  # json calls, a json template
    coder = template(tmp_path, "coder.jinja", QWEN3_CODER_LIKE)
    assert start_lines(tmp_path / "b", capsys, "env.kwargs.tool_format='qwen3_coder'", coder) == []
    no_tools = template(tmp_path, "no_tools.jinja", NO_TOOLS)
    assert start_lines(tmp_path / "c", capsys, "env.kwargs.tool_format='brackets'", no_tools) == []
    assert start_lines(tmp_path / "d", capsys, "env.kwargs.tool_format='brackets'", "policy.chat_template=''") == []


def model_dir(tmp_path: Path, chat_template: str) -> Path:
    """A tiny random model as a Hugging Face directory whose tokenizer_config.json carries
    `chat_template` (the shipped tokenizer, ChatML specials)."""
    from toolgym.agents.model.checkpoint import save_hf_checkpoint
    from toolgym.agents.model.config import NAMED_CONFIGS, ModelConfig
    from toolgym.agents.model.transformer import build_model
    from toolgym.configs.load import SHIPPED_TOKENIZER

    config = ModelConfig(**{**NAMED_CONFIGS["test"], "vocab_size": 1024})
    directory = tmp_path / "hf_model"
    save_hf_checkpoint(build_model(config, seed=0), config, directory, SHIPPED_TOKENIZER, chat_template=chat_template)
    return directory


def test_a_model_directory_s_own_template_is_the_one_rendered_and_read(tmp_path, capsys):
    # no policy.chat_template: the run renders with model.path's tokenizer_config.json template
    directory = model_dir(tmp_path, QWEN3_CODER_LIKE)
    small = [item for item in SMALL if not item.startswith("model.")]
    args = ["train", "shop_tiny", "--no-progress", "--set", f"run.run_dir='{tmp_path / 'run'}'"]
    for item in [*small, f"model.path='{directory}'", "policy.chat_template=''"]:
        args += ["--set", item]
    assert main(args) == 0
    out, err = capsys.readouterr()
    lines = [line for line in (out + err).splitlines() if line.startswith(("warning:", "note:")) and "tool" in line]
    assert lines == [
        f"note: the chat template of model '{directory}' ({directory / 'tokenizer_config.json'}) speaks "
        "'qwen3_coder' tool calls; toolgym/Shop-v0's tool_format is 'json' (its default) "
        "(--set env.kwargs.tool_format=qwen3_coder to match)"
    ]
    # the one decision of the run's template names it
    from toolgym.configs.assembly.parts import run_chat_template
    from toolgym.configs.load import load_config

    config, _ = load_config("shop_tiny", [f"model.path='{directory}'", "policy.chat_template=''"])
    assert run_chat_template(config) == str(directory / "tokenizer_config.json")
    # and it agrees with qwen3_coder calls: silent
    args += ["--set", "env.kwargs.tool_format='qwen3_coder'", "--set", f"run.run_dir='{tmp_path / 'run2'}'"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert not [line for line in (out + err).splitlines() if line.startswith(("warning:", "note:")) and "tool" in line]


def command_lines(capsys, *args: str) -> list[str]:
    assert main(list(args)) == 0
    out, err = capsys.readouterr()
    return [line for line in (out + err).splitlines() if line.startswith(("warning:", "note:")) and "tool" in line]


def test_record_and_eval_print_the_same_lines_with_their_flags(tmp_path, capsys):
    coder = tmp_path / "coder.jinja"
    coder.write_text(QWEN3_CODER_LIKE)
    common = ["--env", "toolgym/Shop-v0", "--policy", "oracle", "--max-turns", "4"]
    record = ["record", *common, "--tasks", "1", "--no-progress", "--out", str(tmp_path / "r.jsonl")]
    assert command_lines(capsys, *record, "--chat-template", str(coder)) == [
        f"note: the chat template of policy 'oracle' ({coder}) speaks 'qwen3_coder' tool calls; "
        "toolgym/Shop-v0's tool_format is 'json' (its default) "
        "(--env-kwargs '{\"tool_format\": \"qwen3_coder\"}' to match)"
    ]
    evaluate = ["eval", *common, "--tasks", "2", "--examples", "0"]
    (line,) = command_lines(capsys, *evaluate, "--env-kwargs", '{"tool_format": "mistral"}')
    assert line == (
        "warning: --env-kwargs' tool_format = 'mistral', but policy 'oracle' renders through plain ChatML "
        "(--chat-template is unset), which has no tools block: the model is never shown the tools in "
        "that format (only the env's system prompt describes them)"
    )
    assert command_lines(capsys, *evaluate, "--chat-template", str(coder), "--env-kwargs", '{"tool_format": "qwen3_coder"}') == []


def test_the_start_checks_and_the_notes_make_the_env_once(tmp_path):
    import gymnasium
    import torch

    from toolgym.configs.assembly.parts import build_renderer, model_config
    from toolgym.configs.checks import check_against_machine, check_environment, start_env
    from toolgym.configs.load import load_config

    made = []

    def counted(**kwargs):
        made.append(kwargs)
        return gymnasium.spec("toolgym/Shop-v0").make(**kwargs).unwrapped

    gymnasium.register("toolgym_test/CountedShop-v0", entry_point=counted)
    try:
        config, _ = load_config("shop_tiny", [*SMALL, "env.id='toolgym_test/CountedShop-v0'", "env.kwargs={tool_format='mistral'}"])
        renderer, _ = build_renderer(config)
        with start_env(config) as env:
            check_environment(config, 1, env)
            check_against_machine(config, model_config(config), renderer, torch.device("cpu"), env)
            (line,) = tool_format_notes(config, renderer, env)
        assert made == [{"tool_format": "mistral"}]
        assert line.startswith("note: the chat template of model 'test' (") and "speaks 'json' tool calls" in line
    finally:
        gymnasium.registry.pop("toolgym_test/CountedShop-v0")
