"""How blocks go over the wire: zero-copy SETs, reused buffers, the lookup script.

Kept apart from the store's policy (breaker, counters, refusals): these are the
byte-level tricks that make the tier as fast as plain redis-py, and each says
why it exists.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from typing import Any

import redis

from kvtier.remote.codec import BlockCodec
from kvtier.remote.remote_config import RedisClient

# Walk the keys in order and stop at the first whose header does not start with
# the expected 32 bytes (absent keys read as ''; a key of another type, e.g. a
# list someone wrote, reads as a refused header, not an error); return that count
# and the stopper's header so the client can say why it was refused. One command
# and one short reply instead of N replies: about half the per-block cost.
PREFIX_LUA = """
for i, key in ipairs(KEYS) do
  local header = redis.pcall('GETRANGE', key, 0, 47)
  if type(header) ~= 'string' then
    return {i - 1, 'not a string value'}
  end
  if string.sub(header, 1, 32) ~= ARGV[i] then
    return {i - 1, header}
  end
end
return {#KEYS, ''}
"""

# PREFIX_LUA over every key but the last, and the members of the set named by the last
# (`head_keys.GROUPINGS_KEY`), in the same call
PREFIX_MEMBERS_LUA = """
local members = redis.pcall('SMEMBERS', KEYS[#KEYS])
if type(members) ~= 'table' or members.err then
  members = false
end
for i = 1, #KEYS - 1 do
  local header = redis.pcall('GETRANGE', KEYS[i], 0, 47)
  if type(header) ~= 'string' then
    return {i - 1, 'not a string value', members}
  end
  if string.sub(header, 1, 32) ~= ARGV[i] then
    return {i - 1, header, members}
  end
end
return {#KEYS - 1, '', members}
"""


# Rows at least this large go to the socket as they are; smaller ones are joined
# with their neighbours (a syscall per tiny row costs more than copying it).
_SEPARATE_SEND_BYTES = 16 * 1024
# buffers per sendmsg (Linux's IOV_MAX is 1024)
_IOV_MAX = 512


def send_sets(
    client: redis.Redis,
    codec: BlockCodec,
    keys: Sequence[bytes],
    block_hashes: Sequence[bytes],
    blocks: Sequence[Sequence[memoryview]],
    ttl_s: int | None,
) -> bool:
    """One node: SETs written on the socket with the header and the caller's bytes as
    separate chunks, so a store copies no payload at all (a pipeline needs each
    value in one buffer, and building it costs more than the send). A block is the
    pieces its payload is end to end: one row, or a CPU slot's segments, which go
    out as they lie (`_send`). Any error drops the connection, since replies may be
    left unread.
    """
    if ttl_s is None:
        argc, suffix = b"*3\r\n$3\r\nSET\r\n$", b"\r\n"
    else:
        argc = b"*5\r\n$3\r\nSET\r\n$"
        suffix = b"\r\n$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl_s)), ttl_s)
    chunks: list[bytes | memoryview] = []
    pending: list[bytes | memoryview] = []  # small pieces, joined into one send
    separator = b""
    header_size = codec.header_size
    for key, block_hash, pieces in zip(keys, block_hashes, blocks, strict=True):
        size = sum(len(piece) for piece in pieces)
        head = b"%d\r\n%s\r\n$%d\r\n" % (len(key), key, header_size + size)
        pending += (separator, argc, head, codec.header_of(block_hash, pieces))
        if size < _SEPARATE_SEND_BYTES:
            pending += pieces
        else:
            chunks += (b"".join(pending), *pieces)
            pending = []
        separator = suffix
    pending.append(separator)
    chunks.append(b"".join(pending))
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        _send(conn, chunks)
        replies = [conn.read_response() for _ in keys]
    except BaseException:
        conn.disconnect()  # type: ignore[no-untyped-call]
        raise
    finally:
        pool.release(conn)
    return all(reply in (b"OK", "OK", True) for reply in replies)


def _send(conn: Any, chunks: list[bytes | memoryview]) -> None:
    """`chunks` on the connection's socket, many to a system call (`sendmsg`). Why: a
    CPU slot's segments are tens per block, and redis-py sends each chunk with its own
    call; gathering them in user space would copy every byte once more. A TLS socket
    (no `sendmsg`) takes them one by one."""
    conn.send_packed_command([])  # connects (and checks health) first, as redis-py does
    sock = conn._sock
    if type(sock) is not socket.socket:
        conn.send_packed_command(chunks, check_health=False)
        return
    views = [memoryview(chunk).cast("B") for chunk in chunks if len(chunk)]
    first = 0
    while first < len(views):
        batch = views[first : first + _IOV_MAX]
        sent = sock.sendmsg(batch)
        for view in batch:
            if sent < len(view):
                views[first] = view[sent:]
                break
            sent -= len(view)
            first += 1


def buffered_sets(
    client: RedisClient,
    codec: BlockCodec,
    buffers: ValueBuffers,
    keys: Sequence[bytes],
    block_hashes: Sequence[bytes],
    blocks: Sequence[Sequence[memoryview]],
    ttl_s: int | None,
) -> bool:
    """A cluster: a pipeline (routed per node) of values built in reused buffers."""
    size = max(sum(len(piece) for piece in pieces) for pieces in blocks)
    values = buffers.get(len(blocks), size + codec.header_size)
    pipe = client.pipeline(transaction=False)
    for key, buffer, block_hash, pieces in zip(keys, values, block_hashes, blocks, strict=False):
        pipe.set(key, codec.encode_into(buffer, block_hash, pieces), ex=ttl_s)
    return all(pipe.execute())


class ValueBuffers(threading.local):
    """Per-thread reusable value buffers, for clients that need one buffer per value.

    Why: a fresh multi-MiB bytes object per block is page-faulted in on every
    store, which costs several times the copy itself.
    """

    def __init__(self) -> None:
        self.buffers: list[bytearray] = []

    def get(self, count: int, size: int) -> list[bytearray]:
        buffers = self.buffers
        for i, buffer in enumerate(buffers[:count]):
            if len(buffer) < size:
                buffers[i] = bytearray(size)  # a new one: views of the old may still live
        buffers.extend(bytearray(size) for _ in range(count - len(buffers)))
        return buffers[:count]
