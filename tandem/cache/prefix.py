"""Prompts' prefixes kept in host memory for later requests that begin with the same tokens.

A prompt prefilled in chunks of `chunk` tokens is kept at one chunk boundary (`cache.snapshot`): the longest prefix
a later prompt could take and still be prefilled in the same chunks (`engine.prefill.prefix_end`). A later
request whose prompt begins with those tokens, under the same settings and chunk length, takes the longest kept
prefix: its cache starts in that state and only the tokens past it are prefilled, with the same results as a
cold prefill. Prefixes are keyed, as vLLM's automatic prefix caching keys its blocks, by a hash chained over the
prompt's chunks (so a lookup hashes the prompt once), seeded with the settings that shape the cache; a hit is
confirmed token by token.

A kept prefix reads the host rows of the request that made it in place and holds copies of the rest (no device
memory). A request that starts from one copies it into its own tiers, or, where no request writes into those host
rows any more (the one that kept them ended), takes them over without a copy and writes its own rows past them:
rows once written never change, so no request ever sees another's tokens.
Under `max_bytes` the least recently used prefixes not being copied from are dropped; a server also drops them
when a request needs the host memory they hold (`evict`).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from . import snapshot


@dataclass
class CachePrefix:
    """One kept prefix: its `tokens`, the layers' state after them (`snapshot.take`) and the host bytes that
    keeps alive (with those of any other prefix that reads the same host tier). `users`: requests copying from it
    now (never dropped meanwhile)."""

    tokens: tuple[int, ...]
    parts: list
    nbytes: int
    users: int = 0
    hits: int = field(default=0)


class PrefixCache:
    """Kept prefixes of one model's prompts, least recently used first out.

    Example:
        >>> store = PrefixCache(max_bytes=8 << 30)
        >>> runner.prefill(ids, chunk_tokens=2048, prefix_cache=store)  # keeps the prompt's longest prefix
        >>> runner2.prefill(ids2, chunk_tokens=2048, prefix_cache=store)  # starts from it where ids2 begins so
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None (no limit), got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, CachePrefix] = OrderedDict()  # least recently used first
        # a server admits (and drops prefixes) on other threads than the one that prefills
        self._lock = threading.Lock()
        self.lookups = self.hits = self.hit_tokens = self.inserted = self.evictions = 0
        self.adopted = 0  # hits that took the prefix's host rows over instead of copying them
        self.bytes_restored = 0  # bytes the other hits copied

    # ---- keys --------------------------------------------------------------------------------------------------
    @staticmethod
    def chain(config, chunk: int, tokens, upto: int) -> list[bytes]:
        """The keys of tokens[:chunk], tokens[:2 * chunk], .. up to tokens[:upto] (upto a multiple of chunk): each
        the hash of the one before and the next chunk's tokens, the first seeded with the cache's settings."""
        seed = json.dumps({"config": config.to_dict(), "chunk": chunk}, sort_keys=True, default=str)
        digest = hashlib.blake2b(seed.encode(), digest_size=16).digest()
        ids = np.asarray(tokens[:upto], dtype=np.int64)
        keys = []
        for start in range(0, upto, chunk):
            digest = hashlib.blake2b(digest + ids[start : start + chunk].tobytes(), digest_size=16).digest()
            keys.append(digest)
        return keys

    # ---- lookups and inserts -----------------------------------------------------------------------------------
    def lookup(self, config, chunk: int, tokens, limit: int) -> CachePrefix | None:
        """The longest kept prefix of `tokens` of at most `limit` tokens (a multiple of `chunk`) kept under
        `config` with this chunk length, marked in use (`restore` then `done`), or None."""
        with self._lock:
            self.lookups += 1
        if limit < chunk:
            return None
        keys = self.chain(config, chunk, tokens, limit)
        with self._lock:
            for n, key in zip(range(len(keys), 0, -1), reversed(keys)):
                entry = self._entries.get(key)
                if entry is not None and entry.tokens == tuple(int(t) for t in tokens[: n * chunk]):
                    self._entries.move_to_end(key)
                    entry.users += 1
                    return entry
        return None

    def restore(self, kvs: list, entry: CachePrefix) -> int:
        """Start a new cache's layers `kvs` from `entry` (taken by `lookup`); returns the tokens it holds. The entry
        is free to go again afterwards, whether the restore succeeded or not.

        Where no request writes into the host rows the entry reads any more (the one that kept it ended), the new
        cache takes them over instead of copying them, and writes its own rows past them: the prefixes of the same
        request that reach further (whose rows those are) are dropped, unless one is in use, which makes it copy."""
        try:
            with self._lock:
                held = snapshot.claims(entry.parts)
                longer = [
                    (key, other)
                    for key, other in self._entries.items()
                    if other is not entry
                    and len(other.tokens) > len(entry.tokens)
                    and snapshot.claims(other.parts) & held
                ]
                adopt = snapshot.adoptable(entry.parts) and not any(other.users for _, other in longer)
                if adopt:
                    for key, other in longer:
                        del self._entries[key]
                        snapshot.release(other.parts)
                        self.evictions += 1
            snapshot.restore(kvs, entry.parts, adopt=adopt)
        finally:
            self.done(entry)
        with self._lock:
            self.hits += 1
            entry.hits += 1
            self.hit_tokens += len(entry.tokens)
            if adopt:
                self.adopted += 1
            else:
                self.bytes_restored += snapshot.copied_bytes(entry.parts)
        return len(entry.tokens)

    def done(self, entry: CachePrefix) -> None:
        with self._lock:
            entry.users -= 1

    def insert(self, kvs: list, config, chunk: int, tokens) -> CachePrefix | None:
        """Keep the state of a batch-1 cache's layers `kvs` holding exactly `tokens` (a multiple of `chunk`, its
        prefill in chunks of `chunk` from the start), unless it is kept already, could never fit `max_bytes` or
        host memory for its copies is short (the prompt goes on all the same). Returns the new entry, or None."""
        n = len(tokens)
        if n == 0 or n % chunk:
            raise ValueError(f"a kept prefix is whole chunks of {chunk} tokens, got {n} tokens")
        key = self.chain(config, chunk, tokens, n)[-1]
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return None
        try:
            parts = snapshot.take(kvs, first_chunk=min(chunk, n))
        except (MemoryError, RuntimeError):  # (pinned memory for the copies): the prompt goes on, not kept
            return None
        entry = CachePrefix(tuple(int(t) for t in tokens), parts, snapshot.nbytes(parts))
        if self.max_bytes is not None and entry.nbytes > self.max_bytes:
            snapshot.release(parts)
            return None
        with self._lock:
            self._entries[key] = entry
            self.inserted += 1
            if self.max_bytes is not None:
                self._evict_locked(self.max_bytes)
        return entry

    # ---- memory ------------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Host bytes the kept prefixes hold (a host tier that several read counted once)."""
        with self._lock:
            return self._held_locked()

    def _held_locked(self, entries=None) -> int:
        entries = self._entries.values() if entries is None else entries
        return snapshot.nbytes([part for entry in entries for part in entry.parts])

    def __len__(self) -> int:
        return len(self._entries)

    def evict(self, keep_bytes: int) -> int:
        """Drop least recently used prefixes not in use until at most `keep_bytes` are held; returns the bytes
        freed."""
        with self._lock:
            return self._evict_locked(keep_bytes)

    def _evict_locked(self, keep_bytes: int) -> int:
        before = held = self._held_locked()
        for key in list(self._entries):
            if held <= keep_bytes:
                break
            entry = self._entries[key]
            if entry.users:
                continue
            del self._entries[key]
            snapshot.release(entry.parts)
            self.evictions += 1
            held = self._held_locked()
        return before - held

    def clear(self) -> None:
        self.evict(0)

    def stats(self) -> dict:
        """Counters since the start: lookups, hits, tokens restored, hits that took the host rows over and the
        bytes the others copied, prefixes kept and dropped; and now: prefixes held and their bytes."""
        with self._lock:
            held = self._held_locked()
            return {
                "lookups": self.lookups, "hits": self.hits, "hit_tokens": self.hit_tokens,
                "adopted": self.adopted, "bytes_restored": self.bytes_restored, "inserted": self.inserted,
                "evictions": self.evictions,
                "entries": len(self._entries), "bytes": held,
            }  # fmt: skip


__all__ = ["CachePrefix", "PrefixCache"]
