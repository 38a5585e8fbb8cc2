"""sbpctl fs: the Toasty file service (ls, mkdir, put, get, rm, stat) over the blocking client."""

import argparse
import functools
import hashlib
import os
import sys

from node.cli import CliError, split_endpoint

DEFAULT_META = "127.0.0.1:7702"


def register(sub):
    p = sub.add_parser("fs", help="files on a node's Toasty file service")
    p.add_argument("--endpoint", default=DEFAULT_META, help="the node's metadata listener HOST:PORT (default %s)" % DEFAULT_META)
    p.add_argument("--timeout", type=float, default=30.0)
    fs = p.add_subparsers(dest="fs_command", metavar="FS_COMMAND")
    p.set_defaults(func=lambda args: _usage(p))
    # --endpoint/--timeout may also come after the command (SUPPRESS: no default overriding the group's)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoint", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--timeout", type=float, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    fs.add_parser = functools.partial(fs.add_parser, parents=[common])

    ls = fs.add_parser("ls", help="list a directory")
    ls.add_argument("path", nargs="?", default="/")
    ls.add_argument("-l", "--long", action="store_true", help="show generations")
    ls.set_defaults(func=run_ls)

    mk = fs.add_parser("mkdir", help="create a directory (its parent must exist)")
    mk.add_argument("path")
    mk.add_argument("-p", "--parents", action="store_true", help="create missing parents too; no error if it exists")
    mk.set_defaults(func=run_mkdir)

    put = fs.add_parser("put", help="upload a local file (replaces the remote file's content)")
    put.add_argument("local", help="local file, or - for stdin")
    put.add_argument("path", help="remote path")
    put.add_argument("--chunk-size", type=int, default=64 * 1024, help="chunk size for a new file (default 65536)")
    put.add_argument("--no-progress", action="store_true")
    put.add_argument("--read-back", action="store_true", help="also read the whole file back and compare its SHA-256")
    put.set_defaults(func=run_put)

    get = fs.add_parser("get", help="download a file (a directory prints its listing)")
    get.add_argument("path", help="remote path")
    get.add_argument("local", nargs="?", default="-", help="local file (default - : stdout)")
    get.add_argument("--no-progress", action="store_true")
    get.set_defaults(func=run_get)

    rm = fs.add_parser("rm", help="delete a file or an empty directory")
    rm.add_argument("path")
    rm.add_argument("--gen", type=int, default=0, help="only if its generation is this (default: any)")
    rm.set_defaults(func=run_rm)

    st = fs.add_parser("stat", help="generation, chunk size and size of a path")
    st.add_argument("path")
    st.set_defaults(func=run_stat)


def _usage(parser):
    parser.print_help()
    return 2


def _client(args):
    from protocols.toasty.client import BlockingToastyClient

    host, port = split_endpoint(args.endpoint, 7702)
    try:
        return BlockingToastyClient(host, port, timeout=args.timeout, tls_ca=getattr(args, "tls_ca", None))
    except OSError as e:
        raise CliError("metadata server at %s:%d is not reachable: %s" % (host, port, e.strerror or e))


def _call(fn, *a, **kw):
    from protocols.toasty.client import ToastyError
    from protocols.toasty.paths import InvalidPath

    try:
        return fn(*a, **kw)
    except (ToastyError, InvalidPath) as e:
        raise CliError(str(e))


def _show(name: bytes) -> str:
    return name.decode("utf-8", "backslashreplace")


def _progress(total, desc, disabled):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=disabled, file=sys.stderr, leave=False)


def run_ls(args):
    from protocols.toasty.client import ToastyError

    with _client(args) as c:
        try:
            _, items = c.list(args.path)
        except ToastyError as e:
            if not e.message.startswith("Entity is not a directory"):
                raise CliError(str(e))
            info = _call(c.stat, args.path)  # a file: show it, as ls does
            print("%20d  %s" % (info["gen"], args.path) if args.long else args.path)
            return 0
        except ValueError as e:  # InvalidPath
            raise CliError(str(e))
        for item in items:
            name = _show(item.name) + ("/" if item.is_dir else "")
            print("%20d  %s" % (item.gen, name) if args.long else name)
    return 0


def run_mkdir(args):
    from protocols.toasty.client import ToastyError
    from protocols.toasty.paths import normalize, join

    with _client(args) as c:
        comps = _call(normalize, args.path)
        targets = [join(comps[: i + 1]) for i in range(len(comps))] if args.parents else [join(comps)]
        for target in targets:
            try:
                gen = c.mkdir(target)
            except ToastyError as e:
                if args.parents and e.message.startswith("File or directory already exists"):
                    continue
                raise CliError(str(e))
        if not args.parents:
            print(gen)
    return 0


def run_put(args):
    from protocols.toasty.client import DEFAULT_CHUNK_SIZE

    if args.chunk_size < 1:
        raise CliError("--chunk-size must be positive")
    if args.local == "-":
        data = sys.stdin.buffer.read()
        size, source = len(data), _HashingReader(_Bytes(data))
    else:
        try:
            f = open(args.local, "rb")
        except OSError as e:
            raise CliError("cannot read %s: %s" % (args.local, e.strerror))
        size, source = os.fstat(f.fileno()).st_size, _HashingReader(f)
    with _client(args) as c:
        bar = _progress(size, "put", args.no_progress)
        try:
            gen = _call(
                c.write_stream,
                args.path,
                source,
                size,
                0,
                truncate=True,
                create=True,
                chunk_size=args.chunk_size if args.chunk_size != DEFAULT_CHUNK_SIZE else None,
                progress=bar.update,
            )
        finally:
            bar.close()
        # Every chunk the chunk server stored was checked against the SHA-256 we computed (its
        # address), so the server holds exactly our bytes; --read-back re-reads the whole file too.
        if args.read_back:
            check = hashlib.sha256()
            got = _call(c.read_into, args.path, check.update)
            if got != size or check.digest() != source.hash.digest():
                raise CliError("verification failed: %s reads back differently (%d bytes)" % (args.path, got))
    print("%s: %d bytes, generation %d, sha256 %s" % (args.path, size, gen, source.hash.hexdigest()), file=sys.stderr)
    return 0


def run_get(args):
    with _client(args) as c:
        info = _call(c.stat, args.path)
        if info["is_dir"]:
            _, items = _call(c.list, args.path)
            for item in items:
                print(_show(item.name) + ("/" if item.is_dir else ""))
            return 0
        out = sys.stdout.buffer if args.local == "-" else None
        tmp = None
        if out is None:
            tmp = args.local + ".part"
            try:
                out = open(tmp, "wb")
            except OSError as e:
                raise CliError("cannot write %s: %s" % (tmp, e.strerror))
        digest = hashlib.sha256()
        bar = _progress(info["size"], "get", args.no_progress or args.local == "-")

        def sink(data):
            out.write(data)
            digest.update(data)
            bar.update(len(data))

        try:
            # Each chunk is verified against its SHA-256 address as it arrives.
            got = _call(c.read_into, args.path, sink)
        finally:
            bar.close()
            if tmp is not None:
                out.close()
        if tmp is not None:
            if got != info["size"]:
                os.remove(tmp)
                raise CliError("%s changed while downloading; try again" % args.path)
            os.replace(tmp, args.local)
            print("%s: %d bytes, sha256 %s" % (args.local, got, digest.hexdigest()), file=sys.stderr)
    return 0


def run_rm(args):
    with _client(args) as c:
        _call(c.delete, args.path, args.gen)
    return 0


def run_stat(args):
    with _client(args) as c:
        info = _call(c.stat, args.path)
    for key in sorted(info):
        print("%-12s %s" % (key, info[key]))
    return 0


class _Bytes:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def seek(self, pos):
        self.pos = pos

    def read(self, n):
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out


class _HashingReader:
    """Reads a source and keeps the SHA-256 of its bytes (each byte once, even when the client
    seeks back to re-read a retried piece)."""

    def __init__(self, f):
        self.f = f
        self.hash = hashlib.sha256()
        self.pos = 0
        self.hashed = 0

    def tell(self):
        return self.pos

    def seek(self, pos):
        self.f.seek(pos)
        self.pos = pos

    def read(self, n):
        data = self.f.read(n)
        end = self.pos + len(data)
        if end > self.hashed:
            self.hash.update(memoryview(data)[self.hashed - self.pos :] if self.hashed > self.pos else data)
            self.hashed = end
        self.pos = end
        return data
