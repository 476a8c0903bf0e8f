"""gpt-oss's harmony format, token in and token out: a `Renderer` (agents/chat.py) of its own.

    <|start|>system<|message|>{identity, dates, reasoning effort, the valid channels}<|end|>
    <|start|>developer<|message|># Instructions\\n\\n{the env's system prompt}\\n\\n# Tools ...<|end|>
    <|start|>user<|message|>{the task}<|end|>
    <|start|>assistant                                              <- generation prompt
      <|channel|>analysis<|message|>{reasoning}<|end|>                 (sampled)
      <|start|>assistant<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{"key": "a"}<|call|>
    <|start|>functions.lookup to=assistant<|channel|>commentary<|message|>{the result}<|end|>
    <|start|>assistant
      <|channel|>final<|message|>{the answer}<|return|>                (sampled)

The tools are a TypeScript-like `namespace functions` in the developer message, written from
their JSON schemas. A sampled turn stops on `<|call|>` or `<|return|>` and may hold several
messages (reasoning, then a call or the final answer).

What an env reads (`action_text`): the sampled turn decoded with harmony's own tokens kept
(`<|channel|>`, `<|message|>`, ...) and the stop token dropped, so the "harmony" tool-call format
(envs/tools/formats/harmony.py) finds calls in `commentary` messages addressed to
`functions.NAME` and the answer in the `final` one. `action_tokens` is the inverse for scripted
policies: markup by id, text encoded, and the stop token a call or an answer ends with; text
without markup is a final message.

Token in, token out (`HarmonyEpisode`): after a turn that ended with `<|call|>`, each tool result
is a message from the function the turn called (in order) to the assistant, then the generation
prompt: the delta is appended and the sampled tokens stay verbatim. After any other turn (a final
answer followed by a user message, a turn cut at max_tokens) the conversation is rendered again
canonically and the turn restarts from it (a new training sequence, `RenderedTurn.restarted`), as
harmony renders a history: a final answer ends with `<|end|>`, not `<|return|>`, and the
reasoning before an earlier turn's final answer is dropped.

Message text is encoded with special-token strings as plain text (a tool result holding
"<|call|>" cannot end a turn); harmony's tokens are inserted by id, only by this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from tokenizers import Tokenizer

from .chat import RenderedTurn
from .tokenizer import encode_text, text_tokenizer
from .types import Message

HARMONY = "harmony"  # policy.chat_template's name for this format
HARMONY_OPTIONS = ("model_identity", "knowledge_cutoff", "current_date", "reasoning_effort")
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
ENDOFTEXT = "<|endoftext|>"
MARKUP = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = (END, CALL, RETURN)
# Harmony's special tokens in a decoded turn, and a header's parts.
_SPLIT = re.compile("(" + "|".join(map(re.escape, MARKUP)) + ")")
_RECIPIENT = re.compile(r"\s*\bto=([^\s<]+)")
_AUTHOR = re.compile(r"[^\s<]*")
FUNCTIONS = "functions"


class HarmonyMessage(NamedTuple):
    """One harmony message: `author` (assistant, user, functions.NAME, ...), `channel`
    (analysis, commentary, final; "" for none), `recipient` (functions.NAME, assistant; ""),
    `content_type` (`<|constrain|>json`, json; ""), `content`, and the token that `end`s it
    (`<|end|>`, `<|call|>`, `<|return|>`; "" when the text stops first)."""

    author: str
    content: str
    channel: str = ""
    recipient: str = ""
    content_type: str = ""
    end: str = END


def parse_turn(text: str) -> list[HarmonyMessage]:
    """The messages of a sampled turn's `action_text` (it starts after the generation prompt
    `<|start|>assistant`; a later `<|start|>` names its author). Text without `<|message|>` is one
    final message (as the "harmony" tool-call format reads it); a header the turn stopped in is a
    message without content. Never raises."""
    if MESSAGE not in text:
        return [HarmonyMessage("assistant", text, "final", end="")] if text.strip() else []
    messages: list[HarmonyMessage] = []
    for i, chunk in enumerate(text.split(START)):
        author = "assistant"
        if i > 0:  # "<|start|>assistant<|channel|>..."
            author = _AUTHOR.match(chunk).group(0) or "assistant"  # type: ignore[union-attr]
            chunk = chunk[len(author) :] if chunk.startswith(author) else chunk
        if not chunk.strip():
            continue
        header, sep, body = chunk.partition(MESSAGE)
        if not sep:  # a header that never got to its content
            messages.append(HarmonyMessage(author, "", *_header(header), end=""))
            continue
        at, end = min(((body.find(e), e) for e in ENDS if e in body), default=(len(body), ""))
        messages.append(HarmonyMessage(author, body[:at], *_header(header), end=end))
    return messages


def _header(header: str) -> tuple[str, str, str]:
    """(channel, recipient, content type) of an assistant header such as
    `<|channel|>commentary to=functions.lookup <|constrain|>json` (the recipient may also come
    before the channel)."""
    recipient = ""
    found = _RECIPIENT.search(header)
    if found:
        recipient = found.group(1)
        header = header[: found.start()] + " " + header[found.end() :]
    channel, content_type = "", ""
    if CHANNEL in header:
        after = header.split(CHANNEL, 1)[1].strip()
        channel, _, rest = after.partition(" ")
        if CONSTRAIN in channel:
            channel, _, rest = channel.partition(CONSTRAIN)
            rest = CONSTRAIN + rest
        content_type = rest.strip()
    elif CONSTRAIN in header:
        content_type = CONSTRAIN + header.split(CONSTRAIN, 1)[1].strip()
    return channel, recipient, content_type


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The developer message's tools section: OpenAI function specs as `namespace functions`."""
    lines = ["# Tools", "", f"## {FUNCTIONS}", "", f"namespace {FUNCTIONS} {{", ""]
    for tool in tools:
        spec = tool.get("function", tool)
        if spec.get("description"):
            lines += [f"// {line}" for line in str(spec["description"]).splitlines()]
        params = spec.get("parameters") or {}
        if "properties" in params:
            lines += [f"type {spec['name']} = (_: {{", *_properties(params), "}) => any;", ""]
        else:
            lines += [f"type {spec['name']} = () => any;", ""]
    lines.append(f"}} // namespace {FUNCTIONS}")
    return "\n".join(lines)


def _properties(schema: Mapping[str, Any]) -> list[str]:
    """One object's fields as harmony writes them (openai_harmony 0.0.8's rendering, its nested
    objects' indentation included)."""
    required = set(schema.get("required") or ())
    lines = []
    for name, prop in (schema.get("properties") or {}).items():
        description = str(prop.get("description") or "")
        lines += [f"// {line}" for line in description.splitlines()]
        field = name + ("" if name in required else "?")
        default = f" // default: {_literal(prop['default'])}" if "default" in prop else ""
        if "oneOf" in prop or "anyOf" in prop:
            choices = prop.get("oneOf") or prop.get("anyOf") or []
            lines += [f"{field}:", *(f" | {_type(c)}" for c in choices), f",{default}"]
        elif prop.get("type") == "object" and prop.get("properties"):
            comment = f"     // {description}" if description else ""
            inner = [f"    {line}" for line in _properties(prop)]
            lines += [f"{field}:{comment}", "{", *inner, "    },"]
        else:
            lines.append(f"{field}: {_type(prop)},{default}")
    return lines


def _type(prop: Mapping[str, Any]) -> str:
    if "enum" in prop:
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in prop["enum"])
    kind = prop.get("type")
    if isinstance(kind, list):
        return " | ".join(_type({**prop, "type": k}) for k in kind)
    if kind == "array":
        items = prop.get("items") or {}
        return f"{_type(items)}[]" if items else "any[]"
    return {
        "string": "string",
        "integer": "number",
        "number": "number",
        "boolean": "boolean",
        "null": "null",
    }.get(str(kind), "any")


def _literal(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class HarmonyRenderer:
    """The harmony `Renderer` for one tokenizer, which must have harmony's special tokens
    (gpt-oss's o200k_harmony does). Thread-safe; holds no conversation.

    The system message: `model_identity`, `knowledge_cutoff`, `current_date` ("" leaves it
    out: rollouts stay reproducible), `reasoning_effort` (low, medium, high) and the channels.
    """

    renders_tools = True  # the developer message holds the tools' namespace

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        model_identity: str = "You are ChatGPT, a large language model trained by OpenAI.",
        knowledge_cutoff: str = "2024-06",
        current_date: str = "",
        reasoning_effort: str = "medium",
    ) -> None:
        if reasoning_effort not in ("low", "medium", "high"):
            raise ValueError(f"reasoning_effort must be low, medium or high, got {reasoning_effort!r}")
        self.tokenizer = tokenizer
        self._text_tokenizer = text_tokenizer(tokenizer)
        self.ids: dict[str, int] = {}
        for token in MARKUP:
            token_id = tokenizer.token_to_id(token)
            if token_id is None:
                raise ValueError(f"the tokenizer has no {token!r} token, which the harmony format needs")
            self.ids[token] = token_id
        self.names = {i: t for t, i in self.ids.items()}
        self.endoftext_id: int | None = tokenizer.token_to_id(ENDOFTEXT)
        self.identity = model_identity
        self.knowledge_cutoff, self.current_date = knowledge_cutoff, current_date
        self.reasoning_effort = reasoning_effort

    @classmethod
    def with_options(cls, tokenizer: Tokenizer, options: Mapping[str, Any]) -> HarmonyRenderer:
        """The renderer with `options` (a config's chat_template_kwargs, a recording's); a name
        that is not one of HARMONY_OPTIONS is a ValueError listing them."""
        unknown = sorted(set(options) - set(HARMONY_OPTIONS))
        if unknown:
            raise ValueError(
                f"harmony has no option {', '.join(map(repr, unknown))}; its options: {', '.join(HARMONY_OPTIONS)}"
            )
        return cls(tokenizer, **options)

    # ---- properties (as ChatRenderer's) ------------------------------------------------------

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """`<|return|>` (an answer) and `<|call|>` (a tool call) end a sampled turn."""
        return (self.ids[RETURN], self.ids[CALL])

    @property
    def im_end_id(self) -> int:
        """`<|return|>`: the end of an answering turn."""
        return self.ids[RETURN]

    @property
    def pad_id(self) -> int:
        return self.endoftext_id if self.endoftext_id is not None else self.ids[END]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def generation_prompt(self) -> list[int]:
        """`<|start|>assistant`."""
        return [self.ids[START], *self.encode("assistant")]

    # ---- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Encode plain text. Special-token strings in `text` stay text; nothing is added around it."""
        return encode_text(self._text_tokenizer, text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def action_text(self, ids: Sequence[int]) -> str:
        """A sampled turn as an env reads it: harmony's tokens kept, the stop token dropped,
        other special tokens skipped."""
        ids = list(ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        out, run = [], []
        for i in ids:
            if i in self.names:
                out.append(self.decode(run, skip_special_tokens=True))
                out.append(self.names[i])
                run = []
            else:
                run.append(i)
        out.append(self.decode(run, skip_special_tokens=True))
        return "".join(out)

    def action_tokens(self, text: str) -> list[int]:
        """The tokens a policy that writes `text` (an `action_text`, or plain text: a final
        answer) samples: harmony's markup by id, then the stop token its last message needs."""
        messages = parse_turn(text) or [HarmonyMessage("assistant", "", "final", end="")]
        ids: list[int] = []
        for k, message in enumerate(messages):
            last = k == len(messages) - 1
            end = (CALL if message.recipient else RETURN) if last else (message.end or END)
            ids += self._message(message._replace(end=end), header=k > 0)
        return ids

    # ---- rendering ---------------------------------------------------------------------------

    def _markup(self, text: str) -> list[int]:
        """Text with harmony's tokens written out (only this module's own strings)."""
        ids: list[int] = []
        for i, piece in enumerate(_SPLIT.split(text)):
            if i % 2:
                ids.append(self.ids[piece])
            elif piece:
                ids += self.encode(piece)
        return ids

    def _message(self, message: HarmonyMessage, header: bool = True) -> list[int]:
        """`<|start|>{author} to={recipient}<|channel|>{channel} {content type}<|message|>{content}{end}`
        (the parts a message has); without `header` it starts after `<|start|>assistant` (a
        sampled turn's first message)."""
        head = START + message.author if header else ""
        if message.recipient:
            head += f" to={message.recipient}"
        if message.channel:
            head += CHANNEL + message.channel
        if message.content_type:
            head += " " + message.content_type
        ids = self._markup(head + MESSAGE)
        return [*ids, *self.encode(message.content), *([self.ids[message.end]] if message.end else [])]

    def system_text(self, tools: bool) -> str:
        lines = [self.identity, f"Knowledge cutoff: {self.knowledge_cutoff}"]
        if self.current_date:
            lines.append(f"Current date: {self.current_date}")
        lines += ["", f"Reasoning: {self.reasoning_effort}", ""]
        lines.append(
            "# Valid channels: analysis, commentary, final. Channel must be included for every message."
        )
        if tools:
            lines.append(f"Calls to these tools must go to the commentary channel: '{FUNCTIONS}'.")
        return "\n".join(lines)

    def opening(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None
    ) -> list[HarmonyMessage]:
        """The harmony messages of an episode's first messages: the system message, a developer
        message (the env's system prompt as instructions, the tools), then the rest."""
        out = [HarmonyMessage("system", self.system_text(bool(tools)))]
        instructions = "\n\n".join(m.content for m in messages if m.role == "system")
        developer = [f"# Instructions\n\n{instructions}"] if instructions else []
        if tools:
            developer.append(render_tools(tools))
        if developer:
            out.append(HarmonyMessage("developer", "\n\n".join(developer)))
        out += conversation_messages([m for m in messages if m.role != "system"], [])
        return out

    def render(self, messages: Sequence[HarmonyMessage], add_generation_prompt: bool = True) -> list[int]:
        """Messages as harmony renders a history for the next turn (openai_harmony's
        `render_conversation_for_completion`): when the last assistant message is a final answer,
        the reasoning before the first final answer is dropped; `<|return|>` is written `<|end|>`."""
        own = [k for k, m in enumerate(messages) if m.author == "assistant"]
        finals = [k for k in own if messages[k].channel == "final"]
        drop_before = finals[0] if finals and own[-1] == finals[-1] else -1
        ids: list[int] = []
        for k, message in enumerate(messages):
            if message.author == "assistant" and message.channel == "analysis" and k < drop_before:
                continue
            end = message.end
            if end in (RETURN, ""):  # an answer, or a turn's last message (its stop token dropped)
                end = CALL if message.author == "assistant" and message.recipient else END
            ids += self._message(message._replace(end=end))
        return ids + (self.generation_prompt if add_generation_prompt else [])

    def render_prompt(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """An episode's first prompt (or, without the generation prompt, a whole conversation)."""
        return self.render(self.opening(messages, tools), add_generation_prompt)

    def render_conversation(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        return self.render_prompt(messages, add_generation_prompt=False, tools=tools)

    def start_episode(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> HarmonyEpisode:
        return HarmonyEpisode(self, messages, tools)


def calls_of(turn: Sequence[HarmonyMessage]) -> list[str]:
    """The recipients the assistant's messages of a turn address, in order: each is a call the
    env answers (a malformed one with its error), as the "harmony" tool-call format reads them."""
    return [m.recipient for m in turn if m.author == "assistant" and m.recipient]


def conversation_messages(messages: Sequence[Message], called: list[str]) -> list[HarmonyMessage]:
    """Messages (after the system prompt) as harmony messages: an assistant message's content is
    a turn's action text; a tool message answers the next of the `called` recipients (consumed;
    "functions" when none is left), a user message is the user's."""
    out: list[HarmonyMessage] = []
    for m in messages:
        if m.role == "assistant":
            turn = parse_turn(m.content)
            out += turn
            called += calls_of(turn)
        elif m.role == "tool":
            author = called.pop(0) if called else FUNCTIONS
            out.append(HarmonyMessage(author, m.content, "commentary", recipient="assistant"))
        else:
            out.append(HarmonyMessage(m.role, m.content))
    return out


class HarmonyEpisode:
    """One episode's conversation in harmony (an EpisodeRendering; see the module doc)."""

    def __init__(
        self,
        renderer: HarmonyRenderer,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        self.renderer = renderer
        self.messages = renderer.opening(messages, tools)
        self.prompt = renderer.render(self.messages)
        self.restarts = 0
        self.last_restart = ""

    def extend(self, sampled_tokens: Sequence[int], replies: Sequence[Message]) -> RenderedTurn:
        """Tool results after a turn that ended with `<|call|>`: the delta; otherwise a restart
        from the conversation rendered again."""
        r = self.renderer
        turn = parse_turn(r.action_text(sampled_tokens))
        replied = conversation_messages(replies, calls_of(turn))
        self.messages = [*self.messages, *turn, *replied]
        ends_with_call = bool(sampled_tokens) and sampled_tokens[-1] == r.ids[CALL]
        if ends_with_call and all(m.role == "tool" for m in replies):
            return RenderedTurn([tok for m in replied for tok in r._message(m)] + r.generation_prompt)
        self.restarts += 1
        self.last_restart = (
            "the turn ended without a tool call" if not ends_with_call else "a reply not from a tool"
        )
        return RenderedTurn(r.render(self.messages), restarted=True)


__all__ = [
    "HARMONY",
    "HARMONY_OPTIONS",
    "HarmonyEpisode",
    "HarmonyMessage",
    "HarmonyRenderer",
    "calls_of",
    "parse_turn",
    "render_tools",
]
