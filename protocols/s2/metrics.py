"""S2 ``/v1/metrics`` from the node's own counters (docs/protocols/s2.md, "Metrics").

``S2Counters`` counts, per minute, the operations of every request (account-ops, basin-ops) and
per basin the appends and reads with their metered bytes; minutes older than ``KEEP_SECONDS`` are
dropped. Totals since start stay in ``node.metrics["s2"]`` too, where the node's own metrics
export finds them. Storage gauges are the stored bytes of a stream's batches, measured when asked.

Reply: ``{"values": [Metric]}``, a Metric being ``{"scalar": {name, unit, value}}``,
``{"accumulation": {name, unit, interval, values: [[epoch_s, value], ...]}}``,
``{"gauge": {name, unit, values: [[epoch_s, value], ...]}}`` or ``{"label": {name, values}}``.
"""

import time
from collections import Counter, OrderedDict

from protocols.s2 import codec
from protocols.s2.access import OP_GROUPS
from protocols.s2.codec import S2Error

KEEP_SECONDS = 7 * 24 * 3600
MAX_RANGE_SECONDS = 30 * 24 * 3600  # S2 refuses longer ranges (its SDK suites check 40 days -> 422)
FUTURE_SKEW_SECONDS = 60  # an ``end`` later than now by more than this is refused, as S2 does
INTERVALS = {"minute": 60, "hour": 3600, "day": 86400}
ACCOUNT_SETS = ("active-basins", "account-ops", "estimated-billable-usage")
BASIN_SETS = ("storage", "append-ops", "read-ops", "read-throughput", "append-throughput", "basin-ops")
STREAM_SETS = ("storage",)
JSON = ("content-type", "application/json")


class S2Counters:
    def __init__(self, totals):
        self.totals = totals  # node.metrics["s2"]: running totals since start
        self.minutes = OrderedDict()  # minute start (epoch s) -> {"ops": Counter, "basins": {basin: Counter}}

    def _bucket(self):
        minute = int(time.time()) // 60 * 60
        b = self.minutes.get(minute)
        if b is None:
            b = self.minutes[minute] = {"ops": Counter(), "basins": {}}
            while self.minutes and next(iter(self.minutes)) < minute - KEEP_SECONDS:
                self.minutes.popitem(last=False)
        return b

    def _basin(self, basin):
        b = self._bucket()["basins"]
        c = b.get(basin)
        if c is None:
            c = b[basin] = Counter()
        return c

    def op(self, op, basin):
        if op is None:
            return
        self._bucket()["ops"][op] += 1
        if basin is not None and OP_GROUPS[op][0] != "account":
            c = self._basin(basin)
            c["op:" + op] += 1

    def appended(self, basin, records, nbytes):
        self.totals["appended_records"] += records
        self.totals["appended_bytes"] = self.totals.get("appended_bytes", 0) + nbytes
        c = self._basin(basin)
        c["append-ops"] += 1
        c["append-bytes"] += nbytes

    def read(self, basin, records, nbytes):
        self.totals["read_records"] += records
        self.totals["read_bytes"] = self.totals.get("read_bytes", 0) + nbytes
        c = self._basin(basin)
        c["read-ops"] += 1
        c["read-bytes"] += nbytes

    def series(self, start, end, step, pick):
        """[(bucket start, value)] of the non-zero sums of ``pick(minute bucket)`` per ``step``."""
        out = Counter()
        for minute, b in self.minutes.items():
            if start <= minute < end:
                v = pick(b)
                if v:
                    out[minute // step * step] += v
        return sorted(out.items())


def _params(query):
    """S2's rules: ``set``, ``start`` and ``end`` (epoch seconds) are required; start <= end, end not
    in the future, at most 30 days; ``interval`` minute, hour or day."""
    metric_set = query.get("set")
    if not metric_set:
        raise codec.invalid("set is required")
    if not query.get("start") or not query.get("end"):
        raise codec.invalid("start and end are required (epoch seconds)")
    try:
        start, end = int(query["start"]), int(query["end"])
    except ValueError:
        raise codec.bad("bad_query", "start and end are epoch seconds")
    if start > end:
        raise codec.invalid("start is after end")
    if end > int(time.time()) + FUTURE_SKEW_SECONDS:
        raise codec.invalid("end is in the future")
    if end - start > MAX_RANGE_SECONDS:
        raise codec.invalid("the range is longer than 30 days")
    interval = query.get("interval")
    if interval is not None and interval not in INTERVALS:
        raise codec.invalid("interval must be minute, hour or day")
    return metric_set, start, end, interval


def _storage_interval(interval, allowed):
    # S2: a basin's storage gauge is hourly, a stream's by the minute; another interval is 422.
    if interval is not None and interval != allowed:
        raise codec.invalid("storage is measured per %s here" % allowed)


def _accumulation(name, unit, interval, values):
    return {"accumulation": {"name": name, "unit": unit, "interval": interval,
                             "values": [[t, float(v)] for t, v in values]}}


def _gauge(name, unit, values):
    return {"gauge": {"name": name, "unit": unit, "values": [[t, float(v)] for t, v in values]}}


class MetricsApi:
    """The handler; ``api`` is the S2Api (basins, streams and stored bytes)."""

    def __init__(self, api, counters):
        self.api = api
        self.counters = counters

    def _stored_bytes(self, meta):
        log = self.api.store.log
        return sum(length for _, _, length in log.batches(meta.stream_id, meta.trim_offset, 1 << 40))

    async def h_metrics(self, req, responder, body):
        seg = req.segments
        metric_set, start, end, interval = _params(req.query)
        c = self.counters
        now = int(time.time())
        sampled = start <= now <= end + FUTURE_SKEW_SECONDS  # storage is known for "now" only
        values = []
        if metric_set != "storage":
            interval = interval or "hour"
            step = INTERVALS[interval]
        if len(seg) == 2:
            if metric_set not in ACCOUNT_SETS:
                raise codec.invalid("unknown account metric set %r (%s)" % (metric_set, ", ".join(ACCOUNT_SETS)))
            if metric_set == "active-basins":
                active = set()
                for minute, b in c.minutes.items():
                    if start <= minute < end:
                        active.update(n for n in b["basins"] if req.auth.sees("basins", n))
                values.append({"label": {"name": "active-basins", "values": sorted(active)}})
            elif metric_set == "account-ops":
                for op in OP_GROUPS:
                    series = c.series(start, end, step, lambda b, op=op: b["ops"].get(op, 0))
                    if series:
                        values.append(_accumulation(op, "operations", interval, series))
            else:
                # A self-hosted node bills nothing: one total series of zero dollars.
                values.append(_accumulation("total", "usd", interval, []))
        else:
            basin = seg[2]
            await self.api._require_basin(basin)
            if len(seg) == 4:
                if metric_set not in STREAM_SETS:
                    raise codec.invalid("unknown stream metric set %r (%s)" % (metric_set, ", ".join(STREAM_SETS)))
                meta = await self.api.find_stream(basin, seg[3])
                if meta is None:
                    raise S2Error(404, "stream_not_found", "stream %s not found in basin %s" % (seg[3], basin))
                _storage_interval(interval, "minute")
                values.append(_gauge("storage", "bytes", [(now, self._stored_bytes(meta))] if sampled else []))
            elif metric_set not in BASIN_SETS:
                raise codec.invalid("unknown basin metric set %r (%s)" % (metric_set, ", ".join(BASIN_SETS)))
            elif metric_set == "storage":
                _storage_interval(interval, "hour")
                points = [(now, sum(self._stored_bytes(m) for m in self.api.streams_of(basin)))] if sampled else []
                values.append(_gauge("storage", "bytes", points))
            elif metric_set == "basin-ops":
                for op, group in OP_GROUPS.items():
                    if group[0] == "account":
                        continue
                    series = c.series(start, end, step, lambda b, k="op:" + op: b["basins"].get(basin, {}).get(k, 0))
                    if series:
                        values.append(_accumulation(op, "operations", interval, series))
            else:
                key, unit = {"append-ops": ("append-ops", "operations"), "read-ops": ("read-ops", "operations"),
                             "append-throughput": ("append-bytes", "bytes"),
                             "read-throughput": ("read-bytes", "bytes")}[metric_set]
                series = c.series(start, end, step, lambda b: b["basins"].get(basin, {}).get(key, 0))
                values.append(_accumulation(metric_set, unit, interval, series))
        responder.respond(200, [JSON], codec.dumps({"values": values}))
