"""/admin: state, manual remedies and reload, behind a bearer token read from a file.

No token file (or an unreadable or empty one) disables the admin API: it answers 403 rather
than run open; the daemon logs a warning naming the file and its problem at start, at reload,
and when a request first meets a new problem (the 403, which any client reads, names neither).
A missing or wrong bearer token answers 401 with `WWW-Authenticate: Bearer` (RFC 6750: a
credential to send again, not a permission the caller lacks).
An action the engine refuses (its `ok` false, the reason in `detail`) answers 409, one that
failed 500, with the body a success has. One that applied and changed nothing (FP8 on an FP8
pool, a halt as strict as the one in force) answers 200 with `changed` false, its `detail`
saying so, and is audited and counted `held`, not `applied`.
Invalid action or debug-hook parameters answer 400 with the field in `error.param`; the
fault-injection hooks under /admin/debug exist only with `api.debug_hooks: true`.

An action during which the engine fails for good (a tensor-parallel rank lost in its agreement)
answers 503 `engine_unavailable`, as requests then do.
An action waits ACTION_TIMEOUT_S for the engine to take it at a step boundary. Not taken, it
is withdrawn (it never runs) and answers 504 `action_withdrawn`; taken, it is waited for as long
again and answers its result, or 504 `action_still_applying` if the engine is still inside it
(it may yet apply). Either way the audit log and kvguard_actions_total get its true outcome.
The stop cuts an action still waiting at the end of its drain period, as it cuts the requests
in flight: 503, `action_withdrawn` (it never runs) or `action_still_applying`; one asked once
the stop has begun is refused (503 `shutting_down`: nothing changed), and so is a reload
(with Retry-After: nothing is wrong with the config, the daemon is on its way out).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Body, Depends, Header
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvguard.daemon.control_plane import AlertPayloadError, manual_detail
from kvguard.daemon.openai_api import RETRY_ELSEWHERE_S, ApiError, engine_unavailable
from kvguard.engine.control import ActionResult
from kvguard.engine.distributed.errors import RankFailure
from kvguard.engine.engine_loop import EngineStopped, EngineUnavailable
from kvguard.rules.actions import ACTIONS, ActionError, ActionWithdrawn

if TYPE_CHECKING:
    from kvguard.daemon.service import Service
    from kvguard.engine.llm_engine import LLMEngine

log = logging.getLogger("kvguard.daemon.api")
_B = TypeVar("_B", bound=BaseModel)
ALERTMANAGER_MAX_BODY = 1 << 20  # 100 alerts with their labels and annotations fit many times
ACTION_TIMEOUT_S = 60.0  # for the engine to take an action; one it took gets as long again
STOP_POLL_S = 0.05  # how often an action's wait looks whether the stop has begun


def check_token(service: Service, authorization: str | None) -> None:
    token, why = service.admin_token_status()
    if not token:  # none configured, or a token file that cannot be read or is empty
        raise ApiError(403, service.admin_disabled(why), type_="permission_error")
    if not authorization or not authorization.lower().startswith("bearer "):
        raise ApiError(401, "missing bearer token", type_="authentication_error")
    if not hmac.compare_digest(authorization[7:].strip().encode(), token.encode()):
        raise ApiError(401, "wrong bearer token", type_="authentication_error")


def router(service: Service) -> APIRouter:
    async def auth(authorization: str | None = Header(None)) -> None:
        check_token(service, authorization)

    r = APIRouter(prefix="/admin", dependencies=[Depends(auth)])

    @r.get("/state")
    async def state() -> dict[str, Any]:
        return service.state()

    @r.get("/actions")
    async def actions() -> dict[str, Any]:
        return {
            name: {"doc": s.doc, "undo": s.undo, "params": s.params.model_json_schema()}
            for name, s in ACTIONS.items()
        }

    @r.post("/actions/{action}")
    async def act(action: str, params: dict[str, Any] | None = Body(None)) -> Any:
        if service.draining:  # the engine is on its way out: nothing is asked of it now
            raise _stopping(
                "admin actions are refused once the stop has begun; nothing changed",
                "shutting_down",
            )
        try:
            fut = service.manual_action(action, params or {})
        except ActionError as e:  # never acted on: 400 naming the parameter, nothing audited
            if action not in ACTIONS:
                raise ApiError(404, str(e), "action") from e
            raise ApiError(400, str(e), e.param or "params", "invalid_action_params") from e
        log.info("admin action %s asked: waiting for the engine to apply it", action)
        try:
            res = await _settled(fut, action, ACTION_TIMEOUT_S, _DrainCut(service))
        except RankFailure as e:  # a rank failed inside it: the engine is done, as for requests
            raise engine_unavailable(e) from e
        except EngineUnavailable as e:  # it had failed before it took the action
            raise engine_unavailable(e.cause) from e
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - the action failed: audited `failed`, said so
            log.error("admin action %s failed: %s", action, e)
            failed = _action_body(action, False, f"failed: {e}", None, None, {}, None)
            return JSONResponse(failed, status_code=500)
        changed = res.ok and not res.changed_nothing()  # as the audit's `held` says it
        body = _action_body(
            action, res.ok, manual_detail(res), res.before, res.after, res.data, changed
        )
        # refused (`ok` false, why in `detail`): 409, so that `curl -f ... && echo applied`
        # does not say applied of what the engine would not do
        return body if res.ok else JSONResponse(body, status_code=409)

    if service.cfg.api.debug_hooks:
        _debug_routes(r, service)

    @r.post("/reload")
    async def reload() -> dict[str, Any]:
        """What changed; a refused reload (bad config or rules file) is the caller's to fix, so
        it answers 400 with the reason, and the running config and rules stay. One asked once
        the stop has begun answers 503 `shutting_down`, as an admin action does. One whose engine
        knobs the engine did not take in time answers 504 `reload_withdrawn` (nothing changed),
        or 504 `reload_still_applying` if it took them and had not finished (they may yet
        apply; the log and the audit log say when; nothing else of the file was applied)."""
        if service.draining:  # nothing is wrong with the file: the daemon is on its way out
            raise _stopping(
                "reloads are refused once the stop has begun; nothing changed",
                "shutting_down",
                retry_after=RETRY_ELSEWHERE_S,
            )
        res = await asyncio.to_thread(service.reload)
        if res.get("engine"):  # the engine's wait ran out: withdrawn, or still applying
            raise ApiError(
                504, str(res["reason"]), code=f"reload_{res['engine']}", type_="server_error"
            )
        if not res.get("reloaded"):
            raise ApiError(
                400, str(res.get("reason", "reload refused")), "config", "reload_refused"
            )
        return res

    return r


class _DrainCut:
    """When the stop cuts an action still waiting: api.drain_timeout after the stop began (seen
    within STOP_POLL_S), as the drain cuts the requests in flight. The drain waits for the
    action's answer meanwhile, and uvicorn, once serving ends, for CUT_GRACE_S more: answered
    here, the caller gets kvguard's JSON 503, not the server's bare 500 for a cancelled one."""

    def __init__(self, service: Service) -> None:
        self._service = service
        self._at: float | None = None

    @property
    def reached(self) -> bool:
        return self._at is not None and time.monotonic() >= self._at

    async def wait(self, waiting: asyncio.Future, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for `waiting`, or until the cut; True if it is done."""
        until = time.monotonic() + timeout_s
        while not waiting.done():
            now = time.monotonic()
            if self._at is None and self._service.draining:
                self._at = now + self._service.cfg.api.drain_timeout
            end = until if self._at is None else min(until, self._at)
            if now >= end:
                return False
            await asyncio.wait({waiting}, timeout=min(end - now, STOP_POLL_S))
        return True


async def _settled(fut: Future, action: str, timeout_s: float, cut: _DrainCut) -> ActionResult:
    """The action's result (as `await_action`, without a thread): withdrawn if the engine has
    not taken it within `timeout_s` (504: it never runs), else waited for as long again (504
    if the engine is still inside it). The caller leaving does not withdraw it: an action the
    operator asked for is carried out, and audited, whether or not anyone reads the answer.
    The stop's `cut` ends either wait the same way, with a 503 saying the daemon stops."""
    waiting = asyncio.wrap_future(fut)
    if not await cut.wait(waiting, timeout_s):
        if fut.cancel():
            if cut.reached:
                log.warning(
                    "the stop withdrew admin action %s: the engine had not taken it", action
                )
                raise _stopping(
                    f"the engine did not take {action} before the end of the drain period (a "
                    "long step or a stalled engine thread): withdrawn before it ran; nothing "
                    "changed",
                    "action_withdrawn",
                )
            withdrawn = ActionWithdrawn(action, timeout_s)
            raise ApiError(504, str(withdrawn), code="action_withdrawn", type_="server_error")
        if not await cut.wait(waiting, timeout_s):
            waiting.add_done_callback(_settles_unread)
            if cut.reached:
                log.warning("the stop cut admin action %s while the engine applied it", action)
                raise _stopping(
                    f"the engine was still applying {action} at the end of the drain period: "
                    "it may still apply; the audit log records its outcome when it does",
                    "action_still_applying",
                )
            raise ApiError(
                504,
                f"the engine took {action} but had not finished it {timeout_s:g}s later: it may "
                "still apply; the audit log records its outcome when it does (GET /admin/state "
                "shows the knobs)",
                code="action_still_applying",
                type_="server_error",
            )
    try:
        return waiting.result()
    except EngineStopped as e:  # the loop stopped before taking it: refused, never run
        raise _stopping(
            f"the engine stopped before it took {action}: it never ran; nothing changed",
            "action_withdrawn",
        ) from e


def _action_body(
    action: str,
    ok: bool,
    detail: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    data: dict[str, Any],
    changed: bool | None,
) -> dict[str, Any]:
    """An action's answer, one shape whether it applied (200), was refused (409) or failed
    (500, `before`, `after` and `changed` unknown). `changed` false with `ok` true: it applied
    and changed nothing (the engine was already so), so that a script reads that from the
    answer, not from comparing `before` and `after` itself."""
    return {
        "action": action,  # as asked: restore_batch, not the set_max_num_seqs it runs
        "ok": ok,
        "changed": changed,
        "detail": detail,
        "before": before,
        "after": after,
        "data": _jsonable(data),
    }


def _stopping(why: str, code: str, retry_after: float | None = None) -> ApiError:
    return ApiError(
        503,
        f"kvguard is shutting down: {why}",
        code=code,
        type_="service_unavailable",
        retry_after=retry_after,
    )


def _settles_unread(fut: asyncio.Future) -> None:
    """An action answered before it settled: its outcome goes to the audit log, and a failure
    is not reported again as an exception nobody retrieved."""
    if not fut.cancelled():
        fut.exception()


class _StallBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    seconds: float = Field(1.0, ge=0.0, le=60.0)


class _OomBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    times: int = Field(1, ge=1, le=10)


class _RankBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    rank: int = Field(1, ge=0, le=1023)


def _body(model: type[_B], body: Any) -> _B:
    """A debug hook's body, validated: a 400 naming the field, never a 500 or a silent clamp."""
    if body is not None and not isinstance(body, dict):
        raise ApiError(400, "expected a JSON object", "body", "invalid_debug_params")
    try:
        return model(**(body or {}))
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(map(str, err["loc"])) or "body"
        raise ApiError(
            400, f"{field}: {err['msg']} (got {err['input']!r:.40})", field, "invalid_debug_params"
        ) from e


def _debug_routes(r: APIRouter, service: Service) -> None:
    """Fault injection for tests and benchmarks, mounted only with `api.debug_hooks: true`
    (default off): a stalled engine or a fake OOM is an outage on a production daemon, and
    the admin token alone should not be able to cause one. Off, the paths answer 404."""
    stalls: set[threading.Event] = set()  # the stalls holding the engine now: /debug/release

    @r.post("/debug/stall")
    async def stall(body: Any = Body(None)) -> dict[str, Any]:
        """Block the engine thread for `seconds` (0..60), as a hung step would; answered once
        the engine thread is blocked, so that what a test does next meets a stalled engine (a
        stall still queued when the stop begins is withdrawn with the rest)."""
        seconds = _body(_StallBody, body).seconds
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            stalls.add(release)
            held.set()
            try:
                release.wait(seconds)
            finally:
                stalls.discard(release)

        fut = service.loop.call(hold)
        while not held.is_set():
            if fut.done():  # withdrawn or refused before it ran: the engine is not stalled
                raise ApiError(503, "the engine did not take the stall", code="not_stalled")
            await asyncio.sleep(0.01)
        return {"stalled_s": seconds}

    @r.post("/debug/release")
    async def release() -> dict[str, Any]:
        """End the stall holding the engine now, before its `seconds`: a test holds the engine
        for as long as it needs, not for a guess at how long a loaded machine takes."""
        held = list(stalls)
        for event in held:
            event.set()
        return {"released": len(held)}

    @r.post("/debug/inject_oom")
    async def inject_oom(body: Any = Body(None)) -> dict[str, Any]:
        """The next `times` (1..10) forward passes fail as out-of-memory would."""
        times = _body(_OomBody, body).times
        await asyncio.wrap_future(service.loop.call(lambda: service.engine.inject_oom(times)))
        return {"injected": times}

    @r.post("/debug/fail_rank")
    async def fail_rank(body: Any = Body(None)) -> dict[str, Any]:
        """The engine's next step fails as if tensor-parallel rank `rank` had died, without
        killing a process: the daemon's fatal path (503s, not ready, exit 1) on any engine."""
        rank = _body(_RankBody, body).rank
        failure = RankFailure(rank, f"died: {FAIL_RANK_REASON}")
        await asyncio.wrap_future(service.loop.call(lambda: _fail_steps(service.engine, failure)))
        return {"failing_rank": rank}


FAIL_RANK_REASON = "injected by /admin/debug/fail_rank"


def _fail_steps(engine: LLMEngine, failure: RankFailure) -> None:
    """Every later step of `engine` raises `failure`, from where a distributed runner raises
    it (the runner's execute). Engine thread."""

    def execute(*_args: Any, **_kw: Any) -> list[int]:
        raise failure

    engine.runner.execute = execute


def alertmanager_router(service: Service) -> APIRouter:
    """POST /alertmanager: Alertmanager's webhook (payload version 4), same bearer token."""

    async def auth(authorization: str | None = Header(None)) -> None:
        check_token(service, authorization)

    r = APIRouter(dependencies=[Depends(auth)])

    @r.post("/alertmanager", max_body_size=ALERTMANAGER_MAX_BODY)
    async def alertmanager(payload: dict[str, Any] = Body(...)) -> dict[str, Any]:
        """Bounded: a body over ALERTMANAGER_MAX_BODY answers 413, as do more than
        MAX_ALERTS_PER_REQUEST alerts; a malformed alert answers 400 naming it."""
        try:
            return service.control.alertmanager(payload)
        except AlertPayloadError as e:
            raise ApiError(e.status, str(e), e.param, "invalid_alerts") from e

    return r


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in data.items()}
