"""A small end-to-end pipeline: events in over SBP, aggregated in Spark, results out to a stream and KV.

    python examples/pipeline.py                                  # starts a throwaway node
    python examples/pipeline.py --sbp HOST:7700 --kv HOST:7701   # a running node (local or not)

1. Ingest: JSON events (``{"user": .., "action": .., "amount": ..}``) are appended to a new
   stream with ``sbpctl stream append``, one record per line, each file with a ``source`` header.
2. Aggregate: Spark (``local[2]``) reads the stream with ``spark.read.format("sbp")``, parses the
   JSON bodies and groups by the ``action`` field and the ``source`` header.
3. Write back: the summary rows go to a second stream with ``df.write.format("sbp")`` (one JSON
   record each, header ``kind=action-summary``) and into the key-value store
   (``pipeline/<action>/<source>`` -> JSON) from the executors with ``BlockingKvClient``.
4. Check: both outputs are read back and printed.

docs/spark.md shows a run and its output.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

ACTIONS = ("view", "click", "cart", "buy")


def start_node(tmp):
    """A throwaway node on free loopback ports (fsync never): returns (process, ready dict)."""
    ready = os.path.join(tmp, "node.ready")
    argv = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile=",
            "sbpnode", "--data-dir", os.path.join(tmp, "data"), "--ready-file", ready, "--fsync", "never"]
    for listener in ("sbp", "kv", "meta", "chunks", "swarm", "http"):
        argv += ["--" + listener, "tcp:0:interface=127.0.0.1"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(os.path.join(tmp, "node.log"), "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env=env)
    deadline = time.monotonic() + 30
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the node did not start; see %s" % log.name)
        time.sleep(0.05)
    with open(ready) as f:
        return proc, json.load(f)


def make_events(path, n, rng):
    with open(path, "w") as f:
        for _ in range(n):
            action = rng.choices(ACTIONS, weights=(60, 25, 10, 5))[0]
            event = {"user": "u%d" % rng.randrange(1000), "action": action}
            if action == "buy":
                event["amount"] = round(rng.uniform(5, 200), 2)
            f.write(json.dumps(event) + "\n")


def sbpctl(*args):
    cmd = [sys.executable, "-m", "node.cli"] + [str(a) for a in args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout.strip()


def write_kv_partition(kv_endpoint):
    """A foreachPartition function: each executor task writes its rows with its own KV client."""

    def run(rows):
        from node.spark.arrow import split_endpoint
        from protocols.partition.client import BlockingKvClient

        host, port = split_endpoint(kv_endpoint)
        with BlockingKvClient(host, port) as kv:
            for r in rows:
                key = "pipeline/%s/%s" % (r["action"], r["source"])
                kv.set(key.encode(), r["json"].encode())

    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sbp", help="HOST:PORT of the node's SBP listener (default: start a node)")
    p.add_argument("--kv", help="HOST:PORT of the node's KV listener (with --sbp)")
    p.add_argument("--events", type=int, default=5000, help="events per source (default 5000)")
    args = p.parse_args(argv)
    if bool(args.sbp) != bool(args.kv):
        p.error("give both --sbp and --kv, or neither")

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")

    tmp = tempfile.mkdtemp(prefix="sbp-pipeline-")
    proc = None
    spark = None
    try:
        if args.sbp:
            sbp_ep, kv_ep = args.sbp, args.kv
        else:
            proc, ready = start_node(tmp)
            sbp_ep, kv_ep = "127.0.0.1:%d" % ready["sbp"], "127.0.0.1:%d" % ready["kv"]
            print("started node %d: sbp %s, kv %s" % (ready["node_id"], sbp_ep, kv_ep))

        # 1. Ingest with sbpctl, one file per source, the source as a header on every record.
        events = sbpctl("stream", "create", "--endpoint", sbp_ep)
        rng = random.Random(7)
        for source in ("web", "app"):
            path = os.path.join(tmp, source + ".jsonl")
            make_events(path, args.events, rng)
            sbpctl("stream", "append", events, path, "--endpoint", sbp_ep, "--header", "source=" + source, "--no-progress")
            print("$ sbpctl stream append %s %s.jsonl --endpoint %s --header source=%s --no-progress"
                  % (events, source, sbp_ep, source))
        print("ingested %d events into stream %s" % (2 * args.events, events))

        # 2. Aggregate in Spark.
        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        import node.spark

        spark = (
            SparkSession.builder.master("local[2]").appName("sbp-pipeline")
            .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.sql.shuffle.partitions", "2").config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        node.spark.register(spark)

        raw = spark.read.format("sbp").option("endpoint", sbp_ep).option("streams", events).load()
        event_schema = "user string, action string, amount double"
        parsed = raw.select(
            F.from_json(F.col("body").cast("string"), event_schema).alias("e"),
            # the source header's value (records carry it as binary name/value pairs)
            F.expr("cast(filter(headers, h -> cast(h.name as string) = 'source')[0].value as string)").alias("source"),
        ).select("e.*", "source")
        summary = (
            parsed.groupBy("action", "source")
            .agg(F.count("*").alias("events"), F.countDistinct("user").alias("users"),
                 F.round(F.sum(F.coalesce("amount", F.lit(0.0))), 2).alias("revenue"))
            .orderBy("action", "source")
        )
        summary = summary.withColumn("json", F.to_json(F.struct("action", "source", "events", "users", "revenue"))).cache()
        summary.drop("json").show(truncate=False)

        # 3a. Write the summary back to a new stream, one JSON record per row.
        results = sbpctl("stream", "create", "--endpoint", sbp_ep)
        # One task (coalesce(1)) appends the rows in their sorted order; with several tasks each
        # task's rows stay in order but the tasks' batches interleave.
        report = os.path.join(tmp, "report.json")
        (summary.select(F.col("json").cast("binary").alias("body"),
                        F.array(F.struct(F.lit(b"kind").alias("name"), F.lit(b"action-summary").alias("value"))).alias("headers"))
         .coalesce(1).write.format("sbp").mode("append").option("endpoint", sbp_ep).option("stream", results)
         .option("report_path", report).save())
        with open(report) as f:
            written = json.load(f)["streams"][results]
        print("wrote %d summary records to stream %s (offsets %d..%d)"
              % (written["records"], results, written["first_offset"], written["last_offset"]))

        # 3b. And into the key-value store, from the executors.
        summary.select("action", "source", "json").foreachPartition(write_kv_partition(kv_ep))

        # 4. Read both back.
        back = spark.read.format("sbp").option("endpoint", sbp_ep).option("streams", results).load()
        print("stream %s read back:" % results)
        for r in back.orderBy("offset").collect():
            print("  offset %d  %s  %s" % (r["offset"], dict((bytes(h["name"]).decode(), bytes(h["value"]).decode()) for h in r["headers"]), bytes(r["body"]).decode()))
        from protocols.partition.client import BlockingKvClient

        host, port = kv_ep.rsplit(":", 1)
        with BlockingKvClient(host, int(port)) as kv:
            print("KV:")
            for action in ACTIONS:
                for source in ("app", "web"):
                    key = "pipeline/%s/%s" % (action, source)
                    print("  %s = %s" % (key, kv.get(key.encode()).decode()))
    finally:
        if spark is not None:
            spark.stop()
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
