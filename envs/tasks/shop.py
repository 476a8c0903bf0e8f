"""Shop: "What do 3 kites cost?" answered by calling `price(item, quantity)` with JSON tool calls.

Prices are drawn afresh every episode (cents, 0.50 to 9.99 a piece), so the only way to the
answer is the tool. The answer is a decimal (the total, e.g. 27.15), graded numerically within
half a cent. A multi-argument typed tool, JSON `<tool_call>` blocks (`tool_format="json"`, the
default here) and a non-integer answer: the shape of a real tool-use task, small enough for the
CPU demo's tiny model (configs/shop_tiny.toml).

    {"name": "price", "arguments": {"item": "kite", "quantity": 3}}  ->  27.15  ->  [ANSWER] 27.15
"""

from __future__ import annotations

from typing import Any

from ..core.grading import numeric
from ..core.task import Example, Task
from ..core.tool_env import ToolEnv
from ..tools.typed import Call, ToolError, tool

ITEMS: tuple[str, ...] = (
    "apple", "bread", "candle", "drum", "egg", "fork", "glove", "hat", "ink", "jar", "kite", "lamp",
    "mug", "nail", "orange", "pen", "quilt", "rope", "soap", "tape", "umbrella", "vase", "whistle",
    "yarn", "zip",
)  # fmt: skip
MAX_QUANTITY = 9

_INSTRUCTIONS = "You are a shop assistant. Prices change every day: ask the price tool."
_EXAMPLE = Example("What do 2 pens cost?", [(Call("price", {"item": "pen", "quantity": 2}), 3.5)], 3.5)


class ShopEnv(ToolEnv):
    """`gymnasium.make("toolgym/Shop-v0")`. Other keyword arguments are the ToolEnv knobs
    (tool_format="json", max_turns=4, rewards, limits)."""

    def __init__(self, *, tool_format: str = "json", max_turns: int = 4, **knobs: Any):
        knobs.setdefault("grader", numeric(abs_tol=0.005))
        self.prices: dict[str, int] = {}  # cents
        super().__init__(
            instructions=_INSTRUCTIONS,
            example=_EXAMPLE,
            tool_format=tool_format,
            max_turns=max_turns,
            **knobs,
        )

    @tool
    def price(self, item: str, quantity: int) -> float:
        """The price of a quantity of an item today.

        Args:
            item: the item, singular (`kite`).
            quantity: how many, 1 to 9.
        """
        if item not in self.prices:
            raise ToolError(f"we do not sell {item[:24]!r}")
        if not 1 <= quantity <= MAX_QUANTITY:
            raise ToolError(f"quantity must be 1 to {MAX_QUANTITY}")
        return self.prices[item] * quantity / 100

    def new_task(self) -> Task:
        rng = self.np_random
        self.prices = dict(zip(ITEMS, rng.integers(50, 1000, size=len(ITEMS)).tolist(), strict=True))
        item = ITEMS[int(rng.integers(len(ITEMS)))]
        quantity = int(rng.integers(1, MAX_QUANTITY + 1))
        noun = item if quantity == 1 else f"{item}s"
        question = f"What do {quantity} {noun} cost?" if quantity > 1 else f"What does 1 {noun} cost?"
        total = self.prices[item] * quantity / 100
        return Task(question, total, [Call("price", {"item": item, "quantity": quantity})])
