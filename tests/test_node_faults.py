"""Disk faults on a real node over its listeners (issue 21):

- a full file system, for real: the node's data dir on a small tmpfs the test mounts (skipped with
  the reason where the machine refuses the mount, e.g. without CAP_SYS_ADMIN), filled up by the
  test: SBP appends get UNKNOWN with the reason, KV SET ERR 0, S2 appends 503, Toasty CREATE a
  CREATE_ERROR; reads go on; when the filler goes, writes resume at the stream's durable end;
  every acknowledged write is there after a restart;
- a failing fdatasync, through the disk-fault seam switched on in the node process
  (``SBPNODE_DISK_FAULTS``, storage/fileops.py): the write gets the error and the store stays
  read-only after the fault is gone, with one log line.
"""

import errno
import http.client
import json
import os
import subprocess

import pytest

from protocols.partition import codec as kvc
from protocols.partition.client import BlockingKvClient, KvError
from protocols.sbp import codec
from protocols.sbp.client import BlockingSbpClient, SbpError
from protocols.toasty.blocking_client import BlockingToastyClient
from storage import record_batch as rb
from tests.nodeproc import NodeProcess
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

LISTENERS = dict(swarm="none", chunks="none")


def batch(tag, size=1000):
    return rb.encode([(1000, [], (b"%d:" % tag).ljust(size, b"x"))])


def s2(node, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", node.ports["http"], timeout=30)
    conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB tmpfs mounted for the test and removed after it."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("this machine refuses to mount a tmpfs for the ENOSPC test: %s" % (r.stderr.strip() or r.returncode))
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(path):
    """Write zeros to ``path`` until the file system says ENOSPC."""
    block = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                block = block[: len(block) // 2]
                if len(block) < 512:
                    return


def test_a_full_disk_refuses_writes_on_every_protocol_and_recovers(tmp_path, small_disk):
    node = NodeProcess(tmp_path, name="full", fsync="always", **LISTENERS)
    node.data_dir = str(small_disk / "data")
    node.start()
    try:
        sbp = BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=10)
        sid = sbp.create_stream()["stream_id"]
        acked = [sbp.append(sid, batch(i)) for i in range(20)]
        assert acked == list(range(20))
        kv = BlockingKvClient(*node.address("kv"))
        kv.set(b"before", b"1")
        assert s2(node, "POST", "/v1/streams", {"stream": "s"})[0] == 201
        assert s2(node, "POST", "/v1/streams/s/records", {"records": [{"body": "a"}]})[0] == 200
        toasty = BlockingToastyClient("127.0.0.1", node.ports["meta"], timeout=10)
        toasty.mkdir("/d")

        filler = small_disk / "filler"
        fill(filler)
        # the first refused write finds the disk full (the file system may still have taken a
        # few small ones into partly used pages)
        with pytest.raises(SbpError) as e:
            for i in range(1000):
                sbp.append(sid, batch(100 + i, 64 << 10))
        assert e.value.code == codec.UNKNOWN and "disk is full" in e.value.message
        with pytest.raises(SbpError) as e:
            sbp.append(sid, batch(1))
        assert e.value.code == codec.UNKNOWN and "writes resume when space returns" in e.value.message
        with pytest.raises(KvError) as e:
            kv.set(b"during", b"1")
        assert e.value.code == kvc.E_UNKNOWN
        status, body = s2(node, "POST", "/v1/streams/s/records", {"records": [{"body": "b"}]})
        assert status == 503 and "disk is full" in json.loads(body)["message"]
        with pytest.raises(Exception) as e:
            toasty.mkdir("/e")
        assert "disk is full" in str(e.value)
        # reads go on
        assert [rb.read_header(b).base_offset for b in rb.split(sbp.fetch(sid, 0, 1 << 20))][:20] == acked
        assert kv.get(b"before") == b"1"

        os.remove(filler)

        def appended():
            try:
                return sbp.append(sid, batch(999))
            except SbpError as e:
                assert "disk is full" in e.message
                return None

        base = wait_until(appended, timeout=30, interval=0.2, what="writes to resume once space returned")
        kv.set(b"after", b"1")
        assert s2(node, "POST", "/v1/streams/s/records", {"records": [{"body": "c"}]})[0] == 200
        toasty.mkdir("/f")
        for c in (sbp, kv, toasty):
            c.close()
        log = node.log_text()
        assert log.count("the disk is full (") == 1 and log.count("disk space is back") == 1, log[-3000:]
        assert node.terminate() == 0
        node.start()
        sbp = BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=10)
        # every acknowledged append is there, the refused ones are not, and there is no gap
        offsets = []
        offset = 0
        while True:
            got = sbp.fetch(sid, offset, 1 << 20)
            if not got:
                break
            for b in rb.split(got):
                h = rb.read_header(b)
                offsets.append(h.base_offset)
                offset = h.base_offset + h.record_count
        assert offsets == list(range(base + 1)) and base >= 20
        sbp.close()
        with BlockingKvClient(*node.address("kv")) as kv:
            assert kv.get(b"before") == b"1" and kv.get(b"after") == b"1" and kv.get(b"during") is None
    finally:
        node.kill9()


def test_a_failed_fsync_makes_the_node_read_only_with_one_log_line(tmp_path, monkeypatch):
    control = tmp_path / "faults"
    monkeypatch.setenv("SBPNODE_DISK_FAULTS", str(control))
    node = NodeProcess(tmp_path, name="eio", fsync="always", **LISTENERS)
    node.start()
    try:
        sbp = BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=10)
        sid = sbp.create_stream()["stream_id"]
        assert [sbp.append(sid, batch(i)) for i in range(5)] == list(range(5))
        control.write_text("fdatasync EIO\n")
        with pytest.raises(SbpError) as e:
            sbp.append(sid, batch(5))
        assert e.value.code == codec.UNKNOWN and "read-only after a disk error" in e.value.message
        control.unlink()  # the disk "works" again: a later fsync would succeed, and prove nothing
        with pytest.raises(SbpError) as e:
            sbp.append(sid, batch(6))
        assert "read-only" in e.value.message
        with BlockingKvClient(*node.address("kv")) as kv:
            with pytest.raises(KvError) as ke:
                kv.set(b"k", b"v")
            assert ke.value.code == kvc.E_UNKNOWN
        status, body = s2(node, "POST", "/v1/streams", {"stream": "t"})
        assert status == 503 and "read-only" in json.loads(body)["message"]
        assert len(list(rb.split(sbp.fetch(sid, 0, 1 << 20)))) == 5  # reads go on
        sbp.close()
        assert node.log_text().count("read-only after a disk error (") == 1
        assert node.terminate() == 0
        node.start()
        with BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=10) as sbp:
            got = rb.split(sbp.fetch(sid, 0, 1 << 20))
            assert [rb.read_header(b).base_offset for b in got] == list(range(5))
            assert sbp.append(sid, batch(7)) == 5
    finally:
        node.kill9()
