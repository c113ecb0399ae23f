"""Which files of a model a node needs, and how a model directory says it is complete.

Pure functions over names and the safetensors index, plus the two marker files: a model directory is
complete only when `.skulk-complete.json` is written, after every file reached its final name (each file is
written under a temporary name, checked against its expected size and renamed), so a runner never loads a
half download.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

INDEX_FILE = "model.safetensors.index.json"
COMPLETE_MARKER = ".skulk-complete.json"
HASHES_FILE = ".skulk-sha256.json"
NEEDED_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "model.gguf",  # an imported GGUF model (models/gguf_import.py); a hub repo's other GGUF files are not fetched
    INDEX_FILE,
    "modules.json",
    "sentence_bert_config.json",
)
NEEDED_NESTED = ("1_Pooling/config.json",)
"""The only files below the top level that are fetched: a sentence encoder's pooling (its mode: mean or CLS)."""
MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9_.-]+|(/[A-Za-z0-9_.-]+)?:[A-Za-z0-9_.-]+)$"
"""A model id the store and the APIs take: Hugging Face's org/name, or an Ollama import's own name,
[namespace/]name:tag (models/ollama_store.model_id_for). Neither can climb out of a directory."""
MODEL_ID = re.compile(MODEL_ID_PATTERN)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class CompleteMarker(BaseModel):
    model_id: str
    total_bytes: int
    downloaded_at: datetime
    files: list[str]


def model_dir_name(model_id: str) -> str:
    """The directory a model is staged in: "org/name" → "org--name" (the Hugging Face cache convention)."""
    if not model_id or model_id.startswith("/") or ".." in model_id.split("/"):
        raise ValueError(f"not a model id: {model_id!r}")
    return model_id.replace("/", "--")


def is_needed(name: str) -> bool:
    """Config, tokenizer files, chat template, safetensors and their index (or a GGUF file), a sentence
    encoder's modules and pooling: nothing else is downloaded."""
    return name in NEEDED_NESTED or ("/" not in name and any(fnmatch.fnmatch(name, p) for p in NEEDED_PATTERNS))


def shard_files(index: dict[str, Any], start_layer: int, end_layer: int, n_layers: int) -> set[str]:
    """The safetensors files that hold layers [start_layer, end_layer) of a pipeline stage, plus the embeddings
    for the first stage (and the last when they are tied: no lm_head) and the final norm and lm_head for the
    last. Multi-token-prediction weights go to no stage, as no engine loads them: DeepSeek's layers past the last
    (by their index) and Qwen3-Next's and Qwen3.5's mtp. block, whose mtp.layers.0 is not decoder layer 0."""
    weight_map: dict[str, str] = index.get("weight_map", {})
    first, last = start_layer == 0, end_layer == n_layers
    tied = not any(t.startswith("lm_head") for t in weight_map)
    chosen: set[str] = set()
    for tensor, filename in weight_map.items():
        match = _LAYER.search(tensor)
        if tensor.startswith("mtp."):
            wanted = False
        elif match is not None:
            wanted = start_layer <= int(match.group(1)) < end_layer
        elif "embed_tokens" in tensor:
            wanted = first or (last and tied)
        elif tensor.startswith("lm_head") or tensor.endswith("model.norm.weight"):
            wanted = last
        else:
            wanted = first or last
        if wanted:
            chosen.add(filename)
    return chosen


def files_for_shard(
    all_files: dict[str, int], index: dict[str, Any] | None, layers: tuple[int, int, int]
) -> dict[str, int]:
    """The needed files (name → bytes) of one shard: every small file, and of the weights only its own."""
    needed = {name: size for name, size in all_files.items() if is_needed(name)}
    if index is None:
        return needed
    start, end, total = layers
    own = shard_files(index, start, end, total)
    return {n: s for n, s in needed.items() if not n.endswith(".safetensors") or n in own}


def read_marker(model_dir: Path) -> CompleteMarker | None:
    try:
        return CompleteMarker.model_validate_json((model_dir / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None


def write_marker(model_dir: Path, model_id: str, files: dict[str, int]) -> CompleteMarker:
    marker = CompleteMarker(
        model_id=model_id, total_bytes=sum(files.values()), downloaded_at=datetime.now(UTC), files=sorted(files)
    )
    tmp = model_dir / (COMPLETE_MARKER + ".tmp")
    tmp.write_text(marker.model_dump_json())
    tmp.replace(model_dir / COMPLETE_MARKER)
    return marker


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_hashes(model_dir: Path, names: Iterable[str]) -> dict[str, str]:
    """SHA-256 of each named file, cached in HASHES_FILE by (size, mtime): a store host hashes a model once, the
    first time a stager lists it (about a second per GB), and stagers verify their copies against it."""
    cache_path = model_dir / HASHES_FILE
    try:
        cache: dict[str, list[Any]] = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    hashes: dict[str, str] = {}
    changed = False
    for name in names:
        stat = (model_dir / name).stat()
        entry = cache.get(name)
        if isinstance(entry, list) and entry[:2] == [stat.st_size, stat.st_mtime_ns]:
            hashes[name] = str(entry[2])
            continue
        hashes[name] = sha256_of(model_dir / name)
        cache[name] = [stat.st_size, stat.st_mtime_ns, hashes[name]]
        changed = True
    if changed:
        try:
            tmp = cache_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache))
            tmp.replace(cache_path)
        except OSError:
            pass  # a read-only store hashes again next time
    return hashes


def has_files(model_dir: Path, files: dict[str, int]) -> bool:
    """Every named file is present at its final name with its expected size."""
    for name, size in files.items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def is_complete(model_dir: Path) -> bool:
    """Downloaded completely (the marker), or a hand-copied directory with a config and weights."""
    if read_marker(model_dir) is not None:
        return True
    return (
        (model_dir / "config.json").is_file()
        and (any(model_dir.glob("*.safetensors")) or (model_dir / "model.gguf").is_file())
        and not (model_dir / ".cache").exists()
    )


def local_files(model_dir: Path) -> dict[str, int]:
    """The needed files present in a directory, name → bytes."""
    if not model_dir.is_dir():
        return {}
    found = {p.name: p.stat().st_size for p in model_dir.iterdir() if p.is_file() and is_needed(p.name)}
    return found | {n: (model_dir / n).stat().st_size for n in NEEDED_NESTED if (model_dir / n).is_file()}


def read_index(model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / INDEX_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def tree_bytes(path: Path) -> int:
    """Bytes under path (files only), 0 when it is missing."""
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
