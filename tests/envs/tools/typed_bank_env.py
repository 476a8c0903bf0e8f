"""A bank env whose tools take every parameter type a tool-call format must carry (str, int,
float, bool, Optional, list, Literal, a msgspec Struct): the call-format tests and their fuzzing
play it in each format."""

from typing import Literal

import msgspec

from toolgym.envs import Call, Task, ToolEnv, ToolError, numeric, tool


class Period(msgspec.Struct, forbid_unknown_fields=True):
    days: int
    start: str = ""


class TypedEnv(ToolEnv):
    """Tools of every parameter type the formats must carry: str, int, float, bool, Optional,
    list, Literal, a Struct."""

    def __init__(self, **knobs):
        knobs.setdefault("grader", numeric(abs_tol=0.01))
        super().__init__(instructions="You run a bank.", **knobs)

    @tool
    def balance(self, account: str) -> float:
        """The balance of an account."""
        if account not in self.state:
            raise ToolError(f"no account named {account!r}")
        return self.state[account]

    @tool
    def transfer(self, source: str, target: str, amount: float, memo: str | None = None) -> str:
        """Move money from one account to another."""
        if {source, target} - self.state.keys() or not 0 < amount <= self.state[source]:
            raise ToolError("transfer refused")
        self.state.update({source: self.state[source] - amount, target: self.state[target] + amount})
        return f"moved {amount:.2f}"

    @tool
    def note(self, text: str, times: int = 1, loud: bool = False) -> str:
        """Write a note; it is read back."""
        return (text.upper() if loud else text) * max(0, min(times, 3))

    @tool
    def audit(self, accounts: list[str], depth: Literal["quick", "full"] = "quick") -> dict:
        """Audit some accounts."""
        return {"known": sorted(set(accounts) & self.state.keys()), "depth": depth}

    @tool
    def rate(self, currency: Literal["eur", "usd"], period: Period | None = None) -> float:
        """An exchange rate."""
        return (1.1 if currency == "eur" else 1.0) + (period.days if period is not None else 0) * 1e-3

    def new_task(self) -> Task:
        balances = {name: round(float(self.np_random.uniform(10, 500)), 2) for name in ("ana", "bo", "cy")}
        half = balances["ana"] / 2
        moves = [
            Call("balance", {"account": "ana"}),
            Call("transfer", dict(source="ana", target="bo", amount=half)),
        ]
        question = "Move half of ana's money to bo. How much does bo have now?"
        return Task(question, round(balances["bo"] + half, 2), solution=moves, state=balances)
