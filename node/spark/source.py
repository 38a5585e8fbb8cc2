"""The ``sbp`` PySpark data source (CONTRACT §8): batch and streaming reads, batch and streaming writes.

Every object here is pickled (cloudpickle) and shipped to Spark's Python workers, so instances hold
only plain option values; connections (``BlockingSbpClient``, a plain socket) are opened inside the
method that uses them and closed before it returns. Nothing here touches the Twisted reactor.

Options (strings, as Spark passes them):

- ``endpoint``: ``host:port`` of an SBP listener (required; never assumed local).
- ``streams``: comma-separated stream ids to read (``stream`` is accepted as an alias).
- ``start_offset``: ``earliest`` (default: each stream's trim point), ``latest``, an offset for
  every stream, or a JSON object ``{"<stream_id>": offset}``.
- ``end_offset`` (batch reads): ``latest`` (default: each stream's tail when the query is planned),
  an offset, or a JSON object; exclusive.
- ``max_records_per_trigger`` (streaming reads): admission control, the most records one
  micro-batch takes over all streams (default: no limit).
- ``fetch_bytes``: FETCH ``batch_max_bytes`` (default 4 MiB); ``timeout``: socket timeout seconds.
- ``read_from``: ``replicas`` (default: each partition reads from a live replica of its range,
  spread over them; CONTRACT §9) or ``endpoint`` (every FETCH through the given node).
- Writes: ``stream`` (target stream id; without it each row goes to its ``stream_id`` column's
  stream), ``batch_bytes`` (record batch size, default 1 MiB), ``report_path`` (the driver writes the
  appended offsets there as JSON on commit).
"""

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import List, Tuple

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow

from node.spark import replicas
from node.spark.arrow import (
    SCHEMA_DDL,
    arrow_to_records,
    encode_records,
    fetch_next_offset,
    fetch_to_arrow,
    parse_streams,
    split_endpoint,
)

# Spark's Python workers run no Twisted log observer, so this module logs through the standard
# library, which Spark's worker stderr (the executor log) captures.
log = logging.getLogger("sbpnode.spark")

DEFAULT_FETCH_BYTES = 4 << 20
# FETCH results a partition's fetch thread may hold ahead of the decoder.
FETCH_AHEAD = 2
DEFAULT_TIMEOUT = 30.0
# APPEND requests carry several record batches; a few MiB amortises one round trip (and, with
# --fsync always, one group commit) over many batches while staying far below the 16 MiB frame.
APPEND_REQUEST_BYTES = 4 << 20


def _client(endpoint: str, timeout: float):
    from protocols.sbp.client import BlockingSbpClient

    host, port = split_endpoint(endpoint)
    # follow_cluster: in a cluster any node's address works (CONTRACT §9)
    return BlockingSbpClient(host, port, timeout=timeout, follow_cluster=True)


class _Options:
    """The plain (picklable) option values shared by readers and writers."""

    def __init__(self, options):
        opts = {str(k).lower(): v for k, v in dict(options).items()}
        self.raw = opts
        self.endpoint = opts.get("endpoint")
        split_endpoint(self.endpoint)  # fail at planning, not in a task
        self.fetch_bytes = int(opts.get("fetch_bytes", DEFAULT_FETCH_BYTES))
        self.timeout = float(opts.get("timeout", DEFAULT_TIMEOUT))
        self.read_from = str(opts.get("read_from", "replicas")).strip().lower()
        if self.read_from not in replicas.READ_FROM:
            raise ValueError("read_from must be one of %s, got %r" % ("/".join(replicas.READ_FROM), self.read_from))

    def streams(self) -> List[int]:
        return parse_streams(self.raw.get("streams", self.raw.get("stream")))


def _offset_spec(value, default: str):
    """``earliest`` / ``latest`` / an int / a ``{"sid": offset}`` JSON object, per stream."""
    if value is None or str(value).strip() == "":
        value = default
    value = str(value).strip()
    if value in ("earliest", "latest"):
        return lambda sid: value
    if value.startswith("{"):
        table = {int(k): v for k, v in json.loads(value).items()}
        return lambda sid: table.get(sid, default)
    n = int(value)
    if n < 0:
        raise ValueError("offsets are >= 0, got %d" % n)
    return lambda sid: n


_bounds = replicas.bounds


def _resolve(spec, sid, earliest, tail) -> int:
    v = spec(sid)
    if v == "earliest":
        return earliest
    if v == "latest":
        return tail
    return int(v)


class SbpPartition(InputPartition):
    """One (stream, range) slice ``[start, end)`` of record offsets, read by one Spark task from
    ``servers`` (the replicas of the range to try, in order; the chosen one first)."""

    def __init__(self, servers, stream_id, range_index, start, end, fetch_bytes, timeout):
        super().__init__((stream_id, range_index, start, end))
        self.servers = list(servers)
        self.stream_id = stream_id
        self.range_index = range_index
        self.start = start
        self.end = end
        self.fetch_bytes = fetch_bytes
        self.timeout = timeout

    def __repr__(self):
        return "SbpPartition(stream=%d, range=%d, [%d, %d) from %s)" % (
            self.stream_id, self.range_index, self.start, self.end, self.servers[0])


def plan_partitions(opts: _Options, stream_id: int, ranges, lo: int, hi: int, spreader=None) -> List[SbpPartition]:
    """CONTRACT §8: one partition per (stream, range), clipped to ``[lo, hi)``; each read from the
    replica ``spreader`` chooses (None: the endpoint).

    The open range is clipped to ``hi`` alone: ``hi`` came from a replica's confirm offset, and the
    ranges may come from a node that has learned less (CONTRACT §9), so its next offset is no bound.
    """
    out = []
    for r in sorted(ranges, key=lambda r: r["range_index"]):
        r_end = hi if r["end_offset"] < 0 else r["end_offset"]
        a = max(lo, r["start_offset"])
        b = min(hi, r_end)
        if a < b:
            servers = spreader.servers(r, a, b) if spreader is not None else [opts.endpoint]
            out.append(SbpPartition(servers, stream_id, r["range_index"], a, b, opts.fetch_bytes, opts.timeout))
    return out


def _planner(opts: _Options):
    """(client, live member addresses, Spreader) for one planning pass; close the client after."""
    client = _client(opts.endpoint, opts.timeout)
    try:
        live = replicas.live_addresses(client)
    except Exception:
        client.close()
        raise
    return client, live, replicas.Spreader(live, opts.endpoint, opts.read_from)


def read_partition(p: SbpPartition):
    """FETCH ``[p.start, p.end)`` and yield one Arrow RecordBatch per FETCH result."""
    if not isinstance(p, SbpPartition):
        return  # Spark plans one bare InputPartition when partitions() finds nothing to read
    for offset, buf in _fetch_ahead(p):
        # No second CRC pass: the SBP frame's CRC-32 covers the payload (CONTRACT §3), and the
        # node derives it from the stored batches' CRCs rather than from the bytes it sends
        # (zero-copy replies), so a records block corrupted on disk fails the frame check in the
        # client (SbpError DATA_CORRUPTED); the node checks every other byte of a stored batch.
        batch, _ = fetch_to_arrow(buf, p.stream_id, offset, p.end, check_crc=False)
        if batch is not None:
            yield batch


_DONE = object()


def _fetch_ahead(p: SbpPartition, depth: int = FETCH_AHEAD):
    """``(fetch_offset, FETCH result)`` pairs covering ``[p.start, p.end)``.

    A thread issues the FETCHes while the caller decodes: the node serves the next result while this
    one is converted (the socket wait releases the GIL), so a partition reads at about the node's
    rate instead of node time + decode time. At most ``depth`` results wait in memory.
    """
    results = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item):
        while not stop.is_set():
            try:
                results.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def fetcher():
        reader = replicas.ReplicaReader(p.servers, p.timeout)
        offset = p.start
        try:
            while offset < p.end and not stop.is_set():
                try:
                    buf = reader.fetch(p.stream_id, offset, p.fetch_bytes)
                except Exception as e:  # SbpError or a socket error: say what was being read
                    e.add_note("sbp: FETCH stream %d at offset %d from %s" % (p.stream_id, offset, ", ".join(p.servers)))
                    raise
                if not buf:
                    raise RuntimeError(
                        "sbp: stream %d ended at offset %d before the planned end %d (trimmed or deleted?)"
                        % (p.stream_id, offset, p.end)
                    )
                next_offset = fetch_next_offset(buf)
                if next_offset <= offset:
                    raise RuntimeError("sbp: FETCH at %d of stream %d made no progress" % (offset, p.stream_id))
                if not put((offset, buf)):
                    return
                offset = next_offset
            put(_DONE)
        except BaseException as e:
            put(e)
        finally:
            reader.close()

    thread = threading.Thread(target=fetcher, name="sbp-fetch-%d" % p.stream_id, daemon=True)
    thread.start()
    try:
        while True:
            item = results.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


class SbpBatchReader(DataSourceReader):
    def __init__(self, options):
        self.opts = _Options(options)
        self.stream_ids = self.opts.streams()
        self.start = _offset_spec(self.opts.raw.get("start_offset"), "earliest")
        self.end = _offset_spec(self.opts.raw.get("end_offset"), "latest")

    def partitions(self):
        parts = []
        client, live, spreader = _planner(self.opts)
        try:
            for sid in self.stream_ids:
                ranges = client.current_ranges(sid, live)
                earliest, tail = _bounds(ranges)
                lo = max(_resolve(self.start, sid, earliest, tail), earliest)
                hi = min(_resolve(self.end, sid, earliest, tail), tail)
                parts.extend(plan_partitions(self.opts, sid, ranges, lo, hi, spreader))
        finally:
            client.close()
        return parts

    def read(self, partition):
        return read_partition(partition)


class SbpStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets are ``{"<stream_id>": next offset to read}``; the end of a micro-batch is exclusive."""

    def __init__(self, options):
        self.opts = _Options(options)
        self.stream_ids = self.opts.streams()
        self.start = _offset_spec(self.opts.raw.get("start_offset"), "earliest")
        limit = self.opts.raw.get("max_records_per_trigger")
        self.max_records = int(limit) if limit else None
        if self.max_records is not None and self.max_records < 1:
            raise ValueError("max_records_per_trigger must be >= 1")
        self.target = None  # availableNow: the tails when the query started

    def _tails(self, with_earliest=False):
        client, live, _ = _planner(self.opts)
        try:
            out = {}
            for sid in self.stream_ids:
                earliest, tail = _bounds(client.current_ranges(sid, live))
                out[sid] = (earliest, tail) if with_earliest else tail
            return out
        finally:
            client.close()

    def initialOffset(self):
        bounds = self._tails(with_earliest=True)
        return {str(sid): _resolve(self.start, sid, e, t) for sid, (e, t) in bounds.items()}

    def getDefaultReadLimit(self):
        return ReadMaxRows(self.max_records) if self.max_records else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self):
        self.target = self._tails()

    def latestOffset(self, start, limit):
        tails = self._tails()
        if self.target is not None:
            tails = {sid: min(t, self.target.get(sid, t)) for sid, t in tails.items()}
        begin = {sid: int(start.get(str(sid), t)) for sid, t in tails.items()}
        end = {sid: max(tails[sid], begin[sid]) for sid in tails}
        if isinstance(limit, ReadMaxRows):
            end = _admit(begin, end, limit.max_rows)
        return {str(sid): end[sid] for sid in self.stream_ids}

    def reportLatestOffset(self):
        return {str(sid): t for sid, t in self._tails().items()}

    def partitions(self, start, end):
        parts = []
        todo = {}
        for sid in self.stream_ids:
            lo = int(start.get(str(sid), end.get(str(sid), 0)))
            hi = int(end.get(str(sid), lo))
            if hi > lo:
                todo[sid] = (lo, hi)
        if not todo:
            return []
        client, live, spreader = _planner(self.opts)
        try:
            for sid, (lo, hi) in todo.items():
                ranges = client.current_ranges(sid, live)
                earliest, _ = _bounds(ranges)
                if lo < earliest:
                    log.warning("sbp: stream %d trimmed past offset %d; reading from %d", sid, lo, earliest)
                parts.extend(plan_partitions(self.opts, sid, ranges, max(lo, earliest), hi, spreader))
        finally:
            client.close()
        return parts

    def read(self, partition):
        return read_partition(partition)

    def commit(self, end):
        # Progress lives in Spark's checkpoint; the node keeps no consumer state.
        pass


def _admit(begin, end, max_rows):
    """Share ``max_rows`` over the streams' backlogs fairly (water-filling), so no stream starves."""
    backlog = {sid: end[sid] - begin[sid] for sid in begin}
    grant = {sid: 0 for sid in begin}
    left = max_rows
    active = [sid for sid, b in backlog.items() if b > 0]
    while left > 0 and active:
        share = max(left // len(active), 1)
        for sid in list(active):
            take = min(share, backlog[sid] - grant[sid], left)
            grant[sid] += take
            left -= take
            if grant[sid] >= backlog[sid]:
                active.remove(sid)
            if left == 0:
                break
    return {sid: begin[sid] + grant[sid] for sid in begin}


@dataclass
class SbpCommitMessage(WriterCommitMessage):
    """What one write task appended: ``(stream_id, base_offset, record_count)`` per record batch."""

    appended: List[Tuple[int, int, int]] = field(default_factory=list)

    @property
    def records(self) -> int:
        return sum(c for _, _, c in self.appended)


def summarize(messages) -> dict:
    """Per stream: records written and the [first, last] offsets of the batches appended."""
    out = {}
    for m in messages:
        for sid, base, count in getattr(m, "appended", None) or ():
            s = out.setdefault(str(sid), {"records": 0, "batches": 0, "first_offset": base, "last_offset": base + count - 1})
            s["records"] += count
            s["batches"] += 1
            s["first_offset"] = min(s["first_offset"], base)
            s["last_offset"] = max(s["last_offset"], base + count - 1)
    return out


class _Appender:
    """The write side shared by batch and streaming writers: Arrow batches in, APPENDs out."""

    def __init__(self, options):
        self.opts = _Options(options)
        target = self.opts.raw.get("stream", self.opts.raw.get("streams"))
        self.stream_id = parse_streams(target)[0] if target else None
        self.batch_bytes = int(self.opts.raw.get("batch_bytes", 1 << 20))
        self.report_path = self.opts.raw.get("report_path")

    def write(self, iterator):
        import pyarrow.compute as pc

        appended = []
        pending = []  # (stream_id, batch bytes, record_count)
        pending_bytes = 0
        client = _client(self.opts.endpoint, self.opts.timeout)

        def flush():
            # each stream's batches go to its node (in a cluster, the open range's primary)
            by_stream = {}
            for i, (sid, _, _) in enumerate(pending):
                by_stream.setdefault(sid, []).append(i)
            bases = [None] * len(pending)
            for sid, idx in by_stream.items():
                got = client.for_stream(sid).append_many([(sid, pending[i][1]) for i in idx])
                for i, base in zip(idx, got):
                    bases[i] = base
            appended.extend((sid, base, n) for (sid, _, n), base in zip(pending, bases))
            pending.clear()

        try:
            now_ms = int(time.time() * 1000)
            for rb in iterator:
                if rb.num_rows == 0:
                    continue
                if self.stream_id is not None:
                    groups = [(self.stream_id, rb)]
                elif "stream_id" in rb.schema.names:
                    col = rb.column(rb.schema.names.index("stream_id"))
                    groups = [(int(sid), rb.filter(pc.equal(col, sid))) for sid in pc.unique(col).to_pylist() if sid is not None]
                else:
                    raise ValueError("writing to sbp needs option stream=<id> or a stream_id column")
                for sid, part in groups:
                    for batch, n in encode_records(arrow_to_records(part, now_ms), self.batch_bytes):
                        pending.append((sid, batch, n))
                        pending_bytes += len(batch)
                        if pending_bytes >= APPEND_REQUEST_BYTES:
                            flush()
                            pending_bytes = 0
            if pending:
                flush()
        finally:
            client.close()
        return SbpCommitMessage(appended)

    def _report(self, messages, batch_id=None):
        summary = summarize(messages)
        log.info("sbp: appended %s", summary)
        if self.report_path:
            doc = {"streams": summary}
            if batch_id is not None:
                doc["batch_id"] = batch_id
            tmp = self.report_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(doc, f, indent=1, sort_keys=True)
            os.replace(tmp, self.report_path)


class SbpWriter(_Appender, DataSourceArrowWriter):
    """``df.write.format("sbp").mode("append")``: one task per partition, each appending its rows.

    Appends cannot be undone, so ``abort`` only reports what the finished tasks already wrote.
    """

    def commit(self, messages):
        self._report(messages)

    def abort(self, messages):
        log.warning("sbp: write aborted; already appended (not undone): %s", summarize(m for m in messages if m))


class SbpStreamWriter(_Appender, DataSourceStreamArrowWriter):
    """``writeStream.format("sbp")``: at-least-once (a retried micro-batch appends again)."""

    def commit(self, messages, batchId):
        self._report(messages, batchId)

    def abort(self, messages, batchId):
        log.warning("sbp: micro-batch %s aborted; already appended: %s", batchId, summarize(m for m in messages if m))


class SbpDataSource(DataSource):
    """``spark.read.format("sbp")`` / ``readStream`` / ``write`` / ``writeStream`` (CONTRACT §8)."""

    @classmethod
    def name(cls):
        return "sbp"

    def schema(self):
        return SCHEMA_DDL

    def reader(self, schema):
        return SbpBatchReader(self.options)

    def streamReader(self, schema):
        return SbpStreamReader(self.options)

    def writer(self, schema, overwrite):
        if overwrite:
            raise ValueError("sbp streams are append-only: use mode('append')")
        return SbpWriter(self.options)

    def streamWriter(self, schema, overwrite):
        return SbpStreamWriter(self.options)
