"""ChatML rendering, token in and token out, as Qwen models use it.

    <|im_start|>system\\n{content}<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}<|im_end|>\\n
    <|im_start|>tool\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n                      <- generation prompt

Why token in, token out: RL trains on the exact tokens the policy sampled, with their sampler
log-probabilities. Decoding a sampled turn and encoding it again can give different ids (a
sampled tokenization need not be the canonical one; a turn cut at max_tokens can end inside a
UTF-8 character), which silently misaligns tokens, loss masks and logprobs. So a rollout keeps
`render_prompt(...)` + sampled + `render_observation(...)` + sampled + ... and never re-renders
history.

How text becomes ids (the canonical rendering):
- Control tokens (`<|im_start|>`, `<|im_end|>`) are inserted by id, only by the renderer.
- Message text is encoded with the tokenizer's special tokens treated as plain text, so a user,
  tool or env message containing the literal string "<|im_end|>" cannot close its turn or open
  a fake one (prompt injection). Non-special added tokens (e.g. Qwen's `<tool_call>`) still match,
  as they do when the model generates them.
- A non-assistant message encodes "{role}\\n{content}" as one string, exactly as Hugging Face's
  `apply_chat_template(..., tokenize=True)` does for content without special-token strings.
- An assistant turn is the header "assistant\\n" encoded on its own, then the content encoded on
  its own: that is what sampling after the generation prompt produces, so prompt + canonical
  sampled tokens + delta equals `render_conversation`. (It differs from Hugging Face only when
  the assistant content starts with whitespace that contains a newline.)
- Tool results use the role `tool` as written above (plain ChatML). Qwen2.5/Qwen3's own Jinja
  templates instead wrap them in a user turn with <tool_response> tags, and add a default
  system prompt; this renderer does neither.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from tokenizers import Tokenizer

from .tokenizer import encode_text, text_tokenizer
from .types import Message

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
ROLES = ("system", "user", "assistant", "tool")


class RenderedTurn(NamedTuple):
    """What to feed the policy after a sampled turn.

    tokens: the delta to append to the history; or, when `restarted`, the whole new history (the
        renderer's full re-rendering of the conversation), which starts a new training sequence.
    """

    tokens: list[int]
    restarted: bool = False


class EpisodeRendering(Protocol):
    """One episode's conversation as tokens: `prompt` first, then one `extend` per sampled turn."""

    prompt: list[int]
    restarts: int  # how many times `extend` had to restart from a full re-rendering

    def extend(self, sampled_tokens: Sequence[int], replies: Sequence[Message]) -> RenderedTurn:
        """The tokens after the sampled turn `sampled_tokens` (kept verbatim, never re-encoded)
        and the env's `replies`, ending with the next generation prompt."""
        ...


class Renderer(Protocol):
    """What the rollout runner, the scripted policies and the CLI use of a renderer: plain ChatML
    (`ChatRenderer`), a model's own chat template (agents/chat_template.py) or gpt-oss's harmony
    (agents/harmony.py). `action_text` is what an env reads of a sampled turn; `action_tokens`
    the tokens of a turn that writes a given text."""

    tokenizer: Tokenizer
    renders_tools: bool  # True: give it the tools' specs and one `tool` message per tool result

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...
    @property
    def im_end_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    def action_text(self, ids: Sequence[int]) -> str: ...
    def action_tokens(self, text: str) -> list[int]: ...
    def render_prompt(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]: ...
    def start_episode(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> EpisodeRendering: ...


class ChatRenderer:
    """Renders ChatML messages to token ids for one tokenizer. Thread-safe; holds no conversation.

    The tokenizer must have `<|im_start|>` and `<|im_end|>` as special added tokens;
    `<|endoftext|>` is optional (it is then a stop token and the pad token, as in Qwen).
    """

    renders_tools = False  # tools are described in the env's own system prompt

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text_tokenizer = text_tokenizer(tokenizer)

        self.im_start_id = _require_token(tokenizer, IM_START)
        self.im_end_id = _require_token(tokenizer, IM_END)
        self.endoftext_id: int | None = tokenizer.token_to_id(ENDOFTEXT)
        control = {self.im_start_id, self.im_end_id} | (
            set() if self.endoftext_id is None else {self.endoftext_id}
        )
        for name in (IM_START, IM_END, ENDOFTEXT):
            if control & set(self.encode(name)):
                raise ValueError(
                    f"the tokenizer encodes the text {name!r} as a control token: mark it as a special "
                    '("special": true) added token in tokenizer.json, or message text could inject it'
                )
        self._newline = self.encode("\n")
        self._headers = {role: [self.im_start_id, *self.encode(f"{role}\n")] for role in ROLES}

    # ---- properties -------------------------------------------------------------------------

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a sampled assistant turn: `<|im_end|>` and, if present, `<|endoftext|>`."""
        if self.endoftext_id is None:
            return (self.im_end_id,)
        return (self.im_end_id, self.endoftext_id)

    @property
    def pad_id(self) -> int:
        """`<|endoftext|>` (as in Qwen), or `<|im_end|>` if the tokenizer has no `<|endoftext|>`."""
        return self.im_end_id if self.endoftext_id is None else self.endoftext_id

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size including added tokens. A model's embedding table may be
        larger (Qwen pads it to a multiple of 128): never use this to size a model."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def generation_prompt(self) -> list[int]:
        """`<|im_start|>assistant\\n`: the tokens after which the policy samples its turn."""
        return list(self._headers["assistant"])

    # ---- text <-> ids -----------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Encode plain text. Special-token strings in `text` stay text; nothing is added around it."""
        return encode_text(self._text_tokenizer, text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Decode ids to text (for humans and envs). Never re-encode the result into a history."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def action_text(self, ids: Sequence[int]) -> str:
        """A sampled turn as the env reads it: decoded, special tokens skipped."""
        return self.decode(ids, skip_special_tokens=True)

    def action_tokens(self, text: str) -> list[int]:
        """What a policy that writes `text` and ends its turn samples (scripted policies, imports)."""
        return [*self.encode(text), self.im_end_id]

    # ---- rendering --------------------------------------------------------------------------

    def render_message(self, message: Message) -> list[int]:
        """One complete turn: `<|im_start|>{role}\\n{content}<|im_end|>\\n`."""
        role = _check_role(message)
        if role == "assistant":
            body = [*self._headers["assistant"], *self.encode(message.content)]
        else:
            body = [self.im_start_id, *self.encode(f"{role}\n{message.content}")]
        return [*body, self.im_end_id, *self._newline]

    def render_prompt(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """The first prompt of an episode: every message rendered, then (by default) the
        generation prompt `<|im_start|>assistant\\n`. Assistant messages in `messages` are
        rendered canonically (see the module docstring)."""
        ids: list[int] = []
        for message in messages:
            ids += self.render_message(message)
        if add_generation_prompt:
            ids += self._headers["assistant"]
        return ids

    def render_conversation(self, messages: Sequence[Message]) -> list[int]:
        """The full canonical rendering of a conversation, assistant turns included, with no
        generation prompt (for SFT data and tests)."""
        return self.render_prompt(messages, add_generation_prompt=False)

    def render_observation(
        self, message: Message, previous_tokens: Sequence[int], add_generation_prompt: bool = True
    ) -> list[int]:
        """The tokens to append after a sampled assistant turn: the delta only.

        `previous_tokens` is the history so far (or just the last turn's sampled tokens); only
        its last token is looked at, and none of it is changed or repeated. The delta is:
        `<|im_end|>` if the sampled turn did not end with it, then `\\n`, then `message` as a
        full turn, then (by default) the next `<|im_start|>assistant\\n`.

        A turn that stopped on `<|endoftext|>` (or any other stop token), or hit max_tokens, is
        kept verbatim and closed with `<|im_end|>` after it, so every turn in the history ends
        with `<|im_end|>\\n` and the transcript stays valid ChatML. An empty `previous_tokens`
        (an empty sampled turn) is closed the same way.
        """
        delta = [] if previous_tokens and previous_tokens[-1] == self.im_end_id else [self.im_end_id]
        delta += self._newline
        delta += self.render_message(message)
        if add_generation_prompt:
            delta += self._headers["assistant"]
        return delta

    def start_episode(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> ChatMLEpisode:
        """An episode's rendering: `render_prompt(messages)`, then `render_observation` per turn.
        `tools` is ignored (plain ChatML has no tools block: the env's text describes them)."""
        return ChatMLEpisode(self, messages)


class ChatMLEpisode:
    """`ChatRenderer`'s EpisodeRendering: append-only by construction, so it never restarts."""

    restarts = 0

    def __init__(self, renderer: ChatRenderer, messages: Sequence[Message]) -> None:
        self.renderer = renderer
        self.prompt = renderer.render_prompt(messages)

    def extend(self, sampled_tokens: Sequence[int], replies: Sequence[Message]) -> RenderedTurn:
        """`render_observation(replies[0], sampled_tokens)`; further replies follow as whole turns
        before the generation prompt."""
        if not replies:
            raise ValueError("extend needs at least one reply message")
        renderer = self.renderer
        if len(replies) == 1:
            return RenderedTurn(renderer.render_observation(replies[0], sampled_tokens))
        tokens = renderer.render_observation(replies[0], sampled_tokens, add_generation_prompt=False)
        for reply in replies[1:]:
            tokens += renderer.render_message(reply)
        return RenderedTurn(tokens + renderer.generation_prompt)


def _require_token(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the tokenizer has no {token!r} token, which ChatML rendering needs")
    return token_id


def _check_role(message: Message) -> str:
    # msgspec validates Literal fields only when decoding, so a hand-built Message can hold anything.
    if message.role not in ROLES:
        raise ValueError(f"unknown chat role {message.role!r}; expected one of {ROLES}")
    if not isinstance(message.content, str):
        raise TypeError(f"message content must be a str, got {type(message.content).__name__}")
    return message.role
