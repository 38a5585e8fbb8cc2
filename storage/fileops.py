"""The OS calls by which the commit core's files reach the disk: the disk-fault seam.

The WAL (``Wal.ops``) and the pre-sync thread make every write, sync and truncation of the WAL
through one ``FileOps`` object, the commit core commits each group's LMDB transaction through it
(``commit``: LMDB's own writes and sync of the index) and asks it how much space is free before it
takes writes again after ENOSPC (storage/commit.py). The node uses ``OS`` (the plain calls).
Tests put a ``Faults`` in its place to make those calls fail as a sick disk does, at the OS-call
boundary and nowhere else: everything above it (the core's error handling, the store, the
protocols) runs as in production.

A node started with ``SBPNODE_DISK_FAULTS=PATH`` in its environment uses ``ControlFile(PATH)``:
while PATH exists, its lines (``pwrite ENOSPC``, ``fdatasync EIO``) make those calls fail, so a
test can switch faults on and off in a live node process. Without the variable nothing is read.
"""

import errno
import os

import lmdb

RWF_DSYNC = getattr(os, "RWF_DSYNC", None)  # Linux 4.7+; None: each write is synced by an fdatasync


class FileOps:
    """The real calls (one instance, ``OS``, serves every store)."""

    pwrite = staticmethod(os.pwrite)
    pwritev = staticmethod(os.pwritev)  # (at most IOV_MAX buffers; may write fewer bytes than given)
    fdatasync = staticmethod(os.fdatasync)
    ftruncate = staticmethod(os.ftruncate)

    def pwritev_dsync(self, fd, parts, offset):
        """``pwritev`` whose bytes are synced as ``fdatasync`` would sync them, in the same call
        (pwritev2 with RWF_DSYNC). A subclass with its own ``pwritev`` or ``fdatasync`` (the tests'
        faults, a test's short writes) gets those two calls instead, faults and all."""
        cls = type(self)
        if cls.pwritev is FileOps.pwritev and cls.fdatasync is FileOps.fdatasync:
            return os.pwritev(fd, parts, offset, RWF_DSYNC)
        n = self.pwritev(fd, parts, offset)
        self.fdatasync(fd)
        return n

    @staticmethod
    def commit(txn):
        """Commit a group's LMDB write transaction (its pages written, and synced under ``always``)."""
        txn.commit()

    @staticmethod
    def free_bytes(path: str) -> int:
        """Bytes this process may still write on the file system holding ``path``."""
        st = os.statvfs(path)
        blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may use the reserve
        return blocks * st.f_frsize


OS = FileOps()


class Faults(FileOps):
    """Fails chosen calls with an errno; tests set ``fail`` to ``{"pwrite": errno.ENOSPC, ...}``
    (a call named there raises ``OSError(errno)`` until the entry is removed; ``commit``, the
    index's LMDB commit, raises ``lmdb.Error`` as py-lmdb does) and ``free`` to
    the byte count ``free_bytes`` reports (None: the real one). ``calls`` counts attempts."""

    def __init__(self):
        self.fail = {}
        self.free = None
        self.calls = {}

    def _check(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        code = self.fail.get(name)
        if code is not None:
            raise OSError(code, "%s (injected)" % os.strerror(code))

    def pwrite(self, fd, data, offset):
        self._check("pwrite")
        return os.pwrite(fd, data, offset)

    def pwritev(self, fd, parts, offset):
        # part by part through ``pwrite`` (a fault, or a test's own ``pwrite``, applies to each):
        # stops at the first short write, as pwritev(2) may
        done = 0
        for p in parts:
            n = self.pwrite(fd, p, offset + done)
            done += n
            if n < len(p):
                break
        return done

    def fdatasync(self, fd):
        self._check("fdatasync")
        os.fdatasync(fd)

    def ftruncate(self, fd, length):
        self._check("ftruncate")
        os.ftruncate(fd, length)

    def commit(self, txn):
        # a failing LMDB commit raises as py-lmdb does (``lmdb.Error`` naming the errno's text;
        # the caller aborts the transaction), not OSError
        try:
            self._check("commit")
        except OSError as e:
            raise lmdb.Error("mdb_txn_commit: %s" % os.strerror(e.errno)) from None
        txn.commit()

    def free_bytes(self, path):
        return FileOps.free_bytes(path) if self.free is None else self.free


class ControlFile(Faults):
    """``Faults`` whose ``fail`` is read from a file at every call (``SBPNODE_DISK_FAULTS``)."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def _check(self, name):
        try:
            with open(self.path) as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            lines = []
        self.fail = {}
        for line in lines:
            words = line.split()
            if len(words) == 2 and hasattr(errno, words[1]):
                self.fail[words[0]] = getattr(errno, words[1])
        super()._check(name)


def from_environment() -> FileOps:
    path = os.environ.get("SBPNODE_DISK_FAULTS")
    return ControlFile(path) if path else OS
