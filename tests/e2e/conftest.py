"""A server shared by modules that need vLLM with the plugin and nothing else configured."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.servers import serve

from vllm_piep.tools.server import ServerOptions, VllmServer


@pytest.fixture(scope="session")
def default_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[VllmServer]:
    """`vllm serve --plugins piep` of the tiny model, one per test process (scripts/test.sh
    runs two): each start costs a minute here. Its users never assume it is fresh, and leave it
    idle and conserved."""
    yield from serve(ServerOptions(model=str(tiny_model), plugin="flag"),
                     tmp_path_factory.mktemp("default_server"))
