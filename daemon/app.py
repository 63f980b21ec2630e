"""The HTTP application: OpenAI API, health, readiness, metrics, admin."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvguard.daemon import admin_api, openai_api
from kvguard.daemon.openai_api import ApiError
from kvguard.daemon.openai_schemas import error_body

if TYPE_CHECKING:
    from kvguard.daemon.service import Service


def create_app(service: Service) -> FastAPI:
    app = FastAPI(
        title="kvguard",
        version="0.1.0",
        description="LLM inference that keeps serving under memory pressure",
    )
    app.include_router(openai_api.router(service))
    app.include_router(admin_api.router(service))
    app.include_router(admin_api.alertmanager_router(service))
    _health_routes(app, service)
    _error_handlers(app)

    @app.middleware("http")
    async def count(request: Request, call_next):  # noqa: ANN001, ANN202
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        service.metrics.http.labels(path, str(response.status_code)).inc()
        return response

    return app


def _health_routes(app: FastAPI, service: Service) -> None:
    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "alive"}

    @app.get("/ready")
    async def ready() -> Any:
        ok, why = service.readiness()
        return JSONResponse({"ready": ok, "reason": why}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
        param = ".".join(loc) or None
        msgs = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
            for e in errs[:5]
        )
        return JSONResponse(error_body(msgs or "invalid request", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(
            error_body(str(exc.detail), "invalid_request_error"),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> Response:
        return PlainTextResponse("internal error", status_code=500)
