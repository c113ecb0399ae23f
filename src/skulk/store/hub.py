"""Downloads from Hugging Face with `huggingface_hub`: only the files a node needs, resumable, never a half
file under a final name (store.fetch writes a partial under `.skulk-partial/`, checks the size and renames;
an interrupted download, even one whose node was killed, resumes from the partial with a Range request).
huggingface_hub lists the repo, builds the URLs and the auth headers; its own file download deletes
partials on failure, which would re-pay every byte after a node restart.

Errors become `HubError`s with an HTTP status and a message that says what to do, so the API, the CLI and
the /state progress all tell the operator the same thing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import httpx2
from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers

from skulk.store.fetch import (
    InsufficientDisk,
    Opener,
    Progress,
    check_disk,
    fetch_all,
    fetch_file,
    httpx_opener,
    present_bytes,
)
from skulk.store.files import INDEX_FILE, is_needed
from skulk.types.errors import ApiError, ErrorCode

hf_constants.HF_HUB_DISABLE_TELEMETRY = True
"""No side requests: with telemetry on, huggingface_hub fetches an "agent harnesses" registry from the hub
(`/api/agent-harnesses`, a 404 on a mirror or a test hub) while it builds headers. Skulk talks to the hub
only to list and download model files (the one documented download path)."""


class HubError(ApiError):
    """A download or a model lookup refused by the hub (or by this node's disk): an ApiError a route re-raises."""


@dataclass(frozen=True)
class Hub:
    """Where to download from: endpoint None is huggingface.co; token is hf_token."""

    endpoint: str | None = None
    token: str | None = None


@dataclass(frozen=True)
class RepoFiles:
    model_id: str
    commit: str
    files: dict[str, int]
    """Needed files, name → bytes."""
    gated: bool

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def list_files(hub: Hub, model_id: str) -> RepoFiles:
    """The repo's needed files with their sizes; 404 for an unknown repo, 400 when it has no safetensors."""
    api = HfApi(endpoint=hub.endpoint, token=hub.token or False)
    try:
        info = api.model_info(model_id, files_metadata=True)
    except GatedRepoError as exc:
        raise gated_error(model_id) from exc
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise HubError(ErrorCode.model_not_found,
                       f"model {model_id} was not found on Hugging Face; check the id") from exc
    except HfHubHTTPError as exc:
        raise HubError(ErrorCode.hub_error, f"Hugging Face answered for {model_id}: {exc}") from exc
    except (httpx.TransportError, httpx2.TransportError) as exc:  # huggingface_hub's own client is httpx2
        raise unreachable_error(hub, model_id, exc) from exc
    files = {s.rfilename: int(s.size or 0) for s in info.siblings or [] if is_needed(s.rfilename)}
    if not any(name.endswith(".safetensors") for name in files):
        raise HubError(ErrorCode.no_safetensors,
                       f"model {model_id} has no safetensors weights; Skulk loads only safetensors checkpoints")
    return RepoFiles(model_id=model_id, commit=info.sha or "main", files=files, gated=bool(info.gated))


def preflight(hub: Hub, model_id: str, model_dir: Path) -> RepoFiles:
    """What an operator download would fetch, refused before it starts: unknown repo (404), no safetensors
    (400), gated without a token (401), not enough disk (507)."""
    repo = list_files(hub, model_id)
    if repo.gated and not hub.token:
        raise gated_error(model_id)
    try:
        check_disk(model_dir, repo.total_bytes - present_bytes(model_dir, repo.files))
    except InsufficientDisk as exc:
        raise HubError(ErrorCode.insufficient_disk, f"{model_id}: {exc}") from exc
    return repo


def unreachable_error(hub: Hub, model_id: str, exc: Exception) -> HubError:
    """502 hub_unreachable: the hub did not answer at all (no network, a wrong endpoint, a firewall)."""
    where = hub.endpoint or "https://huggingface.co"
    return HubError(ErrorCode.hub_unreachable,
                    f"the model hub at {where} could not be reached for {model_id} ({type(exc).__name__}: {exc}); "
                    "check this node's network, or set HF_ENDPOINT (model_store.download.hf_endpoint in skulk.yaml) "
                    "to a hub or mirror it can reach, or copy the model's files into its store_path")


def gated_error(model_id: str) -> HubError:
    return HubError(ErrorCode.gated_model,
                    f"model {model_id} is gated on Hugging Face: accept its license on huggingface.co and set "
                    "hf_token in skulk.yaml (or HF_TOKEN) to a token with access")


def download(hub: Hub, repo: RepoFiles, model_dir: Path, on_progress: Progress | None = None) -> None:
    """Every file of repo into model_dir, then the completion marker; finished files are skipped and a partial
    one resumes where the last attempt stopped."""
    with _hub_opener(hub, repo) as opener:
        urls = {name: _url(hub, repo, name) for name in repo.files}
        fetch_all(urls, repo.files, model_dir, model_id=repo.model_id, on_progress=on_progress, opener=opener)


def fetch_index(hub: Hub, repo: RepoFiles, target: Path) -> Path | None:
    """The safetensors index alone into target, when the repo has one: it says which files hold which layers,
    so a pipeline rank fetches only its own (no completion marker: the directory is not complete yet)."""
    if INDEX_FILE not in repo.files:
        return None
    target.mkdir(parents=True, exist_ok=True)
    with _hub_opener(hub, repo) as opener:
        fetch_file(opener, _url(hub, repo, INDEX_FILE), target / INDEX_FILE, repo.files[INDEX_FILE],
                   on_bytes=lambda _n: None)
    return target / INDEX_FILE


def _url(hub: Hub, repo: RepoFiles, name: str) -> str:
    return hf_hub_url(repo.model_id, name, revision=repo.commit, endpoint=hub.endpoint)


@contextmanager
def _hub_opener(hub: Hub, repo: RepoFiles) -> Iterator[Opener]:
    """An opener for repo's files with the hub's auth headers; transfer failures become HubErrors."""
    if repo.gated and not hub.token:
        raise gated_error(repo.model_id)
    headers = build_hf_headers(token=hub.token or False)
    try:
        with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0, connect=10.0)) as client:
            yield httpx_opener(client, lambda r: _check(repo.model_id, r), headers)
    except InsufficientDisk as exc:
        raise HubError(ErrorCode.insufficient_disk, f"{repo.model_id}: {exc}") from exc
    except (httpx.TransportError, OSError) as exc:
        raise HubError(ErrorCode.download_interrupted,
                       f"downloading {repo.model_id} failed ({exc}); retry and it resumes where it stopped") from exc


def _check(model_id: str, response: httpx.Response) -> None:
    """The hub's error headers as typed errors (huggingface_hub's own mapping needs its own HTTP client)."""
    code = response.headers.get("X-Error-Code")
    if code == "GatedRepo" or response.status_code in (401, 403):
        raise gated_error(model_id)
    if code == "RepoNotFound" or response.status_code == 404:
        raise HubError(ErrorCode.model_not_found,
                       f"model {model_id} (or one of its files) was not found on Hugging Face")
