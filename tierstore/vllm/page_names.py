"""PageNames: the page key of each vLLM offload key, for one scheduler.

Without ``encryption_key_file`` or ``require_cache_salt`` a page key is vLLM's block hash (the
offload key without its 4-byte group suffix) and nothing is kept. With them a page key depends
on the request's ``cache_salt`` (``CacheSalt``, which ``TierStoreConnectorScheduler`` records
in the request's ``ReqContext`` when vLLM adds the request): the id of the salt's key followed
by that key's keyed name of the block hash (``sealing.KeyRing.page_key``), so nothing under the
root holds a block hash and each tenant's pages are sealed with its own key. A request that may
not be cached gets None: its keys miss and are never stored (``refused`` counts them). Such a
request has no salt under ``require_cache_salt``, or a salt without a key of its own while
tenants have keys (``KeyRing.sealer_for``: sealing it under the default key would let every
default-key holder read it).

Names are remembered per offload key (bounded), so calls without the request (a failed load's
probe) find them again, and a failed load reported by page key maps back (``vllm_key``).

Threading: the scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, get_offload_block_hash

from tierstore.format.sealing import KeyRing

MAX_NAMED_KEYS = 1 << 18  # offload keys whose page key is remembered (cleared when full)


@dataclass(frozen=True)
class CacheSalt:
    """A request's vLLM ``cache_salt`` (None: the request has none)."""

    value: str | None


class PageNames:
    """Offload key -> page key (module docstring)."""

    def __init__(self, ring: KeyRing | None = None, require_salt: bool = False) -> None:
        self.ring, self.require_salt = ring, require_salt
        self.plain = ring is None and not require_salt  # the page key is the block hash
        self._page_keys: dict[OffloadKey, bytes | None] = {}
        self._vllm_keys: dict[bytes, OffloadKey] = {}  # page key + suffix -> offload key (loads)
        self.refused = 0

    def of(self, key: OffloadKey, ctx: ReqContext | None = None) -> bytes | None:
        """The page key of ``key`` (None: the request may not be cached, or ``key`` was never
        named and no request is given)."""
        if self.plain:
            return get_offload_block_hash(key)
        if key in self._page_keys:
            return self._page_keys[key]
        if ctx is None:
            return None
        state = ctx.get_state(CacheSalt)
        salt = state.value if state is not None else None
        sealer = self.ring.sealer_for(salt) if self.ring is not None else None
        if (self.require_salt and salt is None) or (self.ring is not None and sealer is None):
            page_key = None  # no salt where one is required, or a salt without a key of its own
            self.refused += 1
        elif sealer is None:
            page_key = get_offload_block_hash(key)
        else:
            page_key = KeyRing.page_key(sealer, get_offload_block_hash(key))
        if len(self._page_keys) >= MAX_NAMED_KEYS:
            self._page_keys.clear()
        self._page_keys[key] = page_key
        return page_key

    def for_index(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> tuple[Sequence[bytes], int]:
        """What ``IndexedLookup.known_prefix`` takes for ``keys``: the offload keys themselves
        and their suffix length when page keys are block hashes, else the page keys up to the
        first that may not be cached."""
        if self.plain:
            return keys, 4
        named = []
        for key in keys:
            page_key = self.of(key, ctx)
            if page_key is None:
                break
            named.append(page_key)
        return named, 0

    def remember_loads(self, keys: Sequence[OffloadKey], page_keys: Sequence[bytes]) -> None:
        """The worker reports a failed load by its page key: remember the way back."""
        if self.plain:
            return
        if len(self._vllm_keys) > MAX_NAMED_KEYS:
            self._vllm_keys.clear()
        self._vllm_keys.update((pk + k[-4:], k) for k, pk in zip(keys, page_keys, strict=True))

    def vllm_key(self, reported: bytes) -> bytes:
        """The offload key of a page key + group suffix the worker reported."""
        return reported if self.plain else self._vllm_keys.get(reported, reported)
