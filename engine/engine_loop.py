"""The engine thread: runs `step()` while there is work, applies posted actions, and hands each
request's outputs to whoever submitted it. Other threads never touch engine state directly.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.sequence import RequestOutput
from kvguard.engine.snapshot import EngineSnapshot

log = logging.getLogger("kvguard.engine.loop")
_DONE = object()


class RequestStream:
    """Outputs of one request as the engine produces them; the last one has `finished` set."""

    def __init__(self, listener: Callable[[RequestOutput], None] | None = None) -> None:
        self.request_id = ""
        self._q: queue.Queue = queue.Queue()
        self.final: RequestOutput | None = None
        self.listener = listener  # called on the engine thread for every output (must not block)

    def _put(self, out: RequestOutput) -> None:
        if self.listener is not None:
            self.listener(out)
        self._q.put(out)
        if out.finished:
            self.final = out
            self._q.put(_DONE)

    def __iter__(self):  # noqa: ANN204 - generator of RequestOutput
        while True:
            item = self._q.get()
            if item is _DONE:
                return
            yield item

    def result(self, timeout: float | None = None) -> RequestOutput:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.final is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            item = self._q.get(timeout=left)
            if item is _DONE:
                break
        assert self.final is not None
        return self.final


class EngineLoop:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_beat = time.monotonic()  # heartbeat: the systemd watchdog follows this
        self.on_step: list[Callable[[EngineSnapshot], None]] = []
        self.error: BaseException | None = None
        self.paused = threading.Event()  # test hook: a set event stalls the loop (no heartbeat)
        engine.mailbox.notify = self._wake.set

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread = threading.Thread(target=self._run, name="kvguard-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            while self.paused.is_set() and not self._stop.is_set():
                time.sleep(0.01)
            self.last_beat = time.monotonic()
            if not (eng.has_unfinished() or eng.mailbox.pending()):
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            try:
                outputs = eng.step()
            except Exception as e:  # noqa: BLE001 - keep serving; the failure is logged and kept
                log.exception("engine step failed")
                self.error = e
                time.sleep(0.1)
                continue
            for out in outputs:
                self._deliver(out)
            snap = eng.latest_snapshot
            for fn in self.on_step:
                try:
                    fn(snap)
                except Exception:  # noqa: BLE001
                    log.exception("on_step hook failed")

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        stream._put(out)
        if out.finished:
            del self._streams[out.request_id]

    # -- from any thread --------------------------------------------------------------------
    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread at the next step boundary."""
        return self.engine.mailbox.post(fn)

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: str | int = "normal",
        request_id: str | None = None,
        add_special_tokens: bool = True,
        timeout: float | None = 60.0,
    ) -> RequestStream:
        """Add a request; raises what `add_request` raises (ValueError, AdmissionRejected)."""
        stream, fut = self.submit_nowait(prompt, params, priority, request_id, add_special_tokens)
        fut.result(timeout)
        return stream

    def submit_nowait(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: str | int = "normal",
        request_id: str | None = None,
        add_special_tokens: bool = True,
        listener: Callable[[RequestOutput], None] | None = None,
    ) -> tuple[RequestStream, Future]:
        """Post a request; the Future resolves to its id (or the add_request error)."""
        stream = RequestStream(listener)

        def add() -> str:
            rid = self.engine.add_request(prompt, params, request_id, priority, add_special_tokens)
            stream.request_id = rid
            self._streams[rid] = stream
            return rid

        return stream, self.call(add)

    def in_flight(self) -> int:
        return len(self._streams)

    def abort(self, request_id: str) -> Future:
        return self.call(lambda: self.engine.abort(request_id))

    def snapshot(self) -> EngineSnapshot:
        return self.engine.latest_snapshot
