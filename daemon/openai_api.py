"""POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /v1/models."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvguard.daemon.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
    now,
    usage,
)
from kvguard.engine.engine_loop import OutputBuffer
from kvguard.engine.llm_engine import AdmissionRejected
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.sequence import RequestOutput

if TYPE_CHECKING:
    from kvguard.daemon.service import Service

DEFAULT_CHAT_MAX_TOKENS = 512


class ApiError(Exception):
    """An error answered as OpenAI-style JSON with a status (and Retry-After when set)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.type_ = status, param, code, type_
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        body = error_body(str(self), self.type_, self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=headers)


def router(service: Service) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": service.model_name,
                    "object": "model",
                    "created": service.started,
                    "owned_by": "kvguard",
                }
            ],
        }

    @r.post("/v1/completions")
    async def completions(
        body: CompletionRequest, request: Request, x_priority: str | None = Header(None)
    ) -> Any:
        prompt = _single_prompt(body.prompt)
        params = _params(body, body.max_tokens or 16)
        return await _serve(
            service, request, "text_completion", prompt, params, body, x_priority, True
        )

    @r.post("/v1/chat/completions")
    async def chat(
        body: ChatCompletionRequest, request: Request, x_priority: str | None = Header(None)
    ) -> Any:
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = service.engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise ApiError(
                400, f"messages cannot be rendered by the chat template: {e}", "messages"
            ) from e
        limit = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
        params = _params(body, limit)
        return await _serve(
            service, request, "chat.completion", prompt, params, body, x_priority, False
        )

    return r


def _single_prompt(prompt: str | list[str] | list[int]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, "only one prompt per request is served (n=1)", "prompt")
        return prompt[0]
    return list(prompt)


def _params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop_list(),
            ignore_eos=body.ignore_eos,
        )
    except ValueError as e:
        raise ApiError(400, str(e)) from e


def _priority(body: Any, header: str | None) -> str:
    p = body.priority or (header.strip().lower() if header else "normal")
    if p not in ("high", "normal", "low"):
        raise ApiError(400, f"priority {p!r}: expected high, normal or low", "priority")
    return p


async def _serve(
    service: Service,
    request: Request,
    kind: str,
    prompt: str | list[int],
    params: SamplingParams,
    body: Any,
    x_priority: str | None,
    completion: bool,
) -> Any:
    if body.model not in (service.model_name, service.engine_model):
        raise ApiError(
            404,
            f"model {body.model!r} does not exist; this server serves {service.model_name!r}",
            "model",
            "model_not_found",
        )
    priority = _priority(body, x_priority)
    if service.draining:
        raise ApiError(503, "server is shutting down", type_="service_unavailable", retry_after=5)
    ctx = _Ctx(service, kind, body.model, priority, time.monotonic(), params)
    outputs = _Outputs(asyncio.get_running_loop(), ctx, keep_deltas=bool(body.stream))
    stream, fut = service.loop.submit_nowait(
        prompt, params, priority, add_special_tokens=completion, listener=outputs.push
    )
    try:
        await asyncio.wrap_future(fut)
    except AdmissionRejected as e:
        d = e.decision
        typ = "invalid_request_error" if d.status == 400 else "overloaded_error"
        raise ApiError(
            d.status,
            d.reason,
            code="admission_rejected",
            type_=typ,
            retry_after=None if d.status == 400 else d.estimated_wait_s,
        ) from e
    except ValueError as e:
        raise ApiError(400, str(e), "prompt") from e
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            _sse(ctx, stream.request_id, outputs, include_usage), media_type="text/event-stream"
        )
    final = await _wait_final(service, request, stream.request_id, outputs)
    return _full_response(ctx, final)


class _Ctx:
    def __init__(
        self,
        service: Service,
        kind: str,
        model: str,
        priority: str,
        t0: float,
        params: SamplingParams,
    ) -> None:
        self.service, self.kind, self.model, self.priority, self.t0 = (
            service,
            kind,
            model,
            priority,
            t0,
        )
        self.params = params
        self.id = new_id("chatcmpl" if kind == "chat.completion" else "cmpl")
        self.created = now()
        self.last: float | None = None

    def observe(self, out: RequestOutput) -> None:
        """Latency metrics, per engine output (engine thread): they measure the engine, not how
        fast the client reads."""
        m = self.service.metrics
        t = time.monotonic()
        if self.last is None:
            m.ttft.labels(self.priority).observe(t - self.t0)
        else:
            m.inter_token.labels(self.priority).observe(t - self.last)
        self.last = t
        if out.finished:
            m.e2e.labels(self.priority).observe(t - self.t0)
            if out.queue_time_s is not None:
                m.queue_time.labels(self.priority).observe(out.queue_time_s)
            m.finished.labels(out.finish_reason or "unknown", self.priority).inc()


class _Outputs:
    """The engine's outputs for one HTTP request until the request's coroutine takes them.

    The engine thread pushes one delta per token; the coroutine can be much slower (a client
    reading its SSE stream slowly, or not at all). Untaken deltas are coalesced, so a request
    holds at most one output however far behind its client is, never one per token. A
    non-streaming request keeps only the final output, the one it answers with.
    """

    def __init__(self, aio: asyncio.AbstractEventLoop, ctx: _Ctx, keep_deltas: bool) -> None:
        self._aio, self._ctx, self._keep_deltas = aio, ctx, keep_deltas
        self._lock = threading.Lock()  # the engine thread adds, the event loop takes
        self._buffer = OutputBuffer()
        self._ready = asyncio.Event()

    def push(self, out: RequestOutput) -> None:
        """The stream's listener, on the engine thread: must not block."""
        self._ctx.observe(out)
        if not (self._keep_deltas or out.finished):
            return
        with self._lock:
            self._buffer.add(out)
        with contextlib.suppress(RuntimeError):  # a closed event loop (shutdown): nobody waits
            self._aio.call_soon_threadsafe(self._ready.set)

    async def get(self) -> RequestOutput:
        """Everything new since the previous get, as one output; waits for something new."""
        while True:
            with self._lock:
                out = self._buffer.take()
            if out is not None:
                return out
            await self._ready.wait()
            self._ready.clear()

    def undelivered(self) -> int:
        """Outputs waiting for the coroutine: 0 or 1."""
        with self._lock:
            return len(self._buffer)


async def _wait_final(
    service: Service, request: Request, rid: str, outputs: _Outputs
) -> RequestOutput:
    while True:
        try:
            out = await asyncio.wait_for(outputs.get(), timeout=0.5)
        except TimeoutError:
            if await request.is_disconnected():
                service.loop.abort(rid)
                raise ApiError(499, "client disconnected") from None
            continue
        if out.finished:
            return out


def _kvguard_ext(ctx: _Ctx, out: RequestOutput) -> dict[str, Any]:
    return {
        "priority": ctx.priority,
        "truncated": out.truncated,
        "queue_time_s": out.queue_time_s,
        "preemptions": out.num_preemptions,
    }


def _full_response(ctx: _Ctx, out: RequestOutput) -> dict[str, Any]:
    if ctx.kind == "chat.completion":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "finish_reason": out.finish_reason,
            "logprobs": None,
        }
    else:
        choice = {
            "index": 0,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "logprobs": None,
        }
    return {
        "id": ctx.id,
        "object": ctx.kind,
        "created": ctx.created,
        "model": ctx.model,
        "choices": [choice],
        "usage": usage(out.num_prompt_tokens, out.num_output_tokens),
        "kvguard": _kvguard_ext(ctx, out),
    }


def _chunk(ctx: _Ctx, text: str | None, finish: str | None, first: bool) -> dict[str, Any]:
    if ctx.kind == "chat.completion":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {
        "id": ctx.id,
        "object": obj,
        "created": ctx.created,
        "model": ctx.model,
        "choices": [choice],
    }


def _sse_line(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(ctx: _Ctx, rid: str, outputs: _Outputs, include_usage: bool) -> AsyncIterator[str]:
    """Stream the engine's text deltas. The engine already holds back text that could still
    become part of a stop string, so every delta is final; a slow client gets several tokens'
    deltas coalesced into one chunk."""
    first, final = True, None
    try:
        while final is None:
            out = await outputs.get()
            if out.finished:
                final = out
            if out.new_text or first:
                yield _sse_line(_chunk(ctx, out.new_text, None, first))
                first = False
        end = _chunk(ctx, None, final.finish_reason, False)
        end["kvguard"] = _kvguard_ext(ctx, final)
        yield _sse_line(end)
        if include_usage:
            u = _chunk(ctx, None, None, False)
            u["choices"] = []
            u["usage"] = usage(final.num_prompt_tokens, final.num_output_tokens)
            yield _sse_line(u)
        yield "data: [DONE]\n\n"
    finally:
        if final is None:  # client went away mid-stream: free its blocks
            ctx.service.loop.abort(rid)
