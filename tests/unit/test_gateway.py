"""The gateway's configuration and the tritonserver restrictions it relies on (the traffic itself is
tested against a real tritonserver in tests/integration/test_abuse.py)."""

from __future__ import annotations

import pytest

from deploy.gateway import (
    GRPC_SECRET_METADATA,
    SECRET_HEADER,
    Gateway,
    GatewayConfig,
    GatewayError,
    input_error,
    new_secret,
    restriction_args,
)

SECRET = "s" * 32


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"upstream": "nohost"}, r"^upstream: must be host:port, got 'nohost'$"),
        ({"secret": "short"}, r"^secret: must be at least 16 characters$"),
        ({"port": 70000}, r"^port: must be in \[0, 65535\], got 70000$"),
        ({"public_models": ()}, r"^public_models: must not be empty$"),
        ({"max_in_flight_per_stream": 0}, r"^max_in_flight_per_stream: must be >= 1, got 0$"),
        ({"drain_timeout_s": 0}, r"^drain_timeout_s: must be > 0, got 0$"),
    ],
)
def test_config_rejects(fields: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"upstream": "127.0.0.1:1", "secret": SECRET}
    with pytest.raises(GatewayError, match=match):
        GatewayConfig(**{**base, **fields})  # type: ignore[arg-type]


def test_restrictions_cover_inference_and_control_but_not_health() -> None:
    grpc_flag, http_flag = restriction_args(SECRET)
    apis = "inference,model-repository,shared-memory,trace,logging,statistics,model-config"
    assert grpc_flag == f"--grpc-restricted-protocol={apis}:{SECRET_HEADER}={SECRET}"
    assert http_flag == f"--http-restricted-api={apis}:{SECRET_HEADER}={SECRET}"
    assert "health" not in apis and "metadata" not in apis
    # Triton 2.51 reads the gRPC key with this prefix (measured: "expecting header 'triton-grpc-protocol-...'").
    assert GRPC_SECRET_METADATA == f"triton-grpc-protocol-{SECRET_HEADER}"


def test_secrets_are_fresh_and_long() -> None:
    secrets = {new_secret() for _ in range(100)}
    assert len(secrets) == 100 and all(len(s) >= 43 for s in secrets)


def test_start_binds_and_stop_is_idempotent() -> None:
    gateway = Gateway(GatewayConfig(upstream="127.0.0.1:1", secret=SECRET))
    gateway.start()
    try:
        assert gateway.port > 0 and gateway.health == (True, "")
        gateway.set_health(False, "grammar probe failed")
        assert gateway.health == (False, "grammar probe failed")
    finally:
        gateway.stop()
    gateway.stop()


def _config(max_batch_size: int = 0) -> object:
    from tritonclient.grpc.model_config_pb2 import DataType, ModelConfig, ModelInput

    return ModelConfig(name="m", max_batch_size=max_batch_size, input=[
        ModelInput(name="TEXT", data_type=DataType.TYPE_STRING, dims=[1]),
        ModelInput(name="IDS", data_type=DataType.TYPE_INT32, dims=[-1], optional=True),
    ])


def _request(*tensors: tuple[str, str, list[int]]) -> object:
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name="m")
    for name, datatype, shape in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    return request


@pytest.mark.parametrize(
    ("tensors", "batch", "problem"),
    [
        ([("TEXT", "BYTES", [1])], 0, None),
        ([("TEXT", "BYTES", [1]), ("IDS", "INT32", [7])], 0, None),
        ([("TEXT", "BYTES", [4, 1]), ("IDS", "INT32", [4, 7])], 8, None),
        ([("TEXT", "INT32", [1])], 0, "input 'TEXT': datatype INT32, expected BYTES"),
        ([("TEXT", "", [1])], 0, "input 'TEXT': datatype (none), expected BYTES"),
        ([("TEXT", "BYTES", [2])], 0, "input 'TEXT': shape [2], expected [1] (-1: any size)"),
        ([("TEXT", "BYTES", [1])], 8, "input 'TEXT': shape [1], expected [-1, 1] (-1: any size)"),
        ([("IDS", "INT32", [3])], 0, "input 'TEXT': is required"),
        ([("TEXT", "BYTES", [1]), ("X", "BYTES", [1])], 0, "input 'X': not an input of m; expected one of IDS, TEXT"),
        ([("TEXT", "BYTES", [1]), ("TEXT", "BYTES", [1])], 0, "input 'TEXT': given more than once"),
    ],
)
def test_input_error_names_the_input_and_the_reason(tensors: list[tuple[str, str, list[int]]], batch: int,
                                                     problem: str | None) -> None:
    assert input_error(_request(*tensors), _config(batch)) == problem  # type: ignore[arg-type]
