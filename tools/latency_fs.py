"""A FUSE passthrough that sleeps DELAY_MS before every operation: a stand-in for an NFS mount
at 1 ms or 10 ms per operation (``tierstore bench lookup``, ``tierstore bench fsck --latency-s``).

    python tools/latency_fs.py SOURCE MOUNTPOINT --delay-ms 10      # foreground; umount to stop

Built on mfusepy (ctypes bindings of libfuse 3; dev extra). Multi-threaded, so operations of
several callers overlap as on NFS (each still waits its delay). No kernel caching of
attributes or names (``attr_timeout=0,entry_timeout=0``): every stat reaches this process.
Threading: libfuse's worker threads call the methods; they keep no state beyond the root.
"""

from __future__ import annotations

import argparse
import errno
import os
import time
from typing import Any

import mfusepy as fuse


class DelayedPassthrough(fuse.Operations):
    use_ns = True  # utimens gets nanoseconds (the float form is deprecated)

    def __init__(self, source: str, delay_s: float) -> None:
        self.source = os.path.realpath(source)
        self.delay_s = delay_s

    def _path(self, path: str) -> str:
        time.sleep(self.delay_s)
        return os.path.join(self.source, path.lstrip("/"))

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        try:
            st = os.lstat(self._path(path))
        except FileNotFoundError:
            raise fuse.FuseOSError(errno.ENOENT) from None
        return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime",
                                            "st_mtime", "st_ctime", "st_ino")}

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._path(path))]

    def open(self, path: str, flags: int) -> int:
        return os.open(self._path(path), flags)

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        time.sleep(self.delay_s)
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        time.sleep(self.delay_s)
        return os.pwrite(fh, data, offset)

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def rename(self, old: str, new: str) -> int:
        os.rename(self._path(old), self._path(new))
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._path(path))
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._path(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._path(path))
        return 0

    def utimens(self, path: str, times: Any = None) -> int:
        os.utime(self._path(path), times)
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("mountpoint")
    ap.add_argument("--delay-ms", type=float, default=10.0)
    args = ap.parse_args()
    fuse.FUSE(DelayedPassthrough(args.source, args.delay_ms / 1000.0), args.mountpoint, foreground=True,
              nothreads=False, attr_timeout=0, entry_timeout=0, negative_timeout=0)


if __name__ == "__main__":
    main()
