"""The agent program of README's "Train your own agent": it answers Shop-v0's questions ("What
do 3 kites cost?") with nothing but the `openai` client and function calling, and
`toolgym train shop_agent` (configs/shop_agent.toml) trains the policy inside it through the
endpoint (rollouts/endpoint/). The code between the markers is in README.md verbatim (a test
checks it).

`task(seed)` draws the task as Shop-v0 does for that seed: the shop (its `price` tool and its
answer), the question, the instructions and the tools as the env states them.
"""

from __future__ import annotations

from typing import Any

import gymnasium

from .. import envs  # noqa: F401 (registers toolgym/Shop-v0)


def task(seed: int) -> dict[str, Any]:
    shop: Any = gymnasium.make("toolgym/Shop-v0").unwrapped
    question, info = shop.reset(seed=seed)
    return {"shop": shop, "question": question, "system": info["instructions"], "tools": info["tools"]}


# --- README agent: begin ---
import json  # noqa: E402
import re  # noqa: E402


async def run_agent(client, task):
    messages = [{"role": "system", "content": task["system"]}, {"role": "user", "content": task["question"]}]
    used_tool = 0.0
    for _ in range(4):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=task["tools"])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:  # the answer: the last number it wrote
            numbers = re.findall(r"\d+(?:\.\d+)?", message.content or "")
            correct = bool(numbers) and abs(float(numbers[-1]) - task["shop"].answer) < 0.005
            return {"correct": float(correct), "used_tool": used_tool}
        for call in message.tool_calls:
            try:
                result = task["shop"].price(**json.loads(call.function.arguments))
            except Exception as exc:  # a wrong item, quantity or argument: the model reads why
                result = f"ERROR: {exc}"
            used_tool = 0.2
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return {"correct": 0.0, "used_tool": used_tool}


# --- README agent: end ---
