"""The HTTP application: OpenAI API, health, readiness, metrics, admin."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvguard.daemon import admin_api, openai_api
from kvguard.daemon.openai_api import (
    DRAIN_CUT_MESSAGE,
    ApiError,
    _cut_error,
    engine_unavailable,
)
from kvguard.daemon.openai_schemas import error_body, new_id
from kvguard.engine.engine_loop import EngineUnavailable

if TYPE_CHECKING:
    from kvguard.daemon.service import Service

log = logging.getLogger("kvguard.daemon.api")


def create_app(service: Service) -> FastAPI:
    app = FastAPI(
        title="kvguard",
        version="0.1.0",
        description="LLM inference that keeps serving under memory pressure",
    )
    openai_routes = openai_api.router(service)
    app.include_router(openai_routes)
    app.include_router(admin_api.router(service))
    app.include_router(admin_api.alertmanager_router(service))
    _health_routes(app, service)
    _error_handlers(app, _served(openai_routes))

    app.add_middleware(CountedRequests, service=service)

    def cut_answer(scope: Scope, begun: bool) -> Response:
        """A request begun before the drain is cut (`request_cut`); one that came during it
        is refused as every request the drain sees is (`shutting down`)."""
        _count(service, scope, 503)
        error = (
            _cut_error(service, None, DRAIN_CUT_MESSAGE) if begun else openai_api.shutting_down()
        )
        response = error.response()
        response.headers["Connection"] = "close"  # the rest of its body is not read
        return response

    # outside the other middleware: the messages it sees are those the server sends
    answers = OpenAnswers(lambda: service.draining, cut_answer)
    app.add_middleware(answers.middleware)
    app.state.open_answers = answers
    app.add_middleware(RequestIds)  # outermost: the drain's answers get their id too
    return app


class RequestIds:
    """Gives every answer an `x-request-id` header (the openai client's `_request_id`, what
    `with_raw_response` and its errors quote): once the route has named the request's
    completion (`request.state.completion_id`, set before anything is answered), that id
    (`chatcmpl-...`: a whole completion's, a stream's, whose chunks carry it, an error's after
    it), under which the daemon's log lines name the request's choices (`<id>-<index>`, a
    failed step's traceback among them); else a fresh `req-...` (an error before it, /health).
    Without one, a client with a failed request had nothing to quote; the log lines about an
    error name the same id, so that what a client quotes is found.

    The id is read when the answer starts: nothing is held or parsed. Plain ASGI, as
    CountedRequests."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"] = new_id("req")  # for the log lines about its answer

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = _with_request_id(message, _answer_id(state))
            await send(message)

        await self.app(scope, receive, sending)


def _answer_id(state: dict[str, Any]) -> str:
    """The completion id its route made, else the request's fresh one."""
    return str(state.get("completion_id") or state.get("request_id", ""))


def _with_request_id(start: Message, request_id: str) -> Message:
    headers = [*start.get("headers", ()), (b"x-request-id", request_id.encode())]
    return {**start, "headers": headers}


class CountedRequests:
    """Per HTTP request: stamps its arrival (`request.state.arrived`, before its body is read
    and parsed: what the latency histograms measure from, a grammar prepared for it counting
    too), answers a route's plain-text 413 as kvguard's JSON one, answers a JSON 500 where the
    app raised before its response started (`_crashed`), and counts kvguard_http_requests by
    route template and status once the response starts.

    Plain ASGI rather than a Starlette `BaseHTTPMiddleware`, which relays every message of the
    answer (each streamed token's SSE chunk) through a memory stream read by another task: a
    quarter of the event loop's CPU per streamed token. Here the messages go straight through."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app, self._service = app, service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # websocket, lifespan: not requests to count
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrived"] = time.monotonic()
        started = replaced = False

        async def sending(message: Message) -> None:
            nonlocal started, replaced
            if replaced:  # the plain-text 413's body: its JSON replacement went instead
                return
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                if status == 413 and b"json" not in _content_type(message):
                    replaced = True
                    route = scope.get("route")
                    limit = getattr(route, "max_body_size", None)
                    self._count(scope, 413)
                    await _too_large(limit or getattr(route, "body_limit", None))(
                        scope, receive, send
                    )
                    return
                self._count(scope, status)
            await send(message)

        try:
            await self.app(scope, receive, sending)
            if not started:
                raise RuntimeError("the app returned without answering")
        except Exception:  # noqa: BLE001 - see _crashed
            if started:  # the answer is under way: the server closes the connection
                raise
            self._count(scope, 500)
            await _crashed(Request(scope))(scope, receive, send)

    def _count(self, scope: Scope, status: int) -> None:
        _count(self._service, scope, status)


def _count(service: Service, scope: Scope, status: int) -> None:
    path = getattr(scope.get("route"), "path", "unmatched")
    service.metrics.http.labels(path, str(status)).inc()


def _content_type(start: Message) -> bytes:
    for name, value in start.get("headers") or ():
        if name.lower() == b"content-type":
            return value.lower()
    return b""


class OpenAnswers:
    """The HTTP exchanges that began before the drain and whose answer the server has not yet
    taken whole: the drain waits for them as for the engine's requests (service.shutdown), so
    that an answer the engine has finished still reaches a client that reads it slowly,
    within api.drain_timeout. Counted once the request's body has arrived whole (an answer
    is built, and a large one serialized, after the engine let go of its request), until
    its final body message has been sent or the exchange ended otherwise (the client hung
    up, an error).

    An exchange whose body is still arriving is not an answer being sent: the drain does not
    wait for it (a client that sends its headers and stalls would hold every stop for the
    whole drain_timeout), and one that has not sent all of it when the drain ends, begun
    before the drain or during it, is cut (`cut_uploads`): answered `cut_answer` (the drain's
    503 `request_cut`) at once, rather than cancelled by uvicorn at the end of its graceful
    shutdown, which answers a bare 500 and logs a traceback.

    The server sends a message only once its write buffer has drained (uvicorn waits before
    writing when the buffer is over its high-water mark), so a final body is sent as the
    body and then an empty final message: the exchange ends once the client has read all
    but what the buffers hold, not when the body was queued."""

    def __init__(
        self, draining: Callable[[], bool], cut_answer: Callable[[Scope, bool], ASGIApp]
    ) -> None:
        self._draining = draining
        self._cut_answer = cut_answer
        self.count = 0  # of those begun before the drain: what it waits for
        self._answers: set[_Exchange] = set()  # body whole (or answered), answer not sent
        self._uploads: set[_Exchange] = set()  # body still arriving, no answer begun
        self._cutting = False  # the drain is over: a body still awaited is not waited for

    def cut_uploads(self) -> int:
        """End of the drain: cut the exchanges still waiting for their request's body (a
        client that stalled, or is slow, sending it); how many. One that arrives from now on
        is cut when it would wait for its body."""
        self._cutting = True
        cut = list(self._uploads)
        for ex in cut:
            ex.cut = True
            ex.task.cancel()  # it waits for the body (uvicorn's receive): it stops waiting
        return len(cut)

    def middleware(self, app: ASGIApp) -> ASGIApp:
        async def tracked(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            task = asyncio.current_task()
            assert task is not None
            ex = _Exchange(task, waited=not self._draining())  # one arriving now: not waited for
            if _has_body(scope):
                self._uploads.add(ex)
            else:
                self._answering(ex)

            async def receiving() -> Message:
                if ex in self._uploads and self._cutting:  # arrived as the drain ended
                    ex.cut = True
                    raise asyncio.CancelledError
                message = await receive()
                if ex in self._uploads and not message.get("more_body"):
                    self._uploads.discard(ex)  # the body is whole, or the client has left
                    if message["type"] == "http.request":
                        self._answering(ex)
                return message

            async def sending(message: Message) -> None:
                if message["type"] == "http.response.start" and ex in self._uploads:
                    self._uploads.discard(ex)  # answered before its body was read (a 413)
                    self._answering(ex)
                final = message["type"] == "http.response.body" and not message.get("more_body")
                if final and message.get("body"):
                    await send({**message, "more_body": True})
                    message = {"type": "http.response.body", "body": b"", "more_body": False}
                await send(message)
                if final:
                    self._answered(ex)

            try:
                await app(scope, receiving, sending)
            except asyncio.CancelledError:
                if not ex.cut or ex in self._answers:  # not the drain's cut of its upload
                    raise
                if task.cancelling():  # cut_uploads' cancel, taken back: the answer goes out
                    task.uncancel()
                self._uploads.discard(ex)
                await self._cut_answer(scope, ex.waited)(scope, receive, send)
            finally:
                self._uploads.discard(ex)
                self._answered(ex)

        return tracked

    def _answering(self, ex: _Exchange) -> None:
        self._answers.add(ex)
        if ex.waited:
            self.count += 1

    def _answered(self, ex: _Exchange) -> None:
        if ex in self._answers:
            self._answers.discard(ex)
            if ex.waited:
                self.count -= 1


class _Exchange:
    """One HTTP exchange, as OpenAnswers follows it."""

    __slots__ = ("task", "waited", "cut")

    def __init__(self, task: asyncio.Task[Any], waited: bool) -> None:
        self.task, self.waited, self.cut = task, waited, False


def _has_body(scope: Scope) -> bool:
    """Whether the request has a body to wait for (RFC 9112: a Content-Length above 0, or
    chunked); an unreadable length is left to the server, which refuses it."""
    headers = scope.get("headers") or ()
    if any(name == b"transfer-encoding" for name, _ in headers):  # wherever it comes
        return True
    return any(
        name == b"content-length" and value.strip() not in (b"0", b"") for name, value in headers
    )


def _health_routes(app: FastAPI, service: Service) -> None:
    # HEAD too (RFC 9110 asks it wherever GET is served): probes such as `wget --spider`, a
    # container's usual health check, and uptime monitors ask with HEAD; the server sends
    # the same status and headers, without the body
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict[str, Any]:
        return {"status": "alive"}

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready() -> Any:
        ok, why = service.readiness()
        return JSONResponse({"ready": ok, "reason": why}, status_code=200 if ok else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _crashed(request: Request) -> Response:
    """A route failed in a way no handler expected: log the traceback, answer a JSON 500.

    Answered here rather than by an exception handler for Exception: Starlette runs those in
    its outermost middleware and then re-raises, and uvicorn, seeing the exception after the
    answer started, closes the connection, so a keep-alive client's next request is reset.
    No input should get here (they are all answered 4xx); this is the net under that rule."""
    request_id = _answer_id(request.scope.get("state") or {})  # the answer's x-request-id
    log.exception(
        "unhandled error in %s %s (request %s)", request.method, request.url.path, request_id
    )
    body = error_body(
        "internal error: kvguard failed on this request; the daemon log has the traceback",
        "server_error",
    )
    return JSONResponse(body, status_code=500)


def _too_large(limit: int | None) -> Response:
    """A route's body limit (e.g. /alertmanager's) answered by Starlette in plain text: the
    same 413, as the OpenAI-style JSON every other refusal is."""
    bound = f"at most {limit} bytes" if limit is not None else "too large"
    body = error_body(f"request body too large: {bound} are taken here", code="body_too_large")
    return JSONResponse(body, status_code=413)


def _param(loc: tuple[Any, ...]) -> str | None:
    """A validation error's location as the field path a client writes, `messages[0].content`
    (FastAPI's leading "body" and pydantic's union-member tags such as `list[int]` dropped)."""
    out = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _UNION_TAG.fullmatch(str(part)):
            out += f".{part}" if out else str(part)
    return out or None


_UNION_TAG = re.compile(r"[a-z][a-z-]*\[.*\]")


def _error_param(err: dict[str, Any]) -> str | None:
    """The field a validation error names: the one its check says (a check of the whole
    `messages` list naming `messages[3].tool_call_id`: `openai_schemas._refusal`), else
    where it was raised."""
    named = (err.get("ctx") or {}).get("param")
    return named if isinstance(named, str) else _param(tuple(err.get("loc", ())))


def _validation_message(err: dict[str, Any]) -> str:
    if isinstance((err.get("ctx") or {}).get("param"), str):  # its message names it already
        return str(err.get("msg"))
    param = _param(tuple(err.get("loc", ())))
    kind = err.get("type")
    if kind == "extra_forbidden":
        return f"{param}: unknown field (kvguard refuses fields it does not serve instead of ignoring them)"
    if param is None and kind == "missing":
        return "the request body is missing: expected a JSON object"
    if param is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        return "expected a JSON object as the request body"
    return f"{param or 'body'}: {err.get('msg')}"


def _json_error(err: dict[str, Any], doc: Any) -> str:
    """`invalid JSON at line 1, column 25: Expecting ',' delimiter`, from the decoder's offset."""
    pos = err["loc"][-1] if isinstance(err["loc"][-1], int) else 0
    why = (err.get("ctx") or {}).get("error", "not valid JSON")
    if not isinstance(doc, str):
        return f"invalid JSON at character {pos + 1}: {why}"
    line = doc.count("\n", 0, pos) + 1
    column = pos - (doc.rfind("\n", 0, pos) + 1) + 1
    return f"invalid JSON at line {line}, column {column}: {why}"


def _error_handlers(app: FastAPI, served: str) -> None:
    """`served`: the OpenAI API's routes, which a request for an unknown path is told of."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(EngineUnavailable)
    async def engine_gone(request: Request, exc: EngineUnavailable) -> Response:
        """Work posted to an engine that has failed for good (a request not yet taken, an
        admin action): 503, as for the requests that were in flight."""
        return engine_unavailable(exc.cause).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        errs = list(exc.errors())
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(_json_error(first, exc.body)), status_code=400)
        if isinstance(exc.body, bytes):  # a body FastAPI did not parse: not sent as JSON
            kind = request.headers.get("content-type", "")
            return JSONResponse(
                error_body(
                    f"Content-Type {kind!r} is not served: send the body as application/json"
                ),
                status_code=415,
            )
        msgs = "; ".join(dict.fromkeys(_validation_message(e) for e in errs[:5]))
        param = _error_param(first)
        return JSONResponse(error_body(msgs or "invalid request", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 413:  # a body sent in chunks (no Content-Length) past the limit
            return _too_large(request.scope.get(MAX_BODY_SIZE_SCOPE_KEY))
        if exc.status_code in (404, 405):  # the router's: no route, or not with this method
            return _invalid_url(request, exc, served)
        message = str(exc.detail)
        cause = exc.__cause__
        if isinstance(cause, RecursionError):
            message = "invalid JSON: nested too deeply"
        elif isinstance(cause, UnicodeDecodeError):
            message = f"invalid JSON: not UTF-8 text ({cause.reason} at byte {cause.start})"
        elif isinstance(cause, ValueError):  # e.g. an integer of more than 4300 digits
            message = f"invalid JSON: {cause}"
        return JSONResponse(
            error_body(message, "invalid_request_error"),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )


def _invalid_url(request: Request, exc: StarletteHTTPException, served: str) -> Response:
    """A path kvguard does not serve (404), or one it serves with other methods (405), as
    OpenAI words it (`Invalid URL (POST /v1/responses)`) and with what is served: a client
    whose framework asks the Responses API or embeddings learns which request was not
    served, and what to ask instead (Starlette's words were `Not Found`)."""
    asked = f"{request.method} {request.url.path}"
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405:
        allowed = (headers or {}).get("Allow") or "other methods"
        message = f"Invalid method for URL ({asked}): it takes {allowed}"
    else:
        message = f"Invalid URL ({asked}): kvguard serves {served}"
    return JSONResponse(error_body(message), status_code=exc.status_code, headers=headers)


def _served(router: APIRouter) -> str:
    """The routes' methods and paths, `POST /v1/completions, GET /v1/models, ...`."""
    routes = [r for r in router.routes if isinstance(r, APIRoute)]
    return ", ".join(f"{'/'.join(sorted(r.methods - {'HEAD'}))} {r.path_format}" for r in routes)
