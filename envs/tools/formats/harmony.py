"""The "harmony" format (gpt-oss; the renderer is agents/harmony.py): a turn is harmony messages,
and a call is a `commentary` message addressed to a function, its arguments a JSON object:
    <|channel|>analysis<|message|>I need a's value.<|end|><|start|>assistant to=functions.lookup<|channel|>commentary <|constrain|>json<|message|>{"key": "a"}
(the recipient may also follow the channel: `<|channel|>commentary to=functions.lookup json`).
The answer is the `final` message, read as any format reads text: its `[ANSWER]` tag, else the
env's grader decides (OTHER). `analysis` messages are the model's reasoning and never parsed.
An env reads this text only through HarmonyRenderer (its `action_text` keeps the markup).

- Every call message counts, in order. Arguments that are not a JSON object (or a JSON string
  holding one), and a message to a recipient outside `functions.`, are malformed calls.
- Calls together with a final `[ANSWER]` are an error (`mixed_call_and_answer`), not a guess.
- Without markup (a model that has not learnt the format), a JSON call object or a known tool's
  name followed by `(` or `[` is a malformed call; other text is read as a final message.
- Results come back as the text of each call's tool message (the renderer writes the harmony
  message from the function to the assistant around it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from ..typed import Call, Tool
from .base import (
    ANSWER,
    ANSWER_TAG_RE,
    BAD_CALL,
    CALLS,
    EMPTY,
    MIXED,
    OTHER,
    ParsedAction,
    ParsedCall,
    ToolCallFormat,
    after_tag,
    foreign_call,
    near_miss_pattern,
)
from .json_calls import BARE_CALL_RE, call_from_object, malformed

_SHAPE: Final = "a tool call is a commentary message to functions.<name> whose content is a JSON object"
_PREFIX: Final = "functions."
MESSAGE: Final = "<|message|>"
# One message of a turn: its header (channel, recipient, content type, before <|message|>), then
# its content up to the token that ends it or the end of the text. The text after the generation
# prompt `<|start|>assistant` starts with the first message's header.
_MESSAGE_RE: Final = re.compile(
    r"(?:^|<\|start\|>assistant)(?P<header>(?:(?!<\|start\|>).)*?)<\|message\|>"
    r"(?P<content>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|$)",
    re.DOTALL,
)
_TO_RE: Final = re.compile(r"\bto=([^\s<]+)")  # as agents/harmony.py reads a recipient
_CHANNEL_RE: Final = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


def messages_of(text: str) -> list[tuple[str, str, str]]:
    """(channel, recipient, content) of each harmony message in a turn's text."""
    out = []
    for m in _MESSAGE_RE.finditer(text):
        header = m.group("header")
        to, channel = _TO_RE.search(header), _CHANNEL_RE.search(header)
        out.append((channel.group(1) if channel else "", to.group(1) if to else "", m.group("content")))
    return out


class HarmonyFormat(ToolCallFormat):
    name = "harmony"
    template_tools = True  # the renderer writes the tools' namespace in the developer message

    def near_miss(self, tool_names: Iterable[str]) -> re.Pattern[str] | None:
        return near_miss_pattern(tool_names)

    def parse(self, text: str, near_miss: re.Pattern[str] | None) -> ParsedAction:
        if MESSAGE not in text:
            if (
                BARE_CALL_RE.search(text)
                or foreign_call(text)
                or (near_miss is not None and near_miss.search(text))
            ):
                return ParsedAction(BAD_CALL, reason=_SHAPE)
            return self._answer(text)
        messages = messages_of(text)
        calls = [self._call(to, content) for _, to, content in messages if to]
        final = "\n".join(content for channel, to, content in messages if channel == "final" and not to)
        if calls:
            return ParsedAction(MIXED) if ANSWER_TAG_RE.search(final) else ParsedAction(CALLS, calls=calls)
        return self._answer(final)

    @staticmethod
    def _answer(text: str) -> ParsedAction:
        tag = ANSWER_TAG_RE.search(text) if "[" in text else None
        if tag is not None:
            return ParsedAction(ANSWER, after_tag(text, tag.end()))
        return ParsedAction(EMPTY if not text.strip() else OTHER)

    @staticmethod
    def _call(recipient: str, content: str) -> ParsedCall:
        """The call a message to `recipient` makes, its arguments read as the JSON dialects read
        them (json_calls: no NaN or infinity, a JSON string holding the object read too)."""
        if not recipient.startswith(_PREFIX) or len(recipient) == len(_PREFIX):
            return malformed(f"ERROR: a message to {recipient[:40]!r}; {_SHAPE}.", recipient)
        name = recipient[len(_PREFIX) :]
        call = call_from_object({"name": name, "arguments": content}, ("arguments",), _SHAPE)
        if call.error is None and isinstance(call.arguments, str) and call.arguments.strip():
            call = call_from_object({"name": name, "arguments": call.arguments}, ("arguments",), _SHAPE)
        if call.error is None and not isinstance(call.arguments, dict):
            return malformed(f"ERROR: the arguments are not a JSON object; {_SHAPE}.", name)
        return call

    def arguments(self, tool: Tool, call: ParsedCall) -> tuple[Any, bool]:
        return call.arguments, True

    def render_call(self, tool: Tool | None, call: Call) -> str:
        """A call as harmony writes it after `<|start|>assistant` (the canonical form)."""
        name = tool.name if tool is not None else call.name
        body = json.dumps(call.arguments, ensure_ascii=False)
        return f" to={_PREFIX}{name}<|channel|>commentary <|constrain|>json<|message|>{body}"

    def render_calls(self, tools: Mapping[str, Tool], calls: Sequence[Call]) -> str:
        # one message each; all but the last end with <|end|> (a turn stops at its <|call|>). gpt-oss
        # calls one function a turn: an oracle that writes several teaches what it does not sample.
        rendered = [self.render_call(tools.get(c.name.upper()), c) for c in calls]
        return "<|end|><|start|>assistant".join(rendered)

    def result(self, tool_name: str, call: ParsedCall, text: str) -> str:
        return text

    def describe(self, tools: Sequence[Tool], finish: str) -> list[str]:
        if not tools:
            return [finish]
        return [
            "Call a tool with a commentary message to functions.<name>, its arguments a JSON object; "
            f"the result comes back from the function. {finish}"
        ]

    def call_example(self, tool: Tool | None) -> str:
        name = tool.name if tool is not None else "name"
        return f" to={_PREFIX}{name}<|channel|>commentary <|constrain|>json<|message|>{{...}}"

    def malformed(self, action: str) -> str | None:
        """The first call's JSON without its last closing brace."""
        for m in _MESSAGE_RE.finditer(action):
            if _TO_RE.search(m.group("header")):
                cut = m.group("content").rfind("}")
                return (
                    None
                    if cut < 0
                    else action[: m.start("content") + cut] + action[m.start("content") + cut + 1 :]
                )
        return None

    def mistakes(self, tools: Sequence[Tool]) -> tuple[str, ...]:
        if not tools:
            return ("", "[ANSWER]", "I am not sure.")
        name = tools[0].name
        call = f" to={_PREFIX}{{}}<|channel|>commentary <|constrain|>json<|message|>{{}}"
        return (
            call.format(name, '{"a": '),
            call.format("foo", "{}"),
            "",
            call.format(name, '{"nonexistent": 1}'),
            call.format(name, "[1, 2]"),
            "<|channel|>final<|message|>[ANSWER]",
            "<|channel|>final<|message|>I am not sure.",
            f'{{"name": "{name}", "arguments": {{}}}}',
        )
