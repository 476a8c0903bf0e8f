"""A chat template's source names the tool-call format it teaches (template_tool_format): each
family's template, as the family writes its tools block and calls, maps to its format; a template
without tools, or in a dialect toolgym has no format for, maps to None.

The fixtures are short templates in each family's own constructs (the markers, the instruction
lines that state the call shape, the way a call is written back), not the whole stock templates."""

import pytest

from toolgym.envs.tools.call_formats import FORMATS, template_tool_format

# Qwen2.5 / Qwen3 (Hermes-style): JSON inside <tool_call> tags, the tools listed in <tools>; the
# tool definitions themselves carry a "parameters" key, which must not read as Llama's calls.
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "assistant" and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- for tool_call in message.tool_calls %}
            {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.function.name }}{{- '", "arguments": ' }}
            {{- tool_call.function.arguments | tojson }}{{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# Hermes 2 Pro: the tool definitions written key by key, with ', "parameters": ' among them.
HERMES = r"""{{- bos_token }}
{%- if tools %}
    {{- "You are a function calling AI model. Here are the available tools: <tools> " }}
    {%- for tool in tools %}
        {{- '{"type": "function", "function": {"name": "' + tool.function.name + '"' }}
        {{- ', "parameters": ' }}{{- tool.function.parameters | tojson }}{{- "}}" }}
    {%- endfor %}
    {{- " </tools>For each function call return a json object within <tool_call></tool_call> XML tags:\n<tool_call>\n" }}
    {{- '{"name": <function-name>, "arguments": <args-dict>}\n</tool_call><|im_end|>' }}
{%- endif %}
{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endfor %}
"""

# Qwen3-Coder: XML calls, <function=NAME> and <parameter=NAME> nested in <tool_call>.
QWEN3_CODER = r"""{%- if tools is iterable and tools | length > 0 %}
    {{- "\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}{{- "\n<function>\n<name>" ~ tool.function.name ~ "</name>\n</function>" }}{%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "assistant" and message.tool_calls %}
        {%- for tool_call in message.tool_calls %}
            {{- '\n<tool_call>\n<function=' + tool_call.function.name + '>\n' }}
            {%- for args_name, args_value in tool_call.function.arguments|items %}
                {{- '<parameter=' + args_name + '>\n' }}{{- args_value }}{{- '\n</parameter>\n' }}
            {%- endfor %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
    {%- endif %}
{%- endfor %}
"""

# Mistral 7B v0.3 / Nemo: [AVAILABLE_TOOLS] before the last user turn, calls after [TOOL_CALLS].
MISTRAL = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS] ' + tools|tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
        {{- '[INST] ' + message.content + '[/INST]' }}
    {%- elif message.tool_calls %}
        {{- '[TOOL_CALLS] ' + message.tool_calls|tojson + eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content|tojson + '}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- message.content + eos_token }}
    {%- endif %}
{%- endfor %}
"""

# Mistral Small 3.2 / Devstral (v11+): [TOOL_CALLS]NAME[ARGS]{...}; the system prompt names JSON.
MISTRAL_V11 = r"""{{- bos_token }}{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + tools|tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- for message in messages %}
    {%- if message.tool_calls %}
        {%- for call in message.tool_calls %}
            {{- '[TOOL_CALLS]' + call.function.name + '[ARGS]' + call.function.arguments|tojson }}
        {%- endfor %}{{- eos_token }}
    {%- endif %}
{%- endfor %}
"""

# Llama 3.1: the JSON call shape stated in the instructions; built-in tools after <|python_tag|>.
LLAMA31 = r"""{{- bos_token }}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
{%- endif %}
{%- for message in messages %}
    {%- if 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}{{- ")" }}
        {%- else %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
"""

# Llama 3.2 (JSON tool calling): the same instructions in a double-quoted Jinja string (the quotes
# escaped), no <|python_tag|>.
LLAMA32_JSON = r"""{%- if tools is not none %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call. " }}
    {{- "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}. " }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{%- endfor %}
{%- endif %}
"""

# Llama 3.2 (pythonic) / Llama 4: a python list of calls, stated in the instructions.
LLAMA32_PYTHONIC = r"""{%- if tools is not none %}
    {{- "You have access to the following functions. To call functions, please respond with a python list of the calls. " }}
    {{- 'Respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)] ' }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{%- endfor %}
{%- endif %}
{%- for message in messages %}
    {%- if 'tool_calls' in message %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n[' -}}
        {%- for tool_call in message.tool_calls %}{{- tool_call.function.name + '()' -}}{%- endfor %}
        {{- ']<|eot_id|>' -}}
    {%- endif %}
{%- endfor %}
"""

LLAMA4_PYTHONIC = r"""{%- if tools is not none %}
    {{- "<|header_start|>system<|header_end|>\n\n" }}
    {{- "Here is a list of functions in JSON format that you can invoke. Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]\n" }}
    {{- tools | tojson(indent=4) }}{{- "<|eot|>" }}
{%- endif %}
"""

# Plain ChatML: no tools block at all.
CHATML = r"""{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# Granite 3: its own <|tool_call|> token, a dialect toolgym has no format for.
GRANITE = r"""{%- if tools %}
    {{- '<|start_of_role|>available_tools<|end_of_role|>' }}{{- tools | tojson(indent=4) }}{{- '<|end_of_text|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.tool_calls %}{{- '<|tool_call|>' + message.tool_calls | tojson }}{%- endif %}
{%- endfor %}
"""

# Pythonic calls wrapped in <tool_call> tags: neither toolgym's json nor its pythonic format.
PYTHONIC_IN_TAGS = r"""{{- "Call tools by writing a list inside <tool_call> </tool_call> tags, e.g. <tool_call> [func_name1(params_name1=params_value1), func_name2(params)] </tool_call>" }}"""


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN25, "json"),
        (HERMES, "json"),
        (QWEN3_CODER, "qwen3_coder"),
        (MISTRAL, "mistral"),
        (MISTRAL_V11, "mistral"),
        (LLAMA31, "llama3_json"),
        (LLAMA32_JSON, "llama3_json"),
        (LLAMA32_PYTHONIC, "pythonic"),
        (LLAMA4_PYTHONIC, "pythonic"),
        (CHATML, None),
        (GRANITE, None),
        (PYTHONIC_IN_TAGS, None),
        ("", None),
    ],
    ids=[
        "qwen2.5", "hermes", "qwen3-coder", "mistral", "mistral-v11", "llama3.1", "llama3.2-json",
        "llama3.2-pythonic", "llama4-pythonic", "chatml", "granite", "pythonic-in-tags", "empty",
    ],
)  # fmt: skip
def test_a_template_names_the_format_its_family_writes(template, expected):
    assert template_tool_format(template) == expected
    assert expected is None or expected in FORMATS


def test_the_built_in_tool_tag_alone_is_llama3_json():
    # a Llama 3.1 template whose instructions were edited away still writes <|python_tag|>
    assert template_tool_format('{{- "<|python_tag|>" + tool_call.name }}') == "llama3_json"


def test_qwen3_coder_wins_over_the_tool_call_tags_it_shares_with_qwen():
    # the order matters: Qwen3-Coder's template also holds <tool_call>, and a Qwen2.5 template
    # followed by a Qwen3-Coder one (in one file) still reads as Qwen3-Coder
    assert "<tool_call>" in QWEN3_CODER
    assert template_tool_format(QWEN25 + QWEN3_CODER) == "qwen3_coder"
    # a <function= without any <parameter= is not Qwen3-Coder's call shape
    assert template_tool_format(QWEN25.replace("<tool_call>", "<tool_call><function=")) == "json"
