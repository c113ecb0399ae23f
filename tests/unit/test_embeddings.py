"""Embeddings without nodes: the BERT encoder against transformers' BertModel, pooling and normalisation by hand,
the demo embedding model, request validation, and the decisions (task kind, single-node placement)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from skulk.api.security import Access, required_access
from skulk.cluster.payloads import PayloadBook, PayloadFetcher
from skulk.engines.torch.bert import load_bert
from skulk.engines.torch.embedding import EmbeddingEngine, EmbeddingRefused, Pooling, pool, read_pooling
from skulk.master.decide import events_for_command
from skulk.models.cards import get_card
from skulk.models.catalog import UnsupportedArchitecture, card_from_config, list_entry
from skulk.models.demo import ensure_builtin_model
from skulk.models.demo_embed import EMBED_MODEL_ID, embed_card, generate_random_bert, wordpiece_tokenizer
from skulk.store import client
from skulk.store.files import is_complete, is_needed, local_files
from skulk.store.hub import Hub, download, list_files
from skulk.store.server import StoreServer
from skulk.types.commands import StartEmbedding
from skulk.types.embeddings import MAX_EMBEDDING_INPUTS, EmbeddingRequest, OllamaEmbedRequest
from skulk.types.events import TaskCreated
from skulk.types.ids import CommandId, ModelId, NodeId, TaskId
from skulk.types.placement import SingleNodeOnly
from skulk.types.state import State
from skulk.types.tasks import ChatCompletion, EmbeddingTaskParams, TextEmbedding
from tests.fake_hub import RunningHub

from .test_model_store import _raw_get
from .test_placement import card, do_place, placed, state

transformers = pytest.importorskip("transformers")

# The real config.json of each model, as published; tests scale the sizes down (_scaled) and keep the rest.
ALL_MINILM_L6_V2 = {
    "_name_or_path": "nreimers/MiniLM-L6-H384-uncased", "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1, "gradient_checkpointing": False, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 384, "initializer_range": 0.02, "intermediate_size": 1536,
    "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert", "num_attention_heads": 12,
    "num_hidden_layers": 6, "pad_token_id": 0, "position_embedding_type": "absolute",
    "transformers_version": "4.8.2", "type_vocab_size": 2, "use_cache": True, "vocab_size": 30522,
}
BGE_SMALL_EN_V1_5 = {
    "_name_or_path": "/root/.cache/torch/sentence_transformers/BAAI_bge-small-en/", "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1, "classifier_dropout": None, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 384, "id2label": {"0": "LABEL_0"}, "initializer_range": 0.02,
    "intermediate_size": 1536, "label2id": {"LABEL_0": 0}, "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
    "model_type": "bert", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0,
    "position_embedding_type": "absolute", "torch_dtype": "float32", "transformers_version": "4.30.0",
    "type_vocab_size": 2, "use_cache": True, "vocab_size": 30522,
}
MEAN_POOLING = {"word_embedding_dimension": 384, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
                "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
CLS_POOLING = {**MEAN_POOLING, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
MODELS = {"all-MiniLM-L6-v2": (ALL_MINILM_L6_V2, MEAN_POOLING), "bge-small-en-v1.5": (BGE_SMALL_EN_V1_5, CLS_POOLING)}


def _scaled(config: dict[str, Any]) -> dict[str, Any]:
    vocab = wordpiece_tokenizer().get_vocab_size()
    return {**config, "hidden_size": 48, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96,
            "max_position_embeddings": 40, "vocab_size": vocab}


def _write_model(path: Path, name: str, *, prefixed: bool = False) -> Any:
    """A random transformers BertModel of the scaled real config, saved as the hub has it (sentence-transformers
    files and the demo's WordPiece tokenizer beside it); prefixed: tensor names under `bert.` as a task head
    saves them."""
    config, pooling = MODELS[name]
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(**_scaled(config)), add_pooling_layer=True).eval()
    for p in hf.parameters():  # random LayerNorms and biases too, so a swapped weight cannot hide
        torch.nn.init.normal_(p, std=0.2)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(_scaled(config)))
    tensors = {("bert." if prefixed else "") + k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "tokenizer.json").write_text(wordpiece_tokenizer().to_str())
    (path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "[PAD]"}))
    (path / "modules.json").write_text(json.dumps(MODULES))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return hf


def _batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


@pytest.mark.parametrize(("name", "prefixed"), [("all-MiniLM-L6-v2", False), ("bge-small-en-v1.5", True)])
def test_encoder_matches_transformers_bert_model(tmp_path: Path, name: str, prefixed: bool) -> None:
    hf = _write_model(tmp_path / name, name, prefixed=prefixed)
    ours = load_bert(tmp_path / name)
    ids, mask = _batch([[2, 10, 20, 30, 40, 3], [2, 7, 3], [2, *range(5, 40), 3][:40]])
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        got = ours(ids, mask)
    real = mask.bool()
    assert torch.allclose(got[real], want[real], atol=2e-5, rtol=1e-4), (got[real] - want[real]).abs().max()


@pytest.mark.parametrize("name", list(MODELS))
def test_engine_pools_and_normalises_as_the_models_files_say(tmp_path: Path, name: str) -> None:
    hf = _write_model(tmp_path / name, name)
    engine = EmbeddingEngine(tmp_path / name)
    texts = ["Hello, world!", "a", "sentence encoders pool the tokens"]
    vectors, tokens = engine.embed(texts)
    rows = [e.ids for e in wordpiece_tokenizer().encode_batch(texts)]
    assert tokens == sum(map(len, rows))
    ids, mask = _batch(rows)
    with torch.no_grad():
        hidden = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    if MODELS[name][1]["pooling_mode_cls_token"]:  # bge: the [CLS] token's state
        by_hand = torch.stack([hidden[i, 0] for i in range(len(rows))])
    else:  # MiniLM: the mean over each text's real tokens, padding left out
        by_hand = torch.stack([hidden[i, :len(r)].mean(dim=0) for i, r in enumerate(rows)])
    by_hand = by_hand / by_hand.norm(dim=1, keepdim=True)
    assert vectors.shape == (3, 48)
    assert torch.allclose(vectors, by_hand, atol=2e-5)
    assert torch.allclose(vectors.norm(dim=1), torch.ones(3), atol=1e-5)
    alone, _ = engine.embed([texts[1]])  # padding in a batch changes nothing
    assert torch.allclose(alone[0], vectors[1], atol=1e-5)


def test_pooling_modes_by_hand() -> None:
    hidden = torch.tensor([[[1.0, 2.0], [3.0, -4.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    raw = {mode: pool(hidden, mask, Pooling(mode, normalize=False))[0].tolist()
           for mode in ("cls", "mean", "max", "mean_sqrt_len", "lasttoken")}
    assert raw == {"cls": [1.0, 2.0], "mean": [2.0, -1.0], "max": [3.0, 2.0],
                   "mean_sqrt_len": pytest.approx([4 / 2**0.5, -2 / 2**0.5]), "lasttoken": [3.0, -4.0]}
    unit = pool(hidden, mask, Pooling("lasttoken", normalize=True))[0]
    assert unit.tolist() == pytest.approx([0.6, -0.8])


def test_pooling_comes_from_modules_json(tmp_path: Path) -> None:
    assert read_pooling(tmp_path) == Pooling("mean", normalize=False)  # a bare encoder: sentence-transformers' default
    (tmp_path / "modules.json").write_text(json.dumps(MODULES))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(CLS_POOLING))
    assert read_pooling(tmp_path) == Pooling("cls", normalize=True)
    (tmp_path / "modules.json").write_text(json.dumps(MODULES[:2]))
    assert read_pooling(tmp_path) == Pooling("cls", normalize=False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({**CLS_POOLING, "pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="exactly one of"):
        read_pooling(tmp_path)
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    (tmp_path / "modules.json").write_text(json.dumps([*MODULES[:2], dense]))
    with pytest.raises(ValueError, match="Dense are not supported"):
        read_pooling(tmp_path)


def test_a_checkpoint_that_is_not_bert_or_misses_tensors_is_refused_at_load(tmp_path: Path) -> None:
    _write_model(tmp_path / "m", "all-MiniLM-L6-v2")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    del weights["encoder.layer.1.output.dense.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 encoder tensor"):
        load_bert(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({**ALL_MINILM_L6_V2, "model_type": "llama"}))
    with pytest.raises(ValueError, match="not a BERT encoder"):
        load_bert(tmp_path / "m")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> EmbeddingEngine:
    return EmbeddingEngine(ensure_builtin_model(EMBED_MODEL_ID, tmp_path_factory.mktemp("models")))


def test_demo_embedding_model_is_deterministic_unit_length_and_catalogued(demo: EmbeddingEngine,
                                                                          tmp_path: Path) -> None:
    again = generate_random_bert(tmp_path / "again", seed=2, hidden_size=384, n_layers=2, n_heads=6,
                                 intermediate_size=1536)
    for f in sorted(p for p in demo.model_dir.rglob("*") if p.is_file()):
        assert (again / f.relative_to(demo.model_dir)).read_bytes() == f.read_bytes(), f.name
    vectors, _ = demo.embed(["The same text", "another one", "The same text"])
    assert vectors.shape == (3, 384)
    assert torch.allclose(vectors.norm(dim=1), torch.ones(3), atol=1e-5)
    assert torch.equal(vectors[0], vectors[2]) and not torch.allclose(vectors[0], vectors[1])
    assert get_card(EMBED_MODEL_ID) == embed_card()
    assert embed_card().embeds and embed_card().tasks == ["TextEmbedding"] and not card().embeds


def test_too_long_or_bad_inputs_say_what_to_fix_and_truncate_cuts_keeping_the_specials(demo: EmbeddingEngine) -> None:
    long_text = "x " * 600
    with pytest.raises(EmbeddingRefused, match=r"input 1 is 602 tokens; .* at most 512 tokens"):
        demo.embed(["fine", long_text])
    (row,) = demo.tokenize([long_text], truncate=True)
    vocab = wordpiece_tokenizer().get_vocab()
    assert len(row) == 512 and row[0] == vocab["[CLS]"] and row[-1] == vocab["[SEP]"]
    assert demo.embed([long_text], truncate=True)[0].shape == (1, 384)
    with pytest.raises(EmbeddingRefused, match="token id 5000"):
        demo.embed([[2, 5000, 3]])
    ids_vector, tokens = demo.embed([[2, 10, 3]])  # the model's own ids, embedded as given
    assert tokens == 3 and ids_vector.shape == (1, 384)


def test_embedding_requests_take_texts_or_token_ids_and_refuse_empty_or_too_many() -> None:
    assert EmbeddingRequest(model="m", input="hi").inputs() == ["hi"]
    assert EmbeddingRequest(model="m", input=["a", "b"]).inputs() == ["a", "b"]
    assert EmbeddingRequest(model="m", input=[1, 2, 3]).inputs() == [[1, 2, 3]]
    assert EmbeddingRequest(model="m", input=[[1], [2, 3]]).inputs() == [[1], [2, 3]]
    assert OllamaEmbedRequest(model="m", input="hi").inputs() == ["hi"]
    for bad, why in [("", "empty string"), (["a", ""], "input\\[1\\] is an empty string"), ([], "at least 1"),
                     (["x"] * (MAX_EMBEDDING_INPUTS + 1), f"at most {MAX_EMBEDDING_INPUTS}")]:
        with pytest.raises(ValidationError, match=why):
            EmbeddingRequest(model="m", input=bad)
    with pytest.raises(ValidationError, match="encoding_format"):
        EmbeddingRequest(model="m", input="x", encoding_format="int8")  # type: ignore[arg-type]


def test_start_embedding_creates_an_embedding_task() -> None:
    command = StartEmbedding(command_id=CommandId("c1"), model=ModelId(EMBED_MODEL_ID), origin_node_id=NodeId("n1"))
    created = events_for_command(State(), command, TaskId("t1"))[0]
    assert isinstance(created, TaskCreated) and isinstance(created.task, TextEmbedding)
    assert created.task.origin_node_id == "n1"


def test_an_embedding_model_is_placed_on_one_node_only() -> None:
    embedder = card(tasks=["TextEmbedding"], n_layers=2, supports_tensor=False)
    two = state({"a": 1 << 34, "b": 1 << 34})
    refused = do_place(two, embedder, min_nodes=2)
    assert isinstance(refused, SingleNodeOnly) and "min_nodes 1" in refused.message
    assert len(placed(do_place(two, embedder)).shard_assignments.node_to_runner) == 1


def test_a_sentence_encoders_config_makes_an_embedding_card() -> None:
    minilm = card_from_config("sentence-transformers/all-MiniLM-L6-v2", ALL_MINILM_L6_V2, 90_868_376)
    assert minilm.embeds and not minilm.supports_tensor and minilm.family == "bert"
    assert (minilm.hidden_size, minilm.n_layers, minilm.context_length, minilm.vocab_size) == (384, 6, 512, 30522)
    assert list_entry(minilm, created=0, where={})["tasks"] == ["TextEmbedding"]
    assert card_from_config("BAAI/bge-small-en-v1.5", BGE_SMALL_EN_V1_5, 133_466_304).n_layers == 12
    with pytest.raises(UnsupportedArchitecture, match="position_embedding_type relative_key"):
        card_from_config("x/rel", {**ALL_MINILM_L6_V2, "position_embedding_type": "relative_key"}, 1)


def test_the_store_fetches_stages_and_serves_a_sentence_encoders_pooling(tmp_path: Path) -> None:
    """modules.json and 1_Pooling/config.json (which says mean or CLS) travel with the weights: from the hub
    listing, through the store host's file server, into a staged copy that pools like the original."""
    assert is_needed("modules.json") and is_needed("1_Pooling/config.json") and is_needed("sentence_bert_config.json")
    assert not is_needed("onnx/model.onnx") and not is_needed("2_Dense/config.json")
    store = tmp_path / "store"
    _write_model(store / "org--bge", "bge-small-en-v1.5")
    assert local_files(store / "org--bge")["1_Pooling/config.json"] > 0
    server = StoreServer(store, "127.0.0.1", 0).start()
    try:
        port = server.server_address[1]
        assert _raw_get(port, "/models/org/bge/files/1_Pooling/config.json") == (
            200, (store / "org--bge" / "1_Pooling" / "config.json").read_bytes())
        for bad in ("/models/org/bge/files/1_Pooling/..%2F..%2Fconfig.json", "/models/org/bge/files/x/config.json"):
            assert _raw_get(port, bad)[0] in (400, 404), bad
        base = client.store_url("127.0.0.1", port)
        staged = tmp_path / "staged"
        client.stage(base, "org/bge", client.store_files(base, "org/bge"), staged, None)
    finally:
        server.close()
    assert read_pooling(staged) == Pooling("cls", normalize=True)
    original, _ = EmbeddingEngine(store / "org--bge").embed(["staged copies pool alike"])
    assert torch.equal(EmbeddingEngine(staged).embed(["staged copies pool alike"])[0], original)


@pytest.mark.timeout(60)
def test_a_sentence_encoder_downloads_from_the_hub_with_its_pooling(tmp_path: Path) -> None:
    """Through the real huggingface_hub client against the local fake of the hub's file API."""
    _write_model(tmp_path / "hub" / "BAAI--bge-small", "bge-small-en-v1.5")
    (tmp_path / "hub" / "BAAI--bge-small" / "onnx").mkdir()
    (tmp_path / "hub" / "BAAI--bge-small" / "onnx" / "model.onnx").write_bytes(b"not needed")
    hub = RunningHub(tmp_path / "hub").start()
    try:
        repo = list_files(Hub(hub.url), "BAAI/bge-small")
        assert "1_Pooling/config.json" in repo.files and "modules.json" in repo.files
        assert "onnx/model.onnx" not in repo.files
        download(Hub(hub.url), repo, tmp_path / "store" / "BAAI--bge-small")
    finally:
        hub.kill()
    target = tmp_path / "store" / "BAAI--bge-small"
    assert is_complete(target) and read_pooling(target) == Pooling("cls", normalize=True)


def test_an_inference_key_may_embed_and_use_ollama_where_it_is_mounted() -> None:
    for method, path in [("POST", "/v1/embeddings"), ("POST", "/ollama/api/embed"), ("POST", "/ollama/api/chat"),
                         ("GET", "/ollama/api/tags")]:
        assert required_access(method, path) is Access.INFERENCE, path
    assert required_access("POST", "/ollama/api/pull") is Access.ADMIN


class _OneReply:
    """A transport whose every query is answered by one node with the same bytes."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply

    async def query(self, key: str, timeout_s: float) -> list[bytes]:
        return [self.reply]


async def test_a_worker_fetches_an_embedding_tasks_texts_as_embedding_params() -> None:
    """The runner's node is often not the API node: the texts come point to point, validated as the task's kind."""
    params = EmbeddingTaskParams(model=ModelId(EMBED_MODEL_ID), inputs=["private text"], truncate=True)
    fetcher = PayloadFetcher(_OneReply(params.model_dump_json().encode()))  # type: ignore[arg-type]
    ids = dict(task_id=TaskId("t1"), command_id=CommandId("c1"), instance_id="i", model=ModelId(EMBED_MODEL_ID),
               origin_node_id=NodeId("api"))
    assert await fetcher.fetch(TextEmbedding.model_validate(ids)) == params
    chat = PayloadFetcher(_OneReply(params.model_dump_json().encode()))  # type: ignore[arg-type]
    assert await chat.fetch(ChatCompletion.model_validate({**ids, "command_id": "c2"})) is None  # wrong kind: dropped
    assert "private text" not in TextEmbedding.model_validate({**ids, "task_params": params}).model_dump_json()


class _Served(_OneReply):
    """A transport that also serves keys (PayloadBook.start) and remembers who asked (a query to itself included)."""

    def __init__(self) -> None:
        super().__init__(b"")
        self.queries: list[str] = []
        self.answer: Callable[[str, str], bytes | None] | None = None

    def serve(self, key: str, answer: Callable[[str, str], bytes | None]) -> None:
        self.answer = answer

    async def query(self, key: str, timeout_s: float) -> list[bytes]:
        self.queries.append(key)
        assert self.answer is not None
        reply = self.answer(key, "")
        return [] if reply is None else [reply]


async def test_a_payload_this_node_took_is_read_from_its_book_without_a_query() -> None:
    """Where the worker's node is the API node that took the request, it reads the payload from the node's own book
    (no query, no serialization: issue 43); another node's query gets the same payload as bytes; a payload of the
    wrong kind, or one withdrawn when its stream closed, is not handed out."""
    transport = _Served()
    book = PayloadBook(transport, NodeId("api"))  # type: ignore[arg-type]
    book.start()
    params = EmbeddingTaskParams(model=ModelId(EMBED_MODEL_ID), inputs=["private text"], truncate=True)
    book.offer(CommandId("c1"), params)
    fetcher = PayloadFetcher(transport, book)  # type: ignore[arg-type]
    ids = dict(task_id=TaskId("t1"), command_id=CommandId("c1"), instance_id="i", model=ModelId(EMBED_MODEL_ID),
               origin_node_id=NodeId("api"))
    task = TextEmbedding.model_validate(ids)
    assert fetcher.local(task) is params and transport.queries == []
    assert fetcher.local(ChatCompletion.model_validate(ids)) is None  # the wrong kind
    elsewhere = PayloadFetcher(transport)  # type: ignore[arg-type]  # another node: one query, bytes on the wire
    assert elsewhere.local(task) is None and await elsewhere.fetch(task) == params
    assert transport.queries == ["payload/api/c1"]
    book.withdraw(CommandId("c1"))
    assert fetcher.local(task) is None
