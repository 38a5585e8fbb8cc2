"""sbpctl: the command-line client for people.

Each protocol's group lives in its own module here and exposes ``register(subparsers)``; the
module adds its sub-parser and sets ``func`` on every leaf to a function taking the parsed args and
returning an exit code.
"""

import argparse
import importlib
import sys

GROUPS = [
    ("status", "node.cli.status"),
    ("cluster", "node.cli.cluster"),
    ("stream", "node.cli.stream"),
    ("kv", "node.cli.kv"),
    ("fs", "node.cli.fs"),
    ("peer", "node.cli.peer"),
    ("s2", "node.cli.s2"),
    ("top", "node.cli.top"),
]


class CliError(Exception):
    """A user-facing failure: printed as one line, exit code 1 (no traceback)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sbpctl",
        description="Talk to an sbpnode: streams (SBP), key-value, files (Toasty), peers, S2.",
    )
    parser.add_argument(
        "--tls-ca", default=None, metavar="PEM",
        help="the node's listeners speak TLS (ssl: endpoints): verify them against this CA file",
    )
    sub = parser.add_subparsers(dest="group", metavar="COMMAND")
    for name, module_name in GROUPS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            # A reserved group whose protocol has not landed: say so instead of hiding it.
            p = sub.add_parser(name, help="(not available in this build)")
            p.set_defaults(func=_unavailable(name))
            continue
        module.register(sub)
    return parser


def _unavailable(name):
    def run(args):
        raise CliError("the '%s' commands are not available in this build" % name)

    return run


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return func(args) or 0
    except CliError as e:
        print("sbpctl: error: %s" % e, file=sys.stderr)
        return 1
    except (ConnectionError, OSError) as e:
        print("sbpctl: error: %s" % (e.strerror or e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def split_endpoint(value: str, default_port: int):
    """``HOST:PORT`` (or ``[v6]:PORT``, or just ``HOST``) -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or "]" in port:
        return value.strip("[]"), default_port
    try:
        return host.strip("[]") or "127.0.0.1", int(port)
    except ValueError:
        raise CliError("bad endpoint %r: expected HOST:PORT" % value)


def node_status(args) -> dict:
    """The status dict of the node at ``args.endpoint`` (DESCRIBE_PD_CLUSTER's detail), or a
    one-line CliError when it cannot be reached. The client connects lazily, so an unreachable
    node surfaces at this first request."""
    from protocols.sbp.client import BlockingSbpClient

    host, port = split_endpoint(args.endpoint, 7700)
    client = BlockingSbpClient(host, port, timeout=args.timeout, tls_ca=getattr(args, "tls_ca", None))
    try:
        return client.status()
    except OSError as e:  # SbpConnectionError is a ConnectionError
        raise CliError("node at %s:%d is not reachable: %s" % (host, port, e.strerror or e))
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
