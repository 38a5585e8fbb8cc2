"""An exclusive lock on the data dir, so two nodes never share one store."""

import fcntl
import os

LOCK_FILE = "LOCK"


class DataDirLocked(Exception):
    pass


class DataDirLock:
    def __init__(self, data_dir: str):
        self.path = os.path.join(data_dir, LOCK_FILE)
        self._fd = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirLocked(
                "data dir %s is in use by another sbpnode (pid %s)" % (os.path.dirname(self.path), holder)
            )
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
