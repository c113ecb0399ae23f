"""Staging from the LAN store host: list a model's files there, fetch the ones a shard needs."""

from __future__ import annotations

from pathlib import Path

import httpx

from skulk.store.fetch import Progress, fetch_all, fetch_file
from skulk.store.files import INDEX_FILE


class NotInStore(LookupError):
    pass


class StoreUnreachable(ConnectionError):
    pass


def store_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _check(response: httpx.Response) -> None:
    if response.status_code == 404:
        raise NotInStore(response.text)


def store_files(base: str, model_id: str) -> dict[str, int]:
    """The files of the store's complete copy of model_id; NotInStore when it has none."""
    try:
        response = httpx.get(f"{base}/models/{model_id}/files", timeout=10.0)
    except httpx.TransportError as exc:
        raise StoreUnreachable(f"the model store at {base} is unreachable: {exc}") from exc
    _check(response)
    response.raise_for_status()
    return {str(k): int(v) for k, v in response.json()["files"].items()}


def fetch_index(base: str, model_id: str, files: dict[str, int], target: Path) -> Path | None:
    """The safetensors index into target (it says which files hold which layers), when the model has one."""
    if INDEX_FILE not in files:
        return None
    target.mkdir(parents=True, exist_ok=True)
    with httpx.Client(timeout=30.0) as client:
        fetch_file(
            client,
            file_url(base, model_id, INDEX_FILE),
            target / INDEX_FILE,
            files[INDEX_FILE],
            on_bytes=lambda _n: None,
            check=_check,
        )
    return target / INDEX_FILE


def file_url(base: str, model_id: str, name: str) -> str:
    return f"{base}/models/{model_id}/files/{name}"


def stage(base: str, model_id: str, files: dict[str, int], target: Path, on_progress: Progress | None) -> None:
    """The named files from the store into target, resumable, then the completion marker."""
    urls = {name: file_url(base, model_id, name) for name in files}
    fetch_all(urls, files, target, model_id=model_id, on_progress=on_progress, check=_check)
