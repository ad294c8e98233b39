"""The gRPC gateway: the only endpoint clients reach; ``tritonserver`` listens on loopback behind it.

Why it exists
-------------
Triton 2.51 (the newest server reachable here, bundled in ``nvidia-pytriton``)
segfaults on some client behaviour in its gRPC stream handler
(``src/grpc/stream_infer_handler.cc`` / ``infer_handler.h``):

1. **``triton_grpc_error: true`` streams.**  On an error response,
   ``StreamInferResponseComplete`` calls ``WriteGRPCErrorResponse``, which
   ``Finish``-es the stream and deletes the response payload even before the
   FINAL flag.  ``Context::IsCancelled`` consumes its one-shot error flag in
   ``Process`` so ``HandleCancellation`` later logs ``HandleCancellation called
   even when the context was not cancelled ... step COMPLETE`` and never cancels
   the in-flight requests; ``HandleCompletion`` then re-queues every state of
   the stream with an alarm, so one state gets two completion-queue tags: the
   first releases it (``context_ = nullptr``), the second dereferences it in
   ``ModelStreamInferHandler::Process``.  Whether the tags land in the crashing
   order depends on timing, so it shows under CPU load: measured here, a cycle
   of three rejected requests on header streams killed 2.51 after 59 requests
   with two busy cores (0 in 800 on an idle machine in an earlier probe).
   Fixed upstream in server PR 8708 (first in 2.68).
2. **Client cancellation / disconnect with responses in flight.**  The
   completion-queue loop marks the notification received before ``Process``
   takes ``step_mtx_``; a FINAL callback in that gap marks the state
   CANCELLED and re-queues it, ``HandleCancellation`` releases it while its
   alarm is still queued: a null dereference (server PRs 7840, 8078; 2.53+).
3. **Ensemble steps never see a client's cancellation** (server issue 6739,
   still open): a decoupled ``llm`` step keeps decoding a departed client's
   sequence to ``max_tokens``.

No server flag avoids these; only a client that never sends the header and
never cancels or drops a stream with requests in flight is safe.  The gateway
is that client, whatever the real client does:

* it **never forwards ``triton_grpc_error``** (errors reach clients as data
  in ``RESULT``, and Triton's own in-band ``error_message`` otherwise);
* it **never cancels or drops an upstream stream** with requests in flight:
  when a client cancels, times out, disconnects or is killed, the gateway sends
  ``CANCEL=<request id>`` to ``llm`` for each of that stream's requests,
  reads their remaining responses until every FINAL flag, and only then
  half-closes the upstream stream;
* it **renames every request id** to an unguessable one (128 random bits)
  and maps responses back, so no client can name another client's request;
* it **serves only the public models** (``constrained_llm``): ``grammar``,
  ``llm``, ``preprocessing`` and ``postprocessing`` are refused with
  ``PERMISSION_DENIED``, as are model-repository, shared-memory, trace and
  log-settings calls.  ``tritonserver`` itself binds loopback and restricts
  inference on its own endpoints to a header carrying a secret generated at
  start (``--grpc-restricted-protocol`` / ``--http-restricted-api``), which
  only the gateway holds;
* readiness (``ServerReady``, ``ModelReady``) also reflects the supervisor's
  health probe (:meth:`Gateway.set_health`), so a broken composing model turns
  readiness false even while Triton still reports ready.

Cost: one more loopback hop and a protobuf parse + serialize per streamed
response.  Measured on the 2-core machine, 10 interleaved streaming requests
each way on one server: time per request gateway/direct 0.97 (within noise),
inter-token p50 94.6 vs 97.8 ms, time to first token p50 217 vs 216 ms.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

import grpc
from grpc import aio
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

__all__ = ["GRPC_SECRET_METADATA", "SECRET_HEADER", "Gateway", "GatewayConfig", "GatewayError"]

_log = logging.getLogger(__name__)

SERVICE: Final = "inference.GRPCInferenceService"
#: Key of the internal secret in tritonserver's ``--grpc-restricted-protocol`` /
#: ``--http-restricted-api`` flags.  Triton 2.51 expects it in gRPC metadata as
#: ``triton-grpc-protocol-<key>`` (:data:`GRPC_SECRET_METADATA`) and in HTTP
#: headers as ``<key>``.
SECRET_HEADER: Final = "x-constrained-llm-internal"
GRPC_SECRET_METADATA: Final = f"triton-grpc-protocol-{SECRET_HEADER}"
_FINAL: Final = "triton_final_response"
_EMPTY_FINAL: Final = "triton_enable_empty_final_response"
# Bounds on what one client message may be: the constraint payload limit is
# 2 MiB (grammar_backend.spec), so 64 MiB leaves room for any valid request and
# keeps one message from taking the gateway's memory.
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
_PER_MODEL: Final = ("ModelReady", "ModelMetadata", "ModelConfig", "ModelStatistics")
# Unary calls forwarded to tritonserver (the per-model ones for public models only).
_FORWARDED: Final = ("ServerLive", "ServerReady", "ServerMetadata", *_PER_MODEL)
_REFUSED: Final = (
    "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",
    "TraceSetting", "LogSettings",
)


class GatewayError(RuntimeError):
    """The gateway could not start (bad config, port taken, upstream unreachable)."""


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of :class:`Gateway`.

    Attributes
    ----------
    upstream : str
        ``host:port`` of tritonserver's (loopback) gRPC endpoint.
    secret : str
        The value of :data:`SECRET_HEADER` that tritonserver requires for inference.
    host, port : str, int
        Where clients connect (port 0 picks a free one).
    public_models : tuple of str
        Models clients may call.
    cancel_model : str
        Model that takes ``CANCEL=<request id>`` (``llm``).
    max_in_flight_per_stream : int
        Requests one client stream may have running; more are refused with
        ``RESOURCE_EXHAUSTED`` in-band.
    max_streams : int
        Concurrent client RPCs; more are refused by gRPC with ``RESOURCE_EXHAUSTED``.
    drain_timeout_s : float
        After a client leaves, how long its cancelled requests may take to send
        their FINAL response before the gateway gives up on them (logged).
    """

    upstream: str
    secret: str
    host: str = "127.0.0.1"
    port: int = 0
    public_models: tuple[str, ...] = ("constrained_llm",)
    cancel_model: str = "llm"
    max_in_flight_per_stream: int = 64
    max_streams: int = 4096
    drain_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.upstream or ":" not in self.upstream:
            raise GatewayError(f"upstream: must be host:port, got {self.upstream!r}")
        if len(self.secret) < 16:
            raise GatewayError("secret: must be at least 16 characters")
        if not 0 <= self.port <= 65535:
            raise GatewayError(f"port: must be in [0, 65535], got {self.port}")
        if not self.public_models:
            raise GatewayError("public_models: must not be empty")
        for name in ("max_in_flight_per_stream", "max_streams"):
            if getattr(self, name) < 1:
                raise GatewayError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.drain_timeout_s > 0:
            raise GatewayError(f"drain_timeout_s: must be > 0, got {self.drain_timeout_s}")


@dataclass
class _Pending:
    """One client request forwarded upstream and not finished yet."""

    client_id: str
    model: str
    wants_empty_final: bool


@dataclass(frozen=True)
class _Health:
    ready: bool = True
    reason: str = ""


def _in_band_error(request: pb.ModelInferRequest, status: str, message: str) -> pb.ModelStreamInferResponse:
    """An in-band error for one stream request (Triton's own form: ``error_message``), marked final."""
    response = pb.ModelStreamInferResponse(error_message=f"{status}: {message}")
    response.infer_response.model_name = request.model_name
    response.infer_response.id = request.id
    response.infer_response.parameters[_FINAL].bool_param = True
    return response


def input_error(request: pb.ModelInferRequest, config: mc.ModelConfig) -> str | None:
    """Why ``request``'s tensors do not fit ``config``'s declared inputs, or None when they do.

    tritonserver 2.51 answers a wrong datatype, shape or tensor name on a
    stream with an in-band message that carries no status; checked here, the
    client gets ``INVALID_ARGUMENT`` naming the input.
    """
    declared = {spec.name: spec for spec in config.input}
    seen: set[str] = set()
    for tensor in request.inputs:
        spec = declared.get(tensor.name)
        where = f"input {tensor.name!r}"
        if spec is None:
            return f"{where}: not an input of {config.name}; expected one of {', '.join(sorted(declared))}"
        if tensor.name in seen:
            return f"{where}: given more than once"
        seen.add(tensor.name)
        expected = mc.DataType.Name(spec.data_type).removeprefix("TYPE_").replace("STRING", "BYTES")
        if tensor.datatype != expected:
            return f"{where}: datatype {tensor.datatype or '(none)'}, expected {expected}"
        dims = ([-1] if config.max_batch_size > 0 else []) + list(spec.dims)
        shape = list(tensor.shape)
        if len(shape) != len(dims) or any(d != -1 and d != n for d, n in zip(dims, shape, strict=True)):
            return f"{where}: shape {shape}, expected {dims} (-1: any size)"
    missing = sorted(name for name, spec in declared.items() if not spec.optional and name not in seen)
    if missing:
        return f"input {missing[0]!r}: is required"
    return None


def _unavailable(model: str, client_id: str, err: BaseException) -> pb.ModelStreamInferResponse:
    reason = err.details() if isinstance(err, grpc.aio.AioRpcError) else "upstream stream closed"
    return _in_band_error(pb.ModelInferRequest(model_name=model, id=client_id), "UNAVAILABLE",
                          f"tritonserver failed: {reason}")


class _StreamSession:
    """One client ``ModelStreamInfer`` call and its upstream stream."""

    def __init__(self, gateway: Gateway, context: aio.ServicerContext) -> None:
        self.gw = gateway
        self.context = context
        self.pending: dict[str, _Pending] = {}
        self.upstream: Any = None
        self.pump: asyncio.Task[None] | None = None
        self.client_gone = False
        self.idle = asyncio.Event()  # set whenever nothing is pending
        self.idle.set()
        self.upstream_error: grpc.RpcError | None = None

    async def _open_upstream(self) -> None:
        self.upstream = self.gw.stream_stub(metadata=self.gw.upstream_metadata)
        self.pump = asyncio.get_running_loop().create_task(self._pump())

    async def run(self) -> None:
        try:
            while True:
                request = await self.context.read()
                if request is aio.EOF:
                    break
                await self._forward(request)
            # Normal half-close: answer everything pending, then end.
            await self._finish_upstream()
        except BaseException:
            # The client cancelled, hit its deadline, disconnected or was killed
            # (CancelledError), or the handler failed: either way the upstream
            # stream is drained, never dropped (dropping it cancels it upstream).
            self.client_gone = True
            self.gw.spawn(self._after_departure())
            raise

    async def _forward(self, request: pb.ModelInferRequest) -> None:
        model = request.model_name
        if model not in self.gw.config.public_models:
            await self._write(_in_band_error(request, "PERMISSION_DENIED",
                                             f"model {model!r} is not served to clients; "
                                             f"call {', '.join(self.gw.config.public_models)}"))
            return
        if len(self.pending) >= self.gw.config.max_in_flight_per_stream:
            await self._write(_in_band_error(request, "RESOURCE_EXHAUSTED",
                                             f"{len(self.pending)} requests already in flight on this stream "
                                             f"(limit {self.gw.config.max_in_flight_per_stream})"))
            return
        if self.upstream_error is not None:
            await self._write(_unavailable(model, request.id, self.upstream_error))
            return
        try:
            config = await self.gw.model_config(model)
        except grpc.RpcError as err:
            await self._write(_unavailable(model, request.id, err))
            return
        problem = input_error(request, config)
        if problem is not None:
            await self._write(_in_band_error(request, "INVALID_ARGUMENT", problem))
            return
        param = request.parameters.get(_EMPTY_FINAL)
        wants_empty_final = bool(param is not None and param.bool_param)
        internal_id = secrets.token_hex(16)
        client_id = request.id
        self.pending[internal_id] = _Pending(client_id, model, wants_empty_final)
        self.idle.clear()
        request.id = internal_id
        # Always ask for the FINAL marker: it is how the gateway knows a request is over.
        request.parameters[_EMPTY_FINAL].bool_param = True
        if self.upstream is None:
            await self._open_upstream()
        try:
            await self.upstream.write(request)
        except (grpc.RpcError, asyncio.InvalidStateError) as err:
            # tritonserver is down or restarting: this request ends now, in-band.
            entry = self.pending.pop(internal_id, None)
            if not self.pending:
                self.idle.set()
            if entry is not None:  # else the pump has already answered it
                await self._write(_unavailable(model, client_id, err))

    async def _write(self, response: pb.ModelStreamInferResponse) -> None:
        if self.client_gone:
            return
        try:
            await self.context.write(response)
        except (asyncio.InvalidStateError, RuntimeError, grpc.RpcError):
            self.client_gone = True

    async def _pump(self) -> None:
        """Upstream responses -> client, with ids mapped back; tracks FINAL flags."""
        try:
            async for response in self.upstream:
                infer = response.infer_response
                internal_id = infer.id
                entry = self.pending.get(internal_id)
                if entry is None:
                    _log.warning("gateway: response for unknown request id dropped")
                    continue
                final_param = infer.parameters.get(_FINAL)
                # Triton marks every response of a decoupled model with the FINAL
                # parameter (true/false); an error the frontend raises before the
                # request starts (bad dtype, unknown input) carries none and is the
                # only response that request gets.
                final = final_param.bool_param if final_param is not None else bool(response.error_message)
                infer.id = entry.client_id
                if response.error_message:
                    response.error_message = response.error_message.replace(internal_id, entry.client_id)
                if final:
                    del self.pending[internal_id]
                    if not self.pending:
                        self.idle.set()
                    if not entry.wants_empty_final:
                        del infer.parameters[_FINAL]
                        if not infer.outputs and not response.error_message:
                            continue
                await self._write(response)
        except grpc.RpcError as err:
            # tritonserver died or refused the stream: every pending request ends
            # now with UNAVAILABLE instead of hanging its client.
            self.upstream_error = err
            _log.error("gateway: upstream stream failed: %s", err)
            for entry in list(self.pending.values()):
                await self._write(_unavailable(entry.model, entry.client_id, err))
        finally:
            self.pending.clear()
            self.idle.set()

    async def _finish_upstream(self) -> None:
        if self.upstream is None or self.pump is None:
            return
        await self.idle.wait()
        if self.upstream_error is None:
            await self.upstream.done_writing()
        await self.pump

    async def _after_departure(self) -> None:
        """Cancel what the departed client left running, drain it, then close upstream."""
        targets = [rid for rid, p in self.pending.items() if p.model in self.gw.config.public_models]
        if targets:
            await self.gw.cancel_requests(targets)
        try:
            await asyncio.wait_for(self._finish_upstream(), self.gw.config.drain_timeout_s)
        except TimeoutError:
            _log.error("gateway: %d cancelled requests did not finish within %.0f s; the upstream stream "
                       "is kept open", len(self.pending), self.gw.config.drain_timeout_s)
            self.gw.keep_open(self.upstream)


class Gateway:
    """The client-facing gRPC endpoint (see the module docstring).

    Parameters
    ----------
    config : GatewayConfig
        Upstream, secret, bind address and limits.
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.upstream_metadata = ((GRPC_SECRET_METADATA, config.secret),)
        self.port = config.port
        self._kept_open: list[Any] = []  # upstream calls that must not be garbage-collected (= cancelled)
        self._health = _Health()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: aio.Server | None = None
        self._channel: aio.Channel | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.stream_stub: Any = None
        self._unary: dict[str, Any] = {}
        self._configs: dict[str, mc.ModelConfig] = {}
        self._stop = asyncio.Event()
        self._grace_s = 5.0

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 30.0) -> None:
        """Bind and serve on a thread of its own; returns once serving.

        Raises
        ------
        GatewayError
            The port could not be bound.
        """
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                loop.run_until_complete(self._main(started))
            except BaseException as err:  # noqa: BLE001 - reported to start()'s caller
                failure.append(err)
                started.set()
            finally:
                # Whatever is left (drains of departed clients) ends with the loop.
                leftover = asyncio.all_tasks(loop)
                for task in leftover:
                    task.cancel()
                if leftover:
                    loop.run_until_complete(_gather(leftover))
                loop.close()

        self._thread = threading.Thread(target=run, name="grpc-gateway", daemon=True)
        self._thread.start()
        if not started.wait(timeout_s):
            raise GatewayError(f"gateway did not start within {timeout_s} s")
        if failure:
            raise GatewayError(f"gateway failed to start: {failure[0]}") from failure[0]

    async def _main(self, started: threading.Event) -> None:
        await self._serve(started)
        await self._stop.wait()
        if self._server is not None:
            await self._server.stop(self._grace_s)
        if self._channel is not None:
            await self._channel.close()

    async def _serve(self, started: threading.Event) -> None:
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self._channel = aio.insecure_channel(self.config.upstream, options=options)
        ser = pb.ModelStreamInferResponse.SerializeToString
        self.stream_stub = self._channel.stream_stream(
            f"/{SERVICE}/ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        handlers: dict[str, grpc.RpcMethodHandler] = {
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                self._model_stream_infer, request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=ser),
        }
        service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        for name in (*_FORWARDED, "ModelInfer", *_REFUSED):
            method = service.methods_by_name[name]
            req_cls = getattr(pb, method.input_type.name)
            resp_cls = getattr(pb, method.output_type.name)
            if name in _FORWARDED:
                self._unary[name] = self._channel.unary_unary(
                    f"/{SERVICE}/{name}", request_serializer=req_cls.SerializeToString,
                    response_deserializer=resp_cls.FromString)
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                self._unary_handler(name), request_deserializer=req_cls.FromString,
                response_serializer=resp_cls.SerializeToString)
        self._server = aio.server(
            options=options, maximum_concurrent_rpcs=self.config.max_streams,
        )
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        address = f"{self.config.host}:{self.config.port}"
        port = self._server.add_insecure_port(address)
        if port == 0:
            raise GatewayError(f"cannot bind {address}")
        self.port = port
        await self._server.start()
        started.set()

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop serving (in-flight RPCs get ``grace_s``); idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        self._grace_s = grace_s
        loop.call_soon_threadsafe(self._stop.set)
        thread.join(grace_s + 10)

    # ------------------------------------------------------------------ health
    def set_health(self, ready: bool, reason: str = "") -> None:
        """Set by the supervisor's probe: while false, readiness RPCs answer not ready."""
        self._health = _Health(ready=ready, reason=reason)

    @property
    def health(self) -> tuple[bool, str]:
        return self._health.ready, self._health.reason

    # ------------------------------------------------------------------ handlers
    def keep_open(self, call: Any) -> None:
        """Hold a reference to an upstream call that must stay open until the gateway stops."""
        self._kept_open.append(call)

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` detached from the calling RPC (it outlives a cancelled client call)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _model_stream_infer(self, _request_iterator: AsyncIterator[Any], context: aio.ServicerContext) -> None:
        await _StreamSession(self, context).run()

    def _unary_handler(self, name: str) -> Any:
        async def handle(request: Any, context: aio.ServicerContext) -> Any:
            return await self._unary_call(name, request, context)

        return handle

    async def _unary_call(self, name: str, request: Any, context: aio.ServicerContext) -> Any:
        if name in _REFUSED:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{name} is not available to clients")
        model = getattr(request, "name", "") or getattr(request, "model_name", "")
        if name in (*_PER_MODEL, "ModelInfer") and model not in self.config.public_models:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"model {model!r} is not served to clients")
        if name == "ModelInfer":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"model {model!r} streams its responses (decoupled): use ModelStreamInfer")
        # Shielded: a client that cancels must not cancel the upstream call (see the module docstring).
        call = self._unary[name](request, metadata=self.upstream_metadata)
        try:
            response = await asyncio.shield(_await(call))
        except grpc.RpcError as err:
            await context.abort(err.code(), err.details() or "")
        if name in ("ServerReady", "ModelReady") and not self._health.ready:
            response.ready = False
        return response

    async def model_config(self, model: str) -> mc.ModelConfig:
        """A public model's configuration, fetched from tritonserver once.

        Raises
        ------
        grpc.RpcError
            tritonserver cannot answer (not cached: the next request asks again).
        """
        config = self._configs.get(model)
        if config is None:
            call = self._unary["ModelConfig"](pb.ModelConfigRequest(name=model), metadata=self.upstream_metadata)
            config = (await asyncio.shield(_await(call))).config
            self._configs[model] = config
        return config

    async def cancel_requests(self, request_ids: list[str]) -> None:
        """Send ``CANCEL`` for each id to ``cancel_model`` on one upstream stream and wait for the answers."""
        call = self.stream_stub(metadata=self.upstream_metadata)
        for rid in request_ids:
            req = pb.ModelInferRequest(model_name=self.config.cancel_model, id=f"cancel-{secrets.token_hex(8)}")
            req.parameters[_EMPTY_FINAL].bool_param = True
            req.inputs.add(name="CANCEL", datatype="BYTES", shape=[1])
            encoded = rid.encode()
            # BYTES tensors travel as 4-byte little-endian length + bytes.
            req.raw_input_contents.append(len(encoded).to_bytes(4, "little") + encoded)
            await call.write(req)
        await call.done_writing()
        try:
            async for response in call:
                if response.error_message:
                    _log.error("gateway: CANCEL failed: %s", response.error_message)
        except grpc.RpcError as err:
            _log.error("gateway: CANCEL stream failed: %s", err)


async def _gather(tasks: set[asyncio.Task[Any]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


async def _await(call: Any) -> Any:
    return await call


def new_secret() -> str:
    """A fresh internal secret (256 random bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def restriction_args(secret: str) -> tuple[str, ...]:
    """tritonserver flags that restrict inference and control APIs to holders of ``secret``.

    Health and metadata stay open on tritonserver's own (loopback) endpoints
    so probes and the launcher's readiness loop work without the secret.
    """
    restricted_grpc = "inference,model-repository,shared-memory,trace,logging,statistics,model-config"
    restricted_http = "inference,model-repository,shared-memory,trace,logging,statistics,model-config"
    return (
        f"--grpc-restricted-protocol={restricted_grpc}:{SECRET_HEADER}={secret}",
        f"--http-restricted-api={restricted_http}:{SECRET_HEADER}={secret}",
    )
