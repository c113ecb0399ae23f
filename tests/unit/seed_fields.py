"""The diagnostics seeds (000, 001, 002) as test data: every field, its JSON type, whether it is required.

Written from /work/shared/seeds so that unit tests (bundles built from fakes) and integration tests (real
responses from a live cluster) check the same contract. `problems(obj, SPEC)` lists every deviation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PHASES = [
    "created", "idle", "connect_group", "load_model", "warmup", "task_submission", "task_agreement",
    "prompt_build", "vision_preprocess", "kv_cache_lookup", "prefill_barrier", "prefill_pipeline",
    "prefill_stream", "decode_barrier", "decode_wait_first_token", "decode_stream", "parser",
    "cancel_requested", "cancel_observed", "completion", "error", "shutdown_cleanup",
]  # fmt: skip
PROCESS_ROLES = ["skulk", "runner", "vector", "python", "other"]
ACCELERATOR_VENDORS = ["apple", "amd", "nvidia", "intel", "cpu", "unknown"]
INTERFACE_TYPES = ["wifi", "ethernet", "maybe_ethernet", "thunderbolt", "unknown"]


@dataclass(frozen=True)
class F:
    """One field: JSON type (string, integer, number, boolean, object, array), required, nested spec, enum."""

    type: str
    required: bool = False
    sub: dict[str, F] | None = None
    enum: tuple[str, ...] | None = None


def req(type_: str, sub: dict[str, F] | None = None, enum: list[str] | None = None) -> F:
    return F(type_, True, sub, tuple(enum) if enum else None)


def opt(type_: str, sub: dict[str, F] | None = None, enum: list[str] | None = None) -> F:
    return F(type_, False, sub, tuple(enum) if enum else None)


MEMORY = {"inBytes": opt("integer")}
MLX_MEMORY = {
    "generatedAt": req("string"),
    "active": opt("object", MEMORY),
    "cache": opt("object", MEMORY),
    "peak": opt("object", MEMORY),
    "wiredLimit": opt("object", MEMORY),
    "source": req("string"),
}
RUNNER_CONTEXT = {
    "nodeId": req("string"),
    "runnerId": req("string"),
    "pid": opt("integer"),
    "instanceId": req("string"),
    "modelId": req("string"),
    "rank": req("integer"),
    "worldSize": req("integer"),
    "startLayer": req("integer"),
    "endLayer": req("integer"),
    "nLayers": req("integer"),
}
FLIGHT_RECORDER_ENTRY = {
    "at": req("string"),
    "phase": req("string", enum=PHASES),
    "event": req("string"),
    "detail": opt("string"),
    "attrs": opt("object"),
    "context": req("object", RUNNER_CONTEXT),
    "taskId": opt("string"),
    "commandId": opt("string"),
    "mlxMemory": opt("object", MLX_MEMORY),
}
TASK = {
    "taskId": req("string"),
    "taskKind": req("string"),
    "taskStatus": req("string"),
    "instanceId": req("string"),
    "commandId": opt("string"),
    "runnerId": opt("string"),
    "modelId": opt("string"),
}
MILESTONE = {"at": req("string"), "name": req("string"), "detail": opt("string")}

# seed 000
CLUSTER_TIMELINE_RUNNER = {
    "nodeId": req("string"),
    "runnerId": req("string"),
    "instanceId": req("string"),
    "modelId": req("string"),
    "deviceRank": req("integer"),
    "worldSize": req("integer"),
    "pid": opt("integer"),
    "processAlive": req("boolean"),
    "statusKind": req("string"),
    "phase": req("string", enum=PHASES),
    "phaseDetail": opt("string"),
    "secondsInPhase": req("number"),
    "lastProgressAt": opt("string"),
    "activeTaskId": opt("string"),
    "activeCommandId": opt("string"),
    "lastMlxMemory": opt("object", MLX_MEMORY),
}

# seed 001
RUNNER_SUPERVISOR_DIAGNOSTICS = {
    "runnerId": req("string"),
    "instanceId": req("string"),
    "nodeId": req("string"),
    "modelId": req("string"),
    "deviceRank": req("integer"),
    "worldSize": req("integer"),
    "startLayer": req("integer"),
    "endLayer": req("integer"),
    "nLayers": req("integer"),
    "pid": opt("integer"),
    "processAlive": req("boolean"),
    "exitCode": opt("integer"),
    "statusKind": req("string"),
    "statusSince": req("string"),
    "secondsInStatus": req("number"),
    "phase": req("string", enum=PHASES),
    "phaseStartedAt": req("string"),
    "secondsInPhase": req("number"),
    "lastProgressAt": opt("string"),
    "activeTaskId": opt("string"),
    "activeCommandId": opt("string"),
    "phaseDetail": opt("string"),
    "lastMlxMemory": opt("object", MLX_MEMORY),
    "flightRecorder": opt("array", FLIGHT_RECORDER_ENTRY),
    "pendingTaskIds": opt("array"),
    "inProgressTasks": opt("array", TASK),
    "completedTaskCount": req("integer"),
    "cancelledTaskIds": opt("array"),
    "lastTaskSentAt": opt("string"),
    "lastEventReceivedAt": opt("string"),
    "lastEventType": opt("string"),
    "milestones": opt("array", MILESTONE),
}

# seed 002
RUNTIME = {
    "nodeId": req("string"),
    "hostname": req("string"),
    "friendlyName": opt("string"),
    "isMaster": req("boolean"),
    "masterNodeId": opt("string"),
    "cwd": req("string"),
    "configPath": req("string"),
    "configFileExists": req("boolean"),
    "skulkVersion": req("string"),
    "skulkCommit": req("string"),
    "libp2PNamespace": opt("string"),
    "pythonUnbuffered": req("boolean"),
    "tracingEnabled": req("boolean"),
    "structuredLoggingConfigured": req("boolean"),
    "loggingIngestUrl": opt("string"),
}
IDENTITY = {
    name: opt("string")
    for name in [
        "modelId",
        "chipId",
        "friendlyName",
        "osVersion",
        "osBuildVersion",
        "skulkVersion",
        "skulkCommit",
    ]
}
MEMORY_USAGE = {
    "ramTotal": req("object", MEMORY),
    "ramAvailable": req("object", MEMORY),
    "swapTotal": req("object", MEMORY),
    "swapAvailable": req("object", MEMORY),
}
DISK = {"total": req("object", MEMORY), "available": req("object", MEMORY)}
ACCELERATOR = {
    "vendor": opt("string", enum=ACCELERATOR_VENDORS),
    "name": opt("string"),
    "utilizationRatio": opt("number"),
    "vramTotalBytes": opt("integer"),
    "vramUsedBytes": opt("integer"),
    "gttTotalBytes": opt("integer"),
    "powerWatts": opt("number"),
    "temperatureCelsius": opt("number"),
    "clockMhz": opt("integer"),
}
SYSTEM = {
    "gpuUsage": opt("number"),
    "temp": opt("number"),
    "sysPower": opt("number"),
    "pcpuUsage": opt("number"),
    "ecpuUsage": opt("number"),
    "accelerator": opt("object", ACCELERATOR),
}
NETWORK_INTERFACE = {
    "name": req("string"),
    "ipAddress": req("string"),
    "interfaceType": opt("string", enum=INTERFACE_TYPES),
}
RESOURCES = {
    "gatheredMemory": opt("object", MEMORY_USAGE),
    "currentMemory": opt("object", MEMORY_USAGE),
    "currentWired": opt("object", MEMORY),
    "disk": opt("object", DISK),
    "system": opt("object", SYSTEM),
    "network": opt("object", {"interfaces": opt("array", NETWORK_INTERFACE)}),
}
PROCESS = {
    "pid": req("integer"),
    "parentPid": opt("integer"),
    "role": req("string", enum=PROCESS_ROLES),
    "command": req("string"),
    "status": opt("string"),
    "cpuPercent": opt("number"),
    "memoryPercent": opt("number"),
    "rss": opt("object", MEMORY),
    "elapsedSeconds": opt("number"),
    "isChildOfSkulk": opt("boolean"),
}
PLACEMENT_RUNNER = {
    "runnerId": req("string"),
    "nodeId": req("string"),
    "friendlyName": opt("string"),
    "statusKind": opt("string"),
    "deviceRank": req("integer"),
    "worldSize": req("integer"),
    "startLayer": req("integer"),
    "endLayer": req("integer"),
    "nLayers": req("integer"),
    "isLocal": req("boolean"),
    "isMaster": req("boolean"),
    "tasks": opt("array", TASK),
}
PLACEMENT = {
    "instanceId": req("string"),
    "modelId": req("string"),
    "masterNodeId": opt("string"),
    "masterIsPlacementNode": req("boolean"),
    "localNodeIsPlacementNode": req("boolean"),
    "placementNodeIds": opt("array"),
    "runners": opt("array", PLACEMENT_RUNNER),
    "warnings": opt("array"),
}
NODE_DIAGNOSTICS = {
    "generatedAt": req("string"),
    "runtime": req("object", RUNTIME),
    "identity": opt("object", IDENTITY),
    "resources": req("object", RESOURCES),
    "processes": opt("array", PROCESS),
    "supervisorRunners": opt("array", RUNNER_SUPERVISOR_DIAGNOSTICS),
    "placements": opt("array", PLACEMENT),
    "warnings": opt("array"),
}
CLUSTER_NODE = {
    "nodeId": req("string"),
    "url": opt("string"),
    "ok": req("boolean"),
    "diagnostics": opt("object", NODE_DIAGNOSTICS),
    "error": opt("string"),
}
CLUSTER_DIAGNOSTICS = {
    "generatedAt": req("string"),
    "localNodeId": req("string"),
    "masterNodeId": opt("string"),
    "nodes": opt("array", CLUSTER_NODE),
}

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def _type_ok(value: Any, type_: str) -> bool:
    if isinstance(value, bool) and type_ != "boolean":
        return False
    return isinstance(value, _JSON_TYPES[type_])


def problems(obj: Any, spec: dict[str, F], path: str = "$", all_keys: bool = False) -> list[str]:
    """Every deviation from the spec. `all_keys` also demands optional keys (present as null or a value)."""
    if not isinstance(obj, dict):
        return [f"{path}: expected object, got {type(obj).__name__}"]
    found: list[str] = []
    for name, field in spec.items():
        where = f"{path}.{name}"
        if name not in obj:
            if field.required or all_keys:
                found.append(f"{where}: missing")
            continue
        value = obj[name]
        if value is None:
            if field.required:
                found.append(f"{where}: required but null")
            continue
        if not _type_ok(value, field.type):
            found.append(f"{where}: expected {field.type}, got {type(value).__name__}")
            continue
        if field.enum is not None and value not in field.enum:
            found.append(f"{where}: {value!r} not one of the seed's values")
        if field.sub is not None and field.type == "object":
            found.extend(problems(value, field.sub, where, all_keys))
        if field.sub is not None and field.type == "array":
            for i, item in enumerate(value):
                found.extend(problems(item, field.sub, f"{where}[{i}]", all_keys))
    return found
