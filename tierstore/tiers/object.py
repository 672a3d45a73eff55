"""ObjectTier: an S3 bucket prefix (setting ``object_url``) as the last tier of a chain.

Store path: the chain hands the tier a copy of each page (``store_copy``, from its own staging
slot); the tier's ``IOEngine`` runs it on its I/O threads as one create-only PUT of the
canonical page file (``objstore.object_files.ObjectFiles``). Load path: a chain load that the
faster tiers missed reaches the tier when its index (``objstore.object_index.ObjectIndex``:
listings of the rank's prefix plus this process's stores) has the key; one GET, verified as a
file is, and the chain promotes the page into the faster tiers.

Contract (``EngineTier`` plus):
- Deadlines: each request is bounded by ``object_deadline_s`` (the client's timeouts, and the
  engine's per-job deadline, which completes the job with ``PageTimeout`` even while its
  thread still waits). A job that fails with ``timeout`` or ``io`` (a refused connection, a 5xx)
  marks the tier down (``fs.deadline.Health``): it is skipped at once, every job it is given
  ends at once as ``down``, until a probe (one HEAD under the deadline) answers again.
- Start (on a background thread): the namespace's ``manifest.json`` object, create-only, once
  per namespace and process (fsck, stats and ls read it as under a file root).
- Start-up probe (once per bucket prefix and process, on a background thread): two create-only
  PUTs of one probe object; the second must be refused (412). ``conditional_put`` says
  ``ok``, ``ignored`` (the endpoint stores both: a bucket with versioning on, where RGW 16
  ignores ``If-None-Match``; logged as a warning: content addressing and verification keep
  pages correct, but "stored" may then be reported by several writers) or ``unknown``.
- Failure kinds: ``missing`` is a miss; bad content is removed by the engine that read it.

Threading: as ``EngineTier``. Threads: the engine's I/O threads, the index's listing thread,
the probe thread (once), the health probe (while down).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from tierstore.config import ObjectLocation, TierStoreConfig
from tierstore.errors import PageError, PageTimeout
from tierstore.format.identity import MANIFEST_NAME, Namespace, manifest_bytes
from tierstore.fs.deadline import Health
from tierstore.metrics import TierMetrics
from tierstore.objstore.access_journal import AccessJournal
from tierstore.objstore.client import ObjectClient
from tierstore.objstore.listing import health_key, object_key, stand_in_root
from tierstore.objstore.object_files import ObjectFiles
from tierstore.objstore.object_index import ObjectIndex
from tierstore.rootstore.engine import IOEngine
from tierstore.rootstore.page_files import PageFiles
from tierstore.store import IOResult
from tierstore.tiers.tier import ENGINE_KWARGS, EngineTier, TierJob

log = logging.getLogger(__name__)

DOWN_KINDS = frozenset({"timeout", "io"})  # a job failing so says the endpoint is not answering

_PROBED: dict[str, str] = {}  # object_url -> what the start-up probe found
_MANIFESTS: set[tuple[str, str]] = set()  # (bucket, manifest key) written, or being written, here
_PROBED_LOCK = threading.Lock()


def probe_conditional_put(client: ObjectClient) -> str:
    """``ok`` when the endpoint refuses a second create-only PUT of one key, ``ignored`` when it
    stores it, ``unknown`` when a request failed. Leaves no object behind (best effort)."""
    key = client.location.key(f".tierstore/probe-{os.urandom(8).hex()}")
    try:
        first = client.put_create(key, b"tierstore create-only probe")
        second = client.put_create(key, b"tierstore create-only probe, again")
    except PageError as exc:
        log.debug("tierstore: the create-only probe of %s failed: %s", client.location.url, exc)
        return "unknown"
    finally:
        with contextlib.suppress(PageError):
            client.delete_many([key])
    return "ok" if first and not second else "ignored"


def _start_once(client: ObjectClient, namespace: Namespace) -> None:
    """Once per bucket prefix, namespace and process (a background thread): the namespace's
    ``manifest.json`` object, create-only (fsck, stats and ls read it, as under a file root;
    one that exists is left alone), then the create-only probe. Failure policy: logged."""
    manifest = client.location.key(f"{namespace.digest}/{MANIFEST_NAME}")
    mine = (client.location.bucket, manifest)
    with _PROBED_LOCK:
        first_manifest = mine not in _MANIFESTS
        _MANIFESTS.add(mine)
    if first_manifest:
        try:
            client.put_create(manifest, manifest_bytes(namespace))
        except PageError as exc:
            with _PROBED_LOCK:
                _MANIFESTS.discard(mine)  # the next tier opened tries again
            log.warning("tierstore: could not write %s (%s); fsck and stats need it", manifest, exc)
    url = client.location.url
    with _PROBED_LOCK:
        if url in _PROBED:
            return
        _PROBED[url] = "unknown"
    found = probe_conditional_put(client)
    with _PROBED_LOCK:
        _PROBED[url] = found
    if found == "ignored":
        log.warning("tierstore: the object endpoint of %s stores an object twice under If-None-Match: * (a bucket "
                    "with versioning on?); pages stay correct (content addresses, verified reads), but several "
                    "writers may each report a page stored; turn versioning off on the bucket", url)


def conditional_put(url: str) -> str:
    """What the start-up probe found for ``url`` in this process (``unknown`` before it ends)."""
    with _PROBED_LOCK:
        return _PROBED.get(url, "unknown")


class ObjectTier(EngineTier):
    """The object tier (module docstring)."""

    def __init__(self, config: TierStoreConfig, namespace: Namespace, group_index: int, rank: int,
                 metrics: TierMetrics, *, name: str = "object", **engine_kwargs: Any) -> None:
        if config.object_url is None:
            raise ValueError("ObjectTier needs the setting object_url")
        super().__init__(name, None, metrics, namespace.groups[group_index].tokens_per_chunk)
        self.location = ObjectLocation.parse(config.object_url)
        self.deadline_s = config.object_deadline_s
        self.client = ObjectClient(self.location, self.deadline_s)
        # File paths under a stand-in root name the objects (the mapper never touches it).
        root = stand_in_root(self.location)
        kwargs = {k: v for k, v in engine_kwargs.items() if k in ENGINE_KWARGS}
        self.index: ObjectIndex | None = None
        self._up_token = object()
        self._listeners: list[Callable[[bool], None]] = []
        self.health = Health(name, self._probe, self.deadline_s, on_change=self._health_changed)

        def files_over(files: PageFiles) -> ObjectFiles:
            prefix = object_key(self.location, files.mapper.base) + "/"
            self.index = ObjectIndex(self.client, prefix, config.index_refresh_s)
            over = ObjectFiles(files, self.client, self.location)
            over.bind_index(self.index)
            return over

        # One request per job (io_batch_pages 1): an I/O thread's batch would send its requests
        # one after another while the other threads idle (the bench found 3.05-3.7 GETs in flight
        # of 4 with batches, 3.84 without).
        self._engine = IOEngine(root, namespace, group_index, rank=rank, config=config.replace(io_batch_pages=1),
                                deadline_s=self.deadline_s, tier_name=name, files_over=files_over, **kwargs)
        self.files: ObjectFiles = self._engine.files  # type: ignore[assignment]
        self.access = AccessJournal(self.client, self.files.object_key)  # hits, for gc's LRU (object_gc.py)
        self._starting = threading.Thread(target=_start_once, args=(self.client, namespace),
                                          name="tierstore-object-start", daemon=True)
        self._starting.start()
        metrics.set_up(self._up_token, True)

    @property
    def available(self) -> bool:
        return self.health.up

    def _probe(self) -> None:
        self.client.head(health_key(self.location))  # raises while the endpoint does not answer

    def on_health(self, callback: Callable[[bool], None]) -> None:
        """``callback(up)`` at each health change (the backlog's uploader starts on "up")."""
        self._listeners.append(callback)

    def _health_changed(self, up: bool) -> None:
        self.metrics.set_up(self._up_token, up)
        for callback in self._listeners:
            callback(up)

    def refuse(self, key: bytes) -> PageError:
        self.metrics.failure("down")
        return PageTimeout(f"{self.name} tier is down ({self.health.reason}); skipped", key=key)

    def _note_down(self, r: IOResult) -> None:
        if not r.ok and r.error is not None and r.error.kind in DOWN_KINDS:
            self.health.mark_down(str(r.error))

    def on_load(self, r: IOResult) -> None:
        self._note_down(r)
        if r.ok:
            self.access.note(r.key)

    def on_store(self, r: IOResult, job: TierJob) -> None:
        self._note_down(r)

    def forget(self, key: bytes) -> None:
        if self.index is not None:
            self.index.discard(self.files.object_key(key))

    def contains(self, key: bytes) -> bool:
        return self.health.up and self.files.contains(key)

    @property
    def conditional_put(self) -> str:
        return conditional_put(self.location.url)

    def close(self, timeout: float | None = None) -> None:
        self.metrics.drop_up(self._up_token)
        self.access.close(flush=self.health.up)
        if self.index is not None:
            self.index.close()
        wait = min(timeout or self.deadline_s, self.deadline_s) if self.health.up else 0.05
        self._starting.join(wait)  # the manifest object is written before a closed tier returns
        super().close(wait)
