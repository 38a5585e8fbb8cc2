"""Spark read throughput: ``spark.read.format("sbp")`` from a node vs the same rows from local Parquet.

    python bench/spark_bench.py                        # starts a node (fsync never) in a temp dir
    python bench/spark_bench.py --endpoint host:7700   # an existing node (a new stream is made)

Appends ``--records`` records (``--body-bytes`` bodies, in ``--ranges`` ranges, so that many Spark
partitions) to one stream over SBP, writes the same rows (CONTRACT §8 columns) to one Parquet file,
starts a ``local[2]`` SparkSession (not timed), then reads every row and column of both sources
in ``--repeat`` interleaved rounds after one warm-up each (Spark's ``noop`` sink, or ``--action agg``)
and prints the best and median rows/s, the ratio of the best runs, and the CPU seconds each run
cost the JVM, Spark's Python workers and the node (from /proc). A third source yields the same
rows as pre-built Arrow batches: the cost of PySpark's Python data source path alone on this
machine (an upper bound for any Python source).
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def load(client, records, body_bytes, ranges, batch_records=1000):
    """Append ``records`` records to a new stream; seal so the stream has ``ranges`` ranges."""
    from storage import record_batch

    sid = client.create_stream()["stream_id"]
    body = os.urandom(body_bytes)
    ts0 = int(time.time() * 1000) - records
    per_range = -(-records // ranges)
    offset = 0
    range_index = 0
    t0 = time.perf_counter()
    while offset < records:
        entries = []
        limit = min(records, (range_index + 1) * per_range)
        while offset < limit and len(entries) < 8:
            n = min(batch_records, limit - offset)
            entries.append((sid, record_batch.encode([(ts0 + offset + i, [], body) for i in range(n)])))
            offset += n
        client.append_many(entries)
        if offset == limit and offset < records:
            client.seal(sid, range_index)
            range_index += 1
    return sid, time.perf_counter() - t0


def write_parquet(path, sid, records, body_bytes, ts0):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from node.spark.arrow import ARROW_SCHEMA, HEADERS_TYPE

    body = os.urandom(body_bytes)
    writer = pq.ParquetWriter(path, ARROW_SCHEMA)
    step = 250_000
    for start in range(0, records, step):
        n = min(step, records - start)
        offsets = np.arange(start, start + n, dtype=np.int64)
        empty = pa.array([[]] * n, HEADERS_TYPE)
        writer.write_batch(
            pa.record_batch(
                [
                    pa.array(np.full(n, sid, dtype=np.int64)),
                    pa.array(offsets),
                    pa.array((offsets + ts0) * 1000, pa.timestamp("us", tz="UTC")),
                    empty,
                    pa.array([body] * n, pa.binary()),
                ],
                schema=ARROW_SCHEMA,
            )
        )
    writer.close()


class CpuMeter:
    """CPU seconds used by this process's descendants (the JVM; Spark's Python workers) and by the
    node, read from /proc (Linux). A process that exits between two readings loses its share,
    which only under-counts (Spark keeps its read workers for the session)."""

    def __init__(self, node_pid=None):
        self.node_pid = node_pid
        self.tick = os.sysconf("SC_CLK_TCK")

    def _procs(self):
        out = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % pid) as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[int(pid)] = (int(fields[1]), comm, (int(fields[11]) + int(fields[12])) / self.tick)
        return out

    def read(self):
        """{pid: (kind, cpu seconds)} for the JVM, the Python workers and the node."""
        procs = self._procs()
        children = {}
        for pid, (ppid, _, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        out = {}
        todo = list(children.get(os.getpid(), []))
        while todo:
            pid = todo.pop()
            if pid in out or pid == self.node_pid:
                continue
            out[pid] = ("jvm" if procs[pid][1] == "java" else "python", procs[pid][2])
            todo.extend(children.get(pid, []))
        if self.node_pid in procs:
            out[self.node_pid] = ("node", procs[self.node_pid][2])
        return out

    @staticmethod
    def delta(before, after):
        out = {"jvm": 0.0, "python": 0.0, "node": 0.0}
        for pid, (kind, cpu) in after.items():
            out[kind] += cpu - before.get(pid, (kind, 0.0))[1]
        return out


def timed(df, action):
    """Seconds to read every row and column of ``df``; returns (seconds, rows seen or None)."""
    from pyspark.sql import functions as F

    t0 = time.perf_counter()
    if action == "noop":
        # Spark's own read benchmarks use the noop sink: every column materialised, nothing kept.
        df.write.format("noop").mode("overwrite").save()
        return time.perf_counter() - t0, None
    row = df.agg(
        F.count("*").alias("n"),
        F.max("offset"),
        F.max("timestamp"),
        F.sum(F.size("headers")),
        F.sum(F.length("body")),
        F.max("stream_id"),
    ).collect()[0]
    return time.perf_counter() - t0, row["n"]


def ceiling_source(records, body_bytes, partitions):
    """A Python data source yielding pre-built Arrow batches of the same rows: no I/O, no decoding.

    It measures what PySpark's Python data source path itself costs on this machine, the bound any
    Python source (ours included) stays under.
    """
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class CeilingReader(DataSourceReader):
        def partitions(self):
            per = -(-records // partitions)
            return [InputPartition((i * per, min(records, (i + 1) * per))) for i in range(partitions)]

        def read(self, partition):
            import numpy as np
            import pyarrow as pa

            from node.spark.arrow import ARROW_SCHEMA, _empty_headers

            lo, hi = partition.value
            step = 38_000  # about what one 4 MiB FETCH of 100-byte records holds
            body = pa.array([os.urandom(body_bytes)] * step, pa.binary())
            for start in range(lo, hi, step):
                n = min(step, hi - start)
                offsets = np.arange(start, start + n, dtype=np.int64)
                yield pa.RecordBatch.from_arrays(
                    [pa.array(np.full(n, 1, dtype=np.int64)), pa.array(offsets),
                     pa.array(offsets * 1000, pa.timestamp("us", tz="UTC")), _empty_headers(n), body.slice(0, n)],
                    schema=ARROW_SCHEMA,
                )

    class CeilingSource(DataSource):
        @classmethod
        def name(cls):
            return "sbp_bench_ceiling"

        def schema(self):
            from node.spark.arrow import SCHEMA_DDL

            return SCHEMA_DDL

        def reader(self, schema):
            return CeilingReader()

    return CeilingSource


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", help="host:port of a running node's SBP listener (default: start one)")
    p.add_argument("--records", type=int, default=2_000_000)
    p.add_argument("--body-bytes", type=int, default=100)
    p.add_argument("--ranges", type=int, default=2, help="ranges in the stream = Spark partitions")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--action", choices=("noop", "agg"), default="noop",
                   help="noop: write to Spark's noop sink; agg: aggregate over every column")
    args = p.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Workers import node.spark: make the checkout importable even without an install.
    os.environ["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")

    from protocols.sbp.client import BlockingSbpClient

    from node.spark.arrow import split_endpoint

    tmp = tempfile.mkdtemp(prefix="spark_bench_")
    node_proc = None
    spark = None
    try:
        if args.endpoint:
            endpoint = args.endpoint
        else:
            from tests.nodeproc import NodeProcess

            node_proc = NodeProcess(tmp, fsync="never").start()
            endpoint = node_proc.endpoint("sbp")
        client = BlockingSbpClient(*split_endpoint(endpoint))
        sid, load_s = load(client, args.records, args.body_bytes, args.ranges)
        client.close()
        print("loaded %d records (%d-byte bodies, %d ranges) into stream %d over SBP in %.1f s (%.0f records/s)"
              % (args.records, args.body_bytes, args.ranges, sid, load_s, args.records / load_s))
        parquet = os.path.join(tmp, "rows.parquet")
        write_parquet(parquet, sid, args.records, args.body_bytes, int(time.time() * 1000))

        from pyspark.sql import SparkSession
        import node.spark

        t0 = time.perf_counter()
        spark = (
            SparkSession.builder.master(args.master)
            .appName("sbp-spark-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.ui.showConsoleProgress", "false")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        node.spark.register(spark)
        print("SparkSession %s started in %.1f s (not timed)" % (args.master, time.perf_counter() - t0))

        spark.dataSource.register(ceiling_source(args.records, args.body_bytes, args.ranges))
        sources = (
            ("sbp", spark.read.format("sbp").option("endpoint", endpoint).option("streams", str(sid)).load()),
            ("parquet", spark.read.parquet(parquet)),
            ("ceiling", spark.read.format("sbp_bench_ceiling").load()),
        )
        for name, df in sources:
            warm, n = timed(df, "agg")  # warm-up, and every source really holds the rows
            assert n == args.records, (name, n)
            print("%-8s partitions=%d, warm-up (aggregate over every column) %.2f s" % (name, df.rdd.getNumPartitions(), warm))
        # Rounds interleave the sources so a burst of load from elsewhere on the machine hits all.
        times = {name: [] for name, _ in sources}
        cpu = {name: [] for name, _ in sources}
        meter = CpuMeter(node_proc.proc.pid if node_proc is not None else None)
        for _ in range(args.repeat):
            for name, df in sources:
                before = meter.read()
                times[name].append(timed(df, args.action)[0])
                cpu[name].append(meter.delta(before, meter.read()))
        best = {}
        for name, _ in sources:
            best[name] = args.records / min(times[name])
            print("%-8s %s runs %s s: best %.0f rows/s, median %.0f rows/s"
                  % (name, args.action, " ".join("%.2f" % t for t in times[name]), best[name],
                     args.records / statistics.median(times[name])))
        # CPU per run (medians), which the other sessions' load changes far less than wall time.
        print("CPU seconds per run (median): %s" % "; ".join(
            "%s: JVM %.2f, Python workers %.2f, node %.2f, total %.2f" % (
                name, *(statistics.median(c[k] for c in cpu[name]) for k in ("jvm", "python", "node")),
                statistics.median(sum(c.values()) for c in cpu[name]))
            for name, _ in sources))
        print("best runs: sbp %.0f rows/s, parquet %.0f rows/s, ratio sbp/parquet = %.2f (target >= 0.5); "
              "Python data source ceiling %.0f rows/s = %.2f of parquet; sbp = %.2f of the ceiling"
              % (best["sbp"], best["parquet"], best["sbp"] / best["parquet"], best["ceiling"],
                 best["ceiling"] / best["parquet"], best["sbp"] / best["ceiling"]))
    finally:
        if spark is not None:
            spark.stop()
        if node_proc is not None:
            node_proc.terminate()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
