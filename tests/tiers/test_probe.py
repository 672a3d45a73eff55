"""The shared tier's health probe (``fs.deadline.probe_root``): a create and unlink the file
server must answer. A refusal is an answer (the tier is up); an I/O error or a hang is not."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tierstore.fs import deadline as shared


def test_a_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    shared.probe_root(tmp_path)
    assert list(tmp_path.iterdir()) == []
    shared.probe_root(tmp_path / "missing")  # ENOENT: the server answered


@pytest.mark.parametrize("code, answered", [(errno.EROFS, True), (errno.EACCES, True), (errno.ENOSPC, True),
                                            (errno.EIO, False), (errno.ETIMEDOUT, False), (errno.ESTALE, False)])
def test_a_refusal_is_an_answer_an_io_error_is_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    code: int, answered: bool) -> None:
    def refuse(path: object, flags: int, mode: int = 0o777) -> int:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(shared.os, "open", refuse)
    if answered:
        shared.probe_root(tmp_path)
    else:
        with pytest.raises(OSError):
            shared.probe_root(tmp_path)


def test_a_stat_alone_is_not_the_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache can answer a stat for a stopped server (seen on a kernel NFS client); the probe
    must reach the server with a create, so a server that fails creates is down."""
    monkeypatch.setattr(shared.os, "stat", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError()))

    def no_server(path: object, flags: int, mode: int = 0o777) -> int:
        raise OSError(errno.EIO, "server not responding", str(path))

    monkeypatch.setattr(shared.os, "open", no_server)
    with pytest.raises(OSError):
        shared.probe_root(tmp_path)
