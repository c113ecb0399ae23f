"""Where a model's files are on one node: downloading from Hugging Face, staging from the store, or ready."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from .base import CamelModel
from .ids import ModelId


class DownloadStatus(StrEnum):
    Pending = "Pending"
    Downloading = "Downloading"
    Completed = "Completed"
    Failed = "Failed"


class DownloadSource(StrEnum):
    HuggingFace = "huggingface"
    Store = "store"
    Local = "local"


class DownloadProgress(CamelModel):
    """One model's files on one node. total_bytes counts only the files this node needs (a pipeline shard
    stages only the safetensors files holding its layers)."""

    model_id: ModelId
    status: DownloadStatus
    source: DownloadSource
    downloaded_bytes: int = 0
    total_bytes: int = 0
    files_done: int = 0
    files_total: int = 0
    bytes_per_second: float = 0.0
    error: str | None = None
    error_status: int | None = None
    updated_at: datetime | None = None

    @property
    def fraction(self) -> float:
        return self.downloaded_bytes / self.total_bytes if self.total_bytes else 0.0
