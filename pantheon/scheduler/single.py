"""The single-user path: one generation at a time per model, in its own OS thread.

Used when batching is off (QWEN35_BATCH_SLOTS=0). A second concurrent request to the same model is
refused at once with 429 + Retry-After instead of waiting; requests to different models run
concurrently because each model has its own backend and lock.
"""

from __future__ import annotations

from typing import Any

from .. import osthread
from ..errors import BusyError
from .api import Finished, GenRequest, Sink, Started, Tokens


class _Handle:
    def __init__(self) -> None:
        self.cancelled = osthread.Event()

    def cancel(self) -> None:
        self.cancelled.set()


class SingleUserBackend:
    """Owns one state (slot 0) of `model` and the gen_lock serialising its use."""

    def __init__(self, model: Any):
        self.model = model
        # gen_lock: held by the one thread generating on this model; acquired non-blocking (429 if held).
        self.gen_lock = osthread.Lock()
        self._state = model.new_state()
        self._closed = False
        self._served = 0

    def submit(self, req: GenRequest, sink: Sink) -> _Handle:
        if self._closed:
            raise BusyError("server is shutting down", status=503)
        if not self.gen_lock.acquire(blocking=False):
            raise BusyError("a generation is already in progress on this model; retry shortly",
                            status=429, retry_after=1)
        handle = _Handle()
        try:
            osthread.start_thread(lambda: self._run(req, sink, handle), name=f"gen-{self.model.name}")
        except BaseException:
            self.gen_lock.release()
            raise
        return handle

    def _run(self, req: GenRequest, sink: Sink, handle: _Handle) -> None:
        n = 0
        reason = "length"
        try:
            sink(Started())
            gen = self.model.generate(req.prompt_ids, req.params, max_tokens=req.max_tokens,
                                      stop_ids=req.stop_ids, state=self._state_for_run(), slot=0,
                                      cancel=handle.cancelled)
            for tid in gen:
                if handle.cancelled.is_set():
                    reason = "cancelled"
                    break
                n += 1
                sink(Tokens((tid,)))
                if tid in req.stop_ids:
                    reason = "stop"
                    break
            if handle.cancelled.is_set():
                reason = "cancelled"
            sink(Finished(reason, prompt_tokens=len(req.prompt_ids), completion_tokens=n))
        except Exception as exc:  # the request fails, the backend keeps serving
            self._state = None
            sink(Finished("error", error=exc, prompt_tokens=len(req.prompt_ids), completion_tokens=n))
        finally:
            self._served += 1
            self.gen_lock.release()

    def _state_for_run(self) -> Any:
        # generate() donates the state it is given; it never hands the final one back, so each run
        # takes a fresh state (cheap: zeros of the cache size, allocated on device).
        self._state = None
        return self.model.new_state()

    def load_info(self) -> dict:
        return {"mode": "single", "slots": 1, "running": int(self.gen_lock.locked()), "queued": 0,
                "served": self._served, "native_kernels": int(bool(getattr(self.model, "native_matmul", False)))}

    def close(self, timeout: float = 10.0) -> None:
        self._closed = True
        if self.gen_lock.acquire(timeout=timeout):
            self.gen_lock.release()
