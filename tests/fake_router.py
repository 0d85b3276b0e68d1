"""A stand-in for SMG's worker control plane, for tests that check what Pantheon sends a router.

It keeps a worker table (`POST /workers` adds, refusing a second worker at one URL with 409 as SMG
does; `PATCH /workers/{id}` merges labels; `DELETE /workers/{id}` removes; `GET /workers` lists) and records every request it receives,
with its headers, so a test can assert on the bodies, the bearer token, or that nothing arrived.
"""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeRouter:
    def __init__(self, port: int = 0, key: str | None = None):
        self.key = key
        self.lock = threading.Lock()
        self.workers: dict[str, dict] = {}  # id -> registration body
        self.requests: list[tuple[str, str, dict, object]] = []  # (method, path, headers, json body)
        self.connections = 0
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
        self.server.shutdown()
        self.server.server_close()
