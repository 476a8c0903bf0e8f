"""Generators that are processes of their own: torchrun ranks (`loop.generator_ranks = N`: the last
N ranks generate, the others train with FSDP2), or processes this one spawns on its machine
(`GeneratorProcesses`). They speak to trainer rank 0 over the channel `trainers/distributed.py`
builds (a gloo group of trainer rank 0 and the generators).

    generator g (of N)                               trainer rank 0           trainer ranks 1..
    ------------------------------------------       ----------------------   ----------------
    GroupProducer (thread) -> TorchEngine  --groups-->  RankGroups.take()      (FSDP2 peers)
      task indices k*N + g                             take_batch (staleness)
                                                        broadcast episodes ----> their share
    policy.load_weights (in flight)  <--weights--  gather_weights  <------- (collective)

Trainer rank 0 drives; every exchange is a Command it broadcasts, then the exchange it names:
- "start": each generator's stream position and the task indices to roll out again (resume);
- "weights": the trainer's weights, one flat float32 tensor (names and shapes in the command);
  a generator loads them in flight and starts its producer on the first. Broadcast over the
  channel, or, for generator processes on this machine (GeneratorProcesses), written into
  a shared-memory file that every generator maps (trainers/weight_sync.py): each copies it out and acknowledges, so the
  trainer never overwrites weights a generator is still reading;
- "groups": each generator sends the groups its buffer holds now (msgpack; none is fine);
- "position": each generator sends its stream position and outstanding indices (checkpoints);
- "stop": the generators close and exit.

Tensors cross as CPU tensors (gloo), so on GPUs the weights go through host memory.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import torch
import torch.distributed as dist

from ...rollouts.batches import TaskSeedStream
from ..distributed import Channel, DistInfo, channel_group
from ..weight_sync import SharedWeights, broadcast_weights, flat_weights, numel_of, unflatten_weights
from .producer import GroupProducer, ProducerError, ScoredGroup

_POLL_S = 0.02


class Command(msgspec.Struct, kw_only=True):
    kind: Literal["start", "weights", "groups", "position", "stop"]
    version: int = 0
    positions: list[int] = []
    pending: list[int] = []
    names: list[str] = []
    shapes: list[list[int]] = []
    weights_file: str = ""  # "weights": in this shared-memory file (SharedWeights), not broadcast


class GroupsReply(msgspec.Struct):
    groups: list[ScoredGroup]
    error: str | None = None  # the generator's producer failed: why


class PositionReply(msgspec.Struct):
    position: int
    outstanding: list[int]


_ENCODER = msgspec.msgpack.Encoder()
_COMMAND = msgspec.msgpack.Decoder(Command)
_GROUPS = msgspec.msgpack.Decoder(GroupsReply)
_POSITION = msgspec.msgpack.Decoder(PositionReply)


class RankGroups:
    """Trainer rank 0's side: the generators' groups behind GroupProducer's interface (`take`,
    `buffered`, `position`), for `take_batch`, and the weights going the other way."""

    def __init__(self, group: dist.ProcessGroup, generators: int, shared_weights: bool = False) -> None:
        """`shared_weights`: the generators are processes on this machine (GeneratorProcesses):
        the weights go through a shared-memory file instead of the channel."""
        self.channel, self.generators = Channel(group), generators
        self.shared_weights = shared_weights
        self._shared: SharedWeights | None = None
        self._received: collections.deque[ScoredGroup] = collections.deque()
        self._stopped = False
        self._in_exchange = False  # an exchange cut short (an exception) leaves the protocol torn

    def _command(self, command: Command) -> None:
        self._in_exchange = True
        self.channel.broadcast_bytes(_ENCODER.encode(command))

    def start(self, positions: list[int], pending: list[int]) -> None:
        """Each generator's stream position (the checkpoint's, or 0) and the task indices drawn
        but not trained on (resume), dealt round-robin among the generators."""
        self._command(Command(kind="start", positions=positions, pending=pending))
        self._in_exchange = False

    def send_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        names, shapes, parts = flat_weights(weights)
        if not self.shared_weights:
            self._command(Command(kind="weights", version=version, names=names, shapes=shapes))
            broadcast_weights(self.channel, parts, 0)
            self._in_exchange = False
            return
        numel = sum(part.numel() for part in parts)
        first = self._shared is None or self._shared.numel != numel
        if first:
            self.close_shared()
            self._shared = SharedWeights(numel)
        assert self._shared is not None
        torch.cat(parts, out=self._shared.buffer)
        path = self._shared.path if first else ""  # mapped already otherwise
        self._command(Command(kind="weights", version=version, names=names, shapes=shapes, weights_file=path))
        for member in range(1, self.generators + 1):  # each has copied the buffer out
            self.channel.recv_bytes(member)
        if first:
            self._shared.unlink()
        self._in_exchange = False

    def close_shared(self) -> None:
        if self._shared is not None:
            self._shared.unlink()
            self._shared = None

    def _poll(self) -> int:
        """One "groups" exchange; returns how many groups arrived."""
        self._command(Command(kind="groups"))
        arrived, errors = 0, []
        for member in range(1, self.generators + 1):  # every reply first: the exchange completes
            reply = _GROUPS.decode(self.channel.recv_bytes(member))
            if reply.error is not None:
                errors.append(f"generator rank {member - 1}'s group producer failed: {reply.error}")
            self._received.extend(reply.groups)
            arrived += len(reply.groups)
        self._in_exchange = False
        if errors:
            raise ProducerError("; ".join(errors))
        return arrived

    def take(self, timeout_s: float | None = None) -> ScoredGroup:
        """The next group a generator finished (blocks; TimeoutError after `timeout_s`)."""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        while not self._received:
            if not self._poll():
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError(f"no group in {timeout_s} s")
                time.sleep(_POLL_S)
        return self._received.popleft()

    @property
    def buffered(self) -> int:
        """Groups received here and not yet taken."""
        return len(self._received)

    def position(self) -> tuple[list[int], list[int]]:
        """(every generator's stream position, the task indices drawn and not trained on: the
        generators' outstanding ones and the groups received here but not taken)."""
        self._command(Command(kind="position"))
        positions, pending = [], {g.group_id for g in self._received}
        for member in range(1, self.generators + 1):
            reply = _POSITION.decode(self.channel.recv_bytes(member))
            positions.append(reply.position)
            pending.update(reply.outstanding)
        self._in_exchange = False
        return positions, sorted(pending)

    def close(self) -> None:
        """Tell the generators to stop, unless an exchange was cut short: then they are not
        listening for a command, and torchrun ends them when this rank exits with the error."""
        self.close_shared()
        if not self._stopped and not self._in_exchange:
            self._stopped = True
            self._command(Command(kind="stop"))


def serve_generator(
    dist_info: DistInfo,
    stream_id: int,
    load_weights: Callable[[list[tuple[str, torch.Tensor]], int], object],
    make_producer: Callable[[TaskSeedStream, list[int]], GroupProducer],
) -> int:
    """A generator rank's loop: obey trainer rank 0's commands until "stop"; returns 0.

    `load_weights(named_tensors, version)` is the policy's; `make_producer(stream, replay)` builds
    the GroupProducer once the first weights are in."""
    channel = Channel(dist_info.channel)
    rank, generators = dist_info.rank, dist_info.generators
    stream = TaskSeedStream(stream=stream_id, rank=rank, world_size=generators)
    replay: list[int] = []
    producer: GroupProducer | None = None
    shared: SharedWeights | None = None  # the trainer's shared-memory weights, once mapped
    try:
        while True:
            command = _COMMAND.decode(channel.broadcast_bytes(None))
            if command.kind == "start":
                stream.position = _start_position(command.positions, rank, generators)
                replay = command.pending[rank::generators]
            elif command.kind == "weights":
                numel = numel_of(command.shapes)
                if command.weights_file:  # the trainer's shared buffer: mapped once, then reused
                    shared = SharedWeights(numel, command.weights_file)
                if shared is not None:
                    flat = shared.buffer.clone()
                    channel.send_bytes(b"")  # copied: the trainer may write the next version
                else:
                    flat = broadcast_weights(channel, None, numel)
                tensors = unflatten_weights(flat, command.names, command.shapes)
                load_weights(tensors, command.version)
                if producer is None:
                    producer = make_producer(stream, replay)
            elif command.kind == "groups":
                channel.send_bytes(_ENCODER.encode(_drain(producer)))
            elif command.kind == "position":
                position, outstanding = producer.position() if producer else (stream.position, replay)
                channel.send_bytes(_ENCODER.encode(PositionReply(position, list(outstanding))))
            else:  # stop
                return 0
    finally:
        if producer is not None:
            producer.close()


def _drain(producer: GroupProducer | None) -> GroupsReply:
    if producer is None:
        return GroupsReply([])
    groups = []
    try:
        while producer.buffered:
            groups.append(producer.take(timeout_s=0))
    except ProducerError as exc:
        return GroupsReply(groups, error=str(exc))
    except TimeoutError:
        pass
    return GroupsReply(groups, error=producer.failure())


def _start_position(positions: list[int], rank: int, generators: int) -> int:
    """This generator's stream position: the checkpoint's, or, from a run with another number of
    generators, past every task index the old ones drew (index = k * N + g)."""
    if not positions:
        return 0
    if len(positions) == generators:
        return positions[rank]
    return -(-max(positions) * len(positions) // generators)


class GeneratorProcesses:
    """`count` generator processes on this machine, without torchrun. Each runs
    `main(*args, info)`, a module-level function (the processes are spawned), with `info` its
    DistInfo: its index, the count, `device`, and the channel to this process (member 0), built on
    a local TCPStore; `main` builds its engine and calls `serve_generator`. Why processes: the
    producer's env steps and tokenizing then run beside the engine, not in the trainer's process,
    where they would hold its GIL (bench/RESULTS.md, "async_vs_sync"). `close` waits for them to
    exit (after RankGroups' "stop") and ends any still running."""

    def __init__(
        self,
        main: Callable[..., Any],
        args: tuple[Any, ...],
        count: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        context = torch.multiprocessing.get_context("spawn")
        self.processes = [
            context.Process(
                target=_generator_process,
                args=(main, args, self.store.port, member, count, str(device)),
                name=f"toolgym-generator-{member - 1}",
                daemon=True,
            )
            for member in range(1, count + 1)
        ]
        for process in self.processes:
            process.start()
        # blocks until every generator has joined (gloo connects the full mesh here)
        self.channel = channel_group(self.store, 0, count)

    def close(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()


def _generator_process(
    main: Callable[..., Any], args: tuple[Any, ...], port: int, member: int, count: int, device: str
) -> None:
    """A spawned generator process's entry (GeneratorProcesses): joins the channel, runs `main`."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    channel = channel_group(store, member, count)
    main(*args, DistInfo(member - 1, count, 0, torch.device(device), "generate", channel, count))
