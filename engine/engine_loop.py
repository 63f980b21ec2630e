"""The engine thread: runs `step()` while there is work, applies posted actions, and hands each
request's outputs to whoever submitted it. Other threads never touch engine state directly.

A step that raises is survived (the engine ends that step's requests itself), except a fatal
failure such as a dead tensor-parallel rank: the engine cannot step again, so the loop stops
stepping, ends every request it still streams with `finish_reason="error"`, refuses whatever is
posted from then on, and tells its `on_fatal` hooks (the daemon exits for systemd to restart it).
A stopped loop does the same without the hooks: what it still streams ends with an error, what
waits in the mailbox and what is posted through it later is refused (EngineStopped), so that
nothing waits for a step that will never come.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Protocol

from kvguard.engine.admission import HIGH
from kvguard.engine.control import Mailbox
from kvguard.engine.distributed.errors import RankFailure
from kvguard.engine.llm_engine import LLMEngine, NewRequest
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.sequence import RequestOutput, TokenLogprob, parse_priority
from kvguard.engine.snapshot import EngineSnapshot

log = logging.getLogger("kvguard.engine.loop")
# Failures after which the engine cannot step again: retrying would only fail again (or hang on
# a collective with a dead peer), so the loop stops instead of serving on.
FATAL_ERRORS: tuple[type[BaseException], ...] = (RankFailure,)
# An idle engine's snapshot is rebuilt this often, so that its rates decay to 0 (the steps
# rebuild it while busy)
IDLE_SNAPSHOT_S = 1.0


class EngineUnavailable(RuntimeError):
    """What the loop answers, after a fatal engine failure, to work posted to it: a request
    or an action that would otherwise wait forever for a step that will never come."""

    def __init__(self, cause: BaseException, message: str | None = None) -> None:
        super().__init__(message or f"the engine stopped after a fatal failure: {cause}")
        self.cause = cause


class EngineStopped(EngineUnavailable):
    """What a stopped loop answers to work posted to it, or still waiting in its mailbox at the
    stop: no step will run it."""

    def __init__(self) -> None:
        cause = RuntimeError("the engine loop has stopped")
        super().__init__(cause, str(cause))


class OutputBuffer:
    """Undelivered outputs of one request, coalesced into at most one.

    A consumer that falls behind (a slow HTTP client, a caller that only wants the result)
    must not make the engine keep one output per token: the buffer keeps the latest output's
    counters and the concatenated deltas, so what it holds grows linearly with the output and
    is one item however far behind the consumer is. Not thread-safe: its owner locks.
    """

    __slots__ = ("_last", "_ids", "_texts", "_logprobs")

    def __init__(self) -> None:
        self._last: RequestOutput | None = None
        self._ids: list[int] = []
        self._texts: list[str] = []  # pieces joined on take: appending is O(1), not a copy
        self._logprobs: list[TokenLogprob] | None = None  # where the request asked for them

    def add(self, out: RequestOutput) -> None:
        self._ids.extend(out.new_token_ids)
        if out.new_text:
            self._texts.append(out.new_text)
        if out.new_logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(out.new_logprobs)
        self._last = out

    def take(self) -> RequestOutput | None:
        """Everything added since the previous take, as one output (None when nothing is)."""
        last = self._last
        if last is None:
            return None
        out = dataclasses.replace(
            last,
            new_token_ids=self._ids,
            new_text="".join(self._texts),
            new_logprobs=self._logprobs,
        )
        self._last, self._ids, self._texts, self._logprobs = None, [], [], None
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
        self.last: RequestOutput | None = None  # the latest output handed out (engine thread)

    def _put(self, out: RequestOutput) -> None:
        self.last = out
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
    def __init__(self, engine: LLMEngine | None = None, idle_wait_s: float = 0.05) -> None:
        """`engine`, or None when `start` builds it on the loop's thread."""
        self.engine: LLMEngine = engine  # type: ignore[assignment] - set by start() if None
        self.idle_wait_s = idle_wait_s
        self._streams: dict[str, RequestStream] = {}
        # requests posted whose add has not resolved yet (it waits in the mailbox behind a long
        # step, or a stalled engine): in flight, though the engine does not know them yet
        self._adding = 0
        self._adding_high = 0  # of them, the high-priority ones (`posted`)
        self._adding_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_beat = time.monotonic()  # heartbeat: the systemd watchdog follows this
        self.on_step: list[Callable[[EngineSnapshot], None]] = []
        self.error: BaseException | None = None
        # A fatal failure (FATAL_ERRORS): set once, never cleared; the engine steps no more.
        self.fatal: BaseException | None = None
        self.on_fatal: list[Callable[[BaseException], None]] = []  # called on the engine thread
        self._fatal_lock = threading.Lock()  # orders `call` against the fatal switch and the stop
        self._closed = False  # stopped: `call` refuses at once (set under _fatal_lock)
        self.paused = threading.Event()  # test hook: a set event stalls the loop (no heartbeat)
        # the snapshot an idle loop last saw, and when (see _refresh_idle_snapshot)
        self._idle_snapshot: EngineSnapshot | None = None
        self._idle_snapshot_at = 0.0
        if engine is not None:
            self._attach(engine)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, factory: Callable[[], LLMEngine] | None = None) -> EngineLoop:
        """Step on the loop's own thread from now on. With `factory`, the engine is first
        built on that thread (this waits for it, and raises what building raised).

        Why build there: GNU OpenMP gives every thread that opens a parallel region its own
        team of workers, and once a process holds more of them than it has CPUs, workers stop
        spinning between regions, so each of the step kernels' many short regions waits for
        sleeping workers to wake (measured: batch-1 decode 2.3x slower). Loading opens
        regions; done on the caller's thread, its team would stay. Built here, the loop's
        thread holds the only team. (Not a thread that loads and exits: a tensor-parallel
        engine's workers die with the thread that started them.)"""
        built = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            if factory is not None:
                try:
                    self.engine = factory()
                except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                    failure.append(e)
                    built.set()
                    return
                self._attach(self.engine)
            built.set()
            try:
                self._run()
            finally:
                self._close()

        self._thread = threading.Thread(target=main, name="kvguard-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            raise failure[0]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping (after the step under way, waiting up to `timeout` for it). From the
        stop on, posts through the loop fail at once; the loop's thread, on its way out, ends
        the requests it still streams with an error and refuses what waits in the mailbox. A
        thread still in a step after `timeout` does that when the step returns; meanwhile
        what waits in the mailbox is refused here (that much is safe from this thread)."""
        with self._fatal_lock:
            self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is None:  # never started: nothing steps, nothing races this thread
            self._close()
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            refused = self.engine.mailbox.refuse_pending(EngineStopped)
            log.warning(
                "engine loop still in a step %gs after the stop; refused %d posted calls, and "
                "its in-flight requests end with an error when the step returns",
                timeout,
                refused,
            )

    def _close(self) -> None:
        """The loop no longer steps: end every stream it still feeds with an error and refuse
        what waits in the mailbox (posts through the loop are refused from now on: nothing can
        slip in behind this). On the loop's thread, or with none left to race."""
        with self._fatal_lock:
            self._closed = True
        error: BaseException | type[EngineStopped] = (
            EngineStopped if self.fatal is None else EngineUnavailable(self.fatal)
        )
        ended = self._end_streams()
        refused = self.engine.mailbox.refuse_pending(error) if self.engine is not None else 0
        if ended or refused:
            log.warning(
                "engine loop stopped: ended %d in-flight requests with an error; refused %d "
                "posted calls",
                ended,
                refused,
            )

    def _attach(self, engine: LLMEngine) -> None:
        """Be woken by posts to `engine`, and beat while it converts its KV pool or runs a
        step's forward: a dtype switch or a resize runs layer by layer inside one step, a
        pause of seconds per GiB on a CPU, and a long prompt step takes as long (a full
        step's tokens through a 7B model on a CPU: minutes); a step making progress layer by
        layer is not a stalled loop (the heartbeat is what the systemd watchdog and /ready
        follow), while a layer that never returns stops the beats."""
        engine.mailbox.notify = self._wake.set
        engine.kv_cache.on_progress = self._beat
        engine.runner.on_layer = self._beat

    def _beat(self) -> None:
        self.last_beat = time.monotonic()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread | None:
        """The engine thread (None before `start`): where a stalled loop is stuck."""
        return self._thread

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            while self.paused.is_set() and not self._stop.is_set():
                time.sleep(0.01)
            if self._stop.is_set():  # stopped while held: no further step
                break
            self._beat()
            try:
                if not (eng.has_unfinished() or eng.mailbox.pending()):
                    eng.check_ranks()  # a rank that dies while idle is noticed without traffic
                    # no step runs while idle: the halved step budget comes back here on time
                    eng.restore_budget_when_due()
                    self._refresh_idle_snapshot()
                    self._wake.wait(self._idle_wait())
                    self._wake.clear()
                    continue
                outputs = eng.step()
            except FATAL_ERRORS as e:
                self._fail_fatally(e)
                self._refuse_until_stopped(e)
                return
            except Exception as e:  # noqa: BLE001 - keep serving; the failure is logged and kept
                log.exception("engine step failed")
                self.error = e
                time.sleep(0.1)
                continue
            with _wakes_after_delivery():
                for out in outputs:
                    self._deliver(out)
            snap = eng.latest_snapshot
            for fn in self.on_step:
                try:
                    fn(snap)
                except Exception:  # noqa: BLE001
                    log.exception("on_step hook failed")

    def _idle_wait(self) -> float:
        """How long an idle loop waits for a post: `idle_wait_s`, or less where the step
        budget an out-of-memory fault halved is due back sooner (the engine's deadline)."""
        due = self.engine.budget_restore_in()
        return self.idle_wait_s if due is None else min(self.idle_wait_s, due)

    def _refresh_idle_snapshot(self) -> None:
        """An idle engine does not step, and the snapshot is otherwise rebuilt only by a step:
        what it says of the recent past (requests finished per second over the last 10 s)
        would keep its last busy value for as long as the engine stays idle. Rebuilt here at
        most once every IDLE_SNAPSHOT_S (a step's own snapshot counts)."""
        eng = self.engine
        now = time.monotonic()
        if eng.latest_snapshot is not self._idle_snapshot:  # a step made a new one
            self._idle_snapshot, self._idle_snapshot_at = eng.latest_snapshot, now
        elif now - self._idle_snapshot_at >= IDLE_SNAPSHOT_S:
            eng.latest_snapshot = eng.snapshot()
            self._idle_snapshot, self._idle_snapshot_at = eng.latest_snapshot, now

    def _fail_fatally(self, error: BaseException) -> None:
        """Record the failure, end every stream so that no consumer waits forever, refuse what
        is already posted, then tell the hooks. The engine itself is not touched again: its
        ranks are out of step, and the state on this side may be half through a step.

        Once the loop has been told to stop, its owner is already taking the engine down (a
        forced exit stops the workers under a step that did not end in time): the failure is
        that, logged as a warning, and the hooks, which would start an exit, are not called."""
        stopping = self._stop.is_set()
        level = logging.WARNING if stopping else logging.ERROR
        log.log(level, "engine %s, no more steps: %s", "stopped" if stopping else "failed", error)
        with self._fatal_lock:
            self.fatal = error
        ended = self._end_streams()
        refused = _refuse_mailbox(self.engine.mailbox, error)
        log.log(
            level,
            "ended %d in-flight requests with an error; refused %d posted calls",
            ended,
            refused,
        )
        if stopping:
            return
        for fn in self.on_fatal:
            try:
                fn(error)
            except Exception:  # noqa: BLE001 - every hook must run
                log.exception("on_fatal hook failed")

    def _end_streams(self) -> int:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._put(_failed_output(stream))
        return len(streams)

    def _refuse_until_stopped(self, error: BaseException) -> None:
        """After a fatal failure, answer later posts at once until the loop is stopped (the
        daemon exits within seconds, but a rule tick or an operator may post meanwhile). No
        heartbeat: the systemd watchdog must not take a dead engine for a live one."""
        while not self._stop.is_set():
            self._wake.wait(self.idle_wait_s)
            self._wake.clear()
            _refuse_mailbox(self.engine.mailbox, error)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        stream._put(out)
        if out.finished:
            del self._streams[out.request_id]

    # -- from any thread --------------------------------------------------------------------
    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread at the next step boundary. After a fatal failure the
        Future fails at once with EngineUnavailable instead of waiting for a step, and after
        a stop with EngineStopped."""
        # a post that wins the race is refused by _fail_fatally, or by the stop's _close
        with self._fatal_lock:
            if self.fatal is None and not self._closed:
                return self.engine.mailbox.post(fn)
            fatal = self.fatal
        fut: Future = Future()
        fut.set_exception(EngineStopped() if fatal is None else EngineUnavailable(fatal))
        return fut

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
        *,
        count_prompt: bool = True,
    ) -> tuple[RequestStream, Future]:
        """Post a request; the Future resolves to its id (or the add_request error).

        A `listener` gets every output (a delta) on the engine thread and must not block; the
        stream then keeps only the final output instead of queueing the deltas too.
        `count_prompt`: as `LLMEngine.add_request`'s (False for a choice after the first).
        """
        stream = RequestStream(listener)
        # it arrives now, not when the engine thread takes it from the mailbox (after the step
        # under way, or a stall): its queue time and TTFT count the wait for the thread too
        arrival = time.monotonic()

        def add() -> str:
            rid = self.engine.add_request(
                prompt,
                params,
                request_id,
                priority,
                add_special_tokens,
                arrival_time=arrival,
                count_prompt=count_prompt,
            )
            self._stream(stream, rid)
            return rid

        return stream, self._post_add(add, 1, priority)

    def submit_all_nowait(
        self,
        requests: list[NewRequest],
        listeners: list[Callable[[RequestOutput], None] | None],
        priority: str | int = "normal",
        add_special_tokens: bool = True,
    ) -> tuple[list[RequestStream], Future]:
        """Post the requests of one client's request (its choices, its prompts), one stream
        each (`listeners`: as `submit_nowait`'s listener), to be taken in as one: the engine
        admits or queues all of them or, refusing one, none (`LLMEngine.add_requests`), so a
        refusal leaves nothing to abort. The Future resolves to their ids, or fails with the
        refusal (`refused_request` says which request it is about)."""
        streams = [RequestStream(listener) for listener in listeners]
        arrival = time.monotonic()  # as submit_nowait's

        def add() -> list[str]:
            rids = self.engine.add_requests(requests, priority, add_special_tokens, arrival)
            for stream, rid in zip(streams, rids, strict=True):
                self._stream(stream, rid)
            return rids

        return streams, self._post_add(add, len(requests), priority)

    def _stream(self, stream: RequestStream, rid: str) -> None:
        """`stream` carries the outputs of the request `rid` the engine took in."""
        stream.request_id = rid
        self._streams[rid] = stream

    def _post_add(self, add: Callable[[], object], count: int, priority: str | int) -> Future:
        """Post `add`, which adds `count` requests: in flight from now until it has run."""
        high = _is_high(priority)
        with self._adding_lock:
            self._adding += count
            self._adding_high += count if high else 0
        posted = self.call(add)
        # run, refused or failed: taken off the count
        posted.add_done_callback(functools.partial(self._added, count, high))
        if high:
            self.engine.interrupt_step()  # after posting: the next drain takes it
        return posted

    def _added(self, count: int, high: bool, _: Future) -> None:
        with self._adding_lock:
            self._adding -= count
            self._adding_high -= count if high else 0

    def posted(self, high: bool = False) -> int:
        """Requests posted whose add the engine thread has not run yet, those a new request
        would queue behind once taken in: every one, or for a `high` request only the high
        ones (admission's queue puts high ahead of the rest). A stalled thread takes none, so
        this is how far a stall has piled them up."""
        return self._adding_high if high else self._adding

    def in_flight(self) -> int:
        """Requests not finished: those the engine holds and those whose add is still on its
        way to it (a drain that counted only the first would miss a request posted behind a
        long step, and exit under it)."""
        return len(self._streams) + self._adding

    def abort(self, request_id: str) -> Future:
        return self.call(lambda: self.engine.abort(request_id))

    def abort_stream(self, stream: RequestStream) -> Future:
        """Abort the request behind `stream`, even one whose add still waits in the mailbox:
        the mailbox runs in order, so by the time this runs the add has run and named the
        request (or failed, leaving nothing to abort). Resolves to whether it aborted one."""
        return self.call(lambda: bool(stream.request_id) and self.engine.abort(stream.request_id))

    def snapshot(self) -> EngineSnapshot:
        return self.engine.latest_snapshot


class _EventLoop(Protocol):
    def call_soon_threadsafe(self, callback: Callable[[], object], /) -> object: ...


_delivery = threading.local()  # .wakes: {event loop: callbacks} while a step's outputs go out


def wake_after_delivery(loop: _EventLoop, callback: Callable[[], object]) -> None:
    """For a stream's listener (engine thread): run `callback` on the event loop `loop`, after
    every output of the step under delivery has been handed out. The callbacks queued on one
    loop during a step run in the order queued, all in one call_soon_threadsafe: one wake of
    the loop per step, not one per output (each writes the loop's self-pipe, some 10 us of the
    engine thread: 32 streams were a millisecond a step). Outside a step's delivery (a stream
    ended by a stop or a fatal failure), at once. A closed loop (the daemon's shutdown) has
    nobody left to wake."""
    wakes = getattr(_delivery, "wakes", None)
    if wakes is None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(callback)
        return
    wakes.setdefault(loop, []).append(callback)


@contextlib.contextmanager
def _wakes_after_delivery() -> Iterator[None]:
    _delivery.wakes = wakes = {}
    try:
        yield
    finally:
        _delivery.wakes = None
        for loop, callbacks in wakes.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(functools.partial(_run_all, callbacks))


def _run_all(callbacks: list[Callable[[], object]]) -> None:
    for fn in callbacks:
        try:
            fn()
        except Exception:  # noqa: BLE001 - the other listeners' wakes must still run
            log.exception("wake callback %r failed", fn)


def _is_high(priority: str | int) -> bool:
    try:
        return parse_priority(priority) == HIGH
    except ValueError:
        return False  # add_request names the problem


def _failed_output(stream: RequestStream) -> RequestOutput:
    """The last output of a request the engine can no longer finish: `finish_reason="error"`,
    the counts it had reached, nothing new. The whole text stays with the failed engine; a
    consumer has had every delta already."""
    last = stream.last
    return RequestOutput(
        request_id=stream.request_id,
        new_token_ids=[],
        new_text="",
        num_prompt_tokens=last.num_prompt_tokens if last else 0,
        num_output_tokens=last.num_output_tokens if last else 0,
        finish_reason="error",
        finished=True,
        priority=last.priority if last else "normal",
        num_preemptions=last.num_preemptions if last else 0,
        num_cached_tokens=last.num_cached_tokens if last else 0,
        ttft_s=last.ttft_s if last else None,
        queue_time_s=last.queue_time_s if last else None,
        final_text="",
        final_token_ids=[],
        final_prompt_token_ids=[],
    )


def _refuse_mailbox(mailbox: Mailbox, error: BaseException) -> int:
    """Fail every call waiting in `mailbox` with EngineUnavailable, without running it: each
    would act on an engine whose ranks are gone."""
    return mailbox.refuse_pending(EngineUnavailable(error))
