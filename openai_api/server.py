"""The OpenAI-compatible HTTP server, on the gateway's event loop.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``,
``GET /v1/models`` and ``GET /v1/models/{id}``, and ``GET /health`` for load
balancers (no key; 200 when ready, else 503): every other route answers 503
until the ensemble is ready.  The launcher starts it with ``--openai-port``.

Why aiohttp on the gateway's loop
---------------------------------
The requests go where the gateway's go, through :meth:`deploy.gateway.Gateway.infer`:
the same unguessable request ids, model and input checks, errors as data,
API keys (``Authorization: Bearer``, the gateway's :class:`~deploy.gateway.KeyRing`
and per-key ``max_streams``) and, above all, the same departure path: a
client that leaves gets its request cancelled inside the server and drained.
``Gateway.infer`` is a coroutine of the gateway's asyncio loop, so the HTTP
server runs on that loop too.  aiohttp (3.14, a well-kept asyncio server
and client) serves on an existing loop without a thread or a second loop of
its own, streams Server-Sent Events through ``StreamResponse`` and, with
``handler_cancellation``, cancels a handler when its client disconnects:
that cancellation is what reaches ``Gateway.infer`` and cancels the request
within one decode step.  An ASGI stack (uvicorn + Starlette/FastAPI) would
need its own loop or a bridge between loops, and Starlette notices a
departed client of a non-streaming request only when the handler polls.

TLS is the gateway's (:class:`~deploy.gateway.GatewaySecurity`: the same
certificate, key and client CA), so one Secret serves both ports.

Errors are OpenAI's JSON with the status of :mod:`openai_api.errors`;
a stream whose request fails before its first token answers with that
status (the headers wait for the first token), one that fails later ends
with an ``error`` event, as OpenAI's do.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import shlex
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

import tritonclient.grpc as grpcclient
from aiohttp import web
from tritonclient.utils import InferenceServerException

import contract
from client.errors import ClientError, InvalidRequest, error_for_status, from_server_error
from client.sdk import DEFAULT_MAX_TOKENS, Chunk, Result, StreamAssembler
from contract import errors as status
from deploy.gateway import ApiKey, Gateway, GatewayError, GatewaySecurity, Refused, bearer_key
from openai_api.errors import BadRequest, OpenAIError, from_status
from openai_api.request import Plan, client_error_param, parse_chat, parse_completion
from openai_api.response import ChatOutput
from openai_api.responses import ResponsesOutput, ResponseStore, parse_responses

__all__ = ["OpenAIConfig", "OpenAIServer", "OpenAIServerError", "try_lines"]

_log = logging.getLogger(__name__)

#: The readiness route (vLLM's and SGLang's path): the one route answered before the ensemble is ready.
HEALTH_PATH: Final = "/health"
#: How long :meth:`OpenAIServer.stop` lets requests in flight finish, beyond which they are cancelled.
STOP_GRACE_S: Final = 5.0
_SSE_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                       "X-Accel-Buffering": "no"}
_OWNER: Final = "constrained-llm"


#: The example of :func:`try_lines`: a person, in strict mode.
_EXAMPLE_SCHEMA: Final = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                          "required": ["name", "age"], "additionalProperties": False}


def try_lines(url: str, model: str, *, keys: bool, python: str = "python") -> tuple[str, str]:
    """A ``curl`` line and a Python ``openai`` line that work against ``url`` (the launcher prints them).

    With ``keys``, both read the key from ``$CONSTRAINED_LLM_API_KEY``.  ``python`` is the interpreter
    the Python line runs: the launcher gives its own (the project's virtualenv, which has ``openai``; a
    system ``python`` may have none).
    """
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": _EXAMPLE_SCHEMA}}
    body = {"model": model, "messages": [{"role": "user", "content": "Invent a person."}], "response_format": fmt}
    auth = ' -H "Authorization: Bearer $CONSTRAINED_LLM_API_KEY"' if keys else ""
    curl = f"curl -s {url}/chat/completions -H 'Content-Type: application/json'{auth} -d '{json.dumps(body)}'"
    key = "os.environ['CONSTRAINED_LLM_API_KEY']" if keys else "'none'"
    line = (f'{shlex.quote(python)} -c "import os, openai; c = openai.OpenAI(base_url=\'{url}\', api_key={key}); '
              f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': "
              f"'Invent a person.'}}], response_format={fmt!r}).choices[0].message.content)\"")
    return curl, line


class OpenAIServerError(RuntimeError):
    """The server cannot start (port taken, TLS files unreadable, gateway not running)."""


@dataclass(frozen=True)
class OpenAIConfig:
    """Settings of :class:`OpenAIServer`.

    Attributes
    ----------
    host, port : str, int
        Where clients connect.
    models : tuple of str
        The ``model`` values served: the gateway's public models.
    security : GatewaySecurity
        TLS (the gateway's certificate and key, optionally mutual).
    default_max_tokens : int
        Chat budget when a request gives none (the SDK's default).
    max_stored_responses, max_stored_bytes : int
        The Responses API's store (:class:`~openai_api.responses.ResponseStore`): responses kept per API
        key, and bytes in all.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    models: tuple[str, ...] = ("constrained_llm",)
    security: GatewaySecurity = field(default_factory=GatewaySecurity)
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_stored_responses: int = 1000
    max_stored_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:  # the launcher picks a free one for its 0
            raise OpenAIServerError(f"port: must be in [1, 65535], got {self.port}")
        if not self.models:
            raise OpenAIServerError("models: must not be empty")
        if self.max_stored_responses < 1 or self.max_stored_bytes < 1:
            raise OpenAIServerError("max_stored_responses, max_stored_bytes: must be positive")
        if not 1 <= self.default_max_tokens <= contract.MAX_MAX_TOKENS:
            raise OpenAIServerError(f"default_max_tokens: must be in [1, {contract.MAX_MAX_TOKENS}], "
                                    f"got {self.default_max_tokens}")

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of the port (None without TLS); its certificate follows the files
        (:class:`~deploy.gateway.TlsFiles`: new connections get a renewed one without a restart)."""
        try:
            files = self.security.tls_files()
        except GatewayError as err:
            raise OpenAIServerError(str(err)) from err
        return None if files is None else files.ssl_context()


def _mapped(plan: Plan | None, err: ClientError) -> OpenAIError:
    """The OpenAI error of a server error the SDK mapped (its status and, for a bad field, the body path)."""
    name = err.status or (status.INVALID_ARGUMENT if isinstance(err, InvalidRequest) else None)
    param = None if plan is None else client_error_param(plan, err)
    message = str(err)
    if param is not None and isinstance(err, InvalidRequest):
        message = f"{param}: {err.reason}"
    return from_status(name, message, param=param)


def _endpoint(request: web.Request) -> str:
    """The metrics label of ``request``: its route's pattern (``/v1/models/{model}``), ``other`` off the routes.

    A label per path would let any scanner of random paths grow the series without bound.
    """
    resource = request.match_info.route.resource
    return "other" if resource is None else resource.canonical


class OpenAIServer:
    """The OpenAI-compatible endpoint (see the module docstring).

    Parameters
    ----------
    gateway : Gateway
        The running gateway (its loop serves this server too).
    config : OpenAIConfig
    """

    def __init__(self, gateway: Gateway, config: OpenAIConfig) -> None:
        self.gateway = gateway
        self.config = config
        self._runner: web.AppRunner | None = None
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.open = 0
        self.store = ResponseStore(config.max_stored_responses, config.max_stored_bytes)

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 30.0) -> None:
        """Bind and serve on the gateway's loop; returns once listening.

        Raises
        ------
        OpenAIServerError
            The gateway is not running, the port cannot be bound, or TLS fails.
        """
        loop = self.gateway.loop
        if loop is None or not loop.is_running():
            raise OpenAIServerError("the gateway is not running")
        # The gateway's own certificate files where the port shares its TLS (the launcher's case): one
        # reload for both ports, counted in the gateway's metrics.
        shared = self.gateway.tls if self.config.security == self.gateway.config.security else None
        context = self.config.ssl_context() if shared is None else shared.ssl_context()
        try:
            asyncio.run_coroutine_threadsafe(self._start(context), loop).result(timeout_s)
        except OSError as err:
            raise OpenAIServerError(f"cannot bind {self.config.host}:{self.config.port}: {err}") from err

    async def _start(self, context: ssl.SSLContext | None) -> None:
        app = web.Application(client_max_size=contract.MAX_MESSAGE_BYTES, middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/responses/{id}", self._stored)
        app.router.add_delete("/v1/responses/{id}", self._forget)
        app.router.add_get(HEALTH_PATH, self._health)
        # handler_cancellation: a departed client cancels its handler, so its request is cancelled.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=STOP_GRACE_S)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port, ssl_context=context)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner

    def stop(self, timeout_s: float = STOP_GRACE_S + 5.0) -> None:
        """Stop listening; requests in flight get :data:`STOP_GRACE_S`, then are cancelled; idempotent."""
        loop, runner = self.gateway.loop, self._runner
        self._runner = None
        if loop is None or runner is None or not loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout_s)
        except TimeoutError:
            _log.error("openai: requests in flight did not end within %.0f s of stop", timeout_s)

    @property
    def url(self) -> str:
        """The base URL clients give the ``openai`` client (``.../v1``)."""
        scheme = "https" if self.config.security.tls else "http"
        return f"{scheme}://{self.config.host}:{self.config.port}/v1"

    def metrics_text(self) -> str:
        """This endpoint's metrics in the Prometheus text format (the launcher serves them at ``/metrics``)."""
        lines = [
            "# HELP openai_requests_total OpenAI-compatible requests answered, by endpoint and HTTP status.",
            "# TYPE openai_requests_total counter",
            *(f'openai_requests_total{{endpoint="{e}",code="{c}"}} {n}'
              for (e, c), n in sorted(self.requests.items())),
            "# HELP openai_requests_open OpenAI-compatible requests in flight.",
            "# TYPE openai_requests_open gauge",
            f"openai_requests_open {self.open}",
        ]
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ plumbing
    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Every answer, errors included, as OpenAI's JSON; counted by endpoint and status."""
        self.open += 1
        try:
            if request.path != HEALTH_PATH:
                self._ready()
            response = await handler(request)
        except OpenAIError as err:
            response = web.json_response(err.body(), status=err.http_status)
        except web.HTTPException as err:
            # aiohttp's own refusals: unknown route (404), method (405), body too large (413).
            name = {404: status.NOT_FOUND, 413: status.INVALID_ARGUMENT}.get(err.status, status.INVALID_ARGUMENT)
            reason = err.reason if err.status != 413 else f"larger than {contract.MAX_MESSAGE_BYTES} bytes"
            body = OpenAIError(name, f"{request.method} {request.path}: {reason}").body()
            response = web.json_response(body, status=err.status)
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client left: nothing to answer
        except Exception as err:  # noqa: BLE001 - a bug: answered as 500 (logged), the server stays up
            _log.exception("openai: %s %s failed", request.method, request.path)
            response = web.json_response(from_status(status.INTERNAL, f"internal error: {err!r}").body(), status=500)
        finally:
            self.open -= 1
        self.requests[(_endpoint(request), response.status)] += 1
        return response

    def _key(self, request: web.Request) -> ApiKey | None:
        header = request.headers.get("Authorization")
        try:
            return self.gateway.check_key(bearer_key([] if header is None else [("authorization", header)]))
        except Refused as err:
            raise OpenAIError(err.code, f"{err}: send the header 'Authorization: Bearer <key>'",
                              code="invalid_api_key") from err

    async def _body(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise BadRequest("body", f"is not JSON: {err}") from err

    def _ready(self) -> None:
        """Refuse (503) while the ensemble is not ready: every route, so that a load balancer that probes
        ``/v1/models`` sends no traffic early either."""
        ready, reason = self.gateway.health
        if not ready:
            raise OpenAIError(status.UNAVAILABLE, f"the server is not ready ({reason}); retry shortly")

    def _served(self, model: str) -> None:
        if model not in self.config.models:
            raise OpenAIError(status.NOT_FOUND, f"model {model!r} does not exist; served: "
                                                f"{', '.join(self.config.models)}", param="model",
                              code="model_not_found")

    # ------------------------------------------------------------------ routes
    async def _health(self, request: web.Request) -> web.Response:
        """Readiness for load balancers (no key needed): 200 when the ensemble serves, else 503 and why."""
        ready, reason = self.gateway.health
        return web.json_response({"status": "ready" if ready else "not ready", "reason": None if ready else reason},
                                 status=200 if ready else 503)

    async def _models(self, request: web.Request) -> web.Response:
        self._key(request)
        return web.json_response({"object": "list", "data": [self._model_object(m) for m in self.config.models]})

    async def _model(self, request: web.Request) -> web.Response:
        self._key(request)
        model = request.match_info["model"]
        self._served(model)
        return web.json_response(self._model_object(model))

    def _model_object(self, model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": 0, "owned_by": _OWNER}

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        key = self._key(request)
        plan = parse_chat(await self._body(request), self.config.default_max_tokens)
        return await self._serve(request, plan, key)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        key = self._key(request)
        plan = parse_completion(await self._body(request))
        return await self._serve(request, plan, key)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        key = self._key(request)
        body = await self._body(request)
        owner = None if key is None else key.id
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        items = None
        if previous is not None:
            if not isinstance(previous, str):
                raise BadRequest("previous_response_id", "must be a string")
            items = self.store.get(owner, previous).items
        parsed = parse_responses(body, self.config.default_max_tokens, items)
        output = ResponsesOutput(parsed)
        answer = await self._serve(request, parsed.plan, key, output)
        if output.response is not None:
            self.store.put(owner, parsed, output.response)
        return answer

    async def _stored(self, request: web.Request) -> web.Response:
        key = self._key(request)
        stored = self.store.get(None if key is None else key.id, request.match_info["id"])
        return web.json_response(stored.response)

    async def _forget(self, request: web.Request) -> web.Response:
        key = self._key(request)
        response_id = request.match_info["id"]
        self.store.delete(None if key is None else key.id, response_id)
        return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def _serve(self, request: web.Request, plan: Plan, key: ApiKey | None,
                     output: Output | None = None) -> web.StreamResponse:
        """Run ``plan``'s choices (one gateway request each, concurrently) and answer with ``output``."""
        self._served(plan.model)
        out: Output = ChatOutput(plan) if output is None else output
        # Async generators: a refusal (key over its streams, draining) raises on its first step.
        streams = [self.gateway.infer(plan.infer_request(plan.model, i), key) for i in range(plan.n)]
        try:
            if not plan.stream:
                outcomes = await _together(self._collect(plan, s, None) for s in streams)
                return web.json_response(out.body([result for result, _ in outcomes]))
            return await self._stream(request, plan, out, streams)
        except Refused as err:
            raise OpenAIError(err.code, str(err)) from err
        finally:
            for stream in streams:
                await stream.aclose()

    async def _collect(self, plan: Plan, responses: AsyncIterator[Any],
                       on_chunk: Callable[[Chunk], Awaitable[None]] | None) -> tuple[Result, Chunk]:
        """Read the request's responses to the end; return the result and the final chunk (the text and
        thinking not yet handed to ``on_chunk``).

        Raises
        ------
        OpenAIError
            The request failed (a refusal in-band or an error RESULT).
        """
        assembler = StreamAssembler(plan.kind)
        async for response in responses:
            if response.error_message:
                err = from_server_error(InferenceServerException(msg=response.error_message))
                raise _mapped(plan, err)
            try:
                chunk = assembler.feed(grpcclient.InferResult(response.infer_response))
            except ClientError as err:
                raise _mapped(plan, err) from err
            if chunk is not None and on_chunk is not None:
                await on_chunk(chunk)
        try:
            final = assembler.finish()
        except ClientError as err:
            raise _mapped(plan, err) from err
        result = final.result
        if result is None:
            raise from_status(status.INTERNAL, "the response stream ended without a result")
        if result.finish_reason == "error":
            raise _mapped(plan, error_for_status(result.status, result.error or "no reason given", result=result))
        return result, final

    async def _stream(self, request: web.Request, plan: Plan, out: Output,
                      streams: Sequence[AsyncIterator[Any]]) -> web.StreamResponse:
        sse: web.StreamResponse | None = None
        lock = asyncio.Lock()  # choices stream concurrently: one event is written whole

        async def send(events: list[dict[str, Any]]) -> web.StreamResponse:
            nonlocal sse
            async with lock:
                if sse is None:  # the headers wait for the first token: an early failure keeps its status
                    sse = web.StreamResponse(status=200, headers=_SSE_HEADERS)
                    await sse.prepare(request)
                    events = [*out.start(), *events]
                for event in events:
                    await sse.write(out.frame(event))
                return sse

        async def choice(i: int) -> Result:
            async def on_chunk(chunk: Chunk) -> None:
                await send(out.piece(i, chunk))

            result, last = await self._collect(plan, streams[i], on_chunk)
            await send(out.finish(i, result, last))
            return result

        try:
            results = await _together(choice(i) for i in range(plan.n))
        except OpenAIError as err:
            if sse is None:
                raise
            for event in out.failed(err.body()):
                await sse.write(out.frame(event))
            return sse
        response = await send(out.end(results))
        if out.done:
            await response.write(out.done)
        await response.write_eof()
        return response


class Output(Protocol):
    """What one endpoint sends for a request's results (:class:`~openai_api.response.ChatOutput`,
    :class:`~openai_api.responses.ResponsesOutput`): the server runs the choices, this shapes them."""

    done: bytes

    def start(self) -> list[dict[str, Any]]: ...
    def piece(self, choice: int, chunk: Chunk) -> list[dict[str, Any]]: ...
    def finish(self, choice: int, result: Result, last: Chunk) -> list[dict[str, Any]]: ...
    def end(self, results: list[Result]) -> list[dict[str, Any]]: ...
    def body(self, results: list[Result]) -> dict[str, Any]: ...
    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]: ...
    def frame(self, event: dict[str, Any]) -> bytes: ...


_T = TypeVar("_T")


async def _together(coroutines: Iterable[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run ``coroutines`` concurrently; their results in order.  The first to fail cancels the others
    (a choice that fails fails the request) and its exception is raised as it is."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and (error := task.exception()) is not None:
                raise error
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
