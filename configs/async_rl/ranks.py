"""Async RL across torchrun's ranks (`loop.generator_ranks = N`): the last N ranks generate, the
others train with FSDP2, over the channel `trainers/distributed.py` builds (a gloo group of
trainer rank 0 and the generators).

    generator rank g (of N)                          trainer rank 0           trainer ranks 1..
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
  a shared-memory file that every generator maps: each copies it out and acknowledges, so the
  trainer never overwrites weights a generator is still reading;
- "groups": each generator sends the groups its buffer holds now (msgpack; none is fine);
- "position": each generator sends its stream position and outstanding indices (checkpoints);
- "stop": the generators close and exit.

Tensors cross as CPU tensors (gloo), so on GPUs the weights go through host memory.
"""

from __future__ import annotations

import collections
import os
import tempfile
import time
from collections.abc import Callable
from typing import Literal

import msgspec
import torch
import torch.distributed as dist

from ...agents.chat import Renderer
from ...rollouts.batches import TaskSeedStream
from ...rollouts.runner import RolloutRunner
from ...trainers.distributed import DistInfo, channel_group
from ..schema import Config
from .placement import buffer_capacity
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


class SharedWeights:
    """One flat float32 buffer in a shared-memory file, mapped by the trainer and by generator
    processes on the same machine. The file is unlinked once every generator has mapped it (the
    mappings stay), so a run leaves none behind unless it dies in between."""

    def __init__(self, numel: int, path: str = "") -> None:
        self.owner = not path
        if self.owner:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            path = os.path.join(folder, f"toolgym-weights-{os.getpid()}-{time.monotonic_ns()}")
        self.path, self.numel = path, numel
        self.buffer = torch.from_file(path, shared=True, size=numel, dtype=torch.float32)

    def unlink(self) -> None:
        if self.owner and os.path.exists(self.path):
            os.unlink(self.path)


class GroupsReply(msgspec.Struct):
    groups: list[ScoredGroup]
    error: str | None = None  # the generator's producer failed: why


class PositionReply(msgspec.Struct):
    position: int
    outstanding: list[int]


class Channel:
    """Bytes and tensors over the channel's gloo group; member 0 is trainer rank 0."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()
        return tensor

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Member 0's `data` on every member (the others pass None)."""
        size = self.broadcast(torch.tensor([len(data) if data is not None else 0], dtype=torch.int64))
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(int(size), dtype=torch.uint8)
        )
        return self.broadcast(buffer).numpy().tobytes() if int(size) else b""

    def send_bytes(self, data: bytes, dst: int = 0) -> None:
        self.group.send([torch.tensor([len(data)], dtype=torch.int64)], dst, 0).wait()
        if data:
            self.group.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], dst, 1).wait()

    def recv_bytes(self, src: int) -> bytes:
        size = torch.zeros(1, dtype=torch.int64)
        self.group.recv([size], src, 0).wait()
        if not int(size):
            return b""
        buffer = torch.empty(int(size), dtype=torch.uint8)
        self.group.recv([buffer], src, 1).wait()
        return buffer.numpy().tobytes()


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
        names = list(weights)
        shapes = [list(weights[n].shape) for n in names]
        parts = [weights[n].detach().reshape(-1).to("cpu", torch.float32) for n in names]
        if not self.shared_weights:
            self._command(Command(kind="weights", version=version, names=names, shapes=shapes))
            self.channel.broadcast(torch.cat(parts))
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
                numel = sum(_numel(s) for s in command.shapes)
                if command.weights_file:  # the trainer's shared buffer: mapped once, then reused
                    shared = SharedWeights(numel, command.weights_file)
                if shared is not None:
                    flat = shared.buffer.clone()
                    channel.send_bytes(b"")  # copied: the trainer may write the next version
                else:
                    flat = channel.broadcast(torch.empty(numel, dtype=torch.float32))
                tensors, offset = [], 0
                for name, shape in zip(command.names, command.shapes, strict=True):
                    tensors.append((name, flat[offset : offset + _numel(shape)].view(shape)))
                    offset += _numel(shape)
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


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def run_generator(config: Config, dist_info: DistInfo, renderer: Renderer, threads: int = 0) -> int:
    """A generator's whole run (a torchrun rank's, or a GeneratorProcesses process's): its engine
    (the trainer's weights replace the initial ones before its first rollout), its share of the
    task stream, until trainer rank 0 says stop. `threads`: its torch threads (0: as set)."""
    from ..build import build_policy, initial_model, policy_max_seq_len
    from ..sft import rl_stream

    if threads:
        torch.set_num_threads(threads)
    model = initial_model(config)
    policy = build_policy(config, model, None, renderer, dist_info.device)
    runner = RolloutRunner(policy, renderer, config.rollout_config())
    max_seq_len = config.batch.max_seq_len or policy_max_seq_len(config, model.config)
    batch_config = msgspec.structs.replace(config.batch, max_seq_len=max_seq_len)
    share = dist_info.generators

    def make_producer(stream: TaskSeedStream, replay: list[int]) -> GroupProducer:
        return GroupProducer(
            runner,
            stream,
            batch_config,
            concurrent_groups=-(-config.batch.groups_per_batch // share),
            capacity=-(-buffer_capacity(config) // share),
            replay=replay,
        )

    del model
    try:
        return serve_generator(dist_info, rl_stream(config), policy.load_weights, make_producer)
    finally:
        policy.close()


class GeneratorProcesses:
    """`count` generator processes on this machine, without torchrun: each runs `run_generator`
    (an engine on `device` and a producer over its share of the task stream) with `threads` torch
    threads, and speaks to this process (member 0) over a channel built on a local TCPStore. Why
    processes: the producer's env steps and tokenizing then run beside the engine, not in the
    trainer's process, where they would hold its GIL (bench/RESULTS.md, "The generator as a
    torchrun rank, on 2 cores"). `close` waits for them to exit (after RankGroups' "stop") and
    ends any still running."""

    def __init__(
        self, config: Config, count: int, threads: int, device: torch.device | str = "cpu"
    ) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        context = torch.multiprocessing.get_context("spawn")
        self.processes = [
            context.Process(
                target=_generator_process,
                args=(config, self.store.port, member, count, threads, str(device)),
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
    config: Config, port: int, member: int, count: int, threads: int, device: str
) -> None:
    """A spawned generator process's main (GeneratorProcesses), its engine on `device`."""
    from ..build import build_renderer

    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    channel = channel_group(store, member, count)
    renderer, _ = build_renderer(config)
    info = DistInfo(member - 1, count, 0, torch.device(device), "generate", channel, count)
    run_generator(config, info, renderer, threads)
