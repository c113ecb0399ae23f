"""Find a model's GGUF blob in a local Ollama store: `ollama:<name>[:tag]` → the blob's path.

Ollama keeps a manifest per tag at <store>/manifests/<registry>/<namespace>/<name>/<tag> (an OCI image manifest)
whose layer of media type application/vnd.ollama.image.model names the GGUF blob by digest, stored at
<store>/blobs/sha256-<hex>. The store is $OLLAMA_MODELS, else ~/.ollama/models. The blob is imported in place
(linked, not copied, where the filesystem allows).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

PREFIX = "ollama:"
MODEL_LAYER = "application/vnd.ollama.image.model"
DEFAULT_REGISTRY = "registry.ollama.ai"
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class OllamaModelNotFound(ValueError):
    """No manifest for the name and tag, or one without a readable GGUF model layer."""


def ollama_store(given: str | None = None) -> Path:
    """The store a reference is looked up in: the one given (the CLI passes its own OLLAMA_MODELS), else this
    process's $OLLAMA_MODELS, else ~/.ollama/models."""
    return Path(given or os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def parse_reference(reference: str) -> tuple[str, str, str]:
    """`ollama:[namespace/]name[:tag]` → (namespace, name, tag); namespace `library` and tag `latest` by
    default. ValueError for anything that is not such a reference (no path may escape the store)."""
    body = reference.removeprefix(PREFIX)
    path, _, tag = body.partition(":")
    namespace, _, name = path.rpartition("/")
    namespace, tag = namespace or "library", tag or "latest"
    if not all(_PART.match(p) for p in (namespace, name, tag)):
        raise ValueError(f"not an Ollama model reference: {reference!r} (expected ollama:<name>[:tag])")
    return namespace, name, tag


def model_id_for(reference: str) -> str:
    """The catalog id an Ollama import gets: Ollama's own name, <name>:<tag> (<namespace>/<name>:<tag> outside
    the library), so the name `ollama run` and Ollama's clients send is the model on every API."""
    namespace, name, tag = parse_reference(reference)
    return f"{name}:{tag}" if namespace == "library" else f"{namespace}/{name}:{tag}"


def find_blob(reference: str, store: Path | None = None) -> Path:
    """The GGUF blob an Ollama reference names in the store."""
    namespace, name, tag = parse_reference(reference)
    store = store or ollama_store()
    manifest_path = store / "manifests" / DEFAULT_REGISTRY / namespace / name / tag
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OllamaModelNotFound(f"no Ollama model {name}:{tag} in {store} ({exc.__class__.__name__})") from exc
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    for layer in layers if isinstance(layers, list) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == MODEL_LAYER:
            digest = str(layer.get("digest", ""))
            algorithm, _, hexdigest = digest.partition(":")
            if algorithm != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexdigest):
                raise OllamaModelNotFound(f"{name}:{tag}: model layer has digest {digest!r}")
            blob = store / "blobs" / f"sha256-{hexdigest}"
            if not blob.is_file():
                raise OllamaModelNotFound(f"{name}:{tag}: blob {blob.name} is missing from {store}")
            return blob
    raise OllamaModelNotFound(f"{name}:{tag}: its manifest has no model layer")
