"""Downloads through the real huggingface_hub client against a local fake of the hub's file API."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skulk.store.files import is_complete, read_marker
from skulk.store.hub import Hub, HubError, download, list_files
from tests.fake_hub import RunningHub, write_random_model, write_repo

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def hub_root(tmp_path: Path) -> Path:
    root = tmp_path / "hub"
    root.mkdir()
    write_random_model(root, "org/small", shards=2)
    write_random_model(root, "org/big", hidden=256, layers=2)
    write_random_model(root, "org/locked", gated=True)
    write_repo(root, "org/pickles", {"config.json": {"model_type": "llama"}, "pytorch_model.bin": b"x" * 10})
    return root


@pytest.fixture
def hub(hub_root: Path) -> Iterator[RunningHub]:
    running = RunningHub(hub_root).start()
    yield running
    running.kill()


def test_download_reports_progress_and_lists_only_needed_files(hub: RunningHub, tmp_path: Path) -> None:
    (hub.root / "org--small" / "README.md").write_text("not needed")
    repo = list_files(Hub(hub.url), "org/small")
    assert "README.md" not in repo.files and "model.safetensors.index.json" in repo.files
    seen: list[tuple[int, int]] = []
    target = tmp_path / "store" / "org--small"
    download(Hub(hub.url), repo, target, lambda b, f: seen.append((b, f)))
    assert seen[-1] == (repo.total_bytes, len(repo.files))
    assert is_complete(target) and read_marker(target) is not None
    for name, size in repo.files.items():
        assert (target / name).stat().st_size == size
    assert not (target / "README.md").exists()


def test_resume_after_the_server_dies_mid_file(hub: RunningHub, tmp_path: Path) -> None:
    repo = list_files(Hub(hub.url), "org/big")
    weights = repo.files["model.safetensors"]
    cut = weights // 2
    hub.kill()
    hub.start(stall_after=cut)
    target = tmp_path / "store" / "org--big"
    partial = target / ".skulk-partial"

    def kill_when_half_written() -> None:
        # the weights' own part file: a smaller file's part may be renamed away between a glob and its stat
        part = partial / "model.safetensors.part"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError):  # not started yet
                if part.stat().st_size >= cut:
                    hub.kill()
                    return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_when_half_written)
    killer.start()
    with pytest.raises(HubError) as caught:
        download(Hub(hub.url), repo, target)
    killer.join()
    assert caught.value.code == "download_interrupted"
    assert not (target / "model.safetensors").exists(), "a half file never takes the final name"
    assert not is_complete(target)
    hub.start()
    download(Hub(hub.url), repo, target)
    assert (target / "model.safetensors").stat().st_size == weights
    assert f"GET /org/big/resolve/{repo.commit}/model.safetensors bytes={cut}-" in hub.requests()
    assert is_complete(target)


def test_gated_without_token_says_to_set_hf_token(hub: RunningHub, tmp_path: Path) -> None:
    repo = list_files(Hub(hub.url), "org/locked")
    with pytest.raises(HubError) as caught:
        download(Hub(hub.url), repo, tmp_path / "x")
    assert caught.value.status == 401 and "hf_token" in caught.value.message
    download(Hub(hub.url, token="hf_fake"), repo, tmp_path / "y")
    assert is_complete(tmp_path / "y")


def test_missing_repo_is_404_with_the_id(hub: RunningHub) -> None:
    with pytest.raises(HubError) as caught:
        list_files(Hub(hub.url), "org/nope")
    assert caught.value.status == 404 and "org/nope" in caught.value.message


def test_repo_without_safetensors_is_400(hub: RunningHub) -> None:
    with pytest.raises(HubError) as caught:
        list_files(Hub(hub.url), "org/pickles")
    assert caught.value.status == 400 and "safetensors" in caught.value.message


def test_not_enough_disk_is_refused_before_it_starts(
    hub: RunningHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    repo = list_files(Hub(hub.url), "org/small")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))  # type: ignore[attr-defined]
    with pytest.raises(HubError) as caught:
        download(Hub(hub.url), repo, tmp_path / "z")
    assert caught.value.status == 507 and "GiB" in caught.value.message
    assert not (tmp_path / "z").exists()
