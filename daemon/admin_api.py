"""/admin: state, manual remedies and reload, behind a bearer token read from a file.

No token file (or an empty one) disables the admin API: it answers 403 rather than run open.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Body, Depends, Header

from kvguard.daemon.openai_api import ApiError
from kvguard.rules.actions import ACTIONS, ActionError

if TYPE_CHECKING:
    from kvguard.daemon.service import Service


def check_token(service: Service, authorization: str | None) -> None:
    token = service.admin_token()
    if not token:
        raise ApiError(
            403,
            "admin API disabled: no token configured (api.admin_token_file)",
            type_="permission_error",
        )
    if not authorization or not authorization.lower().startswith("bearer "):
        raise ApiError(401, "missing bearer token", type_="authentication_error")
    if not hmac.compare_digest(authorization[7:].strip().encode(), token.encode()):
        raise ApiError(403, "wrong bearer token", type_="permission_error")


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
    async def act(action: str, params: dict[str, Any] | None = Body(None)) -> dict[str, Any]:
        try:
            fut = service.manual_action(action, params or {})
        except ActionError as e:
            raise ApiError(404 if "unknown action" in str(e) else 400, str(e), "action") from e
        res = await asyncio.wait_for(asyncio.wrap_future(fut), timeout=60)
        return {
            "action": res.action,
            "ok": res.ok,
            "detail": res.detail,
            "before": res.before,
            "after": res.after,
            "data": _jsonable(res.data),
        }

    @r.post("/debug/stall")
    async def stall(body: dict[str, Any] | None = Body(None)) -> dict[str, Any]:
        """Test hook: block the engine thread for `seconds` (<= 60), as a hung step would."""
        seconds = min(60.0, max(0.0, float((body or {}).get("seconds", 1.0))))
        service.loop.call(lambda: time.sleep(seconds))
        return {"stalled_s": seconds}

    @r.post("/debug/inject_oom")
    async def inject_oom(body: dict[str, Any] | None = Body(None)) -> dict[str, Any]:
        """Test hook: the next `times` (<= 10) forward passes fail as out-of-memory would."""
        times = int(min(10, max(1, int((body or {}).get("times", 1)))))
        await asyncio.wrap_future(service.loop.call(lambda: service.engine.inject_oom(times)))
        return {"injected": times}

    @r.post("/reload")
    async def reload() -> dict[str, Any]:
        """What changed; a refused reload (bad config or rules file) is the caller's to fix, so
        it answers 400 with the reason, and the running config and rules stay."""
        res = await asyncio.to_thread(service.reload)
        if not res.get("reloaded"):
            raise ApiError(
                400, str(res.get("reason", "reload refused")), "config", "reload_refused"
            )
        return res

    return r


def alertmanager_router(service: Service) -> APIRouter:
    """POST /alertmanager: Alertmanager's webhook (payload version 4), same bearer token."""

    async def auth(authorization: str | None = Header(None)) -> None:
        check_token(service, authorization)

    r = APIRouter(dependencies=[Depends(auth)])

    @r.post("/alertmanager")
    async def alertmanager(payload: dict[str, Any] = Body(...)) -> dict[str, Any]:
        try:
            return service.control.alertmanager(payload)
        except ValueError as e:
            raise ApiError(400, str(e), "alerts") from e

    return r


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in data.items()}
