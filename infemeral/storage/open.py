"""Open a store from a URL, and what a store's failure looks like.

The one place that knows every backend, so that the interface (`base.py`) and
each backend can be read alone. Backends load on use: Redis is an optional
dependency.
"""

from __future__ import annotations

from pathlib import Path

from infemeral.storage.base import Store


def store_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the store is unreachable or failed" (answered as UNAVAILABLE)."""
    errors: tuple[type[BaseException], ...] = (OSError,)
    try:
        import redis

        errors += (redis.exceptions.RedisError,)
    except ImportError:
        pass
    return errors


def open_store(url: str | Path, ttl_seconds: float = 7 * 24 * 3600) -> Store:
    """A store from a URL: a plain path or file:///path (local directory), redis://host:port/db."""
    text = str(url)
    if text.startswith(("redis://", "rediss://", "unix://")):
        from infemeral.storage.redis_store import RedisStore

        return RedisStore(text, ttl_seconds)
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        raise ValueError(f"unsupported store URL {text!r}; use a directory path, file:///path or redis://host:port/db")
    from infemeral.storage.directory import DirectoryStore

    return DirectoryStore(Path(text), ttl_seconds)
