"""Rendering a turn's delta: a model's own chat template (jinja2, agents/chat_template.py) against
plain ChatML (agents/chat.py), in microseconds per turn.

The workload is what the rollout runner renders in a JSON tool-call episode: the first prompt
(system instructions, the tools' specs, the question), then per turn the sampled tool call (kept as
tokens) and the tool's result, rendered as the delta to append. ChatML encodes only the new
message; the template renders the whole conversation again each turn (jinja2), checks that it
extends the previous rendering and tokenizes only the new text, so its cost grows with the turns
already in the episode: the table shows a short and a long episode.

    python bench/chat_template.py [--template FILE] [--turns 4 16] [--episodes 200] [--repeats 5]

The default template is the tests' Qwen2.5-like one (tests/agents/chat_templates_testlib.py);
`--template` takes a tokenizer_config.json or a .jinja file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "agents"))

from _common import format_table, machine_summary, time_repeats  # noqa: E402
from chat_templates_testlib import QWEN25_LIKE  # noqa: E402

from toolgym.agents.chat import ChatRenderer  # noqa: E402
from toolgym.agents.chat_template import TemplateRenderer, load_chat_template  # noqa: E402
from toolgym.agents.tokenizer import load_tokenizer  # noqa: E402
from toolgym.agents.types import Message  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "LOOKUP",
            "description": "the zorplex value of a word",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}},
                "required": ["word"],
                "additionalProperties": False,
            },
        },
    }
]
WORDS = ["tree", "sun", "elephant", "ice", "cat", "river", "stone", "cloud"]


def episode_turns(renderer, turns: int) -> list[tuple[list[int], list[Message]]]:
    """(sampled tokens, replies) per turn: a JSON tool call and its result."""
    out = []
    for i in range(turns):
        call = f'<tool_call>\n{{"name": "LOOKUP", "arguments": {{"word": "{WORDS[i % len(WORDS)]}"}}}}\n</tool_call>'
        out.append(([*renderer.encode(call), renderer.im_end_id], [Message("tool", str(10 + i))]))
    return out


def run_episode(renderer, start: list[Message], tools, turns) -> int:
    episode = renderer.start_episode(start, tools)
    n = len(episode.prompt)
    for sampled, replies in turns:
        n += len(sampled) + len(episode.extend(sampled, replies).tokens)
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--template", default="", help="tokenizer_config.json or .jinja (default: Qwen2.5-like)"
    )
    parser.add_argument("--turns", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--episodes", type=int, default=200, help="episodes per timed run")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    tokenizer = load_tokenizer(ROOT / "configs" / "assets" / "tokenizer.json")
    template = load_chat_template(args.template) if args.template else QWEN25_LIKE
    chatml, jinja = ChatRenderer(tokenizer), TemplateRenderer(tokenizer, template)
    instructions = (
        "Every word has a secret zorplex value. Only the tools know it. Finish with [ANSWER] <number>."
    )
    start = [Message("system", instructions), Message("user", "What is zorplex('tree') + zorplex('sun')?")]
    print(machine_summary())
    rows, ratios = [], []
    for turns in args.turns:
        per_turn = {}
        for name, renderer, tools in (
            ("plain ChatML", chatml, None),
            ("chat template (jinja2)", jinja, TOOLS),
        ):
            plan = episode_turns(renderer, turns)
            run_episode(renderer, start, tools, plan)  # warm-up (template compile cache, tokenizer)
            start_only = time_repeats(
                lambda r=renderer, t=tools: [r.start_episode(start, t) for _ in range(args.episodes)],
                args.repeats,
            ).best
            whole = time_repeats(
                lambda r=renderer, t=tools, p=plan: [
                    run_episode(r, start, t, p) for _ in range(args.episodes)
                ],
                args.repeats,
            ).best
            us = (whole - start_only) / (args.episodes * turns) * 1e6
            per_turn[name] = us
            rows.append([f"{name}, {turns} turns", f"{us:.1f}", f"{start_only / args.episodes * 1e6:.1f}"])
        ratios.append((turns, per_turn["chat template (jinja2)"] / per_turn["plain ChatML"]))
    print(format_table(["renderer, episode length", "us/turn (delta)", "us (first prompt)"], rows))
    for turns, ratio in ratios:
        print(f"template / ChatML per turn, {turns} turns: {ratio:.1f}x")


if __name__ == "__main__":
    main()
