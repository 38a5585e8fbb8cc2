"""sbpctl stream: record streams over SBP (create, list, describe, append, fetch, tail, trim, seal)."""

import base64
import json
import sys
import time

from node.cli import CliError, split_endpoint


def register(sub):
    p = sub.add_parser("stream", help="record streams over SBP")
    ssub = p.add_subparsers(dest="stream_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    def add(name, fn, help):
        sp = ssub.add_parser(name, help=help)
        sp.add_argument("--endpoint", default="127.0.0.1:7700", help="the node's SBP listener HOST:PORT (default 127.0.0.1:7700)")
        sp.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a reply (default 30)")
        sp.add_argument("--json", action="store_true", help="JSON lines output")
        sp.set_defaults(func=_guarded(fn))
        return sp

    sp = add("create", run_create, "create a stream; prints its id")
    sp.add_argument("--replicas", type=int, default=1, help="replica_nums (default 1)")
    sp.add_argument("--retention-ms", type=int, default=0, help="retention period in ms (<= 0: infinite)")

    add("list", run_list, "list the node's streams with their offsets")

    sp = add("describe", run_describe, "show a stream and its ranges")
    sp.add_argument("stream_id", type=int)

    sp = add("append", run_append, "append lines (or whole files) as records, with a progress bar")
    sp.add_argument("stream_id", type=int)
    sp.add_argument("files", nargs="*", help="files to read (default: stdin); '-' is stdin")
    sp.add_argument("--whole-files", action="store_true", help="each file is one record (default: each line is one)")
    sp.add_argument("--header", action="append", default=[], metavar="NAME=VALUE", help="a header on every record (repeatable)")
    sp.add_argument("--batch-records", type=int, default=256, help="records per batch (default 256)")
    sp.add_argument("--batch-bytes", type=int, default=1 << 20, help="bytes per batch at most (default 1 MiB)")
    sp.add_argument("--window", type=int, default=16, help="batches in flight (default 16)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")

    sp = add("fetch", run_fetch, "print records from an offset")
    sp.add_argument("stream_id", type=int)
    sp.add_argument("--offset", type=int, default=None, help="first offset (default: the stream's start)")
    sp.add_argument("--limit", type=int, default=None, help="stop after this many records")
    sp.add_argument("--follow", "-f", action="store_true", help="keep printing records as they arrive")
    sp.add_argument("--verbose", "-v", action="store_true", help="text output shows offset, timestamp and headers")

    sp = add("tail", run_tail, "print the last records (and follow with -f)")
    sp.add_argument("stream_id", type=int)
    sp.add_argument("-n", "--lines", type=int, default=10, help="how many records (default 10)")
    sp.add_argument("--follow", "-f", action="store_true", help="keep printing records as they arrive")
    sp.add_argument("--verbose", "-v", action="store_true", help="text output shows offset, timestamp and headers")

    sp = add("trim", run_trim, "drop records below an offset")
    sp.add_argument("stream_id", type=int)
    sp.add_argument("offset", type=int)

    sp = add("seal", run_seal, "seal a range (default: the open one) and open the next")
    sp.add_argument("stream_id", type=int)
    sp.add_argument("range_index", type=int, nargs="?", default=None)


def _guarded(fn):
    """Turn connection failures and SBP statuses into one-line errors (no tracebacks)."""

    def run(args):
        from protocols.sbp.client import BlockingSbpClient, SbpConnectionError, SbpError

        host, port = split_endpoint(args.endpoint, 7700)
        # follow_cluster: in a cluster, data calls go to the stream's node (CONTRACT §9)
        client = BlockingSbpClient(host, port, timeout=args.timeout, follow_cluster=True, tls_ca=getattr(args, "tls_ca", None))
        try:
            return fn(client, args)
        except SbpConnectionError as e:
            raise CliError("node at %s:%d: %s" % (host, port, e.message))
        except SbpError as e:
            raise CliError(str(e))
        except BrokenPipeError:
            return 0
        finally:
            client.close()

    return run


def _out(args, obj, text):
    if args.json:
        print(json.dumps(obj, sort_keys=True))
    else:
        print(text)


def run_create(client, args):
    s = client.create_stream(args.replicas, args.retention_ms)
    _out(args, s, s["stream_id"])
    return 0


def _stream_info(client, sid, ranges=None):
    (s,) = client.describe_streams([sid])
    # in a cluster the open range's replicas know its next offset (any node answers the rest)
    ranges = client.current_ranges(sid) if ranges is None else ranges
    s["start_offset"] = min((r["start_offset"] for r in ranges), default=0)
    s["next_offset"] = max((r["next_offset"] for r in ranges), default=0)
    s["ranges"] = ranges
    return s


def run_list(client, args):
    # every stream of the cluster: LIST_RANGES by each live member's id (a single node: itself)
    ids = sorted({int(m["name"]) for m in client.live_members() if m["name"].isdigit()}) or [0]
    all_ranges = client.list_all_ranges(ids)
    for sid in sorted(all_ranges):
        s = _stream_info(client, sid, all_ranges[sid])
        _out(args, s, "%d\tstart=%d next=%d ranges=%d replicas=%d retention_ms=%d" % (
            sid, s["start_offset"], s["next_offset"], len(s["ranges"]), s["replica_nums"], s["retention_period_ms"]))
    return 0


def replica_progress(client, sid, ranges, live):
    """Each replica's own view of ``sid``, asked of that node (DESCRIBE_RANGES of the open range:
    status.detail holds its durable end and the confirm offset it has learned; the primary's
    answer also has every replica's end as acknowledged to it; docs/cluster.md):
    ``{address: {"durable_end", "confirm_offset", "acked"?} | {"error": text}}``."""
    from protocols.sbp.client import SbpError

    open_ = [r for r in ranges if r["end_offset"] < 0]
    index = (open_ or ranges)[-1]["range_index"] if ranges else 0
    out = {}
    for r in ranges:
        for srv in r["servers"]:
            address = srv["advertise_addr"]
            if not address or address in out:
                continue
            if address not in live:
                out[address] = {"error": "down"}
                continue
            try:
                d = client.peer(address).describe_range(sid, index)
            except SbpError as e:
                out[address] = {"error": str(e)}
                continue
            p = d.get("progress")
            if p is None:
                out[address] = {}  # a single node: no replication
                continue
            me = {"durable_end": p.get("replica_ends", {}).get(str(srv["server_id"])), "confirm_offset": p.get("confirm_offset")}
            if "sequencer" in p:
                me["acked"] = {int(k): v for k, v in p["replica_ends"].items()}
            out[address] = me
    return out


def _describe_replicas(s, progress):
    """Per range and replica: live or not, and its progress (into the JSON and the text)."""
    acked = {}
    for p in progress.values():
        acked.update(p.get("acked", {}))
    for r in s["ranges"]:
        end = r["end_offset"] if r["end_offset"] >= 0 else None
        for srv in r["servers"]:
            p = progress.get(srv["advertise_addr"], {"error": "no address"})
            srv.update(p)
            if end is None and srv["server_id"] in acked:
                srv["acked_by_primary"] = acked[srv["server_id"]]
            if end is not None and srv.get("durable_end") is not None:
                srv["holds_range"] = srv["durable_end"] >= end  # it has the sealed range whole
        r["servers"] = sorted(r["servers"], key=lambda x: (not x["is_primary"], x["server_id"]))


def _replica_line(r, x):
    role = "primary" if x["is_primary"] else "replica"
    head = "    node %-3s %-21s %-7s" % (x["server_id"], x["advertise_addr"] or "-", role)
    if "error" in x:
        return head + " " + x["error"]
    if x.get("durable_end") is None:
        return head
    if r["end_offset"] >= 0:
        state = "complete" if x.get("holds_range") else "behind (durable end %d)" % x["durable_end"]
        return head + " " + state
    text = " durable=%d confirm=%s" % (x["durable_end"], x["confirm_offset"])
    if "acked_by_primary" in x and not x["is_primary"]:
        text += " acked=%d" % x["acked_by_primary"]
    return head + text


def run_describe(client, args):
    s = _stream_info(client, args.stream_id)
    live = {m["advertise_addr"] for m in client.live_members()}
    _describe_replicas(s, replica_progress(client, args.stream_id, s["ranges"], live))
    if args.json:
        print(json.dumps(s, sort_keys=True))
        return 0
    print("stream %d: replicas=%d retention_ms=%d start=%d next=%d" % (
        s["stream_id"], s["replica_nums"], s["retention_period_ms"], s["start_offset"], s["next_offset"]))
    for r in s["ranges"]:
        sealed = r["end_offset"] >= 0
        print("  range %d: [%d, %s) %s" % (
            r["range_index"], r["start_offset"], r["end_offset"] if sealed else "open",
            "sealed" if sealed else "next=%d" % r["next_offset"]))
        for x in r["servers"]:
            print(_replica_line(r, x))
    return 0


def _records_from(args):
    """Yield record bodies from the files (or stdin): lines without their newline, or whole files."""
    sources = args.files or ["-"]
    for name in sources:
        f = sys.stdin.buffer if name == "-" else _open(name)
        try:
            if args.whole_files:
                yield f.read()
            else:
                for line in f:
                    yield line[:-1] if line.endswith(b"\n") else line
        finally:
            if f is not sys.stdin.buffer:
                f.close()


def _open(name):
    try:
        return open(name, "rb")
    except OSError as e:
        raise CliError("cannot read %s: %s" % (name, e.strerror or e))


def _headers(args):
    out = []
    for h in args.header:
        name, sep, value = h.partition("=")
        if not sep:
            raise CliError("--header %r: expected NAME=VALUE" % h)
        out.append((name.encode(), value.encode()))
    return out


def run_append(client, args):
    from tqdm import tqdm

    from storage import record_batch

    headers = _headers(args)
    total_records = 0
    first = last = None
    bar = tqdm(unit="rec", unit_scale=True, disable=args.no_progress or args.json, file=sys.stderr, desc="append")

    def batches():
        pending = []
        size = 0
        for body in _records_from(args):
            pending.append((int(time.time() * 1000), headers, body))
            size += len(body) + 16
            if len(pending) >= args.batch_records or size >= args.batch_bytes:
                yield pending
                pending, size = [], 0
        if pending:
            yield pending

    window = []
    try:
        for recs in batches():
            window.append((args.stream_id, record_batch.encode(recs), len(recs)))
            if len(window) >= args.window:
                first, last, n = _flush(client, window, first, last)
                total_records += n
                bar.update(n)
                window = []
        if window:
            first, last, n = _flush(client, window, first, last)
            total_records += n
            bar.update(n)
    finally:
        bar.close()
    result = {"stream_id": args.stream_id, "records": total_records, "first_offset": first, "next_offset": last}
    _out(args, result, "appended %d records to stream %d (offsets %s..%s)" % (
        total_records, args.stream_id, first if first is not None else "-", (last - 1) if last else "-"))
    return 0


def _flush(client, window, first, last):
    bases = client.for_stream(window[0][0]).append_pipelined([(sid, b) for sid, b, _ in window], window=len(window))
    n = sum(c for _, _, c in window)
    if first is None and bases:
        first = bases[0]
    if bases:
        last = bases[-1] + window[-1][2]
    return first, last, n


def _print_records(args, data):
    from storage import record_batch

    count = 0
    for b in record_batch.split(data):
        header, recs = record_batch.decode(b)
        for r in recs:
            if getattr(args, "_skip_below", None) is not None and r.offset < args._skip_below:
                continue
            if args.json:
                obj = {"stream_id": args.stream_id, "offset": r.offset, "timestamp_ms": r.timestamp_ms,
                       "headers": [[_text(n), _text(v)] for n, v in r.headers]}
                try:
                    obj["body"] = r.body.decode("utf-8")
                except UnicodeDecodeError:
                    obj["body_base64"] = base64.b64encode(r.body).decode()
                print(json.dumps(obj, sort_keys=True))
            elif args.verbose:
                hs = " ".join("%s=%s" % (_text(n), _text(v)) for n, v in r.headers)
                print("%d\t%d\t%s\t%s" % (r.offset, r.timestamp_ms, hs, r.body.decode("utf-8", "backslashreplace")))
            else:
                print(r.body.decode("utf-8", "backslashreplace"))
            count += 1
            args._printed += 1
            if args._limit is not None and args._printed >= args._limit:
                return count, True
    return count, False


def _text(b):
    return b.decode("utf-8", "backslashreplace")


def _read(client, args, offset):
    """Print records from ``offset`` (until --limit, or the end unless following)."""
    from protocols.sbp.client import next_offset_after

    printed = 0
    while True:
        wait = 1000 if args.follow else 0
        data = client.fetch(args.stream_id, offset, 1 << 20, max_wait_ms=wait)
        if not data:
            if not args.follow:
                return 0
            continue
        n, done = _print_records(args, data)
        sys.stdout.flush()
        printed += n
        offset = next_offset_after(data, offset)
        args._skip_below = None
        if done:
            return 0


def run_fetch(client, args):
    args._limit = args.limit
    args._printed = 0
    args._skip_below = None
    offset = args.offset
    if offset is None:
        ranges = client.list_ranges(args.stream_id)
        offset = min((r["start_offset"] for r in ranges), default=0)
    else:
        args._skip_below = offset  # the first batch may start before the offset
    try:
        return _read(client, args, offset)
    except KeyboardInterrupt:
        return 0


def run_tail(client, args):
    ranges = client.list_ranges(args.stream_id)
    start = min((r["start_offset"] for r in ranges), default=0)
    nxt = max((r["next_offset"] for r in ranges), default=0)
    offset = max(start, nxt - args.lines)
    args._limit = None
    args._printed = 0
    args._skip_below = offset
    if offset == nxt and not args.follow:
        return 0
    try:
        return _read(client, args, offset)
    except KeyboardInterrupt:
        return 0


def run_trim(client, args):
    r = client.trim(args.stream_id, args.offset)
    _out(args, {"stream_id": args.stream_id, "first_range": r},
         "stream %d now starts at %s" % (args.stream_id, r["start_offset"] if r else "?"))
    return 0


def run_seal(client, args):
    index = args.range_index
    if index is None:
        ranges = client.list_ranges(args.stream_id)
        open_ranges = [r for r in ranges if r["end_offset"] < 0]
        if not open_ranges:
            raise CliError("stream %d has no open range" % args.stream_id)
        index = open_ranges[-1]["range_index"]
    r = client.seal(args.stream_id, index)
    _out(args, {"stream_id": args.stream_id, "sealed": index, "open_range": r},
         "sealed range %d of stream %d; range %d is open at offset %d" % (index, args.stream_id, r["range_index"], r["start_offset"]))
    return 0
