"""`toolgym train` whose generator ranks' producers fail on their third group (fault injection
for test_loop_generator_ranks.py): `python failing_generator.py train CONFIG ...` under torchrun."""

from __future__ import annotations

import sys

from toolgym.configs.cli import main as cli
from toolgym.trainers.loop.producer import GroupProducer

_real = GroupProducer._one_group
_started = 0


async def _one_group(self: GroupProducer, seed: int, index: int) -> None:
    global _started
    _started += 1
    if _started > 2:
        raise RuntimeError("injected failure in the generator")
    await _real(self, seed, index)


GroupProducer._one_group = _one_group  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
