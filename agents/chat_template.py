"""A model's own chat template (a Hugging Face `chat_template`), token in and token out.

`TemplateRenderer` runs the Jinja template shipped in a checkpoint's tokenizer_config.json (or a
.jinja file) so that the policy sees exactly the format it was trained on: the tools block the
template builds from `tools=`, its assistant and tool turns (Qwen groups consecutive `tool`
messages into one user turn of <tool_response> blocks), its think rules. It is a drop-in for
`ChatRenderer` in the rollout runner (the `Renderer` protocol of agents/chat.py).

The template runs in jinja2's ImmutableSandboxedEnvironment configured as transformers
configures it (trim_blocks, lstrip_blocks, the loopcontrols extension, the `{% generation %}`
tag, `raise_exception`, a `tojson` that keeps non-ASCII text and takes indent/separators/
sort_keys, `strftime_now`), with the tokenizer config's special tokens (bos_token, eos_token,
...) as variables. A template only ever sees copies of plain data: no code from a config runs
outside the sandbox.

Token in, token out (`TemplateEpisode`): the first prompt is the template's rendering of the
messages with `tools=` and the generation prompt. After a sampled turn, the conversation grows
by the assistant message (its content is the sampled text) and the env's replies; the whole
conversation is rendered again and the new rendering must extend the previous one followed by the
sampled text (append-only). The delta (what follows the sampled text, up to and including the
next generation prompt) is tokenized and appended; the sampled tokens are kept verbatim, never
re-encoded. Where the new rendering does not extend the old one (a template that drops earlier
turns' reasoning once a new user turn arrives, a sampled turn the template would write
differently, one that stopped on a token the template does not put there), nothing drifts: the
turn restarts from the full re-rendering (`RenderedTurn.restarted`), which becomes a new training
sequence, and `restarts` counts it.

How rendered text becomes ids: the template's own special tokens (`<|im_start|>`, ...) become
their ids; every other piece is encoded with special-token strings as plain text. So that a
special-token string inside a message (a tool result holding "<|im_end|>") cannot pass for the
template's own, every string handed to the template is escaped first (a private-use marker
inside each special-token string, the marker itself doubled) and unescaped after splitting.
Content without such strings tokenizes as transformers' `apply_chat_template(..., tokenize=True)`
does; the first sampled token is separated from the generation prompt, as with ChatRenderer.

Checks at construction, each a `ChatTemplateError` naming the file on one line: the template
compiles and renders a probe tool conversation; it ends an assistant turn with a special token of
the tokenizer; every `<|...|>` token it writes is a special token of the tokenizer; and it is
append-only on the probe multi-turn tool conversation.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from .chat import RenderedTurn
from .tokenizer import encode_text, text_tokenizer
from .types import Message

# Inserted after the first character of each special-token string in message text; doubled where
# the text holds it itself (a supplementary private-use code point: no text means it).
_MARK = "\U000f0000"
_UNMARK = re.compile(f"{_MARK}({_MARK})?")
# What looks like a ChatML/Llama-style control token in a template's own text.
_CONTROL_LIKE = re.compile(r"<\|[^\s<>|]{1,64}\|>")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

PROBE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "probe_lookup",
            "description": "Look up the value of a key.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string", "description": "the key"}},
                "required": ["key"],
            },
        },
    }
]
PROBE_MESSAGES = (Message("system", "You answer with tools."), Message("user", "What are alpha and beta?"))
PROBE_TURNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        '<tool_call>\n{"name": "probe_lookup", "arguments": {"key": "alpha"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "probe_lookup", "arguments": {"key": "beta"}}\n</tool_call>',
        ("alpha = 7", "beta = 3"),
    ),
    ('<tool_call>\n{"name": "probe_lookup", "arguments": {"key": "gamma"}}\n</tool_call>', ("gamma = 1",)),
)


class ChatTemplateError(ValueError):
    """A chat template toolgym cannot use; the message is one line naming the file."""


class ChatTemplate:
    """A template's text, where it came from, and the tokenizer config's special tokens."""

    def __init__(
        self, text: str, source: str = "<chat template>", special_tokens: Mapping[str, str] | None = None
    ):
        self.text = text
        self.source = source
        self.special_tokens = dict(special_tokens or {})


def load_chat_template(path: str | os.PathLike[str]) -> ChatTemplate:
    """Read a template: a tokenizer_config.json (its `chat_template`, the "default" one of a
    named list, else a chat_template.jinja beside it; plus its special tokens) or a template
    file (.jinja or any other text file). Raises ChatTemplateError naming the file."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"{path}: cannot read the chat template ({exc})") from None
    if path.suffix != ".json":
        return ChatTemplate(raw, str(path))
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{path}: a tokenizer config is a JSON object")
    special = {}
    for key in _SPECIAL_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[key] = value
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (beside := path.with_name("chat_template.jinja")).is_file():
        return ChatTemplate(beside.read_text(encoding="utf-8"), str(beside), special)
    if not isinstance(template, str) or not template:
        raise ChatTemplateError(f"{path}: has no chat_template (a string, or a list with a 'default' one)")
    return ChatTemplate(template, str(path), special)


def model_chat_template(directory: str | os.PathLike[str]) -> str:
    """The file holding a Hugging Face model directory's own chat template, as `load_chat_template`
    takes it: its tokenizer_config.json when that has a `chat_template` (or a chat_template.jinja
    is beside it), else a lone chat_template.jinja; "" when the directory carries none."""
    directory = Path(directory)
    config, beside = directory / "tokenizer_config.json", directory / "chat_template.jinja"
    if config.is_file():
        try:
            named = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            named = None
        if named or beside.is_file():
            return str(config)
    return str(beside) if beside.is_file() else ""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a set)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters; templates expect json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_template(text: str) -> jinja2.Template:
    """The template compiled in the sandbox, configured as transformers configures it. Raises
    jinja2's TemplateSyntaxError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(text)


class TemplateRenderer:
    """Renders conversations with a model's own chat template, token in and token out (see the
    module doc). Thread-safe; holds no conversation (`start_episode` makes one).

    `template_kwargs` are extra template variables (e.g. Qwen3's enable_thinking).
    `renders_tools` is whether the template writes the tools it is given (the probe's do appear):
    the runner then gives it the env's tool specs and one `tool` message per tool result."""

    renders_tools: bool

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: ChatTemplate | str,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        template = ChatTemplate(template) if isinstance(template, str) else template
        self.tokenizer = tokenizer
        self.source = template.source
        self.text = template.text  # what it renders with (the tool-call format it teaches is read from it)
        self._text_tokenizer = text_tokenizer(tokenizer)
        added = tokenizer.get_added_tokens_decoder()
        self._special = {t.content: i for i, t in added.items() if t.special and len(t.content) > 1}
        names = sorted(self._special, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
        self._variables = {**template.special_tokens, **dict(template_kwargs or {})}
        try:
            self._template = compile_template(template.text)
        except jinja2.TemplateSyntaxError as exc:
            raise self._error(
                f"the chat template does not compile (line {exc.lineno}: {exc.message})"
            ) from None
        self._probe(template.special_tokens)

    # ---- properties (as ChatRenderer's) ------------------------------------------------------

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The token that ends an assistant turn in this template, and the config's eos token."""
        return self._stop_ids

    @property
    def im_end_id(self) -> int:
        """The token the template ends an assistant turn with (`<|im_end|>` for ChatML templates)."""
        return self._stop_ids[0]

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def generation_prompt(self) -> list[int]:
        """What the template appends for add_generation_prompt after the probe conversation."""
        return list(self._generation_prompt)

    # ---- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Encode plain text. Special-token strings in `text` stay text; nothing is added around it."""
        return encode_text(self._text_tokenizer, text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def action_text(self, ids: Sequence[int]) -> str:
        return self.decode(ids, skip_special_tokens=True)

    def action_tokens(self, text: str) -> list[int]:
        return [*self.encode(text), self.im_end_id]

    def tokens_of(self, rendered: str) -> list[int]:
        """Ids of a rendering made by `render_text`: the template's special tokens by id, every
        other piece (unescaped) as plain text."""
        if self._split is None:
            return self.encode(_unescape(rendered))
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(rendered)):
            if i % 2:
                ids.append(self._special[piece])
            elif piece:
                ids += self.encode(_unescape(piece))
        return ids

    # ---- rendering ---------------------------------------------------------------------------

    def escape(self, value: Any) -> Any:
        """A copy of `value` (a message, tools, any JSON-like data; a Message becomes a dict)
        with every string escaped so no special-token string in it passes for the template's."""
        if isinstance(value, Message):
            value = {"role": value.role, "content": value.content}
        if isinstance(value, str):
            if _MARK in value:
                value = value.replace(_MARK, _MARK + _MARK)
            if self._split is None:
                return value
            return self._split.sub(lambda m: m.group(0)[0] + _MARK + m.group(0)[1:], value)
        if isinstance(value, Mapping):
            return {k: self.escape(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.escape(v) for v in value]
        return value

    def render_text(
        self, messages: Sequence[Any], tools: Sequence[Any] | None = None, add_generation_prompt: bool = False
    ) -> str:
        """The template's rendering of already-escaped messages and tools (see `escape`)."""
        return self._template.render(
            messages=list(messages),
            tools=None if tools is None else list(tools),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._variables,
        )

    def render_prompt(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The template's rendering of `messages` (Messages or HF-style dicts, e.g. with
        tool_calls) with `tools=`, by default with the generation prompt, as token ids."""
        escaped_tools = None if tools is None else self.escape(list(tools))
        text = self.render_text(self.escape(list(messages)), escaped_tools, add_generation_prompt)
        return self.tokens_of(text)

    def render_conversation(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The full rendering, assistant turns included, no generation prompt (SFT data, tests)."""
        return self.render_prompt(messages, add_generation_prompt=False, tools=tools)

    def start_episode(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> TemplateEpisode:
        return TemplateEpisode(self, messages, tools)

    # ---- construction checks -----------------------------------------------------------------

    def _error(self, what: str) -> ChatTemplateError:
        return ChatTemplateError(f"{self.source}: {' '.join(what.split())}")

    def _probe(self, special_tokens: Mapping[str, str]) -> None:
        probe = [self.escape(m) for m in PROBE_MESSAGES]
        answer = "PROBE_ANSWER_TEXT"
        conversation = [*probe, {"role": "assistant", "content": answer}]
        try:
            prompt = self.render_text(probe, PROBE_TOOLS, add_generation_prompt=True)
            without = self.render_text(probe, PROBE_TOOLS, add_generation_prompt=False)
            full = self.render_text(conversation, PROBE_TOOLS)
        except Exception as exc:
            raise self._error(
                f"the chat template raises on a probe conversation: {type(exc).__name__}: {exc}"
            ) from None
        self.renders_tools = "probe_lookup" in prompt
        if not prompt.startswith(without):
            raise self._error("the generation prompt does not extend the rendering without it")
        self._generation_prompt = self.tokens_of(prompt[len(without) :])

        missing = sorted(
            {t for t in _CONTROL_LIKE.findall(full + prompt) if t not in self._special}
            | {v for v in special_tokens.values() if v in full and v not in self._special and len(v) > 1}
        )
        if missing:
            raise self._error(
                f"the chat template writes {', '.join(missing)}, which the tokenizer lacks as special tokens"
            )
        at = full.rfind(answer)
        tail = full[at + len(answer) :] if at >= 0 else ""
        end = next((t for t in sorted(self._special, key=len, reverse=True) if tail.startswith(t)), None)
        if end is None:
            raise self._error(
                "the chat template does not end an assistant turn with a special token of the "
                f"tokenizer (it writes {tail[:24]!r} after the content)"
            )
        eos = self._special.get(special_tokens.get("eos_token", ""))
        self._stop_ids = (self._special[end],) + (() if eos is None or eos == self._special[end] else (eos,))
        pad = self._special.get(special_tokens.get("pad_token", ""))
        self._pad_id = pad if pad is not None else self._stop_ids[-1]

        try:
            episode = self.start_episode(PROBE_MESSAGES, PROBE_TOOLS)
            for text, results in PROBE_TURNS:
                episode.extend([*self.encode(text), self.im_end_id], [Message("tool", r) for r in results])
        except Exception as exc:
            raise self._error(
                f"the chat template raises on a probe tool conversation: {type(exc).__name__}: {exc}"
            ) from None
        if episode.restarts:
            raise self._error(
                f"the chat template is not append-only on a multi-turn tool conversation ({episode.last_restart})"
            )


class TemplateEpisode:
    """One episode's conversation under a chat template (an EpisodeRendering; see the module doc)."""

    def __init__(
        self,
        renderer: TemplateRenderer,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self.renderer = renderer
        self.tools = None if tools is None else renderer.escape(list(tools))
        self.messages: list[Any] = [renderer.escape(m) for m in messages]
        self.text = renderer.render_text(self.messages, self.tools, add_generation_prompt=True)
        self.prompt = renderer.tokens_of(self.text)
        self.restarts = 0
        self.last_restart = ""  # why the last restart happened (for error lines and logs)

    def extend(self, sampled_tokens: Sequence[int], replies: Sequence[Message]) -> RenderedTurn:
        """Append the assistant turn (content: the sampled text) and `replies`; return the delta,
        or a restart from the full re-rendering when the template is not append-only here."""
        r = self.renderer
        content = r.decode(sampled_tokens, skip_special_tokens=True)
        sampled = r.decode(sampled_tokens, skip_special_tokens=False)
        messages = [*self.messages, r.escape({"role": "assistant", "content": content})]
        messages += [r.escape(m) for m in replies]
        text = r.render_text(messages, self.tools, add_generation_prompt=True)
        before = self.text
        self.messages, self.text = messages, text
        if text.startswith(before) and text.startswith(sampled, len(before)):
            return RenderedTurn(r.tokens_of(text[len(before) + len(sampled) :]))
        self.restarts += 1
        self.last_restart = _first_difference(before + sampled, text)
        return RenderedTurn(r.tokens_of(text), restarted=True)


def _unescape(text: str) -> str:
    return _UNMARK.sub(lambda m: m.group(1) or "", text) if _MARK in text else text


def _first_difference(expected: str, rendered: str) -> str:
    """Where `rendered` stops extending `expected`, in one line."""
    i = next((k for k, (a, b) in enumerate(zip(expected, rendered, strict=False)) if a != b), None)
    if i is None:
        i = min(len(expected), len(rendered))
    return (
        f"at character {i} the history plus the sampled turn reads {_unescape(expected[i : i + 40])!r} "
        f"but the new rendering reads {_unescape(rendered[i : i + 40])!r}"
    )
