"""The last minutes of the node's throughput and latency, for the status page and ``sbpctl top``.

Every ``interval`` seconds a sample of the cumulative counters (node.metrics), the latency
histograms' bucket counts (node/metrics.py) and the streams' next offsets is kept, ``window``
seconds of them. ``series()`` turns consecutive samples into per-second rates and latency
percentiles per interval (the histogram_quantile of PromQL over the bucket increases), so the
page draws the last minutes as soon as it opens, and the node keeps no per-request state for it.
"""

import collections
import math
import time

from twisted.application.internet import TimerService

DEFAULT_INTERVAL = 2.0
DEFAULT_WINDOW = 600.0
BUSIEST_WINDOW = 30.0  # the busiest streams: records appended over about this long
OFFSETS_EVERY = 5  # samples per snapshot of every stream's offsets (a dict over all streams)
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))

# series name -> (node.metrics section or None for the top level, counter key)
RATES = {
    "appends_s": ("sbp", "appends"),
    "append_records_s": ("sbp", "append_records"),
    "append_bytes_s": ("sbp", "append_bytes"),
    "fetches_s": ("sbp", "fetches"),
    "fetch_bytes_s": ("sbp", "fetch_bytes"),
    "kv_requests_s": ("kv", "requests"),
    "s2_requests_s": ("s2", "requests"),
    "toasty_reads_s": (None, "toasty_read"),
    "toasty_writes_s": (None, "toasty_write"),
}


def quantile(q, bounds, counts):
    """The q-quantile of a histogram given as ascending upper bounds (the last +Inf) and cumulative
    counts, interpolated linearly inside the bucket as Prometheus's histogram_quantile does.
    None without observations."""
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if math.isinf(bound):
                return prev_bound  # beyond the last finite bucket: its bound, as Prometheus does
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def _counter(metrics, section, key):
    table = metrics if section is None else (metrics.get(section) or {})
    value = table.get(key, 0)
    return value if isinstance(value, (int, float)) else 0


class StatusHistory(TimerService):
    def __init__(self, node, node_metrics, clock=None, interval=DEFAULT_INTERVAL, window=DEFAULT_WINDOW):
        super().__init__(interval, self.sample)
        if clock is not None:
            self.clock = clock
        self.node = node
        self.node_metrics = node_metrics
        self.interval = interval
        self.samples = collections.deque(maxlen=max(2, int(window / interval) + 1))
        self.offsets = collections.deque(maxlen=max(2, int(BUSIEST_WINDOW / (interval * OFFSETS_EVERY)) + 1))
        self._samples_taken = 0

    def sample(self):
        node = self.node
        now = time.time()
        counters = {name: _counter(node.metrics, section, key) for name, (section, key) in RATES.items()}
        self.samples.append((now, counters, self.node_metrics.latency_buckets()))
        store = node.store
        # every stream's offsets (for the busiest streams) less often than the counters: with
        # 100k streams one snapshot took ~55 ms of the reactor on the loaded build machine
        if store is not None and not store.closed and self._samples_taken % OFFSETS_EVERY == 0:
            self.offsets.append((now, store.log.offsets()))
        self._samples_taken += 1

    def series(self):
        """{"t": [...], "<rate>": [...], "latency_ms": {op: {"p50": [...], ...}}}: one point per
        interval between two samples (rates per second; percentiles None where nothing ran)."""
        out = {"interval_s": self.interval, "t": []}
        for name in RATES:
            out[name] = []
        latency = out["latency_ms"] = {}
        samples = list(self.samples)
        for (t0, c0, h0), (t1, c1, h1) in zip(samples, samples[1:]):
            dt = t1 - t0
            if dt <= 0:
                continue
            out["t"].append(round(t1, 3))
            for name in RATES:
                out[name].append(round(max(0, c1[name] - c0[name]) / dt, 1))
            for op, (bounds, counts1) in h1.items():
                counts0 = h0.get(op, (bounds, [0] * len(counts1)))[1]
                delta = [a - b for a, b in zip(counts1, counts0)]
                series = latency.setdefault(op, {name: [None] * (len(out["t"]) - 1) for name, _ in QUANTILES})
                for name, q in QUANTILES:
                    v = quantile(q, bounds, delta)
                    series[name].append(None if v is None else round(v * 1000, 3))
            for op, series in latency.items():
                for values in series.values():
                    if len(values) < len(out["t"]):
                        values.append(None)
        return out

    def busiest(self, limit=10):
        """The streams that took the most records over the last ~30 s: [{stream_id (a string),
        records_s, next_offset}], busiest first (streams that took none are left out)."""
        if len(self.offsets) < 2:
            return []
        (t0, first), (t1, last) = self.offsets[0], self.offsets[-1]
        dt = max(t1 - t0, 1e-9)
        rates = [(n - first.get(sid, (0, 0))[1], sid, n) for sid, (_, n) in last.items()]
        rates = [r for r in rates if r[0] > 0]
        rates.sort(reverse=True)
        # stream ids as strings: they run to 2^63, past what a JavaScript number holds exactly
        return [{"stream_id": str(sid), "records_s": round(d / dt, 1), "next_offset": n} for d, sid, n in rates[:limit]]
