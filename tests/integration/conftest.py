"""Fixtures of the integration tests: one served ensemble per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from client import Client
from deploy.server import TritonServer
from tests.integration.served import start_ensemble


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    srv = start_ensemble(tmp_path_factory.mktemp("served"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: TritonServer) -> Iterator[Client]:
    with Client(server.grpc_url) as c:
        yield c
