"""A stand-in for SMG's worker control plane, for tests that check what Pantheon sends a router.

It keeps a worker table (`POST /workers` adds, refusing a second worker at one URL with 409 as SMG
does; `PATCH /workers/{id}` merges labels; `DELETE /workers/{id}` removes; `GET /workers` lists) and records every request it receives,
with its headers, so a test can assert on the bodies, the bearer token, or that nothing arrived.

It can also misbehave on cue (`script`): a reply that trickles one byte at a time (`trickling`) or one
far larger than any worker table (`huge_workers`). Such a reply keeps sending until the client hangs
up (`hung_up` is then set) or the test calls `release()`; `stalled` is set once a trickle has begun.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeRouter:
    def __init__(self, port: int = 0, key: str | None = None):
        self.key = key
        self.lock = threading.Lock()
        self.workers: dict[str, dict] = {}  # id -> registration body
        self.requests: list[tuple[str, str, dict, object]] = []  # (method, path, headers, json body)
        self.connections = 0
        self.scripts: list[list] = []  # [method, path, reply(handler), replies left or None: every time]
        self.released = threading.Event()  # ends every scripted reply still sending
        self.stalled = threading.Event()  # a trickling reply has sent its headers
        self.hung_up = threading.Event()  # a client closed its connection in the middle of a scripted reply
        self.sent = 0  # bytes of scripted reply bodies written
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def setup(self) -> None:
                with owner.lock:
                    owner.connections += 1
                super().setup()

            def _reply(self, status: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                with owner.lock:
                    owner.requests.append((self.command, self.path, dict(self.headers), body))
                if owner.key is not None and self.headers.get("Authorization") != f"Bearer {owner.key}":
                    return self._reply(401, {"error": "unauthorized"})
                scripted = owner._scripted(self.command, self.path)
                if scripted is not None:
                    return scripted(self)
                with owner.lock:
                    if self.command == "GET" and self.path == "/workers":
                        ws = [{"id": i, "url": b["url"], "model_id": b.get("model_id"), "labels": b.get("labels")}
                              for i, b in owner.workers.items()]
                        return self._reply(200, {"workers": ws, "total": len(ws)})
                    if self.command == "POST" and self.path == "/workers":
                        if any(b["url"] == body["url"] for b in owner.workers.values()):
                            return self._reply(409, {"code": "WORKER_ALREADY_EXISTS"})
                        wid = str(uuid.uuid4())
                        owner.workers[wid] = body
                        return self._reply(202, {"status": "accepted", "worker_id": wid})
                    if self.command == "PATCH" and self.path.startswith("/workers/"):
                        held = owner.workers.get(self.path[len("/workers/"):])
                        if held is None:
                            return self._reply(404, {"code": "NOT_FOUND"})
                        held.setdefault("labels", {}).update(body.get("labels") or {})
                        return self._reply(202, {"status": "accepted"})
                    if self.command == "DELETE" and self.path.startswith("/workers/"):
                        wid = self.path[len("/workers/"):]
                        if owner.workers.pop(wid, None) is None:
                            return self._reply(404, {"code": "NOT_FOUND"})
                        return self._reply(202, {"status": "accepted"})
                return self._reply(404, {"code": "NOT_FOUND"})

            do_GET = do_POST = do_PATCH = do_DELETE = _handle

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-router", daemon=True)
        self.thread.start()

    # ---- misbehaving on cue ------------------------------------------------------------------------
    def script(self, method: str, path: str, reply: Callable, times: int | None = None) -> None:
        """Answer the next `times` (None: every) `method path` requests with `reply(handler)`."""
        with self.lock:
            self.scripts.append([method, path, reply, times])

    def _scripted(self, method: str, path: str) -> Callable | None:
        with self.lock:
            for entry in self.scripts:
                if entry[0] == method and entry[1] == path and entry[3] != 0:
                    if entry[3] is not None:
                        entry[3] -= 1
                    return entry[2]
        return None

    def release(self) -> None:
        """Behave again: every scripted reply still sending ends, and none is scripted any more."""
        with self.lock:
            self.scripts.clear()
        self.released.set()

    def _pump(self, handler: BaseHTTPRequestHandler, pieces: Iterable[bytes], pause: float = 0.0) -> None:
        for piece in pieces:
            if self.released.is_set():
                return
            try:
                handler.wfile.write(piece)
                handler.wfile.flush()
            except OSError:
                self.hung_up.set()
                return
            with self.lock:
                self.sent += len(piece)
            if pause:
                self.released.wait(pause)

    def trickling(self, every: float = 0.1, announce: int = 1 << 20) -> Callable:
        """A 200 whose headers announce `announce` bytes of JSON, which then come one blank (JSON's
        leading whitespace) every `every` seconds: each read gets a byte, so no read ever times out."""
        def reply(h: BaseHTTPRequestHandler) -> None:
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(announce))
            h.end_headers()
            h.wfile.flush()
            self.stalled.set()
            self._pump(h, iter(lambda: b" ", None), pause=every)
        return reply

    def huge_workers(self, total: int, entry_bytes: int = 4096) -> Callable:
        """A valid `GET /workers` reply of about `total` bytes (other servers' workers, each padded to
        `entry_bytes`), with no Content-Length: it ends when the connection closes (HTTP/1.0)."""
        def pieces() -> Iterator[bytes]:
            yield b'{"workers": ['
            pad = "x" * entry_bytes
            batch: list[bytes] = []
            for i in range(max(1, total // entry_bytes)):
                batch.append(json.dumps({"id": f"w{i}", "url": f"http://elsewhere:1/m/w{i}",
                                         "labels": {"pad": pad}}).encode() + b",")
                if len(batch) == 256:
                    yield b"".join(batch)
                    batch = []
            yield b"".join(batch) + b'{"id": "last", "url": "http://elsewhere:1/m/last"}]}'

        def reply(h: BaseHTTPRequestHandler) -> None:
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.end_headers()
            self._pump(h, pieces())
        return reply

    def urls(self) -> dict[str, dict]:
        """url -> registration body of every worker held."""
        with self.lock:
            return {b["url"]: b for b in self.workers.values()}

    def forget_all(self) -> None:
        """What a router restart looks like from outside: the table is empty again."""
        with self.lock:
            self.workers.clear()

    def count(self, method: str, path_prefix: str = "/") -> int:
        with self.lock:
            return sum(1 for m, p, _, _ in self.requests if m == method and p.startswith(path_prefix))

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()
