"""Chat templates written for the tests, with the constructs of Qwen2.5's and Qwen3's (not copies):
a tools block in the system turn built from `tools` with tojson, assistant `tool_calls`, runs of
`tool` messages grouped into one user turn of <tool_response> blocks, and (QWEN3_LIKE) think blocks
kept only after the last real user query, so earlier reasoning is dropped when a new user turn
arrives (the template is not append-only there). Plus the Hugging Face tokenizer that runs them."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_TOKENIZER = ROOT / "configs" / "assets" / "tokenizer.json"

_TOOLS_BLOCK = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call functions. Their signatures, one per line:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nCall one as JSON inside <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <name>, "arguments": <object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
"""

_TOOL_CALLS = """\
        {%- for call in message.tool_calls %}
            {%- if call.function is defined %}
                {%- set call = call.function %}
            {%- endif %}
            {%- if loop.first and not message.content %}
                {{- '<tool_call>\\n' }}
            {%- else %}
                {{- '\\n<tool_call>\\n' }}
            {%- endif %}
            {{- '{"name": "' + call.name + '", "arguments": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
"""

_TOOL_MESSAGES = """\
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
"""

QWEN25_LIKE = (
    _TOOLS_BLOCK
    + """\
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
"""
    + _TOOL_CALLS
    + """\
        {{- '<|im_end|>\\n' }}
"""
    + _TOOL_MESSAGES
    + """\
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
)

QWEN3_LIKE = (
    _TOOLS_BLOCK
    + """\
{%- set ns = namespace(last_query=messages|length - 1, searching=true) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.searching and message.role == 'user' and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.searching = false %}
        {%- set ns.last_query = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content or '' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
"""
    + _TOOL_CALLS
    + """\
        {{- '<|im_end|>\\n' }}
"""
    + _TOOL_MESSAGES
    + """\
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
)

# The Qwen3-like think rules without a tools block: a renderer that cannot write tools, so the
# runner sends env replies as `observation_role` messages (user turns: earlier reasoning dropped).
QWEN3_NO_TOOLS = QWEN3_LIKE.replace("{%- if tools %}", "{%- if false %}", 1)

TEMPLATES = {"qwen25_like": QWEN25_LIKE, "qwen3_like": QWEN3_LIKE}


def hf_tokenizer(template: str):
    """transformers' tokenizer from the shipped tokenizer.json with `template` (the reference)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(SHIPPED_TOKENIZER),
        chat_template=template,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


def hf_ids(hf, messages, tools=None, add_generation_prompt=False, **kwargs) -> list[int]:
    """`apply_chat_template(..., tokenize=True)` as a plain list of ids."""
    out = hf.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    ids = out["input_ids"] if not isinstance(out, list) else out
    return list(ids)
