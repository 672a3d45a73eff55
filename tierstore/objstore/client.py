"""ObjectClient: the requests of an object tier to one S3-compatible bucket, each one bounded.

Contract: every call is one S3 request (``list_keys`` one per 1,000 keys) through ``obstore``
(its requests run on a Rust runtime with the GIL released), bounded by the client's
``deadline_s``: a connect timeout (at most 2 s) and a whole-request timeout, one retry at most
and never past the deadline. Why: a radosgw whose OSD stopped answering holds a request until
the OSD returns (minutes, measured), and obstore's default retries for up to three minutes.
Endpoint and credentials come from the standard variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``; ``AWS_ALLOW_HTTP=true`` for a
plain-http endpoint such as a local RGW); addressing is path-style unless
``AWS_VIRTUAL_HOSTED_STYLE_REQUEST`` says otherwise.

- ``put_create(key, body)``: one PUT with ``If-None-Match: *``; False when an object of that
  key exists (HTTP 412: names are content addresses, so "already stored").
- ``get(key)``: the whole body and its ETag; ``PageMissing`` when there is none.
- ``head(key)``, ``list_keys(prefix)``: metadata (``ObjectInfo``), never bodies.
- ``delete_many(keys)``: ``DeleteObjects`` in batches of at most 1,000 keys.
- ``put(key, body)`` (overwrite) and ``put_if_match(key, body, etag)`` (compare-and-swap on
  the ETag, sent unquoted: RGW 16 refuses a quoted one): leases and journals, not pages.

Failure policy: ``PageMissing`` for a key with no object; ``ObjectPreconditionFailed`` for a
compare-and-swap that lost; ``PageTimeout`` when the deadline passed; every other failure
(refused connection, 5xx, a denied request) is ``PageIOError`` naming the request, the key and
what the endpoint said. Nothing is retried beyond the one retry above.
Threading: an ``ObjectClient`` may be used from any number of threads at once (obstore's
store is thread-safe and pools its connections).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from tierstore.config import ObjectLocation
from tierstore.errors import ConfigError, PageError, PageIOError, PageMissing, PageTimeout

DELETE_BATCH = 1000  # keys per DeleteObjects request (the S3 API's limit)


class ObjectPreconditionFailed(Exception):
    """A conditional write lost (HTTP 412): the object exists, or its ETag is not the one given."""


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing or a HEAD says of one object."""

    key: str  # the full key in the bucket (prefix included)
    size: int
    last_modified: datetime  # the server's clock
    etag: str  # unquoted


def _unquoted(etag: str | None) -> str:
    return (etag or "").strip('"')


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


class ObjectClient:
    """Bounded requests to one bucket (see the module docstring)."""

    def __init__(self, location: ObjectLocation, deadline_s: float) -> None:
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError as exc:  # a dependency of the package: only a broken install lacks it
            raise ConfigError(f'setting "object_url" needs the obstore package ({exc}); reinstall tierstore '
                              "(pip install tierstore)") from None
        self._ob = obstore
        self.location = location
        self.deadline_s = deadline_s
        timeout = timedelta(seconds=deadline_s)
        options: dict[str, Any] = {"timeout": timeout, "connect_timeout": timedelta(seconds=min(2.0, deadline_s)),
                                   "allow_http": _truthy(os.environ.get("AWS_ALLOW_HTTP"))}
        retry: dict[str, Any] = {"max_retries": 1, "retry_timeout": timeout,
                                 "backoff": {"init_backoff": timedelta(milliseconds=50),
                                             "max_backoff": timedelta(milliseconds=500), "base": 2.0}}
        kwargs: dict[str, Any] = {}
        if not os.environ.get("AWS_VIRTUAL_HOSTED_STYLE_REQUEST"):
            kwargs["virtual_hosted_style_request"] = False
        try:
            self._store = S3Store(location.bucket, client_options=options, retry_config=retry, **kwargs)
        except Exception as exc:  # obstore's configuration errors (an unknown key, a bad endpoint URL)
            raise ConfigError(f'setting "object_url" ({location.url}): the S3 client could not be built ({exc}); '
                              "check AWS_ENDPOINT_URL, AWS_REGION and the credentials variables") from None

    # ----------------------------------------------------------------- pages
    def put_create(self, key: str, body: Any) -> bool:
        """PUT ``body`` (bytes-like) under ``key`` only if no object has that key; False if one has."""
        try:
            self._ob.put(self._store, key, body, mode="create", use_multipart=False)
        except Exception as exc:
            if self._is(exc, "AlreadyExistsError", "PreconditionError"):
                return False
            raise self._error(exc, "PUT", key) from None
        return True

    def get(self, key: str) -> tuple[memoryview, str]:
        """The whole body of ``key`` (a read-only buffer) and its ETag (unquoted)."""
        try:
            res = self._ob.get(self._store, key)
            return memoryview(res.bytes()), _unquoted(res.meta.get("e_tag"))
        except Exception as exc:
            raise self._error(exc, "GET", key) from None

    def head(self, key: str) -> ObjectInfo | None:
        """Metadata of ``key``; None when there is no such object."""
        try:
            meta = self._ob.head(self._store, key)
        except Exception as exc:
            if self._is(exc, "NotFoundError"):
                return None
            raise self._error(exc, "HEAD", key) from None
        return ObjectInfo(meta["path"], int(meta["size"]), meta["last_modified"], _unquoted(meta.get("e_tag")))

    def list_keys(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (a path prefix: ``a/b`` lists ``a/b/...``), in pages of 1,000."""
        try:
            for chunk in self._ob.list(self._store, prefix or None, chunk_size=1000):
                for meta in chunk:
                    yield ObjectInfo(meta["path"], int(meta["size"]), meta["last_modified"],
                                     _unquoted(meta.get("e_tag")))
        except PageError:
            raise
        except Exception as exc:
            raise self._error(exc, "LIST", prefix) from None

    def delete_many(self, keys: Iterable[str]) -> int:
        """Delete ``keys`` (``DeleteObjects``, at most ``DELETE_BATCH`` a request); how many were asked."""
        batch: list[str] = []
        n = 0
        for k in keys:
            batch.append(k)
            if len(batch) == DELETE_BATCH:
                n += self._delete(batch)
                batch = []
        return n + (self._delete(batch) if batch else 0)

    def _delete(self, keys: list[str]) -> int:
        try:
            self._ob.delete(self._store, keys if len(keys) > 1 else keys[0])
        except Exception as exc:
            if self._is(exc, "NotFoundError"):
                return len(keys)
            raise self._error(exc, "DELETE", keys[0]) from None
        return len(keys)

    # ----------------------------------------------------------------- leases, journals
    def put(self, key: str, body: bytes) -> str:
        """PUT ``body`` under ``key``, replacing any object; the new ETag (unquoted)."""
        try:
            res = self._ob.put(self._store, key, body, mode="overwrite", use_multipart=False)
        except Exception as exc:
            raise self._error(exc, "PUT", key) from None
        return _unquoted(res.get("e_tag"))

    def put_new(self, key: str, body: bytes) -> str:
        """PUT ``body`` only if ``key`` has no object: its ETag; ``ObjectPreconditionFailed`` if it has."""
        try:
            res = self._ob.put(self._store, key, body, mode="create", use_multipart=False)
        except Exception as exc:
            if self._is(exc, "AlreadyExistsError", "PreconditionError"):
                raise ObjectPreconditionFailed(f"{key} exists") from None
            raise self._error(exc, "PUT", key) from None
        return _unquoted(res.get("e_tag"))

    def put_if_match(self, key: str, body: bytes, etag: str) -> str:
        """PUT ``body`` only if ``key``'s ETag is still ``etag``: the new ETag;
        ``ObjectPreconditionFailed`` if another writer came first."""
        try:
            res = self._ob.put(self._store, key, body, mode={"e_tag": _unquoted(etag)}, use_multipart=False)
        except Exception as exc:
            if self._is(exc, "PreconditionError", "AlreadyExistsError", "NotFoundError"):
                raise ObjectPreconditionFailed(f"{key} changed") from None
            raise self._error(exc, "PUT", key) from None
        return _unquoted(res.get("e_tag"))

    # ----------------------------------------------------------------- errors
    def _is(self, exc: BaseException, *names: str) -> bool:
        if "NotFoundError" in names and isinstance(exc, FileNotFoundError):  # obstore's "not found"
            return True
        return any(isinstance(exc, getattr(self._ob.exceptions, n)) for n in names)

    def _error(self, exc: BaseException, request: str, key: str) -> PageError:
        """The typed error of a failed request (module docstring)."""
        where = f"s3://{self.location.bucket}/{key}"
        if self._is(exc, "NotFoundError"):
            return PageMissing(f"no object ({request})", path=where)
        text = " ".join(str(exc).split())[:300]
        low = text.lower()
        if "timed out" in low or "deadline has elapsed" in low or "operation timeout" in low:
            return PageTimeout(f"{request} did not complete within object_deadline_s ({self.deadline_s:g} s): "
                               f"{text}", path=where)
        return PageIOError(f"{request} failed: {type(exc).__name__}: {text}", path=where)
