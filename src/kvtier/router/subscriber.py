"""One engine's KV-event stream into the index: vLLM's ZMQ publisher, subscribed.

vLLM numbers its batches from 0 and keeps the last ones for replay on a ROUTER
socket (`replay_endpoint`): a subscriber sends the first number it wants and gets
every buffered batch from there, then an end marker (number -1). The subscriber
applies batches in order, once each:

- a gap in the numbers (a slow joiner, a full queue) is filled from the replay
  socket when there is one (asked again when its answer stalls), else counted as
  missed;
- a number lower than expected means the engine restarted: what it held is gone,
  its entries are dropped and the new stream is followed from its start; unless it is
  a batch already applied, the same bytes (a replay answers every buffered batch from
  the number asked, newer ones too, and those still arrive live after it: taken for a
  restart, they dropped the engine's entries, and a busy engine's next turn was routed
  elsewhere, the router flake of stops 41, 51 and 55);
- `resync()` (the engine was taken out and is back, or the router just started)
  drops the engine's entries and rebuilds them from the replay buffer.

The router's guesses of prompts just routed (`BlockIndex.routed`) are its own, not
the stream's: a rebuild keeps them, and the engine's events end them as usual.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
import xxhash
import zmq
import zmq.asyncio

from kvtier.router.config import EngineSpec
from kvtier.router.events import EventDecoder
from kvtier.router.index import BlockIndex

log = logging.getLogger(__name__)
_END = (-1).to_bytes(8, "big", signed=True)
REPLAY_ATTEMPTS = 3  # replay requests that time out before a gap is counted missed
# batches whose digest is kept, to tell a live copy of a replayed batch from a restart
RECENT_BATCHES = 4096


@dataclass
class EventCounters:
    batches: int = 0
    events: int = 0
    malformed: int = 0  # events (or whole batches) that did not decode
    ignored: int = 0
    missed: int = 0  # batches lost to a gap no replay filled
    replayed: int = 0
    restarts: int = 0


class EventSubscriber:
    def __init__(
        self,
        spec: EngineSpec,
        index: BlockIndex,
        ctx: zmq.asyncio.Context,
        replay_timeout_s: float = 2.0,
    ) -> None:
        if spec.events is None:
            raise ValueError(f"engine {spec.name} has no events endpoint")
        self.spec, self.index = spec, index
        self.counters = EventCounters()
        self._ctx = ctx
        self._decoder = EventDecoder()
        self._expected: int | None = None
        self._applied: dict[int, int] = {}  # batch number -> digest, the last ones applied
        self._resync = True  # at start: whatever the engine holds already
        self._replay_timeout_s = replay_timeout_s
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.LINGER, 0)
        if spec.bind_events:
            self._sub.bind(spec.events)
        else:
            self._sub.connect(spec.events)

    def resync(self) -> None:
        self._resync = True

    def close(self) -> None:
        self._sub.close(linger=0)

    async def run(self) -> None:
        while True:
            if self._resync:
                self._resync = False
                self.index.drop_engine(self.spec.name, keep_routed=True)
                self._expected = None
                if self.spec.replay is not None:
                    await self._replay(0)
            if not await self._sub.poll(100):
                continue
            frames = await self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.counters.malformed += 1
                continue
            _topic, seq_bytes, payload = frames
            await self._receive(int.from_bytes(seq_bytes, "big"), payload)

    async def _receive(self, seq: int, payload: bytes) -> None:
        """A live batch: fill what is missing before it, then apply it."""
        replay = self.spec.replay is not None
        expected = self._expected
        if expected is not None and seq < expected:
            if self._applied.get(seq) == xxhash.xxh3_64_intdigest(payload):
                return  # a live copy of a batch a replay brought
            log.info(
                "engine %s restarted its KV events (batch %d, expected %d)",
                self.spec.name,
                seq,
                expected,
            )
            self.counters.restarts += 1
            self.index.drop_engine(self.spec.name, keep_routed=True)
            self._expected = expected = None
            self._applied.clear()
        if replay and seq > (expected or 0):
            await self._replay(expected or 0)
        if self._expected is not None and seq < self._expected:
            return  # the replay brought it
        if self._expected is not None and seq > self._expected:
            self.counters.missed += seq - self._expected
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self._expected = seq + 1
        applied = self._applied
        applied[seq] = xxhash.xxh3_64_intdigest(payload)
        if len(applied) > 2 * RECENT_BATCHES:
            self._applied = {k: v for k, v in applied.items() if k > seq - RECENT_BATCHES}
        self.counters.batches += 1
        try:
            batch = self._decoder.decode(payload)
        except (msgspec.DecodeError, ValueError):
            self.counters.malformed += 1
            return
        self.counters.malformed += batch.malformed
        self.counters.ignored += batch.ignored
        self.counters.events += len(batch.events)
        for event in batch.events:
            self.index.apply(self.spec.name, event)

    async def _replay(self, start: int) -> None:
        """Apply the publisher's buffered batches numbered `start` and on.

        A replay that stops answering (vLLM's publisher serves it from a thread of the
        engine's busy process) is asked again from the first batch still wanted, up to
        REPLAY_ATTEMPTS times, before the gap is counted missed: a batch missed is never
        asked for again, and its blocks stay unknown until the engine names them."""
        for attempt in range(REPLAY_ATTEMPTS):
            if attempt and self._expected is not None:
                start = max(start, self._expected)
            if await self._replay_once(start):
                return
        log.warning(
            "engine %s: no end to the KV events replay in %d attempts",
            self.spec.name,
            REPLAY_ATTEMPTS,
        )

    async def _replay_once(self, start: int) -> bool:
        """One replay request; whether its end marker came."""
        assert self.spec.replay is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.spec.replay)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while await sock.poll(int(self._replay_timeout_s * 1000)):
                frames = await sock.recv_multipart()
                if len(frames) != 4 or frames[2] == _END:
                    return True
                _empty, _topic, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big")
                if self._expected is None or seq >= self._expected:
                    self.counters.replayed += 1
                    self._apply(seq, payload)
            return False
        finally:
            sock.close(linger=0)
