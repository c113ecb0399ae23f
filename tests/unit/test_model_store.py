"""Pure parts of the model store: eviction decisions, shard files, the store server's path rules, cards from
config.json, and the start gate."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from skulk.models.catalog import UnsupportedArchitecture, card_from_config, list_entry, weight_bytes
from skulk.store import client
from skulk.store.eviction import StagedModel, to_evict, to_purge
from skulk.store.fetch import fetch_file, partial_path
from skulk.store.files import files_for_shard, shard_files
from skulk.store.server import StoreServer
from skulk.types.ids import NodeId
from skulk.types.state import State

pytestmark = pytest.mark.timeout(30)
MB = 10**6


def _staged(model_id: str, size: int, last_used: float, in_use: bool = False) -> StagedModel:
    return StagedModel(model_id, Path("/x") / model_id, size, last_used, in_use)


def test_eviction_keeps_newest_within_budget_and_never_in_use() -> None:
    staged = [
        _staged("old", 5 * MB, 1),
        _staged("mid", 5 * MB, 2),
        _staged("new", 5 * MB, 3),
        _staged("live", 50 * MB, 0, True),
    ]
    assert [s.model_id for s in to_evict(staged, 11 * MB)] == ["old"]
    assert [s.model_id for s in to_evict(staged, 0)] == ["new", "mid", "old"]
    assert [s.model_id for s in to_evict(staged, 10**12)] == []
    # newest-first prefix: once one does not fit, everything older goes even if small
    mixed = [_staged("big-new", 8 * MB, 3), _staged("small-old", 1 * MB, 1)]
    assert [s.model_id for s in to_evict(mixed, 7 * MB)] == ["big-new", "small-old"]


def test_purge_takes_every_idle_copy_or_one_model() -> None:
    staged = [_staged("a", 1, 1), _staged("b", 1, 1), _staged("live", 1, 1, True)]
    assert [s.model_id for s in to_purge(staged, None)] == ["a", "b"]
    assert [s.model_id for s in to_purge(staged, "b")] == ["b"]
    assert to_purge(staged, "live") == []


def test_shard_files_follow_the_index() -> None:
    index = {
        "weight_map": {
            "model.embed_tokens.weight": "f1",
            "model.layers.0.mlp.up_proj.weight": "f1",
            "model.layers.1.mlp.up_proj.weight": "f2",
            "model.layers.2.mlp.up_proj.weight": "f3",
            "model.layers.3.mlp.up_proj.weight": "f4",
            "model.norm.weight": "f4",
            "lm_head.weight": "f4",
        }
    }
    assert shard_files(index, 0, 2, 4) == {"f1", "f2"}
    assert shard_files(index, 2, 3, 4) == {"f3"}
    assert shard_files(index, 3, 4, 4) == {"f4"}
    del index["weight_map"]["lm_head.weight"]  # tied embeddings: the last stage needs them too
    assert shard_files(index, 3, 4, 4) == {"f1", "f4"}
    files = {"config.json": 1, "tokenizer.json": 2, "f1": 0, "f3.safetensors": 9, "README.md": 3}
    assert set(files_for_shard(files, None, (0, 4, 4))) == {"config.json", "tokenizer.json", "f3.safetensors"}


def test_no_stage_downloads_a_qwen_mtp_block() -> None:
    """Qwen3-Next's and Qwen3.5's multi-token-prediction block (mtp.fc, its norms, mtp.layers.0.*), which no engine
    loads: its own file goes to no stage, though mtp.layers.0 reads like decoder layer 0 and mtp.norm like a norm;
    a file it shares with a stage's tensors still comes for those."""
    weight_map = {"model.embed_tokens.weight": "f1", "model.layers.0.mlp.up_proj.weight": "f1",
                  "model.layers.1.mlp.up_proj.weight": "f2", "model.norm.weight": "f2", "lm_head.weight": "f2",
                  "mtp.fc.weight": "f3", "mtp.norm.weight": "f3", "mtp.pre_fc_norm_hidden.weight": "f3",
                  "mtp.layers.0.self_attn.q_proj.weight": "f3", "mtp.layers.0.mlp.experts.gate_up_proj": "f3"}
    assert shard_files({"weight_map": weight_map}, 0, 1, 2) == {"f1"}
    assert shard_files({"weight_map": weight_map}, 1, 2, 2) == {"f2"}
    assert shard_files({"weight_map": weight_map}, 0, 2, 2) == {"f1", "f2"}
    shared = weight_map | {"mtp.layers.0.mlp.gate.weight": "f2"}
    assert shard_files({"weight_map": shared}, 1, 2, 2) == {"f2"}


def _raw_get(port: int, path: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, bytes]:
    """A request with the path exactly as written (httpx would normalise the dot segments away)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_store_server_serves_ranges_and_nothing_outside(tmp_path: Path) -> None:
    store = tmp_path / "store"
    model = store / "org--m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(bytes(range(200)))
    (tmp_path / "secret.txt").write_text("no")
    server = StoreServer(store, "127.0.0.1", 0).start()
    port = server.server_address[1]
    try:
        status, body = _raw_get(port, "/models/org/m/files")
        assert status == 200 and json.loads(body)["files"] == {"config.json": 2, "model.safetensors": 200}
        assert _raw_get(port, "/models/org/m/files/model.safetensors") == (200, bytes(range(200)))
        ranged = _raw_get(port, "/models/org/m/files/model.safetensors", {"Range": "bytes=100-"})
        assert ranged == (206, bytes(range(100, 200)))
        assert _raw_get(port, "/models/org/m/files/model.safetensors", {"Range": "bytes=10-19"}) == (
            206, bytes(range(10, 20)))
        status, body = _raw_get(port, "/models/org/m/files/model.safetensors", {"Range": "bytes=500-"})
        assert status == 416 and json.loads(body)["error"]["code"] == "range_not_satisfiable"
        for path in (
            "/models/org/m/files/..%2F..%2Fsecret.txt",
            "/models/org/m/files/%2E%2E",
            "/models/%2E%2E/m/files/config.json",
            "/models/org/..%2F..%2Fx/files",
            "/models/org/m/../../secret.txt",
            "/models/org/m/files/../../../secret.txt",
            "/../secret.txt",
            "/models/org/nope/files/config.json",
        ):
            status, body = _raw_get(port, path)
            assert status in (400, 404), path
            assert body != b"no" and "error" in json.loads(body), path
        status, body = _raw_get(port, "/registry")
        assert json.loads(body)["entries"][0]["model_id"] == "org/m"
        assert _raw_get(port, "/models/org/m/files/config.json", method="DELETE")[0] == 405
        assert model.joinpath("config.json").exists()
    finally:
        server.close()


def test_card_from_config_and_unsupported_architecture() -> None:
    config = {
        "model_type": "qwen3",
        "num_hidden_layers": 28,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
    }
    card = card_from_config("Qwen/Qwen3-0.6B", config, 1_503_300_328)
    assert (card.family, card.n_layers, card.context_length) == ("qwen3", 28, 40960)
    entry = list_entry(card, created=0, where={})
    assert entry["storage_size_megabytes"] == 1434 and entry["hugging_face_id"] == "Qwen/Qwen3-0.6B"
    with pytest.raises(UnsupportedArchitecture) as caught:  # neither engine: torch's list nor mlx-lm's registry
        card_from_config("x/none", {"model_type": "no_such_family", "architectures": ["NoSuchForCausalLM"]}, 1)
    assert "no_such_family" in str(caught.value) and "llama, qwen2, qwen3" in str(caught.value)
    assert weight_bytes({"a.safetensors": 5, "b.safetensors": 6, "c.json": 100}, None) == 11
    assert weight_bytes({}, {"metadata": {"total_size": 42}}) == 42


def test_an_instance_starts_only_when_every_node_has_its_files() -> None:
    from skulk.store.staging import my_needs, startable
    from skulk.types.downloads import DownloadProgress, DownloadSource, DownloadStatus
    from skulk.types.events import InstanceCreated, NodeDownloadProgress
    from skulk.types.ids import ModelId, NodeId

    from .factories import applied, instance

    two = instance(nodes=("n1", "n2"))
    model = ModelId("test/model")

    def done(node: str, status: DownloadStatus = DownloadStatus.Completed) -> NodeDownloadProgress:
        progress = DownloadProgress(model_id=model, status=status, source=DownloadSource.Store)
        return NodeDownloadProgress(node_id=NodeId(node), model_id=model, progress=progress)

    state = applied(InstanceCreated(instance=two), done("n1"), done("n2", DownloadStatus.Downloading))
    assert startable(state).instances == {}
    assert my_needs(state, NodeId("n2"))[model].layers == (4, 8, 8)
    state = applied(done("n2"), state=state)
    assert list(startable(state).instances) == [two.instance_id]
    gone = applied(NodeDownloadProgress(node_id=NodeId("n2"), model_id=model), state=state)
    assert model not in gone.downloads[NodeId("n2")] and startable(gone).instances == {}


def test_route_a_store_worker_stages_the_store_host_loads_in_place(tmp_path: Path) -> None:
    from skulk.config import resolve
    from skulk.store.staging import Route, route

    (tmp_path / "skulk.yaml").write_text("model_store: {enabled: true, store_host: studio}\n")
    worker = resolve({"config": str(tmp_path / "skulk.yaml"), "node_name": "laptop"}, {})
    host = resolve({"config": str(tmp_path / "skulk.yaml"), "node_name": "studio"}, {})
    alone = resolve({"home": str(tmp_path / "elsewhere")}, {})
    assert route(worker, store_copy_complete=True) == Route.FromStore
    assert (route(host, True), route(host, False)) == (Route.LocalStore, Route.FromHub)
    assert (route(alone, True), route(alone, False)) == (Route.LocalStore, Route.FromHub)
    # a partial pipeline stage without a store downloads only its files (into staging); the store host, which
    # serves every rank, and a complete store copy are unchanged
    assert route(alone, False, shard_only=True) == Route.ShardFromHub
    assert route(alone, True, shard_only=True) == Route.LocalStore
    assert route(host, False, shard_only=True) == Route.FromHub
    assert route(worker, False, shard_only=True) == Route.FromStore


def test_a_need_is_partial_only_for_a_stage_short_of_every_layer() -> None:
    from skulk.store.staging import Need
    from skulk.types.ids import ModelId

    model = ModelId("org/m")
    assert [Need(model, layers).partial for layers in ((0, 2, 6), (2, 4, 6), (4, 6, 6))] == [True] * 3
    assert not Need(model, (0, 6, 6)).partial, "a one-rank pipeline needs the whole model"
    assert not Need(model, None).partial, "a tensor shard reads every layer"


def test_staging_resumes_a_partial_and_splices_the_rest(tmp_path: Path) -> None:
    """A stager killed mid-file left a partial: the next attempt asks for the rest with Range and the file
    takes its final name only whole (the same bytes as the store's)."""
    store = tmp_path / "store"
    model = store / "org--m"
    model.mkdir(parents=True)
    payload = bytes(range(256)) * 40_000  # ~10 MB: several splice rounds
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(payload)
    server = StoreServer(store, "127.0.0.1", 0).start()
    try:
        base = client.store_url("127.0.0.1", server.server_address[1])
        files = client.store_files(base, "org/m")
        target = tmp_path / "staged"
        part = partial_path(target / "model.safetensors")
        part.parent.mkdir(parents=True)
        part.write_bytes(payload[:1_234_567])
        seen: list[int] = []
        client.stage(base, "org/m", files, target, lambda done, _files: seen.append(done))
        assert (target / "model.safetensors").read_bytes() == payload
        assert not part.exists() and seen[-1] == len(payload) + 2
    finally:
        server.close()


def test_a_frozen_store_times_out_and_keeps_the_partial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store host that stops sending mid-file (frozen, or its link cut) ends the transfer with a timeout
    instead of hanging the stager; what arrived stays in the partial for the retry to resume."""
    monkeypatch.setattr(client, "TIMEOUT_S", 1.0)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    release = threading.Event()

    def frozen_store() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 300_000)
        release.wait(20)
        conn.close()

    thread = threading.Thread(target=frozen_store, daemon=True)
    thread.start()
    dest = tmp_path / "m" / "model.safetensors"
    try:
        with pytest.raises(TimeoutError):
            url = f"http://127.0.0.1:{port}/f"
            fetch_file(client.open_store_stream, url, dest, 1_000_000, on_bytes=lambda _n: None)
    finally:
        release.set()
        thread.join(5)
        listener.close()
    assert not dest.exists() and partial_path(dest).stat().st_size == 300_000


def _files_with_a_staged_copy(tmp_path: Path, model_id: str, *, emit: Any = lambda _event: None,
                              live_models: Any = set) -> tuple[Any, Path]:
    from skulk.config import resolve
    from skulk.store.files import write_marker
    from skulk.store.service import ModelFiles

    (tmp_path / "skulk.yaml").write_text("model_store:\n  staging: {staging_keep_recent_gb: 0}\n")
    settings = resolve({"config": str(tmp_path / "skulk.yaml"), "home": str(tmp_path)}, {})
    files = ModelFiles(settings, NodeId("n1"), emit, live_models=live_models)
    staged = files.staging_root / model_id.replace("/", "--")
    staged.mkdir(parents=True)
    (staged / "config.json").write_text("{}")
    write_marker(staged, model_id, {"config.json": 2})
    return files, staged


def test_eviction_asks_the_supervisors_and_waits_for_the_runner_to_go(tmp_path: Path) -> None:
    """The state no longer names the model (its instance was deleted) but a runner still loads it: deferred,
    then evicted once the runner is gone (seed 004: never from under a live runner)."""
    live = {"org/a"}
    files, staged = _files_with_a_staged_copy(tmp_path, "org/a", live_models=lambda: set(live))
    assert files.evict(set(), "instance deactivation") == []
    assert staged.is_dir()
    assert files.purge(State(), None) == [] and staged.is_dir(), "an operator purge spares it too"
    live.clear()
    files.runner_gone()
    assert not staged.exists()


def test_an_eviction_nothing_deferred_does_not_run_again_on_a_runner_exit(tmp_path: Path) -> None:
    files, staged = _files_with_a_staged_copy(tmp_path, "org/a")
    assert files.evict({"org/a"}, "instance deactivation") == []  # in use by the state: kept, not deferred
    files.runner_gone()
    assert staged.is_dir()


def test_a_stale_completed_from_an_earlier_instance_does_not_start_a_runner(tmp_path: Path) -> None:
    """The race behind "FileNotFoundError …/config.json while staging": an instance of the model was deleted
    here, its Completed progress stayed in the state, and a new instance of it started its runner at once,
    before this node had prepared its files (and with the directory forgotten, from the wrong path). Now a
    deactivated model's progress is withdrawn and this node's own word (ModelFiles.ready) gates the start."""
    import asyncio

    from skulk.store.staging import startable
    from skulk.types.downloads import DownloadProgress, DownloadSource, DownloadStatus
    from skulk.types.events import InstanceCreated, InstanceDeleted, NodeDownloadProgress

    from .factories import applied, instance

    published: list[Any] = []
    files, _ = _files_with_a_staged_copy(tmp_path, "test/model", emit=published.append)
    one = instance("one", ("n1",))
    done = DownloadProgress(model_id=one.model_id, status=DownloadStatus.Completed, source=DownloadSource.Store)
    state = applied(InstanceCreated(instance=one),
                    NodeDownloadProgress(node_id=NodeId("n1"), model_id=one.model_id, progress=done))

    async def scenario() -> None:
        files._loop = asyncio.get_running_loop()
        gate = asyncio.Event()

        async def prepare(need: Any) -> None:  # a staging that takes until the test says so
            await gate.wait()
            files._dirs[need.model_id] = files.staging_root / "test--model"

        files._prepare = prepare  # type: ignore[method-assign]
        files.reconcile(state)
        gate.set()
        await asyncio.sleep(0)
        await asyncio.wait(list(files._tasks.values()))
        assert files.ready(one)
        gate.clear()
        gone = applied(InstanceDeleted(instance_id=one.instance_id), state=state)
        files.reconcile(gone)
        await asyncio.sleep(0)
        withdrawn = [e for e in published if e.progress is None]
        assert withdrawn and withdrawn[-1].model_id == one.model_id, "the old Completed is withdrawn"
        two = instance("two", ("n1",))
        again = applied(InstanceCreated(instance=two), state=gone)
        assert list(startable(again).instances) == ["two"], "the stale Completed alone would start it"
        files.reconcile(again)
        assert not files.ready(two) and startable(again, files.ready).instances == {}
        gate.set()
        await asyncio.wait(list(files._tasks.values()))
        assert files.ready(two) and list(startable(again, files.ready).instances) == ["two"]

    asyncio.run(scenario())
