"""POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /v1/models,
POST /tokenize and POST /detokenize."""

from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import copy
import dataclasses
import email.message
import json
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Container,
    Iterator,
    Mapping,
    Sequence,
)
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import APIRouter, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kvguard.daemon import tools
from kvguard.daemon.openai_schemas import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    new_id,
    now,
    usage,
)
from kvguard.engine.admission import AdmissionDecision
from kvguard.engine.admission_policy import AdmissionRejected
from kvguard.engine.engine_loop import OutputBuffer, RequestStream, wake_after_delivery
from kvguard.engine.llm_engine import NewRequest, refused_request
from kvguard.engine.model_config import ModelLoadError
from kvguard.engine.plural import counted
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.sequence import RequestOutput, TokenLogprob, parse_priority
from kvguard.engine.structured import compile_grammar, compile_schema
from kvguard.engine.tokenizer import ChatTemplateError, TemplateLayout

if TYPE_CHECKING:
    from kvguard.daemon.api_keys import ApiKey
    from kvguard.daemon.service import Service
    from kvguard.engine.tokenizer import Tokenizer

log = logging.getLogger("kvguard.daemon.api")
MAX_SEQUENCES = 256  # prompts x n of one request: each is a sequence of its own
# the engine says why it refused a request; the answer is the server's choice: the request
# itself cannot be served (400), the server is busy (429), or it has stopped taking work (503)
ADMISSION_STATUS = {"never_fits": 400, "overloaded": 429, "queue_full": 429, "halted": 503}
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code: a prompt over the context
TOKENIZE_LIMITS = 8  # /tokenize counts texts up to this many times max_model_len
# A request body larger than this is parsed, checked and rendered off the event loop, so that
# the requests being served, and /health, are not held up for the seconds a body of megabytes
# takes. The JSON decoder holds the interpreter while it runs (up to ~50 ms a MiB, every other
# thread waiting): such bodies are parsed one at a time, the next one no sooner than the last
# one took, so that the engine and the event loop have the interpreter half the time at least.
LARGE_BODY_BYTES = 64 << 10
RETRY_ELSEWHERE_S = 5  # Retry-After on a request cut off by the drain
SHUTTING_DOWN = "server is shutting down"  # what a request that came during the drain gets
STALLED_RETRY_S = 5.0  # Retry-After of a request refused while the engine loop is stalled
DRAIN_CUT_MESSAGE = (
    "kvguard is shutting down and cut this request off at the end of its drain period "
    "before it finished; retry it on another instance"
)


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
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.type_ = status, param, code, type_
        self.retry_after = retry_after
        # `x-should-retry`, which the openai clients obey over the status: False for a 5xx
        # that the same request meets every time (they retry any 500 twice, with backoff)
        self.should_retry = should_retry

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.type_, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        if self.should_retry is not None:
            headers["x-should-retry"] = "true" if self.should_retry else "false"
        if self.status == 401:  # RFC 9110: say which scheme would do
            headers["WWW-Authenticate"] = "Bearer"
        if self.status == 415 and self.param == "Content-Encoding":  # RFC 9110: what is served
            headers["Accept-Encoding"] = "identity"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def router(service: Service) -> APIRouter:
    """The OpenAI routes. Each takes a body of at most `api.max_request_bytes`; the caller's
    key is checked before the body is read."""
    limit = service.cfg.api.max_request_bytes

    class KeyedRoute(APIRoute):
        """A route that checks the caller's key before it reads the body (a dependency runs
        only after FastAPI has read and parsed it)."""

        body_limit = limit  # what a 413 names

        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handler = super().get_route_handler()
            field = getattr(self, "body_field", None)
            model = field.field_info.annotation if field is not None else None
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                model = None

            async def keyed(request: Request) -> Response:
                refused = authorize(service, request)
                if refused is not None:
                    return refused
                if model is not None:
                    await _parse_body(service, request, model, one_large)
                return await handler(request)

            return keyed

    one_large = asyncio.Semaphore(1)  # large bodies parsed at once (LARGE_BODY_BYTES)
    compiles = _Compiles()
    slots = _KeySlots()
    r = APIRouter(max_body_size=limit, route_class=KeyedRoute)

    def served() -> dict[str, Any]:
        return {
            "id": service.model_name,
            "object": "model",
            "created": service.started,
            "owned_by": "kvguard",
        }

    @r.api_route("/v1/models", methods=["GET", "HEAD"])  # HEAD: probes such as wget --spider
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [served()]}

    @r.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])  # ids may hold slashes
    async def model(model: str) -> dict[str, Any]:
        _check_model(service, model)
        return served()

    @r.post("/v1/completions")
    async def completions(
        body: CompletionRequest, request: Request, x_priority: str | None = Header(None)
    ) -> Any:
        prompts = _prompts(body.prompt)
        if len(prompts) * (body.n or 1) > MAX_SEQUENCES:
            raise _too_many_prompts(len(prompts), body.n)
        limit = body.max_tokens or _default_max_tokens(service, DEFAULT_COMPLETION_MAX_TOKENS)
        params = await _off_loop(request, _params, service, body, limit)
        return await _serve(
            service,
            compiles,
            slots,
            request,
            "text_completion",
            prompts,
            params,
            body,
            x_priority,
            True,
        )

    @r.post("/v1/chat/completions")
    async def chat(
        body: ChatCompletionRequest, request: Request, x_priority: str | None = Header(None)
    ) -> Any:
        if (problem := body.tool_problem()) is not None:
            raise ApiError(400, problem[1], problem[0])
        await _off_loop(request, _special_in_messages, service, body)
        msgs, params = await _off_loop(request, _chat_input, service, body)
        mode = body.tool_mode()
        schema = None  # a response_format schema under tools: checked on its own (a 400 names it)
        if mode is not None:  # the answer held to the call form (the tools are in `msgs`)
            fns, parallel = body.tool_functions(), body.parallel()
            # a response_format schema holds a text answer (`auto`) to JSON
            schema = params.json_schema
            tags = service.engine.tokenizer.text_tokens  # taken by id: tools._literal
            grammar = await _off_loop(request, tools.grammar, fns, mode, parallel, schema, tags)
            params = dataclasses.replace(params, json_schema=None, grammar=grammar)
        prompt = await _off_loop(request, _render_chat, service, msgs, _request_id(request))
        return await _serve(
            service,
            compiles,
            slots,
            request,
            "chat.completion",
            [prompt],
            params,
            body,
            x_priority,
            False,
            content_schema=schema,
        )

    @r.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        """The token ids a request would be served with: its count against the limit a
        prompt must stay under (max_model_len, or the KV pool's tokens if fewer)."""
        _check_model(service, body.model)
        tok = service.engine.tokenizer
        if body.messages is not None:
            if (problem := body.tool_problem()) is not None:
                raise ApiError(400, problem[1], problem[0])
            await _off_loop(request, _special_in_messages, service, body)
            msgs = await _off_loop(request, _chat_messages, body, tok.template_layout)
            text = await _off_loop(request, _render_chat, service, msgs, _request_id(request))
            special = bool(body.add_special_tokens)
        else:
            text, special = body.prompt or "", body.add_special_tokens is not False
        limit = service.engine.max_total_len()
        most = TOKENIZE_LIMITS * limit  # tokenizing holds the GIL: bounded, as add_request's
        ids, whole = await asyncio.to_thread(tok.encode_within, text, special, most)
        if not whole:
            raise ApiError(
                400,
                f"more than {most} tokens ({TOKENIZE_LIMITS}x max_model_len={limit}): "
                "/tokenize counts texts up to that",
                "messages" if body.messages is not None else "prompt",
            )
        return {"count": len(ids), "max_model_len": limit, "tokens": ids}

    @r.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        _check_model(service, body.model)
        vocab = service.engine.model_config.vocab_size
        bad = await _off_loop(request, _outside, body.tokens, vocab)
        if bad:
            raise ApiError(
                400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens"
            )
        tok = service.engine.tokenizer
        text = await asyncio.to_thread(tok.decode, body.tokens, False)
        return {"prompt": text}

    return r


def _check_model(service: Service, model: str) -> None:
    if model not in (service.model_name, service.engine_model):
        raise ApiError(
            404,
            f"model {model!r} does not exist; this server serves {service.model_name!r}",
            "model",
            "model_not_found",
        )


async def _parse_body(
    service: Service, request: Request, model: type[BaseModel], one_large: asyncio.Semaphore
) -> None:
    """Read a JSON body and validate it as `model`, as FastAPI would, but with its element
    counts bounded first (`_bounded`) and, for a body over LARGE_BODY_BYTES, off the event
    loop: FastAPI parses and validates on it, and a body of megabytes (a logit_bias of 900k
    entries, 500k messages, 5M token ids) held every other request, /health included, for
    seconds. The model is left where FastAPI's handler takes it (the request's parsed JSON:
    an instance of the model passes its validation as it is). A body that is not JSON, or
    empty, is left to FastAPI (a 415, or a 400 saying it is missing). A compressed body is
    refused before it is read (415): parsed as it is, gzip's bytes read as "not UTF-8 text",
    and another coding's as whatever they happened to spell."""
    # every Content-Encoding line, as one list (a proxy may have split it over lines)
    codings = [c.strip().lower() for v in request.headers.getlist("content-encoding")
               for c in v.split(",")]  # fmt: skip
    coding = ", ".join(c for c in codings if c not in ("", "identity"))
    if coding:
        raise ApiError(
            415,
            f"Content-Encoding {coding[:40]!r} is not served: send the body uncompressed",
            "Content-Encoding",
            "unsupported_content_encoding",
        )
    try:
        body = await request.body()
    except ClientDisconnect as e:  # as FastAPI answers it (nobody reads it)
        raise HTTPException(400, "There was an error parsing the body") from e
    request.state.large = len(body) > LARGE_BODY_BYTES
    if not body or not _is_json(request.headers.get("content-type")):
        return
    if request.state.large:
        await one_large.acquire()
        t0 = time.monotonic()
        try:
            parsed = await asyncio.to_thread(_validated, service, model, body)
        finally:  # the next one waits as long again: see LARGE_BODY_BYTES
            took = min(time.monotonic() - t0, 5.0)
            asyncio.get_running_loop().call_later(took, one_large.release)
    else:
        parsed = _validated(service, model, body)
    request._json = parsed  # what Request.json() returns to FastAPI's handler


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON (its rule)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _validated(service: Service, model: type[BaseModel], body: bytes) -> BaseModel:
    """`body` parsed and validated as `model`, failing as FastAPI does (RequestValidationError
    for invalid JSON or fields, HTTPException for a body its decoder cannot read)."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                 "input": {}, "ctx": {"error": e.msg}}  # fmt: skip
        raise RequestValidationError([error], body=e.doc) from e
    except Exception as e:  # noqa: BLE001 - nesting, encoding, huge integers: app.http_error
        raise HTTPException(400, "There was an error parsing the body") from e
    _bounded(service, model, data)
    try:
        return model.model_validate(data, from_attributes=True)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors, body=data) from None


def _bounded(service: Service, model: type[BaseModel], data: Any) -> None:
    """Refuse, before any per-element check, a body with more elements than a request can be
    served with: more logit_bias entries than the vocabulary has tokens; on completions more
    prompts than MAX_SEQUENCES or a token-id prompt too long for the context; on chat more
    messages than a prompt may have tokens (each renders to one at least), on /tokenize more
    than it counts, on /detokenize more ids than /tokenize gives back."""
    if not isinstance(data, dict):
        return
    tokens = data.get("tokens")
    if model is DetokenizeRequest and isinstance(tokens, list):
        most = TOKENIZE_LIMITS * service.engine.max_model_len
        if len(tokens) > most:
            raise ApiError(
                400,
                f"{len(tokens)} token ids: /detokenize takes at most {most} ({TOKENIZE_LIMITS}x "
                f"max_model_len={service.engine.max_model_len}, as many as /tokenize gives)",
                "tokens",
            )
    bias, vocab = data.get("logit_bias"), service.engine.biasable_ids()
    if isinstance(bias, dict) and len(bias) > vocab:
        raise ApiError(
            400,
            f"logit_bias has {len(bias)} entries: at most {vocab}, one per token id of the "
            f"vocabulary [0, {vocab})",
            "logit_bias",
        )
    limit = service.engine.max_total_len()
    prompt, messages = data.get("prompt"), data.get("messages")
    if model is CompletionRequest and isinstance(prompt, list) and prompt:
        if not isinstance(prompt[0], str | list):  # token ids: the engine's refusal, sooner
            several: list[tuple[int | None, list]] = [(None, prompt)]
        elif len(prompt) > MAX_SEQUENCES:
            n = data.get("n", 1)
            raise _too_many_prompts(len(prompt), n if type(n) is int or n is None else 1)
        else:
            several = [(k, p) for k, p in enumerate(prompt) if isinstance(p, list)]
        for k, ids in several:
            if len(ids) >= limit:
                name = "prompt" if k is None else f"prompt[{k}]"
                too_long = _named(service.engine._too_long(len(ids), limit), name)
                raise ApiError(400, too_long, name, CONTEXT_LENGTH_EXCEEDED)
    if not isinstance(messages, list):
        return
    if model is ChatCompletionRequest and len(messages) >= limit:
        raise ApiError(
            400,
            f"{len(messages)} messages are a prompt of at least {len(messages)} tokens (each "
            f"renders to one or more): a prompt must be shorter than {limit} tokens "
            "(max_model_len, or the KV pool's tokens if fewer)",
            "messages",
            CONTEXT_LENGTH_EXCEEDED,
        )
    if model is TokenizeRequest and len(messages) > TOKENIZE_LIMITS * limit:
        raise ApiError(
            400,
            f"more than {TOKENIZE_LIMITS * limit} tokens ({TOKENIZE_LIMITS}x "
            f"max_model_len={limit}): /tokenize counts texts up to that",
            "messages",
        )


def _named(message: str, name: str) -> str:
    """An engine's refusal of "prompt ..." naming the prompt of a list as the client wrote it
    (`prompt[2]`, `name`): in a batch of prompts, which one to shorten."""
    if name.startswith("prompt[") and message.startswith("prompt "):
        return name + message.removeprefix("prompt")
    return message


def _refused_prompt(body: Any, error: BaseException, n: int, completion: bool) -> str:
    """The field of the prompt the engine refused with `error`, as the client wrote it:
    `prompt[i]` for the i-th of a list of prompts (`n` choices each, one engine request per
    choice: `refused_request` names the choice), else `prompt`, or `messages` on chat."""
    if not completion:
        return "messages"
    if not _is_prompt_list(body.prompt) or not hasattr(error, "request_index"):
        return "prompt"  # a refusal that names none of the list's prompts: the field
    return f"prompt[{refused_request(error) // n}]"


def _too_many_prompts(count: int, n: int | None) -> ApiError:
    return ApiError(
        400,
        f"{count} prompts x n={n} choices: at most {MAX_SEQUENCES} sequences per request; "
        "send fewer prompts per request",
        "prompt",
    )


async def _off_loop(request: Request, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, on a worker thread for a request whose body was large (`_parse_body`):
    its work grows with the body (sampling parameters, messages, the chat template)."""
    if getattr(request.state, "large", False):
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _chat_input(
    service: Service, body: ChatCompletionRequest
) -> tuple[list[dict[str, str]], SamplingParams]:
    """A chat request's messages as its template takes them, and its sampling parameters."""
    limit = body.max_completion_tokens or body.max_tokens
    limit = limit or _default_max_tokens(service, DEFAULT_CHAT_MAX_TOKENS)
    layout = service.engine.tokenizer.template_layout
    return _chat_messages(body, layout), _params(service, body, limit)


def _sampling_defaults(service: Service) -> Mapping[str, float]:
    """The model's generation_config.json defaults for what a request leaves out (temperature,
    top_p, top_k, max_tokens: `LLMEngine.sampling_defaults`); none with
    `api.generation_config: none`."""
    if service.cfg.api.generation_config == "none":
        return {}
    return service.engine.sampling_defaults


def _default_max_tokens(service: Service, default: int) -> int:
    """A request's token limit where it sets none: the model's (its generation_config.json
    max_new_tokens, held to max_model_len), else `default`."""
    return int(_sampling_defaults(service).get("max_tokens", default))


def _chat_messages(
    body: ChatCompletionRequest | TokenizeRequest, layout: TemplateLayout
) -> list[dict[str, str]]:
    """A chat request's messages as its template takes them (`layout`: where a system
    message's text and the tools go, whether tool results and the user message after them
    are one turn), its tools described where any are in play (/tokenize counts them so too).
    The system message is placed alike with tools and without (`tools.system_folded`)."""
    return _laid_out(body, layout, _for_template(body.messages or ()), tools.with_tools)


def _laid_out(
    body: ChatCompletionRequest | TokenizeRequest,
    layout: TemplateLayout,
    msgs: list[dict[str, Any]],
    described: Callable[..., list[dict[str, Any]]],
) -> list[dict[str, Any]]:
    """The request's messages `msgs` (texts as strings or as pieces) put as `layout` takes
    them, the tools described by `described` (`tools.with_tools` or `with_tools_pieces`):
    one walk for the prompt's texts and the special-token check's pieces, so that the check
    reads the prompt as the template is given it."""
    if not layout.user_after_user:
        msgs = tools.user_turns_joined(msgs, _sent_roles(body))
    mode = body.tool_mode()
    if mode is not None:
        return described(msgs, body.tool_functions(), mode, body.parallel(), layout)
    if not layout.system:
        return tools.system_folded(msgs)
    return msgs


def _sent_roles(body: ChatCompletionRequest | TokenizeRequest) -> list[str]:
    """The role each of the request's messages was sent with (a tool result's is "tool")."""
    return [m.role for m in body.messages or ()]


def _for_template(messages: Sequence[Any]) -> list[dict[str, str]]:
    return [m.for_template() for m in messages]


def _special_in_messages(service: Service, body: ChatCompletionRequest | TokenizeRequest) -> None:
    """With `api.special_tokens_in_messages: refuse`, a 400 for a request whose messages or
    tools write a special token's text into the prompt: the rendered prompt is encoded with
    special tokens matched (as the chat template's own markers must be), so a user's
    `<|im_end|>` would close its turn and a `<|im_start|>system` open a forged one. The texts
    are checked as the template is given them, whatever the role: content with its text parts
    joined (a token split over two parts is whole there), name, tool calls with their
    arguments written anew (`\\u003c` is `<` there), and the tools described in the system
    message. A hit that touches no field is kvguard's own (`<tool_call>` is a special token
    of some tokenizers); the template's own text around the messages is not checked."""
    if service.cfg.api.special_tokens_in_messages != "refuse" or not body.messages:
        return
    found = _special_tokens(service.engine.tokenizer)[1]
    if found is None:  # the tokenizer has none
        return
    for message in _template_pieces(body, service.engine.tokenizer.template_layout):
        for key in ("name", "content"):
            hit = _field_hit(found, message.get(key, ()))
            if hit is not None:
                raise _special_in_message(*hit)


def _template_pieces(
    body: ChatCompletionRequest | TokenizeRequest, layout: TemplateLayout
) -> list[dict[str, Any]]:
    """`_chat_messages` with the texts as pieces marked with their fields."""
    msgs = [m.template_pieces(f"messages[{i}]") for i, m in enumerate(body.messages or ())]
    return _laid_out(body, layout, msgs, tools.with_tools_pieces)


def _field_hit(
    found: re.Pattern[str], pieces: Sequence[tools.Piece]
) -> tuple[re.Match[str], list[tuple[tools.Piece, int]]] | None:
    """The first special token's text in the joined pieces that a request field is part of,
    and the field pieces it spans, each with where it starts in the text. The hits come in
    order, so the pieces are walked once, however many hits are kvguard's own."""
    k = start = 0  # the piece the walk is at, and where it starts
    for hit in found.finditer(tools.joined(pieces)):
        while start + len(pieces[k].text) <= hit.start():
            start += len(pieces[k].text)
            k += 1
        spanned, j, at = [], k, start
        while at < hit.end():
            if pieces[j].field is not None and pieces[j].text:
                spanned.append((pieces[j], at))
            at += len(pieces[j].text)
            j += 1
        if spanned:
            return hit, spanned
    return None


def _special_in_message(hit: re.Match[str], spanned: list[tuple[tools.Piece, int]]) -> ApiError:
    """The 400 for a special token's text that touches the fields `spanned`: it names the one
    field holding them all (`messages[0].content` for two of its text parts)."""
    fields = list(dict.fromkeys(str(p.field) for p, _ in spanned))
    piece, at = spanned[0]
    if len(spanned) > 1:
        where = f"across {' and '.join(fields)}, as the prompt joins them"
    elif not at <= hit.start() <= hit.end() <= at + len(piece.text):
        where = "where the prompt writes it next to kvguard's own text"
    elif not piece.as_sent:
        where = "in the JSON the prompt writes of it (its escapes read: \\u003c is <)"
    else:
        where = f"(at character {hit.start() - at})"
    param = _enclosing(fields)
    return ApiError(
        400,
        f"{param} holds the special token {hit.group()!r} {where}: this server refuses control "
        "tokens written in messages and tools (api.special_tokens_in_messages: refuse); the "
        "chat template would read it as one: leave it out",
        param,
        "special_token_in_message",
    )


def _enclosing(fields: list[str]) -> str:
    """The field holding all of `fields`: their longest common path."""
    paths = [re.findall(r"\[\d+\]|[^.[]+", f) for f in fields]
    common = paths[0]
    for path in paths[1:]:
        same = [a == b for a, b in zip(common, path, strict=False)]
        common = common[: same.index(False) if False in same else len(same)]
    dotted = "".join(c if c.startswith("[") else "." + c for c in common)
    return dotted.removeprefix(".") or "messages"


def _outside(tokens: list[int], vocab: int) -> list[int]:
    return [t for t in tokens if t >= vocab]


def _request_id(request: Request) -> str | None:
    """The request's `x-request-id` (app.RequestIds), for the log lines about its answer."""
    return getattr(request.state, "request_id", None)


def _render_chat(service: Service, msgs: list[dict[str, str]], request_id: str | None) -> str:
    tok = service.engine.tokenizer
    try:
        return tok.apply_chat_template(msgs, add_generation_prompt=True)
    except ChatTemplateError as e:  # the template fails on its own bug: the server's fault
        raise _template_broken(
            tok,
            e,
            request_id,
            "its operator must fix the template (a template refuses "
            "messages with raise_exception, answered 400)",
        ) from e
    except ModelLoadError as e:  # the model's template does not compile: the server's fault
        raise _template_broken(
            tok, e, request_id, "whatever the messages; the daemon log said so at start"
        ) from e
    except Exception as e:  # noqa: BLE001 - a template error is the request's fault
        raise ApiError(
            400, f"messages cannot be rendered by the chat template: {e}", "messages"
        ) from e


# distinct chat template failures logged, per tokenizer (a reload's model starts afresh): each
# once, as the same failure comes back with every request that meets it; at most this many
TEMPLATE_FAILURES_LOGGED = 32
_template_failures: weakref.WeakKeyDictionary[Tokenizer, set[str]] = weakref.WeakKeyDictionary()
_template_failures_lock = threading.Lock()  # rendered on worker threads too (_off_loop)


def _template_broken(
    tok: Tokenizer, error: ModelLoadError, request_id: str | None, remedy: str
) -> ApiError:
    """The 500 of a chat template failing on its own, the same for every request that meets
    it: logged once per distinct failure (the template's file and the error, and the first
    request's x-request-id, so a client quoting it is found), answered with `x-should-retry:
    false` (the openai client would send it twice more, for the same 500) and without the
    host's paths (the log has them)."""
    if _first_template_failure(tok, str(error)):
        log.error(
            "request %s answered 500 chat_template_error: %s (logged once per distinct failure)",
            request_id,
            error,
        )
    return ApiError(
        500,
        f"this server's chat template is broken: {_without_paths(str(error), tok)}; {remedy}",
        code="chat_template_error",
        type_="server_error",
        should_retry=False,
    )


def _first_template_failure(tok: Tokenizer, message: str) -> bool:
    """Whether `message` is new for `tok` (then remembered), up to TEMPLATE_FAILURES_LOGGED."""
    with _template_failures_lock:
        seen = _template_failures.setdefault(tok, set())
        if message in seen or len(seen) > TEMPLATE_FAILURES_LOGGED:
            return False
        seen.add(message)
        if len(seen) <= TEMPLATE_FAILURES_LOGGED:
            return True
    log.error(
        "more than %d distinct chat template failures: the next are not logged (their "
        "answers are still 500 chat_template_error); fix the template in %s and reload",
        TEMPLATE_FAILURES_LOGGED,
        tok.template_source,
    )
    return False


def _without_paths(message: str, tok: Tokenizer) -> str:
    """`message` with the template's folder left out (`chat_template.jinja`, not where the
    host keeps the model): a client is told what is broken, the log where."""
    folder = os.path.dirname(tok.template_source.split(" (", 1)[0])
    return message.replace(folder + os.sep, "") if folder else message


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A completions request's prompts: one string or token-id list, or a list of them."""
    if isinstance(prompt, str):
        return [prompt]
    if _is_prompt_list(prompt):
        return list(prompt)
    return [list(prompt)]


def _is_prompt_list(prompt: Any) -> bool:
    """Whether a completions request's `prompt` is a list of prompts (strings or token-id
    lists), not one prompt."""
    return (
        isinstance(prompt, list) and bool(prompt) and all(isinstance(p, str | list) for p in prompt)
    )


def _logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives each token's log-probability comes with; None: not asked."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    if body.logprobs is not None and body.echo and body.stream:
        raise ApiError(
            400,
            "logprobs with echo: the prompt's log-probabilities are not streamed; "
            "send stream: false (or echo: false)",
            "logprobs",
        )
    return body.logprobs


def _params(
    service: Service, body: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> SamplingParams:
    logprobs = _logprobs(body)
    tok = service.engine.tokenizer
    stop, stop_ids = _stops(tok, body.stop_list(), body.stop_token_ids or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            **body.sampling(_sampling_defaults(service)),
            seed=body.seed,
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=logprobs if getattr(body, "echo", False) else None,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=body.logit_bias or {},
            json_schema=None
            if body.response_format is None
            else body.response_format.engine_schema(),
        )
    except ValueError as e:  # "stop=['']: ..." names its field first
        field = str(e).split("=", 1)[0]
        raise ApiError(400, str(e), field if field.isidentifier() else None) from e


def _stops(tok: Tokenizer, stop: list[str], ids: list[int]) -> tuple[list[str], list[int]]:
    """A request's stop strings and stop token ids, where a stop string that is exactly a
    special token's text (`<|endoftext|>`) becomes that token's id: an answer's text leaves
    special tokens out, so no string could ever match one. The answer ends at the token as at
    a stop string, `stop`, its text not in the answer."""
    if not stop:
        return stop, ids
    special = _special_tokens(tok)[0]
    mapped = [special[s] for s in stop if s in special]
    if not mapped:
        return stop, ids
    return [s for s in stop if s not in special], list(dict.fromkeys([*ids, *mapped]))


# tokenizer -> its special tokens (text -> id) and a pattern finding any of their texts
_SPECIAL: weakref.WeakKeyDictionary[Tokenizer, tuple[dict[str, int], re.Pattern[str] | None]] = (
    weakref.WeakKeyDictionary()
)
_SPECIAL_LOCK = threading.Lock()  # the event loop and off-loop workers both read it


def _special_tokens(tok: Tokenizer) -> tuple[dict[str, int], re.Pattern[str] | None]:
    """The tokenizer's special tokens, text -> id (its added tokens marked special: those an
    answer's text leaves out, and which encoding a text makes of their text wherever it is
    written), and a pattern finding the first of their texts, longest first (None: it has
    none). Worked out once per tokenizer, from its backend's added tokens (microseconds;
    parsing its JSON took 0.14 s of the event loop for SmolLM2's)."""
    with _SPECIAL_LOCK:
        known = _SPECIAL.get(tok)
        if known is None:
            texts = tok.special_token_ids()
            ordered = sorted(texts, key=len, reverse=True)
            pattern = re.compile("|".join(map(re.escape, ordered))) if texts else None
            known = _SPECIAL[tok] = (texts, pattern)
    return known


def authorize(service: Service, request: Request) -> Response | None:
    """Check the caller's key: the refusal to send, or None with the key (None: no keys are
    checked) in `request.state.api_key`."""
    try:
        request.state.api_key = _api_key(service, request.headers.get("authorization"))
    except ApiError as e:
        return e.response()
    return None


def _api_key(service: Service, authorization: str | None) -> ApiKey | None:
    """The caller's key (None: the daemon checks no keys); 401 without a known one."""
    keys = service.api_keys
    if keys is None:
        return None
    scheme, _, given = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise _unauthorized(
            service, "missing", "missing API key: send it as the header Authorization: Bearer <key>"
        )
    key = keys.find(given.strip())
    if key is None:
        raise _unauthorized(service, "unknown", "incorrect API key provided")
    return key


def _unauthorized(service: Service, reason: str, message: str) -> ApiError:
    service.metrics.auth_failures.labels(reason).inc()
    return ApiError(401, message, code="invalid_api_key", type_="authentication_error")


def _refused_for_key(service: Service, key: ApiKey, reason: str) -> None:
    """Count a known key's refusal, by reason and by key: "which tenant gets the 429s" is in
    /metrics. Not logged: the counter answers it, and a line per refusal would let any key
    holder write to the log as fast as it can send."""
    service.metrics.auth_failures.labels(reason).inc()
    service.metrics.api_key_refusals.labels(key.name, reason).inc()


def _within_limit(
    service: Service, key: ApiKey, asked: int, param: str, priority: str, held: int
) -> None:
    """429 when `asked` more sequences would take `key` past its max_requests. What it has
    in flight is what the daemon still answers for it (the drain's set, which a finished or
    refused request leaves at once and a forgotten one when it is collected) less the choices
    the engine has finished (`_Outputs.engine_done`: a streamed answer stays in that set until
    its client has read it, and a client that stopped reading locked its key out with nothing
    queued or running), and the `held`
    sequences of its requests checked but not yet in that set (`_KeySlots`: their grammar
    being compiled, the tokenizer view built for their log-probabilities). A request
    asking for more sequences than the key may ever have at once is the request's own fault,
    not a passing one: 400 naming `param`, with no Retry-After (a retry could never pass).
    While admission is halted for `priority`, what fills the key's slots may be requests
    waiting for the engine to refuse them too: a request past the limit then gets the halt's
    503 and Retry-After, not a 429 blaming its key (`_refuse_if_halted`)."""
    if key.max_requests is None:
        return
    if asked > key.max_requests:
        _refused_for_key(service, key, "max_requests")
        raise ApiError(
            400,
            f"this request asks for {counted(asked, 'sequence')} and API key {key.name!r} may have "
            f"{key.max_requests} at once (max_requests): it can never be served; ask for "
            "fewer choices or prompts",
            param,
            code="key_request_limit",
        )
    live = sum(1 for o in list(service.requests) if o.ctx.key == key.name and not o.engine_done)
    live += held
    if live + asked > key.max_requests:
        _refuse_if_halted(service, priority, asked)
        _refused_for_key(service, key, "max_requests")
        raise ApiError(
            429,
            f"API key {key.name!r} has {counted(live, 'sequence')} "
            f"({'choice' if live == 1 else 'choices'}) queued or running and may have "
            f"{key.max_requests} at once (max_requests); this one asks for {asked}",
            code="key_request_limit",
            type_="rate_limit_error",
            retry_after=1,
        )


def _refuse_if_halted(service: Service, priority: str, asked: int) -> None:
    """The halt's 503 (as the engine gives it, counted as its `asked` rejects) where admission
    is halted for `priority`, before the request reaches the engine."""
    policy = service.engine.admission_policy
    halted = policy.halted(parse_priority(priority))
    if halted is None:
        return
    service.loop.call(lambda: policy.count_refused(asked))  # the engine thread's counter
    raise _admission_error(halted, None)


def _admission_error(d: AdmissionDecision, param: str | None) -> ApiError:
    """Admission's refusal `d` as the API answers it: 400 for what can never be served
    (`param` the field that asked), else retry later with its Retry-After."""
    status = ADMISSION_STATUS.get(d.kind, 503)
    return ApiError(
        status,
        d.reason,
        param,
        code="admission_rejected",
        type_="invalid_request_error" if status == 400 else "overloaded_error",
        retry_after=None if status == 400 else d.estimated_wait_s,
    )


def _priority(service: Service, body: Any, header: str | None, key: ApiKey | None) -> str:
    asked = body.priority or (header.strip().lower() if header else None)
    p = asked or (key.default_priority if key is not None else "normal")
    if p not in ("high", "normal", "low"):
        raise ApiError(400, f"priority {p!r}: expected high, normal or low", "priority")
    if key is not None and not key.allows(p):
        _refused_for_key(service, key, "priority")
        raise ApiError(
            403,
            f"priority {p}: API key {key.name!r} may ask for {key.max_priority} priority at most",
            "priority",
            code="priority_not_allowed",
            type_="permission_error",
        )
    return p


async def _serve(
    service: Service,
    compiles: _Compiles,
    slots: _KeySlots,
    request: Request,
    kind: str,
    prompts: list[str | list[int]],
    params: SamplingParams,
    body: Any,
    x_priority: str | None,
    completion: bool,
    content_schema: dict[str, Any] | None = None,
) -> Any:
    _check_model(service, body.model)
    key = getattr(request.state, "api_key", None)
    priority = _priority(service, body, x_priority, key)
    if service.loop.fatal is not None:
        raise engine_unavailable(service.loop.fatal)
    _refuse_if_draining(service)
    _refuse_if_stalled(service, len(prompts) * (body.n or 1))
    # from its arrival (the HTTP middleware's time): TTFT and duration take in the body's
    # parsing and the grammar prepared below, which can take seconds for a big schema
    arrived = getattr(request.state, "arrived", None)
    ctx = _Ctx(service, kind, body.model, priority, arrived or time.monotonic(), params)
    # the answer's x-request-id from now (app.RequestIds), a stream's and an error's too: the
    # id the engine's log lines name its choices by (`<id>-<index>`), a failed step's traceback
    request.state.completion_id = ctx.id
    ctx.n = body.n or 1
    asked = len(prompts) * ctx.n
    if key is not None:  # before the grammar: a key's flood is refused at once, not compiled
        _within_limit(service, key, asked, _size_param(ctx), priority, slots.held(key.name))
        ctx.key = key.name
    # the key's slots taken in the step that checked them, until `service.requests` counts it
    with slots.holding(ctx.key, asked):
        await _prepared(service, compiles, request, params, content_schema)
        ctx.echo = prompts if getattr(body, "echo", False) else None
        ctx.tools = params.grammar is not None
        if kind == "chat.completion" and not (body.max_tokens or body.max_completion_tokens):
            ctx.max_tokens_default = params.max_tokens  # said with the answer
        aio = asyncio.get_running_loop()
        outs = [_Outputs(aio, ctx, i, bool(body.stream)) for i in range(asked)]
        choices = [  # one engine request per choice, in order, taken in as one
            NewRequest(
                prompts[i // ctx.n],
                _choice_params(params, i % ctx.n),
                engine_request_id(ctx.id, i),
                count_prompt=i % ctx.n == 0,  # a prompt counted once, as usage has it
            )
            for i in range(len(outs))
        ]
        _refuse_if_stalled(service, asked)  # it may have stalled while the grammar compiled
        _refuse_past_queue(service, asked, priority)  # in the event-loop step that posts it
        ctx.posted = time.monotonic()  # its queue time runs from here (the engine's arrival)
        streams, added = service.loop.submit_all_nowait(
            choices, [o.push for o in outs], priority, add_special_tokens=completion
        )
        service.requests.update(outs)  # a drain that runs out of time cuts it through this set
    watch = _DisconnectWatch(request, service, streams, outs)  # from now, not once admitted
    admitted = False
    try:
        await _admission(added, outs[0])
        admitted = True
    except RequestCut as e:  # the drain ran out while the engine had not yet taken it in
        raise _cut_error(service, None, str(e)) from None
    except ClientGone:  # it hung up before the engine took it in: nobody reads this answer
        raise ApiError(499, "client disconnected") from None
    except AdmissionRejected as e:
        d = e.decision
        if d.kind == "never_fits" and d.about == "prompt":
            # a prompt past the KV its priority may use: too long for the context, as a prompt
            # past max_model_len is (the reason says which priority's share would hold it)
            name = _refused_prompt(body, e, ctx.n, completion)
            raise ApiError(400, _named(d.reason, name), name, CONTEXT_LENGTH_EXCEEDED) from e
        param = None  # a max_tokens past the KV (dynamic_max_tokens off): the field that asked
        if d.kind == "never_fits" and d.about == "max_tokens":
            asked_by = getattr(body, "max_completion_tokens", None) is not None and not completion
            param = "max_completion_tokens" if asked_by else "max_tokens"
        elif d.kind == "never_fits" and d.about == "n":  # more sequences than can ever queue
            param = _size_param(ctx)
        raise _admission_error(d, param) from e
    except ValueError as e:  # the engine's reason names its field first ("logit_bias token ...")
        name = str(e).split(" ", 1)[0].split("=", 1)[0].rstrip(":")
        name = "response_format" if name == "json_schema" else name
        if name not in type(body).model_fields:  # the prompt: chat's is its rendered messages
            name = "prompt" if completion else "messages"
        # a prompt too long for the context (engine._too_long): OpenAI's code for it
        code = CONTEXT_LENGTH_EXCEEDED if str(e).startswith("prompt of ") else None
        if name in ("prompt", "messages"):  # which of a list of prompts: too long, empty, ...
            name = _refused_prompt(body, e, ctx.n, completion)
        raise ApiError(400, _named(str(e), name), name, code) from e
    finally:
        # not answered from here: one taken in meanwhile (its client gone, cut) ends; one refused
        # held nothing
        if not admitted:
            watch.stop()
            for stream, outputs in zip(streams, outs, strict=True):
                service.loop.abort_stream(stream)
                service.requests.discard(outputs)
    if key is not None:  # taken in: a request served, for its key's charge-back
        service.metrics.api_requests.labels(key.name).inc()
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return _ClosingStreamingResponse(
            _sse(ctx, streams, outs, watch, include_usage), media_type="text/event-stream"
        )
    finals = await _wait_final(service, streams, outs, watch)
    return _full_response(ctx, finals)


def grammar_workers() -> int:
    """Grammar compiles run at once: half the CPUs this process may use, at least one; the
    rest are the engine's and the event loop's (six compiles at once on a 2-CPU host took a
    2-token completion from 0.2 s to 20 s)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // 2)


class _KeySlots:
    """The sequences of each API key's requests that passed its max_requests check and are not
    yet in `service.requests`, where the check counts them: they await their grammar's compile
    or the tokenizer view first. Taken in the event-loop step that checked them and held across
    those awaits, they count against the key as the engine's do: counted only once the request
    was in that set, 6 requests of a key that may have 1 at once were all checked meanwhile,
    and all 6 served."""

    def __init__(self) -> None:
        self._held: collections.Counter[str] = collections.Counter()  # the event loop's

    def held(self, key: str) -> int:
        """The sequences of `key`'s requests checked and not yet in `service.requests`."""
        return self._held[key]

    @contextlib.contextmanager
    def holding(self, key: str | None, asked: int) -> Iterator[None]:
        """`asked` sequences held for `key` (None: no key, nothing held) until the block ends,
        however it ends: in `service.requests`, a 400, a client gone, the drain, a cancel."""
        if key is None:
            yield
            return
        self._held[key] += asked
        try:
            yield
        finally:
            self._held[key] -= asked
            if not self._held[key]:
                del self._held[key]


async def _prepared(
    service: Service,
    compiles: _Compiles,
    request: Request,
    params: SamplingParams,
    content_schema: dict[str, Any] | None,
) -> None:
    """What the engine thread should not build for the request, built before it is posted:
    its schema or tools grammar (`_Compiles`), or for log-probabilities alone the grammar
    library's tokenizer view (their tokens' bytes), built once, neither on the engine's thread
    nor on the event loop. Refused if the drain began meanwhile: not admitted after it."""
    if params.json_schema is not None or params.grammar is not None:
        await compiles.ready(service, request, params, content_schema)
    elif params.logprobs is not None or params.prompt_logprobs is not None:
        await asyncio.to_thread(service.engine.grammars.view)
    else:
        return
    _refuse_if_draining(service)


class _Compiles:
    """Grammar preparation (`_grammar_ready`) on worker threads of its own, `grammar_workers()`
    at once, a request past them waiting its turn. On asyncio's default executor, one client's
    slow schemas (a nested `anyOf` the library gives up on after seconds of CPU) held every
    thread that a reload, /tokenize and large bodies wait for: a reload took 8.6 s."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None  # made by the first compile

    def _workers(self, service: Service) -> ThreadPoolExecutor:
        """The pool, made by the first compile and shut down as `service` closes."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(grammar_workers(), thread_name_prefix="kvguard-grammar")
            service.at_close(self.close)
        return self._pool

    def close(self) -> None:
        """With the service: the compiles still queued never run, and the workers end once the
        compiles running (which nothing can interrupt) are done. Left open, the interpreter's
        exit waited for every worker, and a stop that had used its drain time could be killed."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def ready(
        self,
        service: Service,
        request: Request,
        params: SamplingParams,
        content_schema: dict[str, Any] | None,
    ) -> None:
        """`_grammar_job` on a worker, unless the matcher is kept already. That probe (a dict
        lookup and the schema's json.dumps) runs on the event loop, or for a large body on a
        thread (`_off_loop`): a hop to the default executor for every schema waited behind
        the reloads and large bodies this pool keeps off it."""
        kept = content_schema is None and await _off_loop(
            request, service.engine.grammars.prepared, params
        )
        if kept:
            return  # its matcher is kept: no compile, no turn behind other clients' schemas
        _refuse_if_draining(service)  # the pool is shut down with the service
        pool = self._workers(service)
        await _compiled(request, pool.submit(_grammar_job, service, params, content_schema))


async def _compiled(request: Request, job: Future) -> None:
    """Wait for the grammar's `job` or for the client to hang up (a 499: nobody reads the
    answer). A job still waiting for a worker is then withdrawn: a client that gave up on its
    slow schema had it compiled all the same, in front of every other client's schemas, one
    worker on a 2-CPU host. One already running finishes (nothing can interrupt it)."""
    compiled = asyncio.wrap_future(job)
    compiled.add_done_callback(_retrieved)  # a 400 of a job whose client left: read by no one
    left = asyncio.ensure_future(_hung_up(request))
    try:
        await asyncio.wait({compiled, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        job.cancel()  # not started yet (its client gone, this handler cancelled): never runs
    if not compiled.done():
        raise ApiError(499, "client disconnected")
    if compiled.cancelled():  # withdrawn by the pool's shutdown: the service has closed
        raise shutting_down()
    compiled.result()


async def _hung_up(request: Request) -> None:
    """Returns once the client of `request`, whose body has been read, hangs up: nothing but a
    disconnect should come on its receive channel, and one that fails has lost its client."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - see above
        log.debug("receive failed; taking the client as gone")


def _grammar_job(
    service: Service, params: SamplingParams, content_schema: dict[str, Any] | None
) -> None:
    """`_grammar_ready`, unless the drain began while the request waited for a worker (one
    it refuses anyway costs no compile, and a queue of slow schemas does not hold the exit;
    one whose client left meanwhile is withdrawn before it starts: `_compiled`).
    A chat request's response_format schema under tools is checked first, on its own, so that
    a 400 names it rather than `tools`."""
    _refuse_if_draining(service)
    if content_schema is not None:
        _servable(content_schema, None)
    _grammar_ready(service, params)


def _grammar_ready(service: Service, params: SamplingParams) -> None:
    """Off the event loop and the engine thread (a large schema takes a second to compile and
    half a second to build a matcher for, the tokenizer view 0.3 s to build once): the
    request's schema or tools grammar compiled, refused with a 400 naming its field when the
    grammar library cannot serve it, the view built, and the matcher its choices copy built."""
    _servable(params.json_schema, params.grammar)
    grammars = service.engine.grammars
    grammars.view()
    if params.json_schema is None and params.grammar is None:
        return  # log-probabilities only: the view is all they need
    try:
        grammars.prepare(params)
    except ValueError as e:
        field = "tools" if params.grammar is not None else "response_format"
        raise ApiError(400, f"{field}: {str(e).split(': ', 1)[-1]}", field) from e


def _servable(schema: dict[str, Any] | None, grammar: str | None) -> None:
    """A 400 naming `response_format` (a schema) or `tools` (a chat request's tools grammar)
    when the grammar library cannot serve it."""
    try:
        if grammar is not None:
            compile_grammar(grammar)
        elif schema is not None:
            compile_schema(schema)
    except ValueError as e:
        field = "tools" if grammar is not None else "response_format"
        raise ApiError(400, f"{field}: {str(e).split(': ', 1)[-1]}", field) from e


def shutting_down() -> ApiError:
    """The answer to a request that came once the stop began: 503 `shutting_down`, as the
    admin API's, a code a client can branch on (retry on another replica)."""
    return ApiError(
        503, SHUTTING_DOWN, code="shutting_down", type_="service_unavailable", retry_after=5
    )


def _refuse_if_draining(service: Service) -> None:
    if service.draining:
        raise shutting_down()


def _refuse_if_stalled(service: Service, asked: int) -> None:
    """503 `engine_stalled` while the engine loop has not beaten for the stall threshold (as
    `/ready` says): posted, the request would wait for a step that may never come, and a
    stalled engine refused nothing, so its connections piled up without bound. Its `asked`
    choices count as admission's rejects (`engine_stalled`)."""
    stalled = service.stalled_s()
    if stalled is not None:
        service.metrics.api_rejects["engine_stalled"] += asked
        raise ApiError(
            503,
            f"the engine loop has not made progress for {stalled:.0f}s (stalled): new requests "
            "are refused until it does; retry later or on another replica",
            code="engine_stalled",
            type_="service_unavailable",
            retry_after=STALLED_RETRY_S,
        )


def _refuse_past_queue(service: Service, asked: int, priority: str) -> None:
    """Admission's 429 at once, in the event-loop step that would post the request, where
    its queue bound would refuse it behind the queue the engine last published and the
    requests posted before it but not yet taken in (`AdmissionPolicy.refuse_posted`): the
    engine decides only as it takes requests in, so a stalled engine thread held every
    request posted to it and refused none. Its `asked` choices count as admission's rejects
    (`queue_full`)."""
    d = service.engine.admission_policy.refuse_posted(
        parse_priority(priority), service.loop.posted(high=priority == "high"), asked
    )
    if d is not None:
        service.metrics.api_rejects["queue_full"] += asked
        raise _admission_error(d, None)


async def _admission(fut: Future, outputs: _Outputs) -> None:
    """Wait until the engine has taken in the request's choices, all of them as one (raising
    what `add_requests` raised), or raise RequestCut once the drain cuts the request,
    ClientGone once its client hangs up: the engine may be stalled (a long step, a KV pool
    resize), and neither a cut nor a client gone should wait for it. The caller's finally
    then gives the API key's slots back at once, instead of refusing the key's next requests
    until the engine takes and aborts this one."""
    cut = asyncio.ensure_future(outputs.was_cut.wait())
    left = asyncio.ensure_future(outputs.left.wait())
    try:
        added = asyncio.wrap_future(fut)
        await asyncio.wait({added, cut, left}, return_when=asyncio.FIRST_COMPLETED)
        if not added.done():
            # withdrawn if the engine has not taken it yet (never started); if it has, the
            # abort in the caller's finally (and the watch's) ends it
            added.cancel()
            if outputs.cut_message is not None:
                raise RequestCut(outputs.cut_message)
            raise ClientGone
        added.result()
    finally:
        cut.cancel()
        left.cancel()


def engine_request_id(response_id: str, index: int) -> str:
    """The engine's id for choice `index` of the response `response_id`: the ids in engine
    events, logs and the audit log (an OOM's requeued requests, an eviction's) are then ones
    the client holds, not a counter that starts again at every start. Unique: the response id
    is random and the daemon takes no request id from the client."""
    return f"{response_id}-{index}"


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s parameters: a seeded request's choices draw with seeds seed,
    seed + 1, ... (each reproducible, and not all the same sample). A copy, not validated
    again: its logit_bias, checked when the params were made, is shared read-only
    (`CheckedBias`), so the engine's validation of each choice is O(1) in its size (it was
    22 ms a choice for a bias on every token of a 49k vocabulary, 0.7 s of the engine thread
    for 32 choices)."""
    if index == 0 or params.seed is None:
        return params
    choice = copy.copy(params)
    choice.seed = params.seed + index
    return choice


def _size_param(ctx: _Ctx) -> str:
    """The field that asked for a request's sequences: `n`, or `prompt` (a list of prompts)."""
    return "n" if ctx.n > 1 else "prompt"


def _utf8_decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def _echo_offsets(text: str, tokens: list[bytes], added: Container[int]) -> list[int]:
    """Each of an echoed prompt's tokens' offset in its `text` (the prompt as sent, or a token
    prompt's decoding): the character its first byte begins or continues, as `_text_at` finds
    it for an answer's tokens, counted where the text has got to. The tokens' bytes are
    decoded as the text was, so bytes that make no whole character (a token prompt cut
    inside one, a stray byte) are the text's U+FFFD. A token whose characters are a space and
    then the text's there holds a space its tokenizer put before a piece of text
    (SentencePiece's, before each piece: at the start, after a special token), which the text
    does not: it starts at the text's next character. The tokens in `added` (a BOS the
    tokenizer added) take no room; a token the text does not hold where expected (it should
    not happen) takes its characters' room."""
    utf8, made, at = _utf8_decoder(), 0, 0
    chars = _utf8_decoder()  # the same decoding, for the characters each token completes
    out = []
    for k, raw in enumerate(tokens):
        if k in added:
            out.append(at)
            continue
        place, made_now = _text_at(utf8, made, raw)
        own, into = chars.decode(raw), place - made  # its characters, and its own among them
        made = made_now
        spaced = own[:1] == " " and into == 0 and not text.startswith(own, at)
        if spaced and text.startswith(own[1:], at):
            own = own[1:]  # a space the text does not hold: it starts at the next one
        out.append(at + into)
        at += len(own)
    return out


def _text_at(utf8: codecs.IncrementalDecoder, made: int, raw: bytes) -> tuple[int, int]:
    """Where a token of bytes `raw` is in a text of which `utf8` has made `made` characters:
    the character its first byte begins or continues (a byte that ends a character, or is
    replaced, is in the last one it makes; one still pending begins the next), and how many
    characters the text has with it."""
    head = utf8.decode(raw[:1])
    pending = bool(utf8.getstate()[0]) or not raw
    return made + len(head) - (0 if pending else 1), made + len(head) + len(utf8.decode(raw[1:]))


# tokenizer -> the ids its post-processor adds before a text's and after them
_ADDED: weakref.WeakKeyDictionary[Tokenizer, tuple[list[int], list[int]]] = (
    weakref.WeakKeyDictionary()
)


def _added_around(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids a tokenizer adds before a text's own and after them (a BOS; an end token), as
    the engine encodes a completion's prompt (add_special_tokens): found by encoding a probe
    text with and without them, the same for every text (a post-processor's template)."""
    known = _ADDED.get(tok)
    if known is None:
        probe = "a"
        own, full = tok.encode(probe, False), tok.encode(probe, True)
        known = ([], [])
        for i in range(len(full) - len(own) + 1):
            if full[i : i + len(own)] == own:
                known = (full[:i], full[i + len(own) :])
                break
        _ADDED[tok] = known
    return known


# tokenizer -> token id -> whether decoding leaves the token out of the text (event loop only)
_SKIPPED: weakref.WeakKeyDictionary[Tokenizer, dict[int, bool]] = weakref.WeakKeyDictionary()


def _skipped(tok: Tokenizer, token_id: int) -> bool:
    """Whether an answer's text leaves `token_id` out: a special token, which the engine
    decodes answers without (skip_special_tokens), as its end-of-turn token. Worked out once
    per token id, beside its bytes (`Grammars.token_bytes`)."""
    known = _SKIPPED.get(tok)
    if known is None:
        known = _SKIPPED[tok] = {}
    skipped = known.get(token_id)
    if skipped is None:  # an id past the vocabulary has no bytes anyway
        inside = token_id < tok.vocab_size
        skipped = inside and tok.decode([token_id], True) != tok.decode([token_id], False)
        known[token_id] = skipped
    return skipped


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
        self.n = 1  # choices per prompt: choice i answers prompt i // n
        self.echo: list[str | list[int]] | None = None  # the prompts, for a completion with echo
        self.tools = False  # a chat answer that may be tool calls
        # a chat answer's token limit where the request set none (DEFAULT_CHAT_MAX_TOKENS)
        self.max_tokens_default: int | None = None
        self.key: str | None = None  # the API key's name, where the daemon checks keys
        self.posted = t0  # when its choices were posted to the engine (set as they are)
        # prompt index -> its tokens the key was charged for (engine thread)
        self._charged: dict[int, int] = {}
        self.id = new_id("chatcmpl" if kind == "chat.completion" else "cmpl")
        self.created = now()
        # a completion's logprobs, per choice i: its text's UTF-8 decoder (bytes of a character
        # not yet whole) and how many characters it has made, where the next token's text is
        self.text_offset: dict[int, tuple[codecs.IncrementalDecoder, int]] = {}

    def logprobs(
        self,
        lps: list[TokenLogprob] | None,
        index: int = 0,
        shown: int = 0,
        added: Container[int] = (),
        echo: str | None = None,
    ) -> dict[str, Any] | None:
        """`lps` in OpenAI's shape: chat `{"content": [...], "refusal": null}`, a completion
        `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (offsets continue from
        the previous call's for the same choice: a stream's chunks count on). None where not
        asked.

        A token's bytes are its own (the grammar library's view, built off the event loop
        before such a request is taken in): one holding part of a character has its bytes, not
        a replacement character. Its text is its bytes as UTF-8, or where they are not whole
        characters `bytes:` and each byte as `\\xNN` (OpenAI's way), so tokens that print
        alike stay apart; a completion's offsets index its text, a token that continues a
        character at that character's. A generated token the text leaves out (a special
        token: `_skipped`) takes no room in it: a completion's next token has its offset,
        and a chat entry's `bytes` are none, so that they add up to the content. The first
        `shown` tokens (an echoed prompt, whose text shows its special tokens) are all text,
        but those whose indices are in `added`: what the tokenizer added to a prompt sent as
        text (a BOS), which its echo, the text as sent, does not hold, take no room either.
        With `echo` (the echoed prompt's text) their offsets are found in it (`_echo_offsets`):
        a SentencePiece vocabulary's tokens carry a space its tokenizer put before each piece
        of text, which the text as sent does not hold.

        A completion's `top_logprobs` hold the sampled token's too, as OpenAI's do (so up to
        `logprobs` + 1 of them); chat's are the `top_logprobs` likeliest, as OpenAI's are."""
        if lps is None:
            return None
        token_bytes = self.service.engine.grammars.token_bytes
        tok = self.service.engine.tokenizer

        def text(raw: bytes) -> str:
            try:
                return raw.decode()
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

        if self.kind == "chat.completion":

            def entry(token_id: int, logprob: float) -> dict[str, Any]:
                raw = token_bytes(token_id)
                content = b"" if _skipped(tok, token_id) else raw
                return {"token": text(raw), "logprob": logprob, "bytes": list(content)}

            content = [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(*a) for a in lp.top]}
                for lp in lps
            ]
            return {"content": content, "refusal": None}
        tokens, offsets, values, tops = [], [], [], []
        utf8, made = self.text_offset.get(index) or (_utf8_decoder(), 0)
        if echo is not None:
            shown_ids = [lp.token_id for lp in lps[:shown]]
            prompt_offsets = _echo_offsets(echo, [token_bytes(i) for i in shown_ids], added)
        for k, lp in enumerate(lps):
            if k == shown > 0:  # the echoed prompt's text ends here: its bytes that never made
                made += len(utf8.decode(b"", final=True))  # a character are its own U+FFFD
                if echo is not None:  # the text as sent, whole
                    utf8, made = _utf8_decoder(), len(echo)
            raw = token_bytes(lp.token_id)
            tokens.append(text(raw))
            values.append(lp.logprob)
            top: dict[str, float] = {}  # keyed by text: of tokens that print alike, the likelier
            alternatives = list(lp.top)
            if all(i != lp.token_id for i, _ in alternatives):  # the sampled one, in its place
                alternatives.append((lp.token_id, lp.logprob))
                alternatives.sort(key=lambda a: -a[1])
            for i, v in alternatives:
                top.setdefault(text(token_bytes(i)), v)
            tops.append(top)
            if k < shown and echo is not None:
                offsets.append(prompt_offsets[k])
                continue
            if (k >= shown and _skipped(tok, lp.token_id)) or k in added:
                offsets.append(made)  # where the next character starts (or the one pending)
                continue
            at, made = _text_at(utf8, made, raw)
            offsets.append(at)
        if 0 < shown == len(lps):  # an echoed prompt alone: the answer's text starts afresh
            made += len(utf8.decode(b"", final=True))
            if echo is not None:
                utf8, made = _utf8_decoder(), len(echo)
        self.text_offset[index] = (utf8, made)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip

    def answer_logprobs(
        self, out: RequestOutput, lps: list[TokenLogprob] | None
    ) -> list[TokenLogprob] | None:
        """A chat answer's token log-probabilities `lps` (all of them, or the last output's)
        but the end-of-turn token (or stop token) that ended it, which OpenAI does not list:
        its content has no text of it. A completion lists every token generated."""
        if lps and self.kind == "chat.completion" and self.ended_by_eos(out):
            return lps[:-1]
        return lps

    def kept_logprobs(self, out: RequestOutput) -> list[TokenLogprob] | None:
        """A final output's answer log-probabilities (`answer_logprobs`) but those of the
        tokens a stop string cut off (`_Places`), as a stream of it carries them."""
        lps = self.answer_logprobs(out, out.final_logprobs)
        if lps is None:
            return None
        places = _Places(self)
        places.add(lps)
        return places.take(len(out.text)) + places.rest(self.stop_cut(out))

    def stop_cut(self, out: RequestOutput) -> bool:
        """Whether a stop string may have cut a final output's text: tokens' text past its
        end, if any, was cut off."""
        return out.finish_reason == "stop" and bool(self.params.stop)

    def ended_by_eos(self, out: RequestOutput) -> bool:
        """Whether a final output's last token is the end-of-sequence token, or one of its
        `stop_token_ids`, that ended it (the engine stops at such a token before a stop
        string is looked for: a last token among them ended the answer)."""
        ids = out.final_token_ids
        if not (out.finished and out.finish_reason == "stop" and ids):
            return False
        eos = not self.params.ignore_eos and ids[-1] in self.service.engine.eos_ids
        return eos or ids[-1] in self.params.stop_token_ids

    def echo_logprobs(self, out: RequestOutput, index: int) -> dict[str, Any] | None:
        """A completion's logprobs with `echo`: the prompt's tokens first (the first has none,
        as OpenAI's answer has it), then the generated ones."""
        if out.final_prompt_logprobs is None:
            return self.logprobs(self.kept_logprobs(out), index)
        first = TokenLogprob(out.prompt_token_ids[0], 0.0)
        prompt = [first, *out.final_prompt_logprobs]
        added = self.added_to_prompt(index, out.prompt_token_ids)
        answer = self.kept_logprobs(out) or ()
        lps = self.logprobs([*prompt, *answer], index, len(prompt), added, self.echo_text(index))
        lps["token_logprobs"][0] = lps["top_logprobs"][0] = None
        return lps

    def added_to_prompt(self, index: int, ids: Sequence[int]) -> set[int]:
        """The indices in choice `index`'s prompt ids of the tokens the tokenizer added to it
        (`_added_around`: a BOS before it, an end token after it) where it was sent as text:
        its echo is the text as sent, which does not hold theirs; none for token ids, whose echo
        is their text, the added tokens' included."""
        if self.echo is None or not isinstance(self.echo[index // self.n], str):
            return set()
        before, after = _added_around(self.service.engine.tokenizer)
        lead = len(before) if list(ids[: len(before)]) == before else 0
        trail = len(after) if after and list(ids[len(ids) - len(after) :]) == after else 0
        if lead + trail > len(ids):
            return set()
        return {*range(lead), *range(len(ids) - trail, len(ids))}

    def echo_text(self, index: int) -> str:
        """What `echo` puts before choice `index`: its prompt as sent, or its token ids as
        text (decoded once the engine has accepted them, so they are in the vocabulary)."""
        if self.echo is None:
            return ""
        prompt = self.echo[index // self.n]
        if isinstance(prompt, str):
            return prompt
        return self.service.engine.tokenizer.decode(prompt, skip_special_tokens=False)

    def charge(self, index: int, out: RequestOutput) -> None:
        """Charge the key for choice `index`'s final output (engine thread): the tokens the
        engine generated for it, however it ended (a client that hangs up near the end pays
        for what was computed), and its prompt's tokens once, with the first of the prompt's
        choices that got any of them: the whole prompt once it generated a token, else the
        part of it it had got through (a client that hangs up during a long prompt's chunked
        prefill; one aborted while it waited got nothing)."""
        if self.key is None:
            return
        tokens = self.service.metrics.api_tokens
        prompt = out.num_prompt_tokens if out.num_output_tokens else out.num_prompt_tokens_done
        before = self._charged.get(index // self.n, 0)
        if prompt > before:  # a prompt is paid once, as far as any of its choices got
            self._charged[index // self.n] = prompt
            tokens.labels(self.key, "prompt").inc(prompt - before)
        if out.num_output_tokens:
            tokens.labels(self.key, "completion").inc(out.num_output_tokens)

    def observe(self, out: RequestOutput, last: float | None) -> float | None:
        """Latency metrics, per engine output of one choice (engine thread): they measure the
        engine, not how fast the client reads. `last` is when the choice's previous tokens
        came (None: none yet); returns when these did. An output without tokens (an abort
        of a queued request) is no token's latency. Finishes are counted by the engine
        (kvguard_requests_finished_total), where aborts pass too; the queue time by
        `observe_wait`.

        The inter-token latency is per token: k tokens that come in one output after a gap g
        (a run of serving.decode_steps, accepted speculative tokens) are k gaps of g/k, so its
        count and mean are those of the tokens whatever the engine's steps bring at once. The
        first output's tokens after its first came with it: TTFT is their latency, no gap."""
        m = self.service.metrics
        t = time.monotonic()
        if k := len(out.new_token_ids):
            if last is None:
                m.ttft.labels(self.priority).observe(t - self.t0)
            else:
                gaps = m.inter_token.labels(self.priority)
                for _ in range(k):
                    gaps.observe((t - last) / k)
            last = t
        if out.finished:
            m.e2e.labels(self.priority).observe(t - self.t0)
        return last

    def observe_wait(self, out: RequestOutput) -> bool:
        """One choice's queue time, at the first output that shows its wait is over (engine
        thread); whether it did. An output with a queue time is of a started choice, which is
        also counted in kvguard_requests_started_total, the requests PreemptionStorm counts
        preemptions per: admission's `admit` decisions leave out every request it queued
        first, and with admission control off there are none. A choice that ended without
        ever being scheduled (its client gave up, a drain cut it) waited until then: left
        out, the queue-time p99 showed only the requests that got in, and an overload whose
        clients give up while queued looked healthy."""
        m = self.service.metrics
        if out.queue_time_s is not None:
            m.queue_time.labels(self.priority).observe(out.queue_time_s)
            m.started.labels(self.priority).inc()
            return True
        if out.finished:
            m.queue_time.labels(self.priority).observe(time.monotonic() - self.posted)
            return True
        return False


class _Outputs:
    """The engine's outputs for one choice of an HTTP request until the request's coroutine
    takes them.

    The engine thread pushes one delta per token; the coroutine can be much slower (a client
    reading its SSE stream slowly, or not at all). Untaken deltas are coalesced, so a request
    holds at most one output however far behind its client is, never one per token. A
    non-streaming request keeps only the final output, the one it answers with.
    """

    def __init__(
        self, aio: asyncio.AbstractEventLoop, ctx: _Ctx, index: int, keep_deltas: bool
    ) -> None:
        self._aio, self.ctx, self._index, self._keep_deltas = aio, ctx, index, keep_deltas
        self._lock = threading.Lock()  # the engine thread adds, the event loop takes
        self._buffer = OutputBuffer()
        self._ready = asyncio.Event()
        self.gone = False  # the client hung up (event loop only)
        self.left = asyncio.Event()  # ... and when, for a coroutine awaiting admission
        self.cut_message: str | None = None  # the server cut the request off (event loop only)
        self.was_cut = asyncio.Event()  # ... and when, for a coroutine awaiting admission
        self._last: float | None = None  # when the previous token came (engine thread only)
        self._waited = False  # its queue time has been observed (engine thread only)
        # its final output came: it no longer counts against its API key (engine thread sets)
        self.engine_done = False

    def hang_up(self) -> None:
        """The client left: wake the waiting coroutine, which gives up (event loop only)."""
        self.gone = True
        self._ready.set()
        self.left.set()

    def cut(self, message: str) -> None:
        """The daemon gives up on the request (drain deadline): the waiting coroutine answers
        the cut at once, without waiting for the engine, which may be stalled (event loop
        only). Output already produced is still handed out first."""
        self.cut_message = message
        self._ready.set()
        self.was_cut.set()

    def push(self, out: RequestOutput) -> None:
        """The stream's listener, on the engine thread: must not block."""
        self._last = self.ctx.observe(out, self._last)
        if not self._waited:
            self._waited = self.ctx.observe_wait(out)
        if out.finished:
            self.engine_done = True
            try:
                self.ctx.charge(self._index, out)
            except Exception:  # noqa: BLE001 - a metrics fault must not lose the answer
                log.exception("charging request %s to its API key failed", out.request_id)
        if not (self._keep_deltas or out.finished):
            return
        with self._lock:
            pending = len(self._buffer)  # the wake that output asked for is still to come
            self._buffer.add(out)
        if not pending:  # one wake per step for all the streams (a closed loop: nobody waits)
            wake_after_delivery(self._aio, self._ready.set)

    async def get(self) -> RequestOutput:
        """Everything new since the previous get, as one output; waits for something new.

        Raises ClientGone once the client has hung up, RequestCut once the daemon has cut the
        request and everything produced before the cut has been taken."""
        while True:
            if self.gone:
                raise ClientGone
            with self._lock:
                out = self._buffer.take()
            if out is not None:
                return out
            if self.cut_message is not None:
                raise RequestCut(self.cut_message)
            await self._ready.wait()
            self._ready.clear()

    def undelivered(self) -> int:
        """Outputs waiting for the coroutine: 0 or 1."""
        with self._lock:
            return len(self._buffer)


class ClientGone(Exception):
    """The client hung up; its request is aborted and nobody is left to answer."""


class RequestCut(Exception):
    """The daemon cut the request off before it finished (the drain deadline passed)."""


class _ClosingStreamingResponse(StreamingResponse):
    """A stream that closes its body (`_sse`) however the response ends. Starlette cancels
    the sending when the client hangs up and leaves the generator suspended at its `yield`:
    its `finally` (the request's end, and `_merged`'s per-choice tasks, whose ClientGone then
    went unretrieved and was logged as an ERROR traceback) ran only when the garbage collector
    found it."""

    async def stream_response(self, send: Callable[..., Awaitable[None]]) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):  # the hang-up cancelled us: close anyway
                    await aclose()


class _DisconnectWatch:
    """Aborts a request the moment its client hangs up, whatever the request is doing.

    A task waits on the ASGI receive channel, which yields `http.disconnect` when the
    connection drops, beside the coroutine that waits for outputs. A check made only between
    outputs never runs while tokens keep arriving (and an abandoned request would generate to
    its last token), nor in time for a queued request, which has no outputs at all. The abort
    goes through the mailbox behind the request's own add, so it also reaches a request the
    engine has not taken yet; the engine frees the blocks at its next step. Every choice of
    the request (`n`) is aborted.
    """

    def __init__(
        self,
        request: Request,
        service: Service,
        streams: Sequence[RequestStream],
        outs: Sequence[_Outputs],
    ) -> None:
        self._service, self._streams, self._outs = service, streams, outs
        self._task = asyncio.get_running_loop().create_task(self._watch(request))

    async def _watch(self, request: Request) -> None:
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass  # the body has been read: nothing but a disconnect should come
        except Exception:  # noqa: BLE001 - a receive channel that fails has lost its client too
            rid = self._streams[0].request_id
            log.debug("receive failed for %s; taking the client as gone", rid)
        for stream in self._streams:
            self._service.loop.abort_stream(stream)
        for outputs in self._outs:
            outputs.hang_up()

    def stop(self) -> None:
        """The answer is complete (or failed before the engine took the request)."""
        self._task.cancel()


def _cut_error(service: Service, out: RequestOutput | None, cut: str | None) -> ApiError:
    """503 for a request the daemon stopped before it finished: a 200 would read as a
    complete answer, and the client should retry elsewhere rather than use a truncated one."""
    if cut is None:
        cut = DRAIN_CUT_MESSAGE if service.draining else "the request was aborted by the server"
    if out is not None:
        cut += f" ({out.num_output_tokens} tokens had been generated)"
    return ApiError(
        503,
        cut,
        code="request_cut",
        type_="service_unavailable",
        retry_after=RETRY_ELSEWHERE_S,
    )


async def _merged(outs: Sequence[_Outputs]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) as each choice's outputs come, until every choice has its
    final one; raises ClientGone or RequestCut as `_Outputs.get` does."""
    if len(outs) == 1:
        while True:
            out = await outs[0].get()
            yield 0, out
            if out.finished:
                return

    def wait_for(i: int) -> asyncio.Future[RequestOutput]:
        task = asyncio.ensure_future(outs[i].get())
        task.add_done_callback(_retrieved)  # a ClientGone nobody awaits is no logged error
        return task

    waits = {wait_for(i): i for i in range(len(outs))}
    try:
        while waits:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=waits.__getitem__):
                i = waits.pop(task)
                out = task.result()
                yield i, out
                if not out.finished:
                    waits[wait_for(i)] = i
    finally:
        for task in waits:
            task.cancel()


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Marks a finished task's exception as seen: asyncio logs one never retrieved."""
    if not task.cancelled():
        task.exception()


def _failure(service: Service, out: RequestOutput, outputs: _Outputs) -> ApiError | None:
    """The error a choice's final output answers with; None: it finished normally."""
    if out.finish_reason == "abort":  # not the client's doing: the daemon stopped it
        return _cut_error(service, out, outputs.cut_message)
    if out.finish_reason == "error" and out.error is not None:  # the request's own schema
        field = "tools" if outputs.ctx.tools else "response_format"
        return ApiError(
            400,
            f"{field}: the grammar library gave up holding the answer to it "
            f"({out.num_output_tokens} tokens generated): {out.error}; send a simpler one "
            "(fewer alternatives, fewer properties in one object)",
            field,
        )
    if out.finish_reason == "error":
        return _engine_error(service, out)
    return None


def _end(
    service: Service,
    streams: Sequence[RequestStream],
    outs: Sequence[_Outputs],
    finals: dict[int, RequestOutput],
) -> None:
    """The request's answer is complete or failed: the watch's and drain's hold on its
    choices ends, and a choice still running (another one failed, the client left) is
    aborted. (Its API key is charged as each choice's final output comes: `_Ctx.charge`.)"""
    for i, (stream, outputs) in enumerate(zip(streams, outs, strict=True)):
        service.requests.discard(outputs)
        if i not in finals:
            service.loop.abort_stream(stream)


async def _wait_final(
    service: Service,
    streams: Sequence[RequestStream],
    outs: Sequence[_Outputs],
    watch: _DisconnectWatch,
) -> list[RequestOutput]:
    """Every choice's final output; the first that failed fails the request."""
    finals: dict[int, RequestOutput] = {}
    try:
        async with contextlib.aclosing(_merged(outs)) as outputs:
            async for i, out in outputs:
                if out.finished:
                    finals[i] = out
                    if (err := _failure(service, out, outs[i])) is not None:
                        raise err
    except ClientGone:
        raise ApiError(499, "client disconnected") from None
    except RequestCut as e:
        raise _cut_error(service, None, str(e)) from None
    finally:
        watch.stop()
        _end(service, streams, outs, finals)
    return [finals[i] for i in range(len(outs))]


def engine_unavailable(error: BaseException, out: RequestOutput | None = None) -> ApiError:
    """503 once the engine has failed for good (a tensor-parallel rank died or hung): the
    daemon exits and systemd restarts it, so the request may be retried shortly, here or on
    another instance. Not a 500: nothing is wrong with the request or with this answer."""
    message = (
        f"kvguard's engine failed ({error}) and cannot serve this request; the daemon is "
        "restarting: retry it shortly or on another instance"
    )
    if out is not None:
        message += f" ({out.num_output_tokens} tokens had been generated)"
    return ApiError(
        503,
        message,
        code="engine_unavailable",
        type_="service_unavailable",
        retry_after=RETRY_ELSEWHERE_S,
    )


def _engine_error(service: Service, out: RequestOutput) -> ApiError:
    """The engine step running this request failed (a bug, not the input: inputs are checked
    before they reach it); the engine ended only that step's requests and serves on. Unless
    the engine failed for good, which ended every request: then it is a 503. The answer names
    the choice as the daemon log's error line and the `engine_step_failed` audit event do
    (`<response id>-<index>`), streamed or not: a non-streamed 500 carries no other id, and
    without it an operator could not find the traceback of a client's failed request."""
    if service.loop.fatal is not None:
        return engine_unavailable(service.loop.fatal, out)
    return ApiError(
        500,
        f"the engine failed while generating this request ({out.request_id}) and stopped it "
        f"({out.num_output_tokens} tokens had been generated; the daemon log has the cause "
        "under that id)",
        code="engine_error",
        type_="server_error",
    )


def _kvguard_ext(ctx: _Ctx, outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """kvguard's own fields of an answer (of all its choices: the longest queue time)."""
    waits = [o.queue_time_s for o in outs if o.queue_time_s is not None]
    return {
        "priority": ctx.priority,
        "truncated": any(o.truncated for o in outs),
        "queue_time_s": max(waits) if waits else None,
        "preemptions": sum(o.num_preemptions for o in outs),
        # a chat request that set no max_tokens: the default limit it ran under (an answer
        # cut there ends with finish_reason length), else null
        "max_tokens_default": ctx.max_tokens_default,
    }


def _usage(outs: Sequence[RequestOutput], n: int) -> dict[str, Any]:
    """Each prompt once, every choice's output tokens; cached: per prompt, the prompt tokens
    the first of its choices to run found cached (the others found what it computed too)."""
    groups = [outs[k : k + n] for k in range(0, len(outs), n)]
    cached = sum(min(o.num_cached_tokens for o in g) for g in groups)
    prompt = _prompt_tokens(dict(enumerate(outs)), n)
    return usage(prompt, sum(o.num_output_tokens for o in outs), cached)


def _prompt_tokens(outs: dict[int, RequestOutput], n: int) -> int:
    """Each prompt's tokens once, from any of its choices (choice i answers prompt i // n)."""
    return sum({i // n: o.num_prompt_tokens for i, o in outs.items()}.values())


class _Places:
    """A choice's generated tokens' log-probabilities, each with where its text begins in the
    answer's text (as a completion's `text_offset` has it; None for a token the text leaves
    out, `_skipped`), so that they go out with their text: a streamed chunk carries those of
    the tokens whose text begins in the text it and the chunks before it carry, and where a
    stop string cut the text, the tokens whose text begins at or past the cut have none (one
    the cut splits keeps its entry, its text beginning before it). A streamed answer and a
    whole one list the same entries."""

    def __init__(self, ctx: _Ctx) -> None:
        self.engine = ctx.service.engine
        self.utf8, self.made = _utf8_decoder(), 0
        self.waiting: list[tuple[TokenLogprob, int | None]] = []

    def add(self, lps: Sequence[TokenLogprob] | None) -> None:
        for lp in lps or ():
            if _skipped(self.engine.tokenizer, lp.token_id):
                self.waiting.append((lp, None))
                continue
            raw = self.engine.grammars.token_bytes(lp.token_id)
            at, self.made = _text_at(self.utf8, self.made, raw)
            self.waiting.append((lp, at))

    def take(self, shown: int) -> list[TokenLogprob]:
        """The waiting tokens whose text begins in the text's first `shown` characters, and
        those the text leaves out among them, in order."""
        n = 0
        for _, at in self.waiting:
            if at is not None and at >= shown:
                break
            n += 1
        taken, self.waiting = self.waiting[:n], self.waiting[n:]
        return [lp for lp, _ in taken]

    def rest(self, cut: bool) -> list[TokenLogprob]:
        """At the answer's end, after `take` of its whole text: the tokens still waiting, or
        none where a stop string cut the text (they came after the cut)."""
        rest, self.waiting = self.waiting, []
        return [] if cut else [lp for lp, _ in rest]


def _full_response(ctx: _Ctx, outs: Sequence[RequestOutput]) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outs):
        if ctx.kind == "chat.completion":
            calls = tools.parse(out.text) if ctx.tools else None
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            if calls is not None:
                message = {"role": "assistant", "content": None, "tool_calls": _calls(calls)}
            choice = {
                "index": i,
                "message": message,
                "finish_reason": out.finish_reason if calls is None else "tool_calls",
                "logprobs": ctx.logprobs(ctx.kept_logprobs(out), i),
            }
        else:
            choice = {
                "index": i,
                "text": ctx.echo_text(i) + out.text,
                "finish_reason": out.finish_reason,
                "logprobs": ctx.echo_logprobs(out, i),
            }
        choices.append(choice)
    return {
        "id": ctx.id,
        "object": ctx.kind,
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": _usage(outs, ctx.n),
        "kvguard": _kvguard_ext(ctx, outs),
    }


def _calls(calls: list[tools.Call]) -> list[dict[str, Any]]:
    """Tool calls in OpenAI's shape."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def _chunk(
    ctx: _Ctx,
    text: str | None,
    finish: str | None,
    first: bool,
    lps: list[TokenLogprob] | None = None,
    index: int = 0,
    calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    logprobs = ctx.logprobs(lps, index) if lps else None
    if ctx.kind == "chat.completion":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls  # tools.CallStream's deltas
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        text = (ctx.echo_text(index) if first else "") + (text or "")
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
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


def _choice_line(chunk: dict[str, Any], include_usage: bool) -> str:
    """A choice's chunk as an SSE line. With `stream_options.include_usage` it carries
    `"usage": null`, as OpenAI's chunks before the usage chunk do: a client reading
    `chunk["usage"]` off every chunk finds the key (only the last chunk's holds counts)."""
    return _sse_line({**chunk, "usage": None} if include_usage else chunk)


async def _sse(
    ctx: _Ctx,
    streams: Sequence[RequestStream],
    outs: Sequence[_Outputs],
    watch: _DisconnectWatch,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Stream the engine's text deltas, each choice's chunks with its index as they come. The
    engine already holds back text that could still become part of a stop string, so every
    delta is final; a slow client gets several tokens' deltas coalesced into one chunk. A
    choice's last chunk carries its finish reason (and kvguard's fields); the usage chunk,
    when asked for, comes once every choice has finished.

    A request the daemon cut off (drain deadline), or a choice the engine failed, ends the
    stream with an `error` event, the way OpenAI streams report a failure, and no `[DONE]`:
    a stream that ends normally after a cut would read as a complete answer.

    An answer that may be tool calls is held back while it could still be: once its text
    cannot begin a call it streams as content; a call goes out as OpenAI streams one, its id
    and name once known, then its arguments as they are written (tools.CallStream)."""
    first = [True] * len(outs)
    held = [tools.CallStream() if ctx.tools else None for _ in outs]
    finals: dict[int, RequestOutput] = {}
    # tokens' log-probabilities go out with the chunk that carries the text they begin (text
    # held back for a stop string or a split character waits, and so do they), the rest with
    # the end, but those of tokens a stop string cut off (_Places)
    places = [_Places(ctx) for _ in outs]
    shown = [0] * len(outs)  # characters of each choice's text the engine has handed out
    try:
        async with contextlib.aclosing(_merged(outs)) as outputs:
            async for i, out in outputs:
                places[i].add(ctx.answer_logprobs(out, out.new_logprobs))
                shown[i] += len(out.new_text)
                text, deltas, hold = out.new_text, [], held[i]
                if hold is not None:
                    text, deltas = hold.feed(text or "")
                    text += hold.flush() if out.finished else ""
                carries = bool(text or deltas)  # a chunk without text carries no logprobs
                if carries or first[i]:
                    lps = places[i].take(shown[i]) if carries else None
                    chunk = _chunk(ctx, text, None, first[i], lps, i, deltas)
                    yield _choice_line(chunk, include_usage)
                    first[i] = False
                if not out.finished:
                    continue
                finals[i] = out
                if (err := _failure(ctx.service, out, outs[i])) is not None:
                    yield _sse_line(err.body())
                    return
                finish = out.finish_reason
                if hold is not None and hold.finish() is not None:
                    finish = "tool_calls"
                lps = places[i].take(shown[i]) + places[i].rest(ctx.stop_cut(out))
                end = _chunk(ctx, None, finish, False, lps, i)
                end["kvguard"] = _kvguard_ext(ctx, [out])
                yield _choice_line(end, include_usage)
        if include_usage:
            u = _chunk(ctx, None, None, False)
            u["choices"] = []
            u["usage"] = _usage([finals[i] for i in range(len(outs))], ctx.n)
            yield _sse_line(u)
        yield "data: [DONE]\n\n"
    except ClientGone:
        return
    except RequestCut as e:
        yield _sse_line(_cut_error(ctx.service, None, str(e)).body())
    finally:
        watch.stop()
        _end(ctx.service, streams, outs, finals)
