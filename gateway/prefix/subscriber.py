"""The sockets of precise mode: a SUB on an engine's KV event publisher, a DEALER for replays.

vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py) binds a PUB socket, and a ROUTER for
replays that answers `["", start seq]` with `["", seq, batch]` per buffered batch and then
`["", -1, ""]`. This module only moves frames: what they mean, the sequence, faults and the
index are `gateway/prefix/events.py`'s `Follower`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from gateway.prefix.events import END_SEQ, EventSource, Follower


class Subscriber:
    """The asyncio side: a SUB socket on the engine's publisher, a DEALER for replays.

    `busy()` says whether the engine has work from this gateway now (its outstanding requests):
    an engine with work publishes as its blocks fill, so silence then for `silence_s` means
    the stream stopped; an idle engine's silence means nothing.
    """

    def __init__(self, source: EventSource, follower: Follower, busy: Callable[[], bool],
                 context: zmq.asyncio.Context | None = None, silence_s: float = 10.0,
                 replay_timeout_s: float = 1.0, tick_s: float = 0.5) -> None:
        self.source = source
        self.follower = follower
        self.busy = busy
        self.context = context or zmq.asyncio.Context.instance()
        self.silence_s = silence_s
        self.replay_timeout_s = replay_timeout_s
        self.tick_s = tick_s
        self._sub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._last_message = follower.clock()
        self._busy_since: float | None = None

    async def run(self) -> None:
        """Until cancelled; never raises for anything the engine sends."""
        try:
            self._open()
        except zmq.ZMQError as exc:  # an endpoint ZMQ cannot connect to: approximate for good
            self.close()
            self.follower.fault("disconnected", f"{self.source.endpoint}: {exc}")
            return
        monitor = asyncio.create_task(self._watch_connection(), name="kv-events-monitor")
        try:
            while True:
                assert self._sub is not None
                try:
                    frames = await asyncio.wait_for(self._sub.recv_multipart(), self.tick_s)
                except TimeoutError:
                    self._idle()
                    continue
                self._last_message = self.follower.clock()
                self._busy_since = None
                await self._handle(frames)
                self.follower.tick()
        finally:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
            self.close()

    def close(self) -> None:
        for sock in (self._monitor, self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._replay = self._monitor = None

    def _open(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        # Reconnect on our own: a restarted engine binds the same port again.
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self._monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.source.topic)
        sub.connect(self.source.endpoint)
        self._sub = sub
        self._open_replay()

    def _open_replay(self) -> None:
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
        if self.source.replay_endpoint is not None:
            replay = self.context.socket(zmq.DEALER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.connect(self.source.replay_endpoint)
            self._replay = replay

    async def _watch_connection(self) -> None:
        assert self._monitor is not None
        monitor = self._monitor
        while True:
            message = await recv_monitor_message(monitor)
            event = message["event"]
            if event == zmq.EVENT_CONNECTED:
                self.follower.set_connected(True)
            elif event == zmq.EVENT_DISCONNECTED:
                self.follower.set_connected(False)

    def _idle(self) -> None:
        follower = self.follower
        follower.tick()
        now = follower.clock()
        if not self.busy():
            self._busy_since = None
            return
        if self._busy_since is None:
            self._busy_since = now
        quiet_from = max(self._busy_since, self._last_message)
        if follower.state.precise and now - quiet_from >= self.silence_s:
            follower.fault("stopped", f"no event for {now - quiet_from:.0f} s while the engine "
                           "has requests from us")

    async def _handle(self, frames: list[bytes]) -> None:
        follower = self.follower
        if len(frames) != 3 or len(frames[1]) != 8:
            follower.fault("garbage", f"a message of {len(frames)} frames")
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        expected = follower.expected()
        if follower.state.last_seq < 0:
            if seq > 0:
                # Subscribed after the engine started: what its replay buffer still holds
                # from the start rebuilds the index (nothing lost if it no longer does).
                await self._replay_from(0, seq, initial=True)
        elif seq > expected:
            recovered = await self._replay_from(expected, seq)
            follower.gap(expected, seq, recovered)
        follower.receive(seq, payload)

    async def _replay_from(self, first: int, upto: int, initial: bool = False) -> bool:
        """Ask the replay socket for batches first..upto-1; True if all came, in order.
        `initial`: nothing applied yet, so the replay may start wherever the buffer does."""
        replay = self._replay
        if replay is None:
            return False
        follower = self.follower
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout_s
        try:
            await replay.send_multipart([b"", first.to_bytes(8, "big")])
            # Bounded: the replay sends at most its buffer, and we stop at the gap's end.
            while follower.expected() < upto:
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError
                frames = await asyncio.wait_for(replay.recv_multipart(), left)
                if len(frames) != 3 or len(frames[1]) != 8:
                    return False
                _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ or not payload:
                    break
                if seq > follower.expected() and not (initial and follower.state.last_seq < 0):
                    break  # the engine's buffer no longer holds the start of the gap
                if seq == follower.expected():
                    follower.receive(seq, payload)
        except (TimeoutError, zmq.ZMQError):
            # Late answers to this request must not be read as the next one's: a new socket.
            self._open_replay()
            return False
        if follower.expected() >= upto:
            self._drain_rest()
            return True
        return False

    def _drain_rest(self) -> None:
        # The replay goes on to its END marker after the batches we needed; a fresh socket is
        # simpler than reading the rest, and a gap is rare.
        self._open_replay()
