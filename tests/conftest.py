"""Shared pytest configuration: markers, skips, ordering, and a server fixture.

Markers
-------
``triton``
    Needs a ``tritonserver`` (bundled in ``nvidia-pytriton``, or the image's).
``gpu``
    Needs an NVIDIA GPU (``nvidia-smi -L``).
``trtllm``
    Needs the ``tensorrt_llm`` package in ``$TRTLLM_PYTHON`` (the NGC ``trtllm-python-py3`` image).
``slow``
    Takes more than a few seconds; deselect with ``-m "not slow"``.

A selected test whose marker's part is missing is skipped with the reason, or,
under ``REQUIRE_ASSETS=1`` (``make test``, ``make test-gpu``), the run stops
with a usage error naming every missing part: see :mod:`tests.support.assets`,
the one home of what the tests need and of that switch.

Unit tests (``tests/unit``) run before integration tests so that a broken
building block fails fast, before minutes of server start-ups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support import assets

if TYPE_CHECKING:
    # Imported where a server starts: deploy.server imports the gateway (grpc_health, tritonclient), which
    # TensorRT-LLM's environment lacks, and every test module collects under this file.
    from deploy.server import TritonServer

_MARKERS = {
    "triton": "needs the tritonserver bundled in nvidia-pytriton (skipped when missing; REQUIRE_ASSETS=1: an error)",
    "gpu": "needs an NVIDIA GPU (skipped when missing; REQUIRE_ASSETS=1: an error)",
    "trtllm": "needs the tensorrt_llm package in $TRTLLM_PYTHON (skipped when missing; REQUIRE_ASSETS=1: an error)",
    "slow": "takes more than a few seconds (deselect with -m 'not slow')",
    "e2e": "the full ensemble on the real model over gRPC (select with -m e2e)",
}

_UNIT_DIR = Path(__file__).parent / "unit"


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in _MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    assets.required()  # a malformed REQUIRE_ASSETS stops the run before collection


# trylast: after `-m` has deselected what this run leaves out, so `make test` (no GPU tests) never
# asks for CUDA and `make test-gpu` never for tritonserver.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing: dict[str, None] = {}  # an ordered set of the reasons
    for item in items:
        reasons = assets.marker_missing_reasons(item)
        if reasons:
            missing.update(dict.fromkeys(reasons))
            item.add_marker(pytest.mark.skip(reason="; ".join(reasons)))
    if missing and assets.required():
        # There a missing part is a broken install, not a reason to skip.
        raise pytest.UsageError(f"{assets.SWITCH}=1 but " + "; ".join(missing))
    # Stable sort: unit tests first, every other test keeps its relative order.
    items.sort(key=lambda item: 0 if item.path.is_relative_to(_UNIT_DIR) else 1)


@pytest.fixture
def start_triton(tmp_path: Path) -> Iterator[Callable[..., TritonServer]]:
    """Start real tritonservers on free loopback ports; all are stopped at teardown.

    Call it as ``start_triton(model_repository, models=("m",), **ServerConfig fields)``;
    it returns a ready :class:`deploy.server.TritonServer`.  The log goes to
    ``tmp_path/tritonserver-<n>.log`` unless ``log_file`` is given.
    """
    from deploy.server import ServerConfig, TritonServer

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
