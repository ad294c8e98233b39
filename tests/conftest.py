"""Shared pytest configuration: markers, skips, ordering, and a server fixture.

Markers
-------
``triton``
    Needs the ``tritonserver`` bundled in ``nvidia-pytriton``; skipped, with the
    reason, when it cannot be found (an error instead when ``REQUIRE_TRITON=1``,
    as in CI).
``gpu``
    Needs CUDA; skipped when ``torch.cuda.is_available()`` is false.
``trtllm``
    Needs the ``tensorrt_llm`` package (the NGC ``trtllm-python-py3`` image);
    skipped when it cannot be imported.
``slow``
    Takes more than a few seconds; deselect with ``-m "not slow"``.

Unit tests (``tests/unit``) run before integration tests so that a broken
building block fails fast, before minutes of server start-ups.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deploy.server import (
    ServerConfig,
    TritonNotFoundError,
    TritonServer,
    locate_tritonserver,
)

_MARKERS = {
    "triton": "needs the tritonserver bundled in nvidia-pytriton (skipped when it cannot be found)",
    "gpu": "needs a CUDA device (skipped when torch.cuda.is_available() is false)",
    "trtllm": "needs the tensorrt_llm package (skipped when it cannot be imported)",
    "slow": "takes more than a few seconds (deselect with -m 'not slow')",
    "e2e": "the full ensemble on the real model over gRPC (select with -m e2e)",
}

_UNIT_DIR = Path(__file__).parent / "unit"


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in _MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")


@functools.cache
def _triton_missing_reason() -> str | None:
    try:
        locate_tritonserver()
    except TritonNotFoundError as err:
        return f"bundled tritonserver unavailable: {err}"
    return None


@functools.cache
def _gpu_missing_reason() -> str | None:
    # Imported only when a gpu test is collected: `import torch` costs ~1.5 s.
    import torch

    if torch.cuda.is_available():
        return None
    return "CUDA is not available (torch.cuda.is_available() is False)"


@functools.cache
def _trtllm_missing_reason() -> str | None:
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is None:
        return "tensorrt_llm is not installed (the NGC trtllm-python-py3 image has it; see deploy/gpu/README.md)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("triton") is not None:
            reason = _triton_missing_reason()
            if reason is not None:
                if os.environ.get("REQUIRE_TRITON") == "1":
                    # CI sets this: there a missing server is a broken install.
                    raise pytest.UsageError(f"REQUIRE_TRITON=1 but {reason}")
                item.add_marker(pytest.mark.skip(reason=reason))
        for marker, missing in (("trtllm", _trtllm_missing_reason), ("gpu", _gpu_missing_reason)):
            if item.get_closest_marker(marker) is not None:
                reason = missing()
                if reason is not None:
                    item.add_marker(pytest.mark.skip(reason=reason))
    # Stable sort: unit tests first, every other test keeps its relative order.
    items.sort(key=lambda item: 0 if item.path.is_relative_to(_UNIT_DIR) else 1)


@pytest.fixture
def start_triton(tmp_path: Path) -> Iterator[Callable[..., TritonServer]]:
    """Start real tritonservers on free loopback ports; all are stopped at teardown.

    Call it as ``start_triton(model_repository, models=("m",), **ServerConfig fields)``;
    it returns a ready :class:`deploy.server.TritonServer`.  The log goes to
    ``tmp_path/tritonserver-<n>.log`` unless ``log_file`` is given.
    """
    servers: list[TritonServer] = []

    def start(model_repository: Path, **fields: object) -> TritonServer:
        fields.setdefault("log_file", tmp_path / f"tritonserver-{len(servers)}.log")
        config = ServerConfig(model_repository=model_repository, **fields)  # type: ignore[arg-type]
        server = TritonServer(config)
        servers.append(server)
        server.start()
        server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()
