"""Block bytes in a shared Redis: one key per block, batched, never raising.

Key: `<prefix>:<fingerprint>:<salt>:{<block hash hex>}`. The layout fingerprint
and the cache salt are part of every key, so incompatible engines and tenants
never read each other's blocks. The block hash is the Redis Cluster hash tag:
blocks spread over the nodes, and anything kept about a block (today its one
value: header and bytes together, so they cannot be separated by eviction)
stays on the node that holds it.

Every public method is one round trip (a pipeline; a cluster groups it per
node), guarded by the circuit breaker, and turns any Redis or socket failure
into a miss or a failed store, counted in `stats`: the caller never sees an
exception from the server. Eviction is Redis's own (maxmemory with an
allkeys-lru / allkeys-lfu policy); a block may vanish at any time, which costs a
recompute, never a wrong answer.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Self, TypeVar

import redis
import xxhash
from redis.commands.core import Script
from redis.exceptions import AuthenticationError, OutOfMemoryError, RedisError, ResponseError

from kvtier.remote.breaker import BreakerState, CircuitBreaker
from kvtier.remote.codec import HEADER_SIZE, BlockCodec, DecodeStatus
from kvtier.remote.prefetch import PREFETCHED, PrefetchedValues
from kvtier.remote.remote_config import NotAClusterError, RedisClient, RemoteConfig, make_client
from kvtier.remote.remote_stats import RemoteCounters, RemoteStats
from kvtier.remote.wire import (
    PREFIX_LUA,
    PREFIX_MEMBERS_LUA,
    ValueBuffers,
    buffered_sets,
    send_sets,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
Payload = bytes | bytearray | memoryview
_NO_SALT = b"-"
_MAX_CACHED_SALTS = 4096


class RemoteStartupError(ValueError):
    """The remote tier is misconfigured (e.g. wrong password): fix the config, not the server."""


_REFUSED = {
    DecodeStatus.CORRUPT: "corrupt_blocks",
    DecodeStatus.FOREIGN: "foreign_blocks",
    DecodeStatus.MALFORMED: "malformed_blocks",
    DecodeStatus.WRONG_KEY: "wrong_key_blocks",
}


class RedisBlockStore:
    def __init__(
        self,
        client: RedisClient,
        codec: BlockCodec,
        config: RemoteConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.codec = codec
        self.config = config
        self.breaker = CircuitBreaker(config.breaker, clock)
        self._counters = RemoteCounters()
        # lookup round trips made so far: a lookup may take several (another layout's
        # values, see head_keys), and the cost model's estimate is of one
        self.lookup_round_trips = 0
        self.fetched_blocks = 0  # values lookups read whole (`prefetch`), so far
        self._base = f"{config.key_prefix}:{codec.fp_digest[:8].hex()}:".encode()
        self._namespaces: dict[str | None, bytes] = {}
        self._buffers = ValueBuffers()
        # values lookups read whole, for this process's loads (`prefetch`)
        self.prefetched: PrefetchedValues = PREFETCHED
        one_node = isinstance(client, redis.Redis)
        self._prefix_script: Script | None = (
            client.register_script(PREFIX_LUA) if one_node else None
        )
        self._members_script: Script | None = (
            client.register_script(PREFIX_MEMBERS_LUA) if one_node else None
        )

    @classmethod
    def connect(
        cls,
        config: RemoteConfig,
        fingerprint: str | bytes,
        clock: Callable[[], float] = time.monotonic,
    ) -> Self:
        """Build a store and check the server once: a wrong password fails here, loudly.

        An unreachable server is not an error at start-up (engines must start
        while Redis restarts): it is counted and the breaker takes over.
        """
        client = make_client(config)  # a cluster's is built (and its nodes reached) later
        store = cls(client, BlockCodec.for_fingerprint(fingerprint), config, clock)
        try:
            store.check_startup()
        except RemoteStartupError:
            store.close()
            raise
        return store

    def check_startup(self) -> bool:
        """PING once; raise RemoteStartupError on bad credentials, else report reachability."""
        try:
            self.client.ping()
        except AuthenticationError as exc:
            raise _auth_error(self.config, exc) from exc
        except ResponseError as exc:  # it answered, and refused: the config is wrong
            if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
                raise _auth_error(self.config, exc) from exc
            raise RemoteStartupError(_refusal(self.config, exc)) from exc
        except (RedisError, OSError) as exc:
            if _tls_failure(exc):
                raise RemoteStartupError(
                    f"TLS handshake with remote tier {self._where()} failed ({exc}); "
                    "check RemoteConfig.ssl_ca_certs and the server certificate"
                ) from exc
            log.warning("remote tier %s unreachable at start-up: %s", self._where(), exc)
            return self._failed("ping", exc)
        return True

    @property
    def stats(self) -> RemoteStats:
        return self._counters.snapshot()

    def namespace(self, salt: str | None) -> bytes:
        """The key prefix for one cache salt (cached: salts repeat across requests)."""
        ns = self._namespaces.get(salt)
        if ns is None:
            if len(self._namespaces) >= _MAX_CACHED_SALTS:
                self._namespaces.clear()  # tenants come and go; keep this bounded
            tag = _NO_SALT if salt is None else xxhash.xxh3_64_hexdigest(salt.encode()).encode()
            ns = self._namespaces[salt] = self._base + tag + b":{"
        return ns

    def key(self, block_hash: bytes, salt: str | None = None) -> bytes:
        return self._keys((block_hash,), salt)[0]

    def _keys(self, block_hashes: Sequence[bytes], salt: str | None) -> list[bytes]:
        ns = self.namespace(salt)
        return [b"".join((ns, h.hex().encode(), b"}")) for h in block_hashes]

    # -- the three calls -----------------------------------------------------------------

    def count_prefix(self, block_hashes: Sequence[bytes], salt: str | None = None) -> int:
        """How many leading blocks exist with a valid header for our layout (one round trip).

        Stops at the first hole: a chain whose middle was evicted is only useful
        up to the hole. Headers are fetched (GETRANGE, 48 bytes) rather than
        EXISTS so a value of another fingerprint or format is ignored here,
        before anyone plans a load of it. A failed or refused call counts none.
        """
        found = self.try_count_prefix(block_hashes, salt)
        return 0 if found is None else found

    def try_count_prefix(
        self, block_hashes: Sequence[bytes], salt: str | None = None, fetch: int = 0
    ) -> int | None:
        """`count_prefix`, or None when the server gave no answer (the call failed, or
        the breaker refused it): a caller that can ask again later tells "not known"
        from "not there" (`async_lookup`). `fetch`: read up to that many of the first
        blocks found whole, for a load in this process (`prefetch`)."""
        if not block_hashes:
            return 0
        keys = self._keys(block_hashes, salt)
        expected = [self.codec.expected_prefix(h) for h in block_hashes]
        call = partial(self._walk_prefixes, [keys], [expected], self._fetchable(fetch))
        found: list[tuple[int, bytes]] | None = self._guarded("lookup", call, None)
        if found is None:
            self._counters.add(lookups=1)
            return None
        return self._counted(block_hashes, *found[0])

    def try_count_prefixes(
        self, questions: Sequence[Sequence[bytes]], salt: str | None = None, fetch: int = 0
    ) -> list[int] | None:
        """`try_count_prefix` of each prefix, all in one round trip (a pipeline of header
        reads), or None when the server gave no answer. vLLM asks block by block, so the
        lookups one scheduler step starts cost one round trip, not one each: on a busy
        machine each round trip waits its turn for the CPU (the server's and this one's).
        `fetch`: the first that many blocks asked (in order) are read whole where found
        (`prefetch`)."""
        if len(questions) == 1:
            found = self.try_count_prefix(questions[0], salt, fetch)
            return None if found is None else [found]
        keys = [self._keys(q, salt) for q in questions]
        expected = [[self.codec.expected_prefix(h) for h in q] for q in questions]
        call = partial(self._walk_prefixes, keys, expected, self._fetchable(fetch))
        answers: list[tuple[int, bytes]] | None = self._guarded("lookup", call, None)
        if answers is None:
            self._counters.add(lookups=len(questions))
            return None
        return [self._counted(q, *a) for q, a in zip(questions, answers, strict=True)]

    def _fetchable(self, fetch: int) -> int:
        """`fetch` where a worker in this process loads this store's values, else 0."""
        return fetch if fetch > 0 and self.prefetched.serves(self._base) else 0

    def prefetched_count(self, block_hashes: Sequence[bytes], salt: str | None = None) -> int:
        """How many of the blocks a lookup read whole and a load here would take."""
        if not block_hashes or not len(self.prefetched):
            return 0
        return self.prefetched.count(self._keys(block_hashes, salt))

    def _counted(self, block_hashes: Sequence[bytes], num_hits: int, stopper: bytes) -> int:
        """Count one answered lookup (and why a present block was refused)."""
        if stopper:
            self._count_refused(self.codec, block_hashes[num_hits], stopper)
        self._counters.add(lookups=1, lookup_hit_blocks=num_hits)
        return num_hits

    def _count_refused(self, codec: BlockCodec, block_hash: bytes, stopper: bytes) -> None:
        """A block present but refused by a lookup (`stopper`: its header): say why."""
        status = codec.check_prefix(block_hash, stopper)
        self._counters.add(**{_REFUSED.get(status, "malformed_blocks"): 1})

    def store(
        self,
        block_hashes: Sequence[bytes],
        payloads: Sequence[Payload],
        salt: str | None = None,
    ) -> bool:
        """Write the blocks (one pipeline); False if any write may have failed."""
        return self.store_pieces(block_hashes, [[p] for p in payloads], salt)

    def store_pieces(
        self,
        block_hashes: Sequence[bytes],
        blocks: Sequence[Sequence[Payload]],
        salt: str | None = None,
    ) -> bool:
        """`store`, each block's payload given as the pieces it is end to end (a CPU
        slot's segments): they are written as they lie, never joined on one node."""
        if len(block_hashes) != len(blocks):
            raise ValueError(f"{len(block_hashes)} hashes but {len(blocks)} payloads")
        if not block_hashes:
            return True
        keys = self._keys(block_hashes, salt)
        views = [[memoryview(p).cast("B") for p in pieces] for pieces in blocks]
        client = self.client
        ttl = self.config.ttl_s
        if isinstance(client, redis.Redis):
            call = partial(send_sets, client, self.codec, keys, block_hashes, views, ttl)
        else:
            buffers = self._buffers
            call = partial(
                buffered_sets, client, self.codec, buffers, keys, block_hashes, views, ttl
            )
        ok = self._guarded("store", call, False)
        if ok:
            nbytes = sum(len(piece) for pieces in views for piece in pieces)
            self._counters.add(stored_blocks=len(views), stored_bytes=nbytes)
        return ok

    def load(
        self, block_hashes: Sequence[bytes], salt: str | None = None, carried: bool = False
    ) -> list[memoryview | None]:
        """Each block's verified bytes (zero-copy views), or None where it is not servable.
        `carried`: the lookup read some of them whole (`prefetch`): taken from there.

        A corrupt value is deleted (best effort) so the next lookup stops
        before it instead of planning another failing load.
        """
        if not block_hashes:
            return []
        keys = self._keys(block_hashes, salt)
        values = self._read_values(keys, carried)
        if values is None:
            return [None] * len(keys)
        out: list[memoryview | None] = []
        refused_keys = []
        counts = dict.fromkeys(("loaded_blocks", "loaded_bytes", "missing_blocks"), 0)
        decode = self.codec.decode
        for block_hash, key, value in zip(block_hashes, keys, values, strict=True):
            if value is None:
                counts["missing_blocks"] += 1
                out.append(None)
                continue
            status, payload = decode(block_hash, value)
            out.append(payload)
            if payload is None:
                refused_keys.append(key)
                counts[_REFUSED[status]] = counts.get(_REFUSED[status], 0) + 1
            else:
                counts["loaded_blocks"] += 1
                counts["loaded_bytes"] += len(payload)
        self._counters.add(**counts)
        if refused_keys:  # never served again: drop them now
            self._guarded("delete", lambda: self.client.delete(*refused_keys), 0)
        return out

    def _read_values(self, keys: list[bytes], carried: bool) -> list[Any] | None:
        """Each key's value: those a lookup read whole (`prefetch`, where `carried`) from
        there, the rest in one round trip (none where every one was read); None where the
        server gave no answer."""
        held: list[Any] = self.prefetched.take(keys) if carried else [None] * len(keys)
        missing = [i for i, value in enumerate(held) if value is None]
        if len(missing) < len(keys):
            self._counters.add(prefetch_loaded_blocks=len(keys) - len(missing))
        if not missing:
            return held
        asked = [keys[i] for i in missing]
        values = self._guarded("load", lambda: self._pipeline_get(asked), None)
        if values is None:
            return None
        for i, value in zip(missing, values, strict=True):
            held[i] = value
        return held

    def holders_of(self, block_hashes: Sequence[bytes]) -> list[int] | None:
        """Where a load should read each block first, if this store keeps blocks in
        several groupings (`head_keys`); None here: one value a block."""
        return None

    def ping(self) -> bool:
        """One guarded PING: a cheap probe for a half-open breaker."""
        return bool(self._guarded("ping", self.client.ping, False))

    def close(self) -> None:
        self.client.close()

    # -- plumbing ------------------------------------------------------------------------

    def sibling(self, codec: BlockCodec) -> RedisBlockStore:
        """A store of values encoded by `codec` (its own key namespace, from its
        fingerprint digest) over this one's connection, breaker and counters: one tier
        whose values come in several kinds (`head_keys`' head groups)."""
        other = RedisBlockStore.__new__(RedisBlockStore)
        other.__dict__.update(self.__dict__)
        other.codec = codec
        other._base = f"{self.config.key_prefix}:{codec.fp_digest[:8].hex()}:".encode()
        other._namespaces = {}
        return other

    def _walk_prefixes(
        self, keys: list[list[bytes]], expected: list[list[bytes]], fetch: int = 0
    ) -> list[tuple[int, bytes]]:
        """For each question (a run of keys), how many leading values start with their
        expected bytes, and the header of the value that stopped the walk (b"" if absent
        or none did): one round trip (the lookup script for one question on one node,
        else a pipeline). Unguarded: the caller guards it. `fetch`: the first that many
        keys are read whole, and those found kept for a load (`prefetch`)."""
        return self._walk_prefixes_and(keys, expected, None, fetch)[0]

    def _walk_prefixes_and(
        self,
        keys: list[list[bytes]],
        expected: list[list[bytes]],
        members_of: bytes | None,
        fetch: int = 0,
    ) -> tuple[list[tuple[int, bytes]], set[bytes] | None]:
        """`_walk_prefixes`, and the members of the set `members_of` (None: not asked, or
        no set reply) read in the same round trip."""
        self.lookup_round_trips += 1
        script = self._prefix_script if members_of is None else self._members_script
        if script is not None and not fetch and len(keys) == 1 and len(keys[0]) > 1:
            on = keys[0] if members_of is None else [*keys[0], members_of]
            try:
                num_hits, stopper, *more = script(keys=on, args=expected[0])
            except ResponseError as exc:  # a server without scripting: pipeline for good
                log.warning(
                    "remote tier %s: lookup script refused (%s); pipelining", self._where(), exc
                )
                self._prefix_script = self._members_script = None
            else:
                members = _members(more[0]) if more else None
                return [(int(num_hits), bytes(stopper))], members
        pipe = self.client.pipeline(transaction=False)
        left = fetch
        for question in keys:
            for key in question:
                if left > 0:
                    pipe.get(key)
                    left -= 1
                else:
                    pipe.getrange(key, 0, HEADER_SIZE - 1)
        if members_of is not None:
            pipe.smembers(members_of)
        replies = pipe.execute(raise_on_error=False)  # a key of another type: refused, below
        members = _members(replies.pop()) if members_of is not None else None
        answers, start = [], 0
        for question, question_expected in zip(keys, expected, strict=True):
            end = start + len(question_expected)
            found, stopper = _prefix_of(question_expected, replies[start:end])
            answers.append((found, stopper))
            if start < fetch:  # values read whole: kept for the load of those found
                self._keep_fetched(question[: min(found, fetch - start)], replies[start:end])
            start = end
        return answers, members

    def _keep_fetched(self, keys: list[bytes], values: list[Any]) -> None:
        kept = sum(self.prefetched.put(k, v) for k, v in zip(keys, values, strict=False))
        self.fetched_blocks += len(keys)
        if kept:
            self._counters.add(prefetched_blocks=kept)

    def _pipeline_get(self, keys: list[bytes]) -> list[Any]:
        """MGET on one node (one command to pack and one reply to parse, not N);
        a cluster pipelines GETs, which it routes per node."""
        if isinstance(self.client, redis.Redis):
            return list(self.client.mget(keys))
        client: RedisClient = self.client
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        replies = pipe.execute(raise_on_error=False)  # (MGET reads other types as nil)
        return [b"" if isinstance(r, ResponseError) else r for r in replies]

    def _guarded(self, what: str, call: Callable[[], T], fallback: T) -> T:
        """Run one server call under the breaker; a failure becomes `fallback`."""
        if not self.breaker.allow():
            self._counters.add(skipped_calls=1)
            return fallback
        try:
            result = call()
        except OutOfMemoryError as exc:
            # Full under a noeviction policy: the server is healthy and lookups
            # still hit, so this fails the call without tripping the breaker.
            log.debug("remote tier %s: %s refused, server full: %s", self._where(), what, exc)
            self._counters.add(errors=1, full_refusals=int(what == "store"))
            self.breaker.record_success()
            return fallback
        except (RedisError, OSError) as exc:
            self._failed(what, exc)
            return fallback
        except BaseException as exc:  # a bug, not the server: raise it, but as a failed call,
            self._failed(what, exc)  # or a half-open breaker would wait for this probe forever
            raise
        self.breaker.record_success()
        return result

    def _failed(self, what: str, exc: BaseException) -> bool:
        was_open = self.breaker.state is BreakerState.OPEN
        self.breaker.record_failure()
        opened = not was_open and self.breaker.state is BreakerState.OPEN
        self._counters.add(errors=1, breaker_opened=int(opened))
        log.debug("remote tier %s: %s failed: %r", self._where(), what, exc)
        if opened:
            log.warning(
                "remote tier %s: %s failed (%s); skipping it for now", self._where(), what, exc
            )
        return False

    def _where(self) -> str:
        return self.config.redacted_url()


def _prefix_of(expected: Sequence[bytes], replies: list[Any]) -> tuple[int, bytes]:
    """(leading replies that start with their expected bytes, the stopper's header)."""
    for i, (want, prefix) in enumerate(zip(expected, replies, strict=True)):
        if isinstance(prefix, ResponseError):
            return i, b"not a string value"
        if not prefix:
            return i, b""
        if prefix[: len(want)] != want:
            return i, bytes(prefix[:HEADER_SIZE])  # (a value read whole: its header)
    return len(expected), b""


def _tls_failure(exc: BaseException | None) -> bool:
    """Is a certificate problem anywhere in the chain? (a config error, like a bad password)"""
    while exc is not None:
        if isinstance(exc, ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _refusal(config: RemoteConfig, exc: BaseException) -> str:
    """Why a reachable server refused the configuration, naming the URL part at fault."""
    where = config.redacted_url()
    if isinstance(exc, NotAClusterError):
        return (
            f"remote tier {where}: the node list names a node that is not in cluster mode "
            f"({exc}); give one node as redis://host:port/db, or the nodes of a cluster"
        )
    if "DB index" in str(exc):
        return (
            f"remote tier {where}: the server has no database {config.db} (the URL path; "
            f"{exc}); a server has databases 0 to its `databases` setting - 1 (default 15)"
        )
    return f"remote tier {where} refused the connection's setup: {exc}"


def _auth_error(config: RemoteConfig, exc: BaseException) -> RemoteStartupError:
    return RemoteStartupError(
        f"remote tier {config.redacted_url()} refused our credentials ({exc}); "
        "check the password in the URL or RemoteConfig.password"
    )


def _members(reply: object) -> set[bytes] | None:
    """A set's members from SMEMBERS (a set, or a script's list), None for anything else
    (an error: the set holds another type, or the call failed)."""
    if isinstance(reply, set | list):
        return {bytes(m) for m in reply}
    return None
