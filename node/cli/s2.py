"""sbpctl s2: the S2-compatible HTTP API from the command line (plain HTTP/1.1 JSON; the s2-sdk is
the client applications bring)."""

import http.client
import json
import os
import sys
import urllib.parse

from node.cli import CliError, split_endpoint


def register(sub):
    p = sub.add_parser("s2", help="S2 HTTP API: basins, streams, append, read, tail")
    p.add_argument("--endpoint", default="127.0.0.1:7780", help="the node's HTTP listener HOST:PORT (default 127.0.0.1:7780)")
    p.add_argument("--token", default=os.environ.get("SBPNODE_HTTP_TOKEN"),
                   help="bearer token (--http-token of the node; default $SBPNODE_HTTP_TOKEN)")
    p.add_argument("--basin", default=None, help="basin (default: the node's sbpnode-default)")
    p.add_argument("--timeout", type=float, default=30.0)
    s = p.add_subparsers(dest="s2_command", metavar="SUBCOMMAND")

    c = s.add_parser("basins", help="list basins")
    c.add_argument("--prefix", default="")
    c.set_defaults(func=basins)
    c = s.add_parser("create-basin", help="create a basin")
    c.add_argument("name")
    c.set_defaults(func=create_basin)
    c = s.add_parser("delete-basin", help="delete a basin and its streams")
    c.add_argument("name")
    c.set_defaults(func=delete_basin)
    c = s.add_parser("streams", help="list the basin's streams")
    c.add_argument("--prefix", default="")
    c.set_defaults(func=streams)
    c = s.add_parser("create-stream", help="create a stream")
    c.add_argument("name")
    c.add_argument("--retention-secs", type=int, default=None, help="age retention (default infinite)")
    c.set_defaults(func=create_stream)
    c = s.add_parser("delete-stream", help="delete a stream")
    c.add_argument("name")
    c.set_defaults(func=delete_stream)
    c = s.add_parser("config", help="show a stream's config and SBP stream id")
    c.add_argument("name")
    c.set_defaults(func=config)
    c = s.add_parser("append", help="append records (one per BODY, or one per stdin line with -)")
    c.add_argument("name")
    c.add_argument("bodies", nargs="+", metavar="BODY")
    c.add_argument("--header", action="append", default=[], metavar="NAME=VALUE", help="header on every record")
    c.set_defaults(func=append)
    c = s.add_parser("read", help="read records (JSON lines)")
    c.add_argument("name")
    c.add_argument("--seq-num", type=int, default=0)
    c.add_argument("--count", type=int, default=None)
    c.add_argument("--follow", action="store_true", help="keep following the tail (SSE)")
    c.add_argument("--base64", action="store_true", help="s2-format base64 (binary-safe)")
    c.set_defaults(func=read)
    c = s.add_parser("tail", help="show the stream's tail position")
    c.add_argument("name")
    c.set_defaults(func=tail)


def _request(args, method, path, body=None, headers=None, stream=False):
    host, port = split_endpoint(args.endpoint, 7780)
    tls_ca = getattr(args, "tls_ca", None)
    if tls_ca:
        import ssl

        conn = http.client.HTTPSConnection(host, port, timeout=args.timeout, context=ssl.create_default_context(cafile=tls_ca))
    else:
        conn = http.client.HTTPConnection(host, port, timeout=args.timeout)
    hdrs = {"content-type": "application/json"}
    if args.token:
        hdrs["authorization"] = "Bearer " + args.token
    if args.basin:
        hdrs["s2-basin"] = args.basin
    hdrs.update(headers or {})
    conn.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=hdrs)
    resp = conn.getresponse()
    if stream and resp.status == 200:
        return resp
    data = resp.read()
    conn.close()
    if resp.status >= 300:
        try:
            err = json.loads(data)
        except ValueError:
            err = {"message": data.decode("utf-8", "replace")}
        raise CliError("HTTP %d: %s" % (resp.status, json.dumps(err)))
    return json.loads(data) if data else None, dict((k.lower(), v) for k, v in resp.getheaders())


def _stream_path(name, suffix=""):
    return "/v1/streams/" + urllib.parse.quote(name, safe="") + suffix


def basins(args):
    out, _ = _request(args, "GET", "/v1/basins?" + urllib.parse.urlencode({"prefix": args.prefix}))
    for b in out["basins"]:
        print("%s\t%s" % (b["name"], b["created_at"]))


def create_basin(args):
    _request(args, "POST", "/v1/basins", {"basin": args.name})
    print("created basin %s" % args.name)


def delete_basin(args):
    _request(args, "DELETE", "/v1/basins/" + urllib.parse.quote(args.name, safe=""))
    print("deleted basin %s" % args.name)


def streams(args):
    start_after = ""
    while True:
        q = urllib.parse.urlencode({"prefix": args.prefix, "start_after": start_after})
        out, _ = _request(args, "GET", "/v1/streams?" + q)
        for s in out["streams"]:
            print("%s\t%s" % (s["name"], s["created_at"]))
        if not out["has_more"] or not out["streams"]:
            return 0
        start_after = out["streams"][-1]["name"]


def create_stream(args):
    body = {"stream": args.name}
    if args.retention_secs:
        body["config"] = {"retention_policy": {"age": args.retention_secs}}
    _, headers = _request(args, "POST", "/v1/streams", body)
    print("created stream %s (sbp stream id %s)" % (args.name, headers.get("sbp-stream-id")))


def delete_stream(args):
    _request(args, "DELETE", _stream_path(args.name))
    print("deleted stream %s" % args.name)


def config(args):
    out, headers = _request(args, "GET", _stream_path(args.name))
    out["sbp_stream_id"] = int(headers.get("sbp-stream-id", 0))
    print(json.dumps(out, indent=2, sort_keys=True))


def append(args):
    bodies = args.bodies
    if bodies == ["-"]:
        bodies = [line.rstrip("\n") for line in sys.stdin]
    headers = []
    for h in args.header:
        name, sep, value = h.partition("=")
        if not sep:
            raise CliError("--header wants NAME=VALUE, not %r" % h)
        headers.append([name, value])
    total = None
    for i in range(0, len(bodies), 1000):
        records = [{"body": b, "headers": headers} if headers else {"body": b} for b in bodies[i:i + 1000]]
        ack, _ = _request(args, "POST", _stream_path(args.name, "/records"), {"records": records})
        total = (total or ack)
        total["end"] = ack["end"]
    print("appended seq_nums %d..%d" % (total["start"]["seq_num"], total["end"]["seq_num"] - 1))


def read(args):
    q = {"seq_num": args.seq_num}
    if args.count is not None:
        q["count"] = args.count
    fmt = {"s2-format": "base64"} if args.base64 else {}
    path = _stream_path(args.name, "/records?" + urllib.parse.urlencode(q))
    if not args.follow:
        out, _ = _request(args, "GET", path, headers=fmt)
        for r in out["records"]:
            print(json.dumps(r))
        return 0
    resp = _request(args, "GET", path, headers=dict(fmt, accept="text/event-stream"), stream=True)
    if not hasattr(resp, "readline"):
        return 0
    event = None
    for raw in resp:
        line = raw.decode("utf-8").rstrip("\n")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            if line == "data: [DONE]":
                return 0
            if event == "batch":
                for r in json.loads(line[6:])["records"]:
                    print(json.dumps(r), flush=True)
            elif event == "error":
                raise CliError(line[6:])
    return 0


def tail(args):
    out, _ = _request(args, "GET", _stream_path(args.name, "/records/tail"))
    print("seq_num %d timestamp %d" % (out["tail"]["seq_num"], out["tail"]["timestamp"]))
