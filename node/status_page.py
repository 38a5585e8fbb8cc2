"""The node's own pages on the ``--http`` listener, outside the S2 routes (docs/observability.md):

- ``GET /metrics``: the Prometheus exposition (prometheus_client's text format);
- ``GET /`` and ``GET /ui/``: the status page (node/ui/index.html + app.js, charts by the vendored
  uPlot), which polls ``GET /ui/status.json`` (also what ``sbpctl top`` reads);
- ``GET /ui/<file>``: the page's static files, served from node/ui/ (no CDN: works offline).

With ``--metrics-token`` every one of them needs ``Authorization: Bearer TOKEN`` or ``?token=TOKEN``
(the page passes its own ``?token=`` on to its polls); without it they are open, whatever
``--http-token`` says (that one guards the S2 API).

``handle(responder)`` is called by the S2 API's dispatch with its transport-neutral responder
(HTTP/1.1 and HTTP/2 alike) and returns False for any other path.
"""

import hmac
import json
import os
import time

from twisted.logger import Logger

from node import cluster_view
from node.metrics import version
from node.status_history import RATES

UI_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ui")
UPLOT_VERSION = "1.6.32"

STATIC = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "vendor/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "vendor/uPlot.min.css": "text/css; charset=utf-8",
}
JSON_TYPE = ("content-type", "application/json")
NO_STORE = ("cache-control", "no-store")
BUSIEST_STREAMS = 10


def load_static():
    """{path under /ui/: (content type, bytes)}, read once at start-up."""
    files = {}
    for name, ctype in STATIC.items():
        with open(os.path.join(UI_DIR, name), "rb") as f:
            files[name] = (ctype, f.read())
    return files


class StatusPages:
    log = Logger()

    def __init__(self, node, node_metrics, history, token=None):
        self.node = node
        self.node_metrics = node_metrics
        self.history = history
        self.token = token
        self.files = load_static()

    def handle(self, responder) -> bool:
        req = responder.request
        seg = req.segments
        if seg == ["metrics"]:
            route = self.metrics
        elif not seg or seg == ["ui"]:
            route = self.index
        elif seg == ["ui", "status.json"]:
            route = self.status_json
        elif len(seg) >= 2 and seg[0] == "ui" and "/".join(seg[1:]) in self.files:
            route = self.static
        else:
            return False
        # answered once the request body has arrived (as the S2 handlers are): the transports
        # feed the body after dispatch returns
        if req.method not in ("GET", "HEAD"):
            responder.on_body = lambda body: responder.respond(
                405, [JSON_TYPE, ("allow", "GET, HEAD")], b'{"code":"method_not_allowed","message":"GET only"}')
        elif not self._authorized(req):
            responder.on_body = lambda body: responder.respond(
                401, [JSON_TYPE, ("www-authenticate", 'Bearer realm="sbpnode metrics"')],
                b'{"code":"authn","message":"missing or wrong metrics token"}')
        else:
            responder.on_body = lambda body: self._answer(route, responder)
        return True

    def _answer(self, route, responder):
        try:
            route(responder)
        except Exception:  # a bug here must cost one 500, not the connection
            self.log.failure("{path} failed", path=responder.request.raw_path)
            responder.respond(500, [JSON_TYPE], b'{"code":"other","message":"status page failed; see the node log"}')

    def _authorized(self, req) -> bool:
        if self.token is None:
            return True
        expected = self.token.encode()
        auth = req.header("authorization", "")
        if auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].encode(), expected):
            return True
        return hmac.compare_digest(req.query.get("token", "").encode(), expected)

    # -- routes -----------------------------------------------------------------------------------

    def metrics(self, responder):
        body, ctype = self.node_metrics.exposition()
        responder.respond(200, [("content-type", ctype), NO_STORE], body)

    def index(self, responder):
        ctype, body = self.files["index.html"]
        responder.respond(200, [("content-type", ctype), NO_STORE], body)

    def static(self, responder):
        ctype, body = self.files["/".join(responder.request.segments[1:])]
        responder.respond(200, [("content-type", ctype), ("cache-control", "max-age=300")], body)

    def status_json(self, responder):
        body = json.dumps(self.status(), sort_keys=True, default=str).encode()
        responder.respond(200, [JSON_TYPE, NO_STORE], body)

    # -- the status document (docs/observability.md "Status JSON") --------------------------------

    def status(self) -> dict:
        node = self.node
        now = time.time()
        store = node.store
        stats = {}
        streams = 0
        if store is not None and not store.closed:
            try:
                stats = store.stats()
                streams = stats.get("streams", 0)
            except Exception as e:  # closing under us: say so rather than fail the poll
                stats = {"error": str(e)}
        view = cluster_view.snapshot(node)
        view["per_node"] = {str(k): v for k, v in cluster_view.ranges_per_node(view).items()}
        totals = {}
        for name, (section, key) in RATES.items():
            table = node.metrics if section is None else (node.metrics.get(section) or {})
            totals[key if section is None else "%s_%s" % (section, key)] = table.get(key, 0)
        return {
            "time": now,
            "node": {
                "node_id": node.node_id,
                "version": version(),
                "started_at": node.started,
                "uptime_s": round(now - node.started, 1),
                "pid": os.getpid(),
                "fsync": str(node.config.fsync),
                "data_dir": node.config.data_dir,
                "listeners": {name: node.advertised(name) for name in sorted(node.ports)},
                "ui": {"charts": "uPlot " + UPLOT_VERSION},
            },
            "store": stats,
            "cluster": view,
            "streams": {"count": streams, "busiest": self.history.busiest(BUSIEST_STREAMS)},
            "totals": totals,
            "series": self.history.series(),
            "peers": [
                {"peer": address, "connected": bool(p.get("connected")), "lag": p.get("lag", 0),
                 "items": p.get("items", 0), "bytes": p.get("bytes", 0),
                 "rate_items_s": p.get("rate_items_s", 0.0), "rate_bytes_s": p.get("rate_bytes_s", 0.0),
                 "last_error": p.get("last_error")}
                for address, p in sorted((node.metrics.get("peers") or {}).items())
            ],
        }
