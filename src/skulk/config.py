"""Settings of one node: defaults, then skulk.yaml, then environment, then command-line flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    api_host: str = "0.0.0.0"
    api_port: int = Field(default=52415, ge=0, le=65535)
    home: Path = Path("~/.skulk").expanduser()
    config: Path = Path("skulk.yaml")
    place_default: bool = True
    node_name: str | None = None
    cluster: str = "default"
    bootstrap_peers: list[str] = []
    zenoh_listen: list[str] = ["tcp/0.0.0.0:0"]
    multicast: bool = True
    multicast_interface: str | None = None
    warmup_deadline_seconds: float = 300.0
    runner_restart_budget: int = Field(default=3, ge=0)
    """Restarts of one runner (or of a multi-rank instance as a whole) allowed within the window below."""
    runner_restart_window_seconds: float = Field(default=60.0, gt=0)
    runner_hung_seconds: float = Field(default=15.0, gt=0)
    """A runner whose heartbeat thread is silent this long is declared hung, killed and restarted."""
    rejoin_wait_seconds: float = Field(default=10.0, ge=0)
    """After a pause (a laptop lid), how long a node waits to hear its old peers before it may elect itself."""

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def config_exists(self) -> bool:
        return self.config.exists()


ENV_PREFIX = "SKULK_"
LIST_FIELDS = {"bootstrap_peers", "zenoh_listen"}
ENV_ALIASES = {"bootstrap_peers": "SKULK_BOOTSTRAP_PEERS", "zenoh_listen": "SKULK_ZENOH_LISTEN"}


def env_values(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, Any]:
    """SKULK_<FIELD> for every field; list fields split on commas."""
    found: dict[str, Any] = {}
    for name in Settings.model_fields:
        key = ENV_ALIASES.get(name, ENV_PREFIX + name.upper())
        raw = environ.get(key)
        if raw is None or raw == "":
            continue
        if name in LIST_FIELDS:
            found[name] = [part.strip() for part in raw.split(",") if part.strip()]
        elif name in ("place_default", "multicast"):
            found[name] = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            found[name] = raw
    return found


def yaml_values(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    loaded = yaml.safe_load(path.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return {k.replace("-", "_"): v for k, v in loaded.items()}


def resolve(flags: dict[str, Any], environ: dict[str, str] | os._Environ[str] = os.environ) -> Settings:
    """Flags beat environment, environment beats skulk.yaml, skulk.yaml beats defaults."""
    from_env = env_values(environ)
    chosen = {k: v for k, v in flags.items() if v is not None}
    config_path = Path(chosen.get("config") or from_env.get("config") or "skulk.yaml").expanduser()
    home = Path(chosen.get("home") or from_env.get("home") or "~/.skulk").expanduser()
    if not config_path.is_absolute() and not config_path.exists() and (home / config_path).exists():
        config_path = home / config_path
    merged = {**yaml_values(config_path), **from_env, **chosen}
    merged["config"] = config_path.resolve()
    merged["home"] = Path(merged.get("home", home)).expanduser().resolve()
    return Settings.model_validate(merged)
