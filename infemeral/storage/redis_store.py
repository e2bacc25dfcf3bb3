"""Redis store, for several server replicas sharing sessions behind a load balancer.

Keys per session: `<prefix>:<sid>:manifest`, `<prefix>:<sid>:chunk:<name>`, the
set `<prefix>:<sid>:chunks`, and the turn lock `<prefix>:<sid>:lock`. The lock
is SET NX with a lease (so a crashed replica's lock expires) holding a fencing
token from INCR; the manifest is replaced, and chunks are deleted, by Lua
scripts only while the lock still holds that token, so a replica whose lease
ran out can neither overwrite a newer turn nor delete the chunks it wrote. Every key carries the session TTL, refreshed on each commit.
"""

from __future__ import annotations

import redis

from infemeral.storage.base import SessionBusy, SessionLock, Store

SOCKET_TIMEOUT_SECONDS = 10.0

_COMMIT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
"""
_REFRESH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
_DELETE_CHUNKS = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
for i = 3, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('SREM', KEYS[2], unpack(ARGV, 2))
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class _RedisLock(SessionLock):
    def __init__(self, store: "RedisStore", key: str, token: str, lease_ms: int):
        self.store, self.key, self.token, self.lease_ms = store, key, token, lease_ms
        self.held = True

    def refresh(self) -> None:
        if not self.held or not self.store._refresh(keys=[self.key], args=[self.token, self.lease_ms]):
            self.held = False
            raise SessionBusy("this turn's lease on the session expired and another turn may have taken it; "
                              "reopen the session")

    def release(self) -> None:
        if self.held:
            self.store._release(keys=[self.key], args=[self.token])
            self.held = False


class RedisStore(Store):
    def __init__(self, url: str, ttl_seconds: float = 7 * 24 * 3600, prefix: str = "infemeral"):
        super().__init__(ttl_seconds)
        # A Redis that hangs must not hang turns: every command gives up after a while (the URL may say otherwise).
        self.r = redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_SECONDS,
                                      socket_connect_timeout=SOCKET_TIMEOUT_SECONDS)
        self.r.ping()
        self.prefix = prefix
        self._commit = self.r.register_script(_COMMIT)
        self._refresh = self.r.register_script(_REFRESH)
        self._release = self.r.register_script(_RELEASE)
        self._delete_chunks = self.r.register_script(_DELETE_CHUNKS)

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl_seconds * 1000))

    def key(self, session_id: bytes, *parts: str) -> str:
        return ":".join((self.prefix, session_id.hex(), *parts))

    def lock(self, session_id: bytes, lease_seconds: float = 60.0) -> SessionLock:
        fence = self.r.incr(f"{self.prefix}:fence")
        key, lease_ms = self.key(session_id, "lock"), int(lease_seconds * 1000)
        if not self.r.set(key, str(fence), nx=True, px=lease_ms):
            raise SessionBusy("this session is in a turn on another connection or replica; "
                              "wait for it to finish (one turn at a time per session)")
        return _RedisLock(self, key, str(fence), lease_ms)

    def read_manifest(self, session_id: bytes) -> bytes | None:
        return self.r.get(self.key(session_id, "manifest"))

    def write_chunk(self, session_id: bytes, name: str, data: bytes) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.set(self.key(session_id, "chunk", name), data, px=self.ttl_ms)
        pipe.sadd(self.key(session_id, "chunks"), name)
        pipe.pexpire(self.key(session_id, "chunks"), self.ttl_ms)
        pipe.execute()
        self._count(len(data))

    def read_chunk(self, session_id: bytes, name: str) -> bytes | None:
        return self.r.get(self.key(session_id, "chunk", name))

    def commit_manifest(self, session_id: bytes, data: bytes, lock: SessionLock) -> None:
        ok = self._commit(keys=[self.key(session_id, "lock"), self.key(session_id, "manifest")],
                          args=[lock.token, data, self.ttl_ms])
        if not ok:
            raise SessionBusy("this turn's lease on the session expired before its commit; "
                              "the session is unchanged — reopen it and retry")
        self._count(len(data))
        pipe = self.r.pipeline(transaction=False)
        for name in self.list_chunks(session_id):
            pipe.pexpire(self.key(session_id, "chunk", name), self.ttl_ms)
        pipe.pexpire(self.key(session_id, "chunks"), self.ttl_ms)
        pipe.execute()

    def list_chunks(self, session_id: bytes) -> list[str]:
        return sorted(m.decode() for m in self.r.smembers(self.key(session_id, "chunks")))

    def delete_chunks(self, session_id: bytes, names: list[str], lock: SessionLock) -> None:
        if not names:
            return
        keys = [self.key(session_id, "lock"), self.key(session_id, "chunks")]
        keys += [self.key(session_id, "chunk", n) for n in names]
        if not self._delete_chunks(keys=keys, args=[lock.token, *names]):
            raise SessionBusy("this turn's lease on the session expired; its stale chunks are left for the "
                              "session's next commit to remove")

    def delete_session(self, session_id: bytes) -> bool:
        names = self.list_chunks(session_id)
        keys = [self.key(session_id, "manifest"), self.key(session_id, "chunks")]
        keys += [self.key(session_id, "chunk", n) for n in names]
        existed = bool(self.r.exists(keys[0]))
        self.r.delete(*keys)
        return existed

    def purge_expired(self) -> int:
        return 0  # Redis expires every key by itself

    def close(self) -> None:
        self.r.close()
