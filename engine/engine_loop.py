"""The engine thread: runs `step()` while there is work, applies posted actions, and hands each
request's outputs to whoever submitted it. Other threads never touch engine state directly.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.sequence import RequestOutput
from kvguard.engine.snapshot import EngineSnapshot

log = logging.getLogger("kvguard.engine.loop")


class OutputBuffer:
    """Undelivered outputs of one request, coalesced into at most one.

    A consumer that falls behind (a slow HTTP client, a caller that only wants the result)
    must not make the engine keep one output per token: the buffer keeps the latest output's
    counters and the concatenated deltas, so what it holds grows linearly with the output and
    is one item however far behind the consumer is. Not thread-safe: its owner locks.
    """

    __slots__ = ("_last", "_ids", "_texts")

    def __init__(self) -> None:
        self._last: RequestOutput | None = None
        self._ids: list[int] = []
        self._texts: list[str] = []  # pieces joined on take: appending is O(1), not a copy

    def add(self, out: RequestOutput) -> None:
        self._ids.extend(out.new_token_ids)
        if out.new_text:
            self._texts.append(out.new_text)
        self._last = out

    def take(self) -> RequestOutput | None:
        """Everything added since the previous take, as one output (None when nothing is)."""
        last = self._last
        if last is None:
            return None
        out = dataclasses.replace(last, new_token_ids=self._ids, new_text="".join(self._texts))
        self._last, self._ids, self._texts = None, [], []
        return out

    def __len__(self) -> int:
        return 0 if self._last is None else 1


class RequestStream:
    """Outputs of one request as the engine produces them; the last one has `finished` set.

    Without a listener, iterate the stream (or call `result()`): outputs not yet taken are
    coalesced, so an iteration may see several tokens in one output. With a listener, the
    listener gets every output on the engine thread and the stream keeps only the final one
    (for `result()`): it does not queue a second copy nobody reads.
    """

    def __init__(self, listener: Callable[[RequestOutput], None] | None = None) -> None:
        self.request_id = ""
        self.final: RequestOutput | None = None
        self.listener = listener  # called on the engine thread for every output (must not block)
        self._cond = threading.Condition()
        self._buffer = OutputBuffer()
        self._done = False  # the final output has been taken by an iteration

    def _put(self, out: RequestOutput) -> None:
        if self.listener is not None:
            try:
                self.listener(out)
            except Exception:  # noqa: BLE001 - a consumer's bug must not stop the engine thread
                log.exception("output listener for %s failed", out.request_id)
        with self._cond:
            if self.listener is None:
                self._buffer.add(out)
            if out.finished:
                self.final = out
            self._cond.notify_all()

    def __iter__(self) -> Iterator[RequestOutput]:
        if self.listener is not None:
            raise RuntimeError("a stream with a listener delivers its outputs to the listener")
        while True:
            with self._cond:
                while not self._done and not len(self._buffer):
                    self._cond.wait()
                if self._done:
                    return
                out = self._buffer.take()
                assert out is not None
                self._done = out.finished
            yield out

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final output (whole text and token ids); waits for it."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.final is not None, timeout):
                raise TimeoutError(f"request {self.request_id} not finished after {timeout}s")
            assert self.final is not None
            return self.final

    def undelivered(self) -> int:
        """Outputs held for an iteration that has not taken them yet: 0 or 1."""
        with self._cond:
            return len(self._buffer)


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
        """Post a request; the Future resolves to its id (or the add_request error).

        A `listener` gets every output (a delta) on the engine thread and must not block; the
        stream then keeps only the final output instead of queueing the deltas too.
        """
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

    def abort_stream(self, stream: RequestStream) -> Future:
        """Abort the request behind `stream`, even one whose add still waits in the mailbox:
        the mailbox runs in order, so by the time this runs the add has run and named the
        request (or failed, leaving nothing to abort). Resolves to whether it aborted one."""
        return self.call(lambda: bool(stream.request_id) and self.engine.abort(stream.request_id))

    def snapshot(self) -> EngineSnapshot:
        return self.engine.latest_snapshot
