"""The LAN model store over real node processes: a store host serves, a worker stages only its shard's files
and serves a chat; deactivation evicts with a zero budget; purge reaches every node; a bad skulk.yaml stops a
node with the message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from skulk.store.files import files_for_shard
from skulk.testing.nodes import LocalNode, free_port
from tests.fake_hub import ALTERNATING_TEMPLATE, RunningHub, set_chat_template, write_random_model, write_repo

from .harness import Cluster, instance_ready, place, wait_until

pytestmark = pytest.mark.timeout(180)

MODEL = "org/tiny-store"


def _yaml(home: Path, text: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "skulk.yaml").write_text(text)


def _store_yaml(store_path: Path, port: int, keep_gb: float) -> str:
    return (
        "model_store:\n  enabled: true\n  store_host: store\n  store_address: 127.0.0.1\n"
        f"  store_port: {port}\n  store_path: {store_path}\n"
        f"  download: {{allow_hf_fallback: false}}\n  staging: {{staging_keep_recent_gb: {keep_gb}}}\n"
    )


def _my_shard(state: dict[str, Any], instance_id: str, node_id: str) -> dict[str, Any]:
    inner = next(iter(state["instances"][instance_id].values()))
    runner = inner["shardAssignments"]["nodeToRunner"][node_id]
    return next(iter(inner["shardAssignments"]["runnerToShard"][runner].values()))


def _chat(node: LocalNode) -> dict[str, Any]:
    status, reply = node.post(
        "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    )
    assert status == 200, reply
    return reply


def test_store_host_serves_workers_stage_their_shards_then_evict(cluster: Cluster, tmp_path: Path) -> None:
    """Three nodes: the store host loads in place, each worker stages only the files of its pipeline stage,
    the chat works, purge spares the in-use copies, deactivation evicts them (budget 0)."""
    store_path = tmp_path / "store"
    repo = write_random_model(store_path, MODEL, shards=4, layers=6)
    port = free_port()
    _yaml(cluster.root / "node0", _store_yaml(store_path, port, keep_gb=0))
    for i in (1, 2):
        _yaml(cluster.root / f"node{i}", _store_yaml(tmp_path / f"worker-store{i}", port, keep_gb=0))
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing here may reach the internet
    host = cluster.start(1, extra_env={"SKULK_NODE_NAME": "store", **offline})[0]
    workers = [cluster.start(1, extra_env={"SKULK_NODE_NAME": f"worker{i}", **offline})[0] for i in (1, 2)]
    wait_until(lambda: len((host.get("/state") or {}).get("nodeIdentities", {})) == 3, 30, "three nodes")

    status, added = host.post("/models/add", {"model_id": MODEL})
    assert status == 200, added
    assert added["id"] == MODEL and added["family"] == "llama" and added["downloaded"]
    listed = {m["id"]: m for m in host.get("/models")["data"]}
    assert listed[MODEL]["storage_size_megabytes"] >= 0 and listed[MODEL]["is_custom"]
    assert host.get("/store/registry")["entries"][0]["model_id"] == MODEL
    assert workers[0].get("/store/health")["store_reachable"] is True
    forwarded = workers[0].get(f"/store/models/{MODEL}/download/status")
    assert forwarded["status"] == "Completed", "a worker asks the store host about store downloads"

    instance_id = place(host, MODEL, min_nodes=3)["instanceId"]
    wait_until(lambda: instance_ready(host, instance_id), 90, "the instance to be ready", workers[0].log_tail)
    previews = host.get(f"/instance/previews?model_id={MODEL}")
    assert all(previews["downloads"][w.node_id]["status"] == "Completed" for w in workers)
    assert _chat(workers[1])["choices"][0]["message"]["content"] is not None

    state = host.get("/state")
    index = json.loads((repo / "model.safetensors.index.json").read_text())
    sizes = {p.name: p.stat().st_size for p in repo.iterdir() if p.is_file()}
    staged_dirs = [w.home / "staging" / "org--tiny-store" for w in workers]
    for worker, staged_dir in zip(workers, staged_dirs, strict=True):
        progress = state["downloads"][worker.node_id][MODEL]
        assert (progress["status"], progress["source"]) == ("Completed", "store")
        shard = _my_shard(state, instance_id, worker.node_id)
        expected = files_for_shard(sizes, index, (shard["startLayer"], shard["endLayer"], shard["nLayers"]))
        staged = {p.name for p in staged_dir.glob("*.safetensors")}
        assert staged == {n for n in expected if n.endswith(".safetensors")}
        assert len(staged) < 4, "a pipeline shard stages only the files holding its layers"
        assert [m["in_use"] for m in worker.get("/store/storage")["staged_models"]] == [True]
    assert not (host.home / "staging" / "org--tiny-store").exists(), "the store host loads in place"

    status, _ = workers[0].post("/store/purge-staging", {})
    assert status == 200
    assert all(d.is_dir() for d in staged_dirs), "a model in use is never purged"

    response = host.client().delete(f"/instance/{instance_id}")
    assert response.status_code == 200
    wait_until(lambda: not any(d.exists() for d in staged_dirs), 30, "deactivation to evict (budget 0)")
    for worker in workers:
        wait_until(lambda w=worker: any("evicted staged org/tiny-store" in x for x in w.output), 10, "the log line")
    assert (store_path / "org--tiny-store" / "config.json").exists(), "the store copy is never touched"


def test_purge_on_every_node_and_startup_pass(cluster: Cluster, tmp_path: Path) -> None:
    """Copies planted in two nodes' staging roots: purge {"modelId"} removes one model everywhere, {} the rest;
    a restart with a budget keeps the newest copy and evicts the older beyond it."""
    config = "model_store:\n  staging: {staging_keep_recent_gb: 1000}\n"
    for i in range(2):
        _yaml(cluster.root / f"node{i}", config)
    nodes = cluster.form(2)
    for node in nodes:
        for name in ("org--a", "org--b"):
            folder = node.home / "staging" / name
            folder.mkdir(parents=True)
            (folder / "model.safetensors").write_bytes(b"x" * 1000)
    status, reply = nodes[0].post("/store/purge-staging", {"modelId": "org/a"})
    assert status == 200 and all(r["ok"] for r in reply["nodes"].values()), reply
    for node in nodes:
        assert not (node.home / "staging" / "org--a").exists()
        assert (node.home / "staging" / "org--b").exists()
    assert nodes[1].client().post("/store/purge-staging").status_code == 422, "a JSON body is required"
    status, reply = nodes[1].post("/store/purge-staging", {})
    assert status == 200 and sorted(r["removed"] for r in reply["nodes"].values()) == [["org/b"], ["org/b"]]

    node = nodes[1]
    for name, age in (("org--old", 1000), ("org--new", 0)):
        folder = node.home / "staging" / name
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 600_000)
        stamp = folder / ".skulk-last-used"
        stamp.touch()
        import os
        import time

        os.utime(stamp, (time.time() - age, time.time() - age))
    _yaml(node.home, "model_store:\n  staging: {staging_keep_recent_gb: 0.0008}\n")  # ~860 kB: one fits
    node.stop()
    node.restart()
    node.wait_ready()
    assert (node.home / "staging" / "org--new").exists()
    assert not (node.home / "staging" / "org--old").exists()
    assert any("evicted staged org/old" in line and "node startup" in line for line in node.output)


def test_invalid_skulk_yaml_stops_the_node_with_the_message(tmp_path: Path) -> None:
    _yaml(tmp_path, "model_store:\n  staging:\n    staging_keep_recnt_gb: 3\n")
    done = subprocess.run(
        [sys.executable, "-m", "skulk", "--home", str(tmp_path), "--no-place-default"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert str(tmp_path / "skulk.yaml") in done.stderr
    assert "model_store.staging.staging_keep_recnt_gb: unknown key" in done.stderr


def test_hugging_face_download_progress_errors_and_chat(cluster: Cluster, tmp_path: Path) -> None:
    """A node pointed at a local fake of the hub: operator download with progress in /state, the typed errors,
    a model added from its config.json and placed straight from the hub, and `skulk models download`."""
    root = tmp_path / "hub"
    for repo_id in ("org/dl", "org/placed", "org/cli"):
        write_random_model(root, repo_id, shards=2)
    set_chat_template(root / "org--placed", ALTERNATING_TEMPLATE)  # Gemma's and Mistral's rule
    write_random_model(root, "org/locked", gated=True)
    write_repo(root, "org/pickles", {"config.json": {"model_type": "llama"}, "pytorch_model.bin": b"x"})
    write_repo(
        root,
        "org/strange",
        {"config.json": {"model_type": "no_such_family", "architectures": ["StrangeForCausalLM"]},
         "model.safetensors": b"x"},
    )
    hub = RunningHub(root).start()
    try:
        node = cluster.start(1, extra_env={"HF_ENDPOINT": hub.url})[0]
        assert node.post("/store/models/org/dl/download", {})[0] == 202
        wait_until(lambda: _progress(node, "org/dl").get("status") == "Completed", 60, "the download")
        status = node.get("/store/models/org/dl/download/status")
        assert status["downloadedBytes"] == status["totalBytes"] > 0 and status["filesDone"] == status["filesTotal"]
        assert (node.home / "models" / "org--dl" / "model-00002-of-00002.safetensors").is_file()

        code, reply = node.post("/store/models/org/locked/download", {})
        assert code == 401 and "hf_token" in reply["error"]["message"]
        code, reply = node.post("/store/models/org/nope/download", {})
        assert code == 404 and "org/nope" in reply["error"]["message"]
        code, reply = node.post("/store/models/org/pickles/download", {})
        assert code == 400 and "safetensors" in reply["error"]["message"]
        code, reply = node.post("/models/add", {"model_id": "org/strange"})  # a family no engine runs
        message = reply["error"]["message"]
        assert code == 400 and "no_such_family" in message and "qwen3" in message and "mlx" in message.lower(), reply

        assert node.post("/models/add", {"model_id": "org/placed"})[0] == 200
        instance_id = place(node, "org/placed")["instanceId"]
        wait_until(lambda: instance_ready(node, instance_id), 90, "the instance to be ready", node.log_tail)
        assert _progress(node, "org/placed")["status"] == "Completed"
        code, reply = node.post(
            "/v1/chat/completions",
            {"model": "org/placed", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert code == 200, reply
        twice = {"model": "org/placed", "messages": [{"role": "user", "content": "hi"}] * 2, "max_tokens": 2}
        code, reply = node.post("/v1/chat/completions", twice)  # the template refuses: the client's to fix
        assert code == 400 and "roles must alternate" in reply["error"]["message"], reply
        assert node.post("/v1/chat/completions", {**twice, "messages": twice["messages"][:1]})[0] == 200

        done = subprocess.run(
            [sys.executable, "-m", "skulk", "models", "--url", node.url, "download", "org/cli"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert "org/cli downloaded" in done.stderr
    finally:
        hub.kill()


def _progress(node: LocalNode, model_id: str) -> dict[str, Any]:
    state = node.get("/state") or {}
    return state.get("downloads", {}).get(node.node_id, {}).get(model_id, {})


def test_a_download_survives_kill_9_and_a_hub_that_is_down(cluster: Cluster, tmp_path: Path) -> None:
    """The field conditions of a download: the node is killed -9 mid-file, then restarts while the hub is down.
    It retries by itself (the progress in /state says so) and, once the hub is back, resumes the partial with a
    Range request from where the killed node stopped; no half file ever takes its final name."""
    root = tmp_path / "hub"
    repo = write_random_model(root, "org/resume", hidden=128)
    weights = (repo / "model.safetensors").stat().st_size
    cut = weights // 2
    hub = RunningHub(root).start(stall_after=cut)
    try:
        node = cluster.start(1, extra_env={"HF_ENDPOINT": hub.url}, place_default=False)[0]
        assert node.post("/models/add", {"model_id": "org/resume"})[0] == 200
        place(node, "org/resume")
        model_dir = node.home / "models" / "org--resume"
        part = model_dir / ".skulk-partial" / "model.safetensors.part"
        wait_until(lambda: part.is_file() and part.stat().st_size >= cut, 60, "half the weights on disk")
        node.kill()
        hub.kill()
        assert not (model_dir / "model.safetensors").exists(), "a half file never takes the final name"

        node.restart()
        node.wait_ready()
        instance_id = place(node, "org/resume")["instanceId"]
        wait_until(lambda: "retrying in" in (_progress(node, "org/resume").get("error") or ""), 60,
                   "the node to report that it retries")
        hub.start()
        wait_until(lambda: instance_ready(node, instance_id), 90, "the instance to be ready", node.log_tail)
        assert (model_dir / "model.safetensors").read_bytes() == (repo / "model.safetensors").read_bytes()
        assert any(line.endswith(f"model.safetensors bytes={cut}-") for line in hub.requests()), hub.requests()
        assert _progress(node, "org/resume")["status"] == "Completed"
    finally:
        hub.kill()


GGUF_MODEL = "org/tiny-gguf"


def test_an_imported_gguf_model_is_staged_to_a_worker_like_safetensors(cluster: Cluster, tmp_path: Path) -> None:
    """A GGUF file (a scaled-down Llama 3.2, Q8_0, rope scaling as rope_freqs) imported on the store host with
    POST /models/import, placed over two nodes: the worker stages model.gguf, config and tokenizer from the store
    (nothing else, the file byte for byte), its runner loads the stage from it, the chat answers on the worker,
    and deactivation evicts the staged copy while the store's import stays."""
    from skulk.store.files import sha256_of
    from tests.unit.test_gguf_families import REAL_CONFIGS, scaled_down, write_checkpoint, write_gguf

    llama = "meta-llama/Llama-3.2-1B-Instruct"
    config = scaled_down(llama, REAL_CONFIGS[llama], layers=4, vocab=320)
    source = write_gguf(config, write_checkpoint(config, tmp_path / "hf"), "llama", tmp_path / "tiny.gguf")
    store_path, port = tmp_path / "store", free_port()
    _yaml(cluster.root / "node0", _store_yaml(store_path, port, keep_gb=0))
    _yaml(cluster.root / "node1", _store_yaml(tmp_path / "worker-store", port, keep_gb=0))
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9"}
    host = cluster.start(1, extra_env={"SKULK_NODE_NAME": "store", **offline})[0]
    worker = cluster.start(1, extra_env={"SKULK_NODE_NAME": "worker", **offline})[0]
    wait_until(lambda: len((host.get("/state") or {}).get("nodeIdentities", {})) == 2, 30, "two nodes")

    status, imported = host.post("/models/import", {"source": str(source), "model_id": GGUF_MODEL})
    assert status == 200, imported
    assert imported["id"] == GGUF_MODEL and imported["downloaded"]
    instance_id = place(host, GGUF_MODEL, min_nodes=2)["instanceId"]
    wait_until(lambda: instance_ready(host, instance_id), 90, "the GGUF instance to be ready", worker.log_tail)
    state = host.get("/state")
    shard = _my_shard(state, instance_id, worker.node_id)
    assert 0 < shard["endLayer"] - shard["startLayer"] < config["num_hidden_layers"], "a pipeline stage"
    progress = state["downloads"][worker.node_id][GGUF_MODEL]
    assert (progress["status"], progress["source"]) == ("Completed", "store")

    staged = worker.home / "staging" / "org--tiny-gguf"
    names = {p.name for p in staged.iterdir() if not p.name.startswith(".")}
    assert names == {"model.gguf", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert sha256_of(staged / "model.gguf") == sha256_of(source)
    assert json.loads((staged / "config.json").read_text())["rope_freq_factors"], "the import's config, staged"
    assert not (host.home / "staging" / "org--tiny-gguf").exists(), "the store host loads its import in place"
    status, reply = worker.post("/v1/chat/completions", {
        "model": GGUF_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply

    assert host.client().delete(f"/instance/{instance_id}").status_code == 200
    wait_until(lambda: not staged.exists(), 30, "deactivation to evict the staged GGUF (budget 0)")
    assert (store_path / "org--tiny-gguf" / "model.gguf").is_file(), "the store's import is never touched"


def test_deleting_an_instance_while_its_runner_loads_never_evicts_its_files(cluster: Cluster, tmp_path: Path) -> None:
    """Seed 004: eviction can never pull weights out from under a live runner. The worker's runner stalls in
    load_model (alive, reading its files); the instance is deleted: eviction asks the supervisors, defers, and
    removes the staged copy only after the runner process is gone."""
    store_path = tmp_path / "store"
    write_random_model(store_path, MODEL, shards=2, layers=4)
    port = free_port()
    _yaml(cluster.root / "node0", _store_yaml(store_path, port, keep_gb=0))
    _yaml(cluster.root / "node1", _store_yaml(tmp_path / "worker-store", port, keep_gb=0))
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9"}
    host = cluster.start(1, extra_env={"SKULK_NODE_NAME": "store", **offline}, place_default=False)[0]
    worker = cluster.start(1, extra_env={"SKULK_NODE_NAME": "worker", "SKULK_FAULT": "stall:load_model", **offline},
                           place_default=False)[0]
    wait_until(lambda: len((host.get("/state") or {}).get("nodeIdentities", {})) == 2, 30, "two nodes")
    assert host.post("/models/add", {"model_id": MODEL})[0] == 200
    instance_id = place(host, MODEL, min_nodes=2)["instanceId"]
    staged = worker.home / "staging" / "org--tiny-store"

    def loading() -> bool:
        state = host.get("/state") or {}
        runner = next(iter(state.get("instances", {}).get(instance_id, {}).values()), {})
        rid = runner.get("shardAssignments", {}).get("nodeToRunner", {}).get(worker.node_id)
        return rid is not None and "RunnerLoading" in state["runners"].get(rid, {})

    wait_until(loading, 90, "the worker's runner to be loading", worker.log_tail)
    assert (staged / "config.json").exists()
    assert host.client().delete(f"/instance/{instance_id}").status_code == 200
    wait_until(lambda: any("evicted staged org/tiny-store" in x for x in worker.output), 60, "the eviction",
               worker.log_tail)
    lines = list(worker.output)
    deferred = next(i for i, x in enumerate(lines) if "eviction of org/tiny-store deferred" in x)
    stopped = next(i for i, x in enumerate(lines) if "runner " in x and " stopped (exit code" in x)
    evicted = next(i for i, x in enumerate(lines) if "evicted staged org/tiny-store" in x)
    assert deferred < stopped < evicted, "\n".join(lines[deferred:])
    assert not staged.exists()
    assert not any("Traceback" in x for x in lines), worker.log_tail()
