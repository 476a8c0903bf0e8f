"""GroupProducer: groups rolled out on a background thread, continuously, into a bounded buffer.

The thread runs its own asyncio loop over the runner and keeps `concurrent_groups` groups in
flight: each is rolled out and scored by rollouts (`rollouts/batches.py`'s `roll_group`: a
`ScoredGroup` with its advantages, made by the scorer) and put in the buffer as it finishes, and
the next task index is drawn. The policy's compute is elsewhere (the
engine's worker thread, or vLLM's engine), so this thread only drives envs and requests. It runs
in a generator process or rank (generators.py) beside that generator's engine, or, with the "thread"
placement and vLLM, in the trainer's process. New weights reach the policy between decode steps or
requests, so a group's turns may carry different policy versions (each Completion records its own).

Backpressure: when the buffer holds `capacity` groups, finished groups wait (their tasks hold
them) and no new group starts, so at most capacity + concurrent_groups groups are ahead of the
trainer.

Resume without losing or repeating a group: a task index is *outstanding* from when it is drawn
until the trainer takes its group. `position()` gives (the stream position, the outstanding
indices) consistently; a checkpoint stores both, and a producer built with `replay` = those
indices rolls them out again first, then continues the stream from the position. Everything the
trainer took before the checkpoint is below the position and not outstanding.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from ...rollouts.batches import BatchConfig, GroupRunner, ScoredGroup, TaskSeedStream, roll_group
from ...rollouts.scoring.distill import TeacherScorer
from ...rollouts.scoring.judge import Judge

_POLL_S = 0.02


class GroupSource(Protocol):
    """Where `take_batch` takes finished groups from: a GroupProducer, or the generator ranks
    (generators.py's RankGroups)."""

    def take(self, timeout_s: float | None = None) -> ScoredGroup: ...

    @property
    def buffered(self) -> int: ...


class ProducerError(RuntimeError):
    """The producer's thread failed; the message holds its exception."""


class GroupProducer:
    """Rolls out groups of `runner` from `stream` on a thread (see the module doc). Use as a
    context manager, or call `close`."""

    def __init__(
        self,
        runner: GroupRunner,
        stream: TaskSeedStream,
        config: BatchConfig,
        *,
        concurrent_groups: int,
        capacity: int,
        replay: Sequence[int] = (),
        teacher: TeacherScorer | None = None,
        judge: Judge | None = None,
    ) -> None:
        """teacher: scores each finished group on this thread (on-policy distillation); judge:
        judges it there first (rollouts/scoring/judge.py)."""
        self.teacher, self.judge = teacher, judge
        if concurrent_groups < 1 or capacity < 1:
            raise ValueError(
                f"concurrent_groups and capacity must be >= 1, got {concurrent_groups}, {capacity}"
            )
        self.runner, self.stream, self.config = runner, stream, config
        self.concurrent_groups, self.capacity = concurrent_groups, capacity
        self._buffer: queue.Queue[ScoredGroup] = queue.Queue()
        self._lock = threading.Lock()
        self._replay = list(replay)
        self._outstanding: set[int] = set(self._replay)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="toolgym-group-producer", daemon=True)
        self._thread.start()

    # ---- the trainer's side ---------------------------------------------------------------------
    def take(self, timeout_s: float | None = None) -> ScoredGroup:
        """The next finished group (blocks). Raises ProducerError if the producer failed, and
        TimeoutError after `timeout_s` without one."""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        while True:
            try:
                group = self._buffer.get(timeout=_POLL_S)
            except queue.Empty:
                if self._error is not None:
                    raise ProducerError(f"the group producer failed: {self._error!r}") from self._error
                if not self._thread.is_alive():
                    raise ProducerError("the group producer stopped") from None
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError(f"no group in {timeout_s} s") from None
                continue
            with self._lock:
                self._outstanding.discard(group.group_id)
            return group

    @property
    def buffered(self) -> int:
        """Finished groups waiting for the trainer."""
        return self._buffer.qsize()

    def failure(self) -> str | None:
        """Why the producer's thread ended, if it did (it runs until `close`)."""
        if self._error is not None:
            return repr(self._error)
        if not self._thread.is_alive() and not self._stop.is_set():
            return "the group producer stopped"
        return None

    def position(self) -> tuple[int, list[int]]:
        """(stream position, outstanding task indices), consistent with each other."""
        with self._lock:
            return self.stream.position, sorted(self._outstanding)

    def close(self) -> None:
        """Stop rolling out and wait for the thread; groups in flight are abandoned (they stay
        outstanding, so a checkpoint taken after this still replays them)."""
        self._stop.set()
        self._thread.join(timeout=60)

    def __enter__(self) -> GroupProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the producer's thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._produce())
        except BaseException as exc:  # handed to the trainer's next take()
            self._error = exc

    def _draw(self) -> tuple[int, int]:
        with self._lock:
            if self._replay:
                index = self._replay.pop(0)
            else:
                (_,), (index,) = self.stream.take(1)
                self._outstanding.add(index)
            return self.stream.seed_of(index), index

    async def _produce(self) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while not self._stop.is_set():
                while len(tasks) < self.concurrent_groups and self._buffer.qsize() < self.capacity:
                    tasks.add(asyncio.create_task(self._one_group(*self._draw())))
                if not tasks:  # the buffer is full: wait for the trainer to take some
                    await asyncio.sleep(_POLL_S)
                    continue
                done, tasks = await asyncio.wait(tasks, timeout=_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # an exception ends the producer (and reaches take())
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one_group(self, seed: int, index: int) -> None:
        group = await roll_group(self.runner, seed, index, self.config, self.teacher, self.judge)
        while self._buffer.qsize() >= self.capacity and not self._stop.is_set():
            await asyncio.sleep(_POLL_S)
        if not self._stop.is_set():
            self._buffer.put(group)
