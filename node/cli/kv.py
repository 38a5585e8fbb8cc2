"""sbpctl kv: get, set, rm, scan and keys over the Primary_Partition key-value protocol.

Keys and values are UTF-8 text on the command line unless ``--hex`` or ``--base64`` says they (and
the output) are encoded, which makes every command binary-safe. Output is text (``key<TAB>value``
lines for scans) or, with ``--json``, one JSON object per line.
"""

import argparse
import base64
import binascii
import json
import sys

from node.cli import CliError, split_endpoint

DEFAULT_PORT = 7701


def register(sub):
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoint", default="127.0.0.1:%d" % DEFAULT_PORT, help="the node's kv listener HOST:PORT (default 127.0.0.1:7701)")
    enc = common.add_mutually_exclusive_group()
    enc.add_argument("--hex", dest="encoding", action="store_const", const="hex", help="keys and values (in and out) are hex")
    enc.add_argument("--base64", dest="encoding", action="store_const", const="base64", help="keys and values (in and out) are base64")
    common.add_argument("--json", action="store_true", help="print JSON lines")
    common.add_argument("--timeout", type=float, default=30.0, help="socket timeout in seconds")
    common.set_defaults(encoding="text")

    kv = sub.add_parser("kv", help="key-value store: get, set, rm, scan, keys")
    ksub = kv.add_subparsers(dest="kv_command", metavar="ACTION")
    kv.set_defaults(func=lambda args: _usage(kv))

    p = ksub.add_parser("get", parents=[common], help="print a key's value")
    p.add_argument("key")
    p.set_defaults(func=run_get)

    p = ksub.add_parser("set", parents=[common], help="store a value (read from stdin when VALUE is omitted or -)")
    p.add_argument("key")
    p.add_argument("value", nargs="?", default="-")
    p.set_defaults(func=run_set)

    p = ksub.add_parser("rm", parents=[common], help="remove a key")
    p.add_argument("key")
    p.set_defaults(func=run_rm)

    p = ksub.add_parser("scan", parents=[common], help="print key/value pairs in key order (paging through a cursor)")
    p.add_argument("--start", default="", help="first key (inclusive; default: the first key, or the last with --reverse)")
    p.add_argument("--reverse", action="store_true", help="descending order (GET_FB)")
    p.add_argument("--limit", type=int, default=None, help="stop after this many pairs")
    p.add_argument("--page", type=int, default=1024, help="pairs per request (1..1024)")
    p.set_defaults(func=run_scan)

    p = ksub.add_parser("keys", parents=[common], help="print keys in order, optionally only those with a prefix")
    p.add_argument("--prefix", default="", help="only keys starting with this")
    p.add_argument("--start", default="", help="first key (inclusive)")
    p.add_argument("--limit", type=int, default=None, help="stop after this many keys")
    p.add_argument("--page", type=int, default=1024, help="keys per request (1..1024)")
    p.set_defaults(func=run_keys)


def _usage(parser):
    parser.print_help()
    return 2


def _decode_arg(text, encoding, what):
    try:
        if encoding == "hex":
            return bytes.fromhex(text)
        if encoding == "base64":
            return base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        raise CliError("%s %r is not valid %s" % (what, text, encoding))
    return text.encode("utf-8", "surrogateescape")


def _show(data, encoding):
    if encoding == "hex":
        return data.hex()
    if encoding == "base64":
        return base64.b64encode(data).decode("ascii")
    return data.decode("utf-8", "backslashreplace")


def _client(args):
    from protocols.partition.client import BlockingKvClient

    host, port = split_endpoint(args.endpoint, DEFAULT_PORT)
    try:
        return BlockingKvClient(host, port, timeout=args.timeout, tls_ca=getattr(args, "tls_ca", None))
    except OSError as e:
        raise CliError("kv server at %s:%d is not reachable: %s" % (host, port, e.strerror or e))


def _run(args, fn):
    from protocols.partition.client import KvError, KvProtocolError

    client = _client(args)
    try:
        return fn(client)
    except KvError as e:
        raise CliError(str(e))
    except KvProtocolError as e:
        raise CliError("bad reply from the kv server: %s" % e)
    except (ConnectionError, OSError) as e:
        raise CliError("kv connection failed: %s" % (e.strerror or e if isinstance(e, OSError) else e))
    finally:
        client.close()


def _emit_pair(args, key, value):
    out = sys.stdout
    if args.json:
        obj = {"key": _show(key, args.encoding)}
        if value is not None:
            obj["value"] = _show(value, args.encoding)
        out.write(json.dumps(obj) + "\n")
    elif value is None:
        out.write(_show(key, args.encoding) + "\n")
    else:
        out.write(_show(key, args.encoding) + "\t" + _show(value, args.encoding) + "\n")


def run_get(args):
    key = _decode_arg(args.key, args.encoding, "key")

    def go(client):
        value = client.get(key)
        if value is None:
            raise CliError("key %s not found" % _show(key, args.encoding))
        if args.json:
            _emit_pair(args, key, value)
        elif args.encoding == "text":
            sys.stdout.flush()
            sys.stdout.buffer.write(value + b"\n")
            sys.stdout.buffer.flush()
        else:
            print(_show(value, args.encoding))
        return 0

    return _run(args, go)


def run_set(args):
    key = _decode_arg(args.key, args.encoding, "key")
    if args.value == "-":
        raw = sys.stdin.buffer.read()
        value = _decode_arg(raw.decode("ascii", "replace").strip(), args.encoding, "value") if args.encoding != "text" else raw
    else:
        value = _decode_arg(args.value, args.encoding, "value")
    if not key:
        raise CliError("the key must not be empty")
    if len(key) > 0xFFFF:
        raise CliError("the key is %d bytes; at most 65535" % len(key))
    if len(value) > 16 * 1024 * 1024:
        raise CliError("the value is %d bytes; at most 16 MiB" % len(value))

    def go(client):
        client.set(key, value)
        if args.json:
            print(json.dumps({"key": _show(key, args.encoding), "status": "OK"}))
        return 0

    return _run(args, go)


def run_rm(args):
    key = _decode_arg(args.key, args.encoding, "key")

    def go(client):
        existed = client.remove(key)
        if args.json:
            print(json.dumps({"key": _show(key, args.encoding), "removed": existed}))
        elif not existed:
            raise CliError("key %s not found" % _show(key, args.encoding))
        return 0

    return _run(args, go)


def _check_page(args):
    if not 1 <= args.page <= 1024:
        raise CliError("--page must be 1..1024")
    if args.limit is not None and args.limit < 0:
        raise CliError("--limit must be >= 0")


def _scan(args, cmd, prefix=b""):
    _check_page(args)
    start = _decode_arg(args.start, args.encoding, "start key")

    def go(client):
        emitted = 0
        if args.limit == 0:
            return 0
        for page in client.iter_scan(cmd, start=start, page=args.page, prefix=prefix):
            items = page.items if cmd != _codec().GET_FB else list(reversed(page.items))
            for k, v in items:
                _emit_pair(args, k, v)
                emitted += 1
                if args.limit is not None and emitted >= args.limit:
                    return 0
        return 0

    return _run(args, go)


def _codec():
    from protocols.partition import codec

    return codec


def run_scan(args):
    codec = _codec()
    return _scan(args, codec.GET_FB if args.reverse else codec.GET_FF)


def run_keys(args):
    codec = _codec()
    prefix = _decode_arg(args.prefix, args.encoding, "prefix")
    if prefix:
        return _scan(args, codec.GET_KEYS_PREFIX, prefix)
    return _scan(args, codec.GET_KEYS)
