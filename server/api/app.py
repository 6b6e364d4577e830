"""The app factory (``create_app``; nothing is created at import time): thin routes, error bodies, API key, CORS, and
the lifespan that starts and stops the engine.

/health needs no API key; /v1/* need it when one is set, /metrics with ``metrics_need_api_key``, /openapi.json, /docs
and /redoc with ``docs_need_api_key``. A path with a trailing slash the route does not have is 404 (no redirect built
from the Host header).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.routing import Match
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from server.api.completions import CompletionServing
from server.api.guard import HeaderChecks, Linger, RequestGuard, closing, guarded_protocol
from server.api.json_body import BodyRefused, JSONBodyRoute
from server.api.openapi import ERROR_RESPONSES, GENERATION_RESPONSES, errors, schema_for
from server.api.protocol import (
    ChatRequest,
    CompletionRequest,
    CompletionResponse,
    DeletedModel,
    ErrorDetail,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    RuntimeModelRequest,
    TransduceRequest,
    TransduceResponse,
)
from server.api.serving import Serving
from server.engine.client import EngineClient
from server.engine.engine import Engine, EngineFront
from server.errors import APIError, BadRequest, Unauthorized
from server.metrics import ServerMetrics
from server.settings import Settings

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client went away; nobody reads it
HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 401: "authentication_error"}
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")  # those a 405's Allow may name
T = TypeVar("T")


def create_app(settings: Settings | None = None, engine: EngineFront | None = None) -> FastAPI:
    """The ASGI app. ``engine`` (not started) lets ``python -m server`` keep a handle on it; by default the
    lifespan builds one from ``settings``: in this process, or in a child where ``engine_process`` is true."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        running = engine or (EngineClient if settings.engine_process else Engine)(settings, ServerMetrics())
        app.state.engine = running
        app.state.serving = Serving(running, settings)
        app.state.completions = CompletionServing(app.state.serving)
        _build_routes(app)
        running.start()
        yield
        await asyncio.to_thread(running.stop)

    app = FastAPI(title="regularlm", version="0.1.0", lifespan=lifespan, redirect_slashes=False)
    app.state.settings = settings
    app.openapi = schema_for(app, settings)  # type: ignore[method-assign]  # FastAPI's documented schema override

    def arrive() -> Callable[[], None]:
        engine = getattr(app.state, "engine", None)  # none before the lifespan has started
        return (lambda: None) if engine is None else engine.arrive().leave

    app.state.header_checks = HeaderChecks(
        settings.api_key, _paths_that_need_the_key(app, settings), settings.max_body_bytes, api_error_response, arrive
    )
    app.state.linger = Linger(settings.linger_max_bytes, settings.linger_timeout_s, settings.linger_read_timeout_s)
    app.add_middleware(
        RequestGuard, checks=app.state.header_checks, body_timeout_s=settings.body_timeout_s, linger=app.state.linger
    )
    if settings.cors_origins:  # added last, so outermost: preflights need no key, and refusals carry CORS headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    _add_error_handlers(app)
    app.include_router(_health_router())
    app.include_router(_metrics_router())
    app.include_router(_api_router())
    return app


def http_protocol(app: FastAPI, protocol: type[asyncio.Protocol] = AutoHTTPProtocol) -> type[asyncio.Protocol]:
    """uvicorn's HTTP ``protocol`` as the server runs ``app`` (:func:`guarded_protocol`): connections with late headers
    closed, and requests refused from their headers answered there (not with CORS, whose headers the app adds)."""
    settings: Settings = app.state.settings
    checks = None if settings.cors_origins else app.state.header_checks
    return guarded_protocol(protocol, settings.header_timeout_s, checks, app.state.linger)


def _build_routes(app: FastAPI) -> None:
    """Match a request against every route once, so that FastAPI builds its routes' state at start-up rather than on the
    first /v1 request."""
    scope = {"type": "http", "path": "/", "method": "GET", "root_path": "", "headers": []}
    for route in app.router.routes:
        route.matches(scope)


def _paths_that_need_the_key(app: FastAPI, settings: Settings) -> Callable[[str], bool]:
    """/v1/*, and /metrics and the API's documentation where the settings say so."""
    also = {"/metrics"} if settings.metrics_need_api_key else set()
    docs_need_api_key = settings.docs_need_api_key
    if docs_need_api_key is None:
        docs_need_api_key = settings.metrics_need_api_key
    if docs_need_api_key:
        urls = (app.openapi_url, app.docs_url, app.swagger_ui_oauth2_redirect_url, app.redoc_url)
        also |= {url for url in urls if url is not None}
    return lambda path: path.startswith("/v1/") or path in also


# --- dependencies -------------------------------------------------------------------------------------


# ``async def``, all of them: FastAPI runs a plain ``def`` dependency in a worker thread, a hand-off that costs more
# than the rest of a small request.


async def get_engine(request: Request) -> EngineFront:
    engine: EngineFront = request.app.state.engine
    return engine


async def get_serving(request: Request) -> Serving:
    serving: Serving = request.app.state.serving
    return serving


async def get_completions(request: Request) -> CompletionServing:
    completions: CompletionServing = request.app.state.completions
    return completions


EngineDep = Annotated[EngineFront, Depends(get_engine)]
ServingDep = Annotated[Serving, Depends(get_serving)]
CompletionsDep = Annotated[CompletionServing, Depends(get_completions)]


# --- routes -------------------------------------------------------------------------------------------


def _health_router() -> APIRouter:
    router = APIRouter()

    @router.get(
        "/health",
        response_model=HealthResponse,
        response_model_exclude_none=True,
        responses={503: {"model": HealthResponse, "description": "loading, draining or failed"}},
    )
    def health(engine: EngineDep) -> Any:
        """200 "ok"; 200 "degraded" where checkpoint folders were skipped at load (the models that loaded serve);
        503 while loading, draining or failed."""
        if engine.state == "ready":
            skipped = engine.skipped_folders
            if skipped:
                return HealthResponse(status="degraded", detail=_skipped_detail(skipped))
            return HealthResponse(status="ok")
        status = "draining" if engine.state == "stopped" else engine.state
        body = HealthResponse(status=status, detail=engine.detail)
        return JSONResponse(body.model_dump(exclude_none=True), status_code=503)

    return router


def _skipped_detail(folders: list[str]) -> str:
    some = "1 checkpoint folder was" if len(folders) == 1 else f"{len(folders)} checkpoint folders were"
    return f"{some} skipped at load and not served: {', '.join(folders)} (the server's log says why)"


def _metrics_router() -> APIRouter:
    router = APIRouter()

    @router.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text exposition"},
            401: ERROR_RESPONSES[401],
        },
    )
    def metrics(engine: EngineDep) -> Response:
        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return router


def _api_router() -> APIRouter:
    router = APIRouter(prefix="/v1", route_class=JSONBodyRoute)

    @router.get("/models", response_model=ModelList, responses=errors(401, 503))
    def list_models(serving: ServingDep) -> ModelList:
        return serving.models()

    @router.get("/models/{model_id}", response_model=ModelCard, responses=errors(401, 404, 503))
    def retrieve_model(model_id: str, serving: ServingDep) -> ModelCard:
        return serving.model(model_id)

    @router.post(
        "/models", status_code=201, response_model=ModelCard, responses=errors(401, 408, 409, 413, 415, 422, 503)
    )
    async def add_model(body: RuntimeModelRequest, serving: ServingDep) -> Any:
        """Compile a regular expression (over ``alphabet``) or a DFA into a transduce model and serve it."""
        return _json(await serving.add_model(body), status_code=201)

    @router.delete("/models/{model_id}", response_model=DeletedModel, responses=errors(401, 404, 409, 503))
    async def delete_model(model_id: str, serving: ServingDep) -> DeletedModel:
        """Stop serving a model added by POST /v1/models (shipped models: 409)."""
        return await serving.delete_model(model_id)

    @router.post(
        "/transduce",
        response_model=TransduceResponse,
        response_model_exclude_none=True,
        responses=errors(400, 401, 404, 408, 413, 415, 422, 429, 500, 503),
    )
    async def transduce(body: TransduceRequest, request: Request, serving: ServingDep) -> Any:
        return _json(await _until_disconnected(request, serving.transduce(body, _flow(request))), exclude_none=True)

    @router.post("/generate", response_model=GenerateResponse, responses=GENERATION_RESPONSES)
    async def generate(body: GenerateRequest, request: Request, serving: ServingDep) -> Any:
        return _respond(await _until_disconnected(request, serving.generate(body, _flow(request))))

    @router.post("/chat/completions", responses=errors(400, 401, 404, 408, 413, 415, 422, 503))
    def chat_completions(body: ChatRequest, serving: ServingDep) -> Any:
        """No served model ships a chat template, so there is no chat format to apply: a clear refusal."""
        serving.served(body.model, "generate")  # 404 for an unknown model, 400 for a transducer
        raise BadRequest(
            f"model {body.model!r} has no chat template, so this server cannot turn messages into a prompt; "
            "send the text to /v1/completions instead"
        )

    @router.post("/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request, completions: CompletionsDep) -> Any:
        return _respond(await _until_disconnected(request, completions.create(body, _flow(request))))

    return router


def _json(body: BaseModel, exclude_none: bool = False, status_code: int = 200) -> Response:
    """The body as JSON, serialized by pydantic once (``response_model`` still documents it)."""
    return Response(
        body.model_dump_json(exclude_none=exclude_none), status_code=status_code, media_type="application/json"
    )


def _respond(result: BaseModel | AsyncIterator[str]) -> Any:
    """A body, or a Server-Sent Events stream (whose generator is closed if the client leaves)."""
    if isinstance(result, BaseModel):
        return _json(result)
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _flow(request: Request) -> str:
    """Who asks, for the scheduler's fairness: the peer address."""
    return request.client.host if request.client else ""


class _ClientGone(Exception):
    pass


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it (its engine work stops at the next slice) if the client disconnects first (awaited, not
    polled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise _ClientGone


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- errors -------------------------------------------------------------------------------------------


def _allowed_methods(request: Request, path: str | None = None) -> list[str]:
    """Every method some route serves on ``path`` (by default the request's), asked of the router itself."""
    scope = {**request.scope, "path": request.scope["path"] if path is None else path}
    return [
        method
        for method in HTTP_METHODS
        if any(route.matches({**scope, "method": method})[0] is Match.FULL for route in request.app.router.routes)
    ]


def error_response(
    status: int, message: str, error_type: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(message=message, type=error_type))
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status, headers=headers)


def api_error_response(error: APIError) -> JSONResponse:
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    if isinstance(error, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return error_response(error.status_code, error.message, error.error_type, headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return api_error_response(error)

    @app.exception_handler(BodyRefused)
    async def body_refused(request: Request, error: BodyRefused) -> Response:
        response = api_error_response(error.error)
        return closing(response) if error.body_unread else response

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(422, _describe_validation(error), "invalid_request_error")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        error_type = HTTP_ERROR_TYPES.get(error.status_code, "invalid_request_error")
        headers, message = error.headers, str(error.detail)
        if error.status_code == 405:  # Starlette names the methods of the first route on the path only
            allowed = _allowed_methods(request) or [(headers or {}).get("Allow", "")]
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}
        bare = request.scope["path"].rstrip("/")
        if error.status_code == 404 and bare and bare != request.scope["path"] and _allowed_methods(request, bare):
            message = f"{message}: the route is {bare}, without the trailing slash"
        return error_response(error.status_code, message, error_type, headers)

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, error: _ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal server error", "internal_error")


def _describe_validation(error: RequestValidationError) -> str:
    """'body.inputs.0: Input should be a valid string; ...' from pydantic's error list."""
    parts = []
    for problem in error.errors():
        if problem.get("type") == "json_invalid":  # FastAPI's: at ("body", character offset)
            reason = problem.get("ctx", {}).get("error", "it cannot be parsed")
            parts.append(f"the body is not valid JSON: {reason} (at character {problem['loc'][-1]})")
            continue
        where = ".".join(str(part) for part in problem.get("loc", ()))
        parts.append(f"{where}: {problem.get('msg', 'invalid')}" if where else problem.get("msg", "invalid"))
    return "; ".join(parts) or "invalid request"
