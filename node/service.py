"""The node: one MultiService holding the store, one listener per protocol and one syncer per peer.

Start-up order (privilegedStartService, before the reactor runs): lock the data dir, open the store,
bind every listener (a bind failure exits non-zero with a one-line message). The ready file is
written atomically once every warm-up a protocol registered (``NodeContext.before_ready``: the
compiled APPEND check) has finished, so a client told "ready" gets the node at full speed; the log
says how long start-up took. Shutdown (SIGTERM/SIGINT): stop accepting, run the protocols'
shutdown hooks (SBP GOAWAY, parked FETCHes answered) with a bounded wait, stop peer syncers, close
the store, remove the ready file.
"""

import gc
import json
import os
import signal
import sys
import time

from twisted.application import service
from twisted.internet import defer, endpoints, error
from twisted.logger import Logger

from node import guard, listeners
from node.config import LISTENERS, NodeConfig
from node.identity import NodeIdMismatch, load_or_create_node_id
from node.lockfile import DataDirLock, DataDirLocked
from node.metrics import ignore_latency


class NodeContext:
    """What protocol code may see of the node: store, config, identity, addresses, hooks."""

    def __init__(self, config: NodeConfig, reactor):
        self.config = config
        self.reactor = reactor
        self.node_id = None
        self.store = None
        self.ports = {}  # listener name -> IListeningPort
        self.guard = None  # node.guard.ConnectionGuard: connection cap and idle timeouts
        self.metrics = {}
        self.metrics = {}  # the counters the protocols keep (read by node/metrics.py at scrape time)
        # observe_latency(operation, seconds): the protocols' latency hook (node/metrics.py
        # OPERATIONS); a no-op with --metrics off
        self.observe_latency = ignore_latency
        self.node_metrics = None  # node.metrics.NodeMetrics with --metrics on
        self.http_pages = None  # fn(responder) -> bool: /metrics and the status page (node/status_page.py)
        self.cluster = None  # node.cluster.service.ClusterNode with --cluster (CONTRACT §9; its status() is node/cluster_view.py's view); None: single node
        self.started = time.time()
        self._shutdown_hooks = []
        self.warm_ups = []  # (what, Deferred) to finish before the ready file is written
        self.ready = False
        self._ready_waiters = []

    def before_ready(self, d, what: str) -> None:
        """Hold the ready file until ``d`` fires (for work that would slow the first requests)."""
        self.warm_ups.append((what, d))

    def when_ready(self):
        """A Deferred fired once the node serves at full speed (the ready file is written then):
        what announces the node to others (a cluster registration) waits for it."""
        d = defer.Deferred()
        if self.ready:
            d.callback(None)
        else:
            self._ready_waiters.append(d)
        return d

    def _now_ready(self):
        self.ready = True
        waiters, self._ready_waiters = self._ready_waiters, []
        for d in waiters:
            d.callback(None)

    def advertised(self, name: str):
        port = self.ports.get(name)
        if port is None:
            return None
        addr = port.getHost()
        host = getattr(addr, "host", None)
        if self.config.advertise:
            host = self.config.advertise  # CONTRACT §9 --advertise
        elif host in (None, "", "0.0.0.0", "::"):
            host = "127.0.0.1"
        return "%s:%d" % (host, addr.port) if ":" not in host else "[%s]:%d" % (host, addr.port)

    def bound_port(self, name: str):
        port = self.ports.get(name)
        return port.getHost().port if port is not None else None

    def on_shutdown(self, fn) -> None:
        self._shutdown_hooks.append(fn)

    def run_shutdown_hooks(self):
        return defer.DeferredList(
            [defer.maybeDeferred(fn) for fn in self._shutdown_hooks], consumeErrors=True
        )


class NodeService(service.MultiService):
    log = Logger()

    def __init__(self, config: NodeConfig, reactor=None):
        super().__init__()
        if reactor is None:
            from twisted.internet import reactor
        self.node = NodeContext(config, reactor)
        self._lock = DataDirLock(config.data_dir) if config.data_dir else None
        self._ready_written = False

    @property
    def config(self) -> NodeConfig:
        return self.node.config

    def prepare(self) -> None:
        """Create and lock the data dir and learn the node id (called from makeService)."""
        os.makedirs(self.config.data_dir, exist_ok=True)
        try:
            self._lock.acquire()
            self.node.node_id = load_or_create_node_id(self.config.data_dir, self.config.node_id)
        except (DataDirLocked, NodeIdMismatch) as e:
            self._lock.release()
            raise SystemExit("sbpnode: %s" % e)

    def privilegedStartService(self):
        from storage import Store

        node = self.node
        ready_dir = os.path.dirname(self.config.ready_file or "") or "."
        if self.config.ready_file and not os.access(ready_dir, os.W_OK):
            # checked now: the file is written later (after the warm-ups), when a failure could
            # only stop the node
            self._abort_start("--ready-file %s: %s is not a writable directory" % (self.config.ready_file, ready_dir))
        try:
            node.store = Store.open(
                os.path.join(self.config.data_dir, "store"),
                fsync=self.config.fsync,
                reactor=node.reactor,
                node_id=node.node_id,
            )
            node.store.kv.row_cache_bytes = self.config.kv_cache_mb << 20  # --kv-cache-mb (storage/kv_cache.py)
        except Exception as e:
            self.log.failure("could not open the store")
            self._lock.release()
            raise SystemExit("sbpnode: could not open the store in %s: %s" % (self.config.data_dir, e))
        nofile = guard.raise_fd_limit()
        node.guard = guard.ConnectionGuard(
            node.reactor,
            self.config.max_connections or guard.default_max_connections(nofile),
            self.config.idle_timeouts,
            node.metrics.setdefault("connections", {}),
            self.config.max_unsent_bytes,
        )
        if self.config.metrics:
            self._start_metrics()
        if self.config.cluster:
            from node.cluster.service import ClusterNode

            node.cluster = ClusterNode(node)
        for name in LISTENERS:
            description = self.config.endpoint(name)
            if description is None:
                continue
            factory = node.guard.wrap(name, listeners.build_factory(name, node))
            result = endpoints.serverFromString(node.reactor, description).listen(factory)
            failures = []
            result.addCallbacks(lambda port, name=name: node.ports.__setitem__(name, port), failures.append)
            if name in node.ports:
                guard.limit_accepts(node.ports[name])
            if failures:
                self._abort_start("cannot listen on --%s %s: %s" % (name, description, failures[0].value))
            if name not in node.ports:
                self._abort_start("listener --%s %s did not bind at start-up" % (name, description))
        for peer in self.config.peers:
            peer_service = listeners.build_peer_service(node, peer)
            if peer_service is not None:
                peer_service.setServiceParent(self)
        super().privilegedStartService()

    def _start_metrics(self):
        from node.metrics import NodeMetrics
        from node.status_history import StatusHistory
        from node.status_page import StatusPages

        node = self.node
        node.node_metrics = metrics = NodeMetrics(node, self.config.metrics_streams)
        node.observe_latency = metrics.observe_latency
        node.store.wal.on_sync = metrics.observe_fsync
        history = StatusHistory(node, metrics, clock=node.reactor)
        history.setServiceParent(self)
        node.http_pages = StatusPages(node, metrics, history, token=self.config.metrics_token).handle

    def _abort_start(self, message: str):
        for port in self.node.ports.values():
            port.stopListening()
        self._lock.release()
        raise SystemExit("sbpnode: " + message)

    def startService(self):
        super().startService()
        self.node.guard.start()
        self.log.info(
            "at most {max} client connections (RLIMIT_NOFILE {nofile}); idle timeouts {idle}",
            max=self.node.guard.max_connections, nofile=guard.raise_fd_limit(),
            idle=" ".join("%s=%gs" % kv for kv in sorted(self.config.idle_timeouts.items())),
        )
        self._install_signal_handlers()  # before the reactor runs: SIGTERM never finds SIG_DFL
        self.node.reactor.callWhenRunning(self._install_signal_handlers)  # over the reactor's own
        for name in LISTENERS:
            port = self.node.ports.get(name)
            self.log.info(
                "{listener} listening on {address}",
                listener=name,
                address=self.node.advertised(name) if port else "none (off)",
            )
        self._ready_call = self.node.reactor.callLater(0, self._when_warm)

    # A warm-up that never finishes (a wedged compile) must not keep the node from ever serving.
    WARM_UP_LIMIT = 120.0

    @defer.inlineCallbacks
    def _when_warm(self):
        node = self.node
        started = time.monotonic()
        for what, d in node.warm_ups:
            left = self.WARM_UP_LIMIT - (time.monotonic() - started)
            timer = node.reactor.callLater(max(left, 0), d.cancel)
            try:
                yield d
            except defer.CancelledError:
                self.log.warn("{what} not ready after {limit}s; writing the ready file anyway",
                              what=what, limit=self.WARM_UP_LIMIT)
            except Exception:
                self.log.failure("warm-up {what} failed", what=what)
            finally:
                if timer.active():
                    timer.cancel()
        if not self.running:
            return
        # Start-up leaves ~150k long-lived objects (numba, llvmlite, numpy, the protocols' modules);
        # every full collection would walk them all (~30-100 ms with the reactor stopped, seen as
        # p99.9 spikes). Collect once now, then move what survived out of the collector's sight.
        gc.collect()
        gc.freeze()
        self._warm_seconds = time.monotonic() - started
        if node.cluster is None:
            self._ready()
            return
        # CONTRACT §9: the ready file appears only after registration (and registration only
        # once the node serves at full speed)
        d = node.cluster.start()
        d.addCallbacks(lambda _: self._ready(), self._cluster_start_failed)

    def _ready(self):
        node = self.node
        # whatever ran since start-up, a SIGTERM after the ready file means a clean exit 0
        self._install_signal_handlers()
        try:
            self._write_ready_file()
        except OSError as e:  # a supervisor waiting for the file would wait forever: stop instead
            self.log.critical("cannot write the ready file {path}: {error}; stopping",
                              path=self.config.ready_file, error=e)
            node.reactor.stop()
            return
        node._now_ready()
        self.log.info(
            "node {node_id} ready in {seconds:.2f}s since process start (warm-up {warm:.2f}s; data dir {data_dir})",
            node_id=node.node_id, seconds=process_age(), warm=getattr(self, "_warm_seconds", 0.0),
            data_dir=self.config.data_dir,
        )

    def _cluster_start_failed(self, failure):
        from node.cluster.etcd import EtcdError
        from node.cluster.membership import StartRefused

        if failure.check(StartRefused, EtcdError):
            message = str(failure.value)
        else:
            self.log.failure("cluster start failed", failure)
            message = "%s: %s" % (type(failure.value).__name__, failure.value)
        self._exit_after_stop("cannot join the cluster: " + message)

    def _exit_after_stop(self, message):
        """A start-up failure found once the reactor runs: one line on stderr, a clean stop,
        exit status 1 (twistd itself would exit 0 after reactor.stop())."""
        self.log.critical("{message}", message=message)
        stderr = sys.__stderr__
        stderr.write("sbpnode: %s\n" % message)
        stderr.flush()
        self.node.cluster = None  # nothing to leave: start() undid its registration

        def exit_1():
            for f in (sys.stdout, sys.__stdout__, stderr):
                try:
                    f.flush()
                except Exception:
                    pass
            os._exit(1)

        self.node.reactor.addSystemEventTrigger("after", "shutdown", exit_1)
        self.node.reactor.stop()

    def _install_signal_handlers(self):
        # CONTRACT §1: SIGTERM/SIGINT mean a clean shutdown that exits 0. twistd's own handlers
        # re-raise the signal after stopping (exit status -15), so ours replace them once the
        # reactor runs.
        def stop_reactor():
            try:
                self.node.reactor.stop()
            except error.ReactorNotRunning:
                pass  # a second signal while shutting down: already on the way out

        def stop(signum, frame):
            self.log.info("received {signal}; stopping", signal=signal.Signals(signum).name)
            self.node.reactor.callFromThread(stop_reactor)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)

    def _write_ready_file(self):
        path = self.config.ready_file
        if not path:
            return
        ready = {name: self.node.bound_port(name) for name in LISTENERS}
        ready["node_id"] = self.node.node_id
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(ready, f)
        # the rename makes it appear whole; no fsync: it describes this run only (removed at
        # shutdown), and a disk flush here delays start-up on a busy disk
        os.replace(tmp, path)
        self._ready_written = True

    @defer.inlineCallbacks
    def stopService(self):
        node = self.node
        call = getattr(self, "_ready_call", None)
        if call is not None and call.active():
            call.cancel()
        if node.guard is not None:
            node.guard.stop()
        self.log.info("shutting down: no new connections")
        yield defer.DeferredList([defer.maybeDeferred(p.stopListening) for p in node.ports.values()])
        hooks = node.run_shutdown_hooks()
        timeout = node.reactor.callLater(self.config.shutdown_timeout, hooks.cancel)
        try:
            yield hooks
        except defer.CancelledError:
            self.log.warn("shutdown hooks still running after {t}s; closing anyway", t=self.config.shutdown_timeout)
        finally:
            if timeout.active():
                timeout.cancel()
        if node.cluster is not None:
            # leave at once (lease revoked) rather than after the TTL
            yield node.cluster.stop()
        yield super().stopService()
        if node.store is not None:
            yield node.store.close()
            self.log.info("store closed cleanly")
        if self._ready_written:
            try:
                os.remove(self.config.ready_file)
            except FileNotFoundError:
                pass
        self._lock.release()
        # Shutdown is complete. Python's finalization puts SIG_DFL back for every signal that has
        # a Python handler, so a supervisor's second SIGTERM landing while the interpreter winds
        # down would turn this clean exit 0 into -15 (CONTRACT §1); ignored signals stay ignored.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def process_age() -> float:
    """Seconds since this process started (Linux /proc; interpreter start-up included)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.process_time()


def attach_log_level(node_service: NodeService, application, twistd_options) -> None:
    """Honour --log-level by giving twistd's Application a filtering observer (twistd asks for an
    ILogObserver component before building its own; we build the same file target it would)."""
    from twisted.logger import (
        FilteringLogObserver,
        ILogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        textFileLogObserver,
    )
    from twisted.python import logfile

    if twistd_options is None:  # not under twistd (e.g. a test building the service)
        logfilename, nodaemon = None, True
    else:
        logfilename, nodaemon = twistd_options.get("logfile"), bool(twistd_options.get("nodaemon"))
    if logfilename == "-" or (nodaemon and not logfilename):
        out = sys.stdout
    else:
        out = logfile.LogFile.fromFullPath(logfilename or "twistd.log")
    level = LogLevel.levelWithName(node_service.config.log_level)
    observer = FilteringLogObserver(
        textFileLogObserver(out), [LogLevelFilterPredicate(defaultLogLevel=level)]
    )
    application.setComponent(ILogObserver, observer)
