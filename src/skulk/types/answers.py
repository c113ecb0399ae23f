"""The success bodies of the node's HTTP routes that are built as dicts, declared for `/openapi.json`.

Documentation of what goes on the wire, never a filter: routes still return their dicts, and these models are
named in the decorators' `responses=`. Each lists the keys the route writes; values whose shape another module
owns (a download's progress, a trace's spans) stay open, so the declaration cannot drift from that owner."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Json = dict[str, Any]


class _Answer(BaseModel):
    """Keys as they are written (snake_case or camelCase, route by route); a key added later is not a violation."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class StateView(_Answer):
    """GET /state: the replicated State (camelCase) plus this node's view of health, system and resources."""

    instances: Json
    topology: Json
    term: int
    node_health: Json = Field(alias="nodeHealth")
    node_system: Json = Field(alias="nodeSystem")
    node_resources: Json = Field(alias="nodeResources")


class InstanceView(_Answer):
    """GET /instance/{id}: the instance as a tagged union, {"MlxRingInstance": {...}}."""

    mlx_ring_instance: Json = Field(alias="MlxRingInstance")


class PlacedInstance(_Answer):
    """POST /place_instance."""

    message: str
    command_id: str = Field(alias="commandId")
    instance_id: str = Field(alias="instanceId")
    model_id: str = Field(alias="modelId")
    instance: Json


class CreatedInstance(_Answer):
    """POST /instance."""

    message: str
    command_id: str
    model_card: Json


class Previews(_Answer):
    """GET /instance/previews."""

    previews: list[Json]
    downloads: Json


class DeletedInstance(_Answer):
    """DELETE /instance/{id}."""

    message: str
    command_id: str = Field(alias="commandId")
    instance_id: str = Field(alias="instanceId")


class CancelRequested(_Answer):
    """POST /v1/cancel/{command_id}."""

    message: str
    command_id: str = Field(alias="commandId")


class MetaInstanceCommand(_Answer):
    """POST /meta_instance and DELETE /meta_instance/{id}."""

    message: str
    command_id: str
    meta_instance_id: str


class MetaInstances(_Answer):
    """GET /meta_instances: each MetaInstance with its status and the instances serving it."""

    meta_instances: dict[str, Json]


class CatalogEntry(_Answer):
    """One model of GET /models (and POST /models/add, /models/import)."""

    id: str


class Catalog(_Answer):
    """GET /models."""

    data: list[CatalogEntry]


class OpenAIModel(_Answer):
    """GET /v1/models/{id}, and each entry of GET /v1/models."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class OpenAIModelList(_Answer):
    object: Literal["list"]
    data: list[OpenAIModel]


class ClaudeModel(_Answer):
    """Anthropic's model object (GET /v1/models/{id} with an `anthropic-version` header)."""

    type: Literal["model"]
    id: str
    display_name: str
    created_at: str
    max_input_tokens: int
    max_tokens: int


class ClaudeModelList(_Answer):
    """Anthropic's list of models (GET /v1/models with an `anthropic-version` header)."""

    data: list[ClaudeModel]
    has_more: bool
    first_id: str | None
    last_id: str | None


class RunnerCancel(_Answer):
    """POST /v1/diagnostics/node/runners/{runner_id}/cancel."""

    runner_id: str = Field(alias="runnerId")
    node_id: str = Field(alias="nodeId")
    cancel_requested_task_ids: list[str] = Field(alias="cancelRequestedTaskIds")


class PeerDiagnostics(_Answer):
    """GET /v1/diagnostics/cluster/{node_id}: a ClusterDiagnostics node entry."""

    node_id: str = Field(alias="nodeId")
    ok: bool


class SecurityView(_Answer):
    """GET /v1/diagnostics/security."""

    members: list[str]
    unvouched_tokens: list[str] = Field(alias="unvouchedTokens")
    sealed: bool
    forged_dropped: int = Field(alias="forgedDropped")
    replayed_dropped: int = Field(alias="replayedDropped")
    opened: int
    sealed_sent: int = Field(alias="sealedSent")
    warnings: list[str]


class Health(_Answer):
    """GET /healthz."""

    status: Literal["ok"]


class ConfigView(_Answer):
    """GET /config."""

    config: Json
    config_path: str = Field(alias="configPath")
    file_exists: bool = Field(alias="fileExists")
    effective: Json
    live_keys: list[str] = Field(alias="liveKeys")
    """Dotted keys PUT /config applies without a restart; every other key needs one."""


class ConfigApplied(_Answer):
    """PUT /config."""

    message: str
    changed: list[str]
    applied: list[str]
    """The changed keys applied live (skulk.yaml written)."""
    restart_required: list[str] = Field(alias="restartRequired")
    """Always empty on a 200: a change to any key that needs a restart is a 400 restart_required naming it."""
    effective: Json


class RestartAnswer(_Answer):
    """POST /admin/restart (200), and its 409 when a restart is already pending."""

    status: Literal["restart_sent", "restarting", "restart_already_pending"]
    node_id: str = Field(alias="nodeId")


class EventsPage(_Answer):
    """GET /events: records after `since`, and the log's status."""

    events: list[Json]
    next_since: int = Field(alias="nextSince")


class TracingSwitch(_Answer):
    """GET and PUT /v1/tracing."""

    enabled: bool


class TraceList(_Answer):
    """GET /v1/traces and /v1/traces/cluster."""

    traces: list[Json]


class TraceBody(_Answer):
    """GET /v1/traces/{task_id} (and /v1/traces/cluster/{task_id})."""

    task_id: str = Field(alias="taskId")
    source_nodes: list[str] = Field(alias="sourceNodes")
    spans: list[Json]


class TraceStats(_Answer):
    """GET /v1/traces/{task_id}/stats: where the time of one request went (skulk.tracing.store.stats)."""

    task_id: str = Field(alias="taskId")
    total_wall_time_us: int = Field(alias="totalWallTimeUs")
    by_category: Json = Field(alias="byCategory")
    by_rank: Json = Field(alias="byRank")
    source_nodes: list[str] = Field(alias="sourceNodes")


class ChromeTrace(_Answer):
    """GET /v1/traces/{task_id}/raw: Chrome trace-event JSON, which Perfetto opens."""

    trace_events: list[Json] = Field(alias="traceEvents")
    display_time_unit: str = Field(alias="displayTimeUnit")


class TracesDeleted(_Answer):
    """POST /v1/traces/delete."""

    deleted: Any


class StoreHealth(_Answer):
    """GET /store/health."""

    status: Literal["ok"]
    node_id: str
    store_configured: bool


class StoreRegistry(_Answer):
    """GET /store/registry: the store server's registry, passed through."""

    entries: list[Json]


class StoreDownloads(_Answer):
    """GET /store/downloads."""

    node_id: str
    downloads: list[Json]
    cluster: Json


class DownloadStarted(_Answer):
    """POST /store/models/{id}/download (202)."""

    model_id: str
    message: str
    status_url: str


class DownloadState(_Answer):
    """GET /store/models/{id}/download/status: a DownloadProgress (camelCase), or a local copy's
    {"model_id", "status": "Completed", "source": "local"}."""

    status: str


class ModelRemoved(_Answer):
    """DELETE /store/models/{id}."""

    model_id: str
    removed: Any


class StorageView(_Answer):
    """GET /store/storage (ModelFiles.storage): staged models, totals, the staging volume's disk."""

    node_id: str
    staging_root: str
    staged_models: list[Json]
    staged_total_bytes: int
    event_log_bytes: int
    disk_total_bytes: int
    disk_free_bytes: int


class PurgedLocal(_Answer):
    """POST /store/purge-staging/local."""

    node_id: str
    removed: list[Any]


class Purged(_Answer):
    """POST /store/purge-staging: every node's answer."""

    model_id: str | None = None
    nodes: Json


class OllamaTags(_Answer):
    """GET /ollama/api/tags and /ollama/api/ps."""

    models: list[Json]


class OllamaVersion(_Answer):
    version: str


class OllamaShow(_Answer):
    """POST /ollama/api/show."""

    modelfile: str
    details: Json
    model_info: Json
    capabilities: list[str]


class TokenCount(_Answer):
    """POST /v1/messages/count_tokens."""

    input_tokens: int


class ChatCompletionAnswer(_Answer):
    """POST /v1/chat/completions (and /bench/chat/completions) without `stream`."""

    id: str
    object: Literal["chat.completion"]
    choices: list[Json]


class TextCompletionAnswer(_Answer):
    """POST /v1/completions without `stream`."""

    id: str
    object: Literal["text_completion"]
    choices: list[Json]


class ResponseAnswer(_Answer):
    """POST /v1/responses without `stream`."""

    id: str
    object: Literal["response"]
    output: list[Json]


class ClaudeMessage(_Answer):
    """POST /v1/messages without `stream`."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[Json]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None


class OllamaReply(_Answer):
    """POST /ollama/api/chat and /ollama/api/generate without `stream`: the one final line."""

    model: str
    done: bool


class EmbeddingList(_Answer):
    """POST /v1/embeddings."""

    object: Literal["list"]
    data: list[Json]


class OllamaEmbeddings(_Answer):
    """POST /ollama/api/embed."""

    model: str
    embeddings: list[list[float]]


class OllamaLegacyEmbedding(_Answer):
    """POST /ollama/api/embeddings (Ollama's legacy route)."""

    embedding: list[float]


class OllamaPullStatus(_Answer):
    """POST /ollama/api/pull: one progress object (a line of the stream, or the whole answer without streaming)."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None


class ResponseDeleted(_Answer):
    """DELETE /v1/responses/{id}."""

    id: str
    object: Literal["response"]
    deleted: bool
