"""The object tier seen as directories: its stand-in root, and listings that fill page indexes.

An object tier's pages are named as files under a file root would be, so the code that names
and indexes files names and indexes objects too: ``stand_in_root(location)`` is the path a
``FileMapper`` is given for a bucket prefix (never touched: no file is opened under it), and
``object_key(location, root, path)`` turns such a path into the object key.
``page_exists(client)`` answers one key the lookup has not listed yet (a HEAD).
``index_lister(client)`` is the ``ListedTier.lister`` of the scheduler's lookup
(``index.indexed_lookup``): one listing of a rank's prefix (1,000 keys a request) fills every
fan-out directory of its ``PageIndex`` (``begin_listing``/``publish_listing``).

Failure policy: a failed listing raises its ``PageError`` (the lookup marks the tier down and
probes it back); nothing is published from a listing that did not finish. A failed HEAD of
``page_exists`` is a miss.
Threading: no state; the lister runs on the lookup's loader thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tierstore.config import ObjectLocation
from tierstore.errors import PageError
from tierstore.fs.mapper import FANOUT_DIRS
from tierstore.index.page_index import PageIndex, names_fingerprints
from tierstore.objstore.client import ObjectClient


def stand_in_root(location: ObjectLocation) -> Path:
    """The path a ``FileMapper`` of the object tier at ``location`` is rooted at."""
    return Path("/") / "s3:" / location.bucket / location.prefix


def health_key(location: ObjectLocation) -> str:
    """The key every health probe of the tier HEADs (the worker's tier and the scheduler's
    lookup): never written, so a probe that answers at all (404 included) says the endpoint is up."""
    return location.key(".tierstore/health")


def object_key(location: ObjectLocation, path: str | os.PathLike[str]) -> str:
    """The object key of ``path``, a path under ``stand_in_root(location)``."""
    return location.key(os.path.relpath(path, stand_in_root(location)))


def page_exists(client: ObjectClient) -> Callable[[str | os.PathLike[str]], bool]:
    """``ListedTier.exists``: whether the object of a path under ``stand_in_root`` is there (a
    HEAD; a failed request answers False: a miss costs a recompute, never a wrong page)."""

    def exists(path: str | os.PathLike[str]) -> bool:
        try:
            return client.head(object_key(client.location, path)) is not None
        except PageError:
            return False

    return exists


def index_lister(client: ObjectClient) -> Callable[[PageIndex], None]:
    """Fill a ``PageIndex`` whose base is under ``stand_in_root`` from one listing."""
    location = client.location
    fanout_of = {name: i for i, name in enumerate(FANOUT_DIRS)}

    def lister(index: PageIndex) -> None:
        prefix = object_key(location, index.base) + "/"
        started = index.begin_listing()
        names: list[list[str]] = [[] for _ in FANOUT_DIRS]
        for info in client.list_keys(prefix):
            parts = info.key[len(prefix):].split("/")
            if len(parts) == 2 and parts[0] in fanout_of:
                names[fanout_of[parts[0]]].append(parts[1])
        for d, found in enumerate(names):
            index.publish_listing(d, names_fingerprints(found, d), started)

    return lister
