"""The families that need a cluster, end to end on real node processes: seeded random checkpoints in their real
Hugging Face layouts (float32, since mlx[cpu]'s GatherMM takes float32 only), served from the local stand-in hub:
- DeepSeek-V3 (transformers 5's DeepseekV3ForCausalLM: 3 layers, the first dense and two MoE with 8 routed experts
  and a shared one, MLA attention): carded open to both engines, and on one MLX rank;
- Qwen3-Next (Qwen3NextForCausalLM: 3 gated-DeltaNet layers and 1 attention layer, MoE): on torch.
Each gives the 16 greedy tokens, with their logprobs, of transformers' own forward on the same prompt ids. The
torch engine runs both natively (engines/torch/models/deepseek_v3.py, qwen3_next.py): a node whose only engine
is torch places DeepSeek-V3 on one rank and gives the same tokens, auto puts it on torch split over two nodes,
and Qwen3-Next as a torch Pipeline over two nodes gives them too. Both families split over MLX nodes (Pipeline
over three and two, Tensor over two where mlx-lm has shard(), and Qwen3-Next's Tensor refused) are
test_mlx_family_nodes', with the other families mlx-lm splits. One hub and one set of nodes for the module."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from skulk.testing.nodes import LocalNode
from tests.fake_hub import RunningHub

from .harness import Cluster, instance_ready, place, wait_until

pytest.importorskip("mlx_lm")

pytestmark = pytest.mark.timeout(240)

MODEL = "org/tiny-deepseek-v3"
NEXT = "org/tiny-qwen3-next"
TOKENS = 16
MESSAGES = [{"role": "user", "content": "hi"}]


@dataclass
class Served:
    hub: RunningHub
    mlx: list[LocalNode]
    torch_only: LocalNode
    expected: dict[str, list[tuple[str, float]]]
    """Per model, transformers' greedy tokens for MESSAGES: each token's text (as logprobs report it) and its
    logprob."""


def write_deepseek_v3(repo: Path) -> Path:
    """A seeded random DeepSeek-V3 as transformers saves it; the router's correction bias spread so experts are
    not picked by ties."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from skulk.models import demo

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=demo.BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=demo.BOS_ID, eos_token_id=demo.EOS_ID,
        initializer_range=0.2,  # peaked logits: greedy's top two differ by 0.04 at least, not 0.005 as at 0.02
    )
    model = DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(0, 0.1)
    return with_tokenizer(model, repo)


def write_qwen3_next(repo: Path) -> Path:
    """A seeded random Qwen3-Next as transformers 5 saves it (rope settings inside rope_parameters): layers 0-2
    gated DeltaNet, layer 3 full attention, every layer MoE with a shared expert."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from skulk.models import demo

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=demo.BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        full_attention_interval=4,  # pyright: ignore[reportCallIssue]  (kept in config.json: mlx-lm reads it)
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=demo.BOS_ID, eos_token_id=demo.EOS_ID, initializer_range=0.2,
    )
    return with_tokenizer(Qwen3NextForCausalLM(config).float().eval(), repo)


def with_tokenizer(model: Any, repo: Path) -> Path:
    """Save the model with the demo model's byte tokenizer (vocabulary 260) and ChatML template."""
    from skulk.models import demo

    model.save_pretrained(repo)
    tokenizer = demo.generate_random_llama(repo.parent / "tokenizer-source", hidden_size=16, n_layers=1, n_heads=2,
                                           n_kv_heads=1, intermediate_size=32, seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, repo / name)
    return repo


def reference(repo: Path) -> list[tuple[str, float]]:
    """Greedy decoding with transformers' own forward (the whole sequence each step) from the prompt ids the
    engines build (the project's chat tokenizer, which the MLX engine uses)."""
    import torch
    from transformers import AutoModelForCausalLM

    from skulk.engines.torch.tokenizer import ChatTokenizer
    from skulk.types.chat import ChatMessage

    tokenizer = ChatTokenizer(repo)
    ids = tokenizer.encode_chat([ChatMessage(role="user", content="hi")])
    model = AutoModelForCausalLM.from_pretrained(str(repo), dtype=torch.float32).eval()
    out: list[tuple[str, float]] = []
    with torch.no_grad():
        for _ in range(TOKENS):
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)
            token = int(logprobs.argmax())
            assert token not in tokenizer.eos_ids, "the seed must give 16 tokens before a stop"
            out.append((tokenizer.decode([token]), float(logprobs[token])))
            ids.append(token)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("families")
    expected = {model: reference(write(root / "hub" / model.replace("/", "--")))
                for model, write in ((MODEL, write_deepseek_v3), (NEXT, write_qwen3_next))}
    hub = RunningHub(root / "hub").start()
    clusters = [Cluster(root / "mlx", extra_env={"HF_ENDPOINT": hub.url}),
                Cluster(root / "torch", extra_env={"HF_ENDPOINT": hub.url, "SKULK_ENGINES": "torch"})]
    try:
        mlx = clusters[0].form(2, place_default=False)
        (torch_only,) = clusters[1].start(1, place_default=False)
        yield Served(hub, mlx, torch_only, expected)
    finally:
        hub.kill()
        for cluster in clusters:
            cluster.print_logs()
        assert [pid for cluster in clusters for pid in cluster.stop_all()] == [], "runner processes outlived nodes"


def greedy(node: LocalNode, model: str) -> list[tuple[str, float]]:
    status, reply = node.post("/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": TOKENS,
                                                       "temperature": 0, "logprobs": True, "top_logprobs": 1})
    assert status == 200, reply
    return [(t["token"], t["logprob"]) for t in reply["choices"][0]["logprobs"]["content"]]


def assert_same_tokens(got: list[tuple[str, float]], expected: list[tuple[str, float]]) -> None:
    """The same 16 tokens, each with transformers' logprob within float32 noise (a byte-level vocabulary reports
    some bytes alike as U+FFFD: the logprob tells those apart)."""
    assert [t for t, _ in got] == [t for t, _ in expected], (got, expected)
    assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(got, expected, strict=True)), (got, expected)


def serve_and_compare(served: Served, model: str = MODEL, **body: Any) -> dict[str, Any]:
    """Place the model, compare its greedy tokens with transformers', and delete the instance, waiting for its
    runners to stop (the next test's placement needs the memory)."""
    node = served.mlx[0]
    assert node.post("/models/add", {"model_id": model})[0] == 200
    wait_until(lambda: not any(n.runner_pids() for n in served.mlx) or None, 60, "the earlier instance to stop")
    placed = place(node, model, **body)
    instance = next(iter(placed["instance"].values()))
    try:
        wait_until(lambda: instance_ready(node, placed["instanceId"]), 150, f"the {model} instance to be ready",
                   lambda: node.log_tail(30))
        assert_same_tokens(greedy(node, model), served.expected[model])
    finally:
        with node.client() as client:
            assert client.delete(f"/instance/{placed['instanceId']}").status_code == 200
    return instance


def test_the_card_is_open_to_both_engines(served: Served) -> None:
    node = served.mlx[0]
    status, added = node.post("/models/add", {"model_id": MODEL})
    assert status == 200, added
    assert added["compatible_backends"] is None and added["family"] == "deepseek_v3"
    assert added["torch_runtime"] == "native"
    card = wait_until(lambda: node.get("/state")["modelCards"].get(MODEL), 30, "the card in the cluster's state")
    assert card["compatibleBackends"] is None and card["torchRuntime"] == "native" and card["nLayers"] == 3
    assert (card["numKeyValueHeads"], card["headDim"]) == (4, 24), "MLA: per-head keys of nope + rope"


def test_one_mlx_rank_gives_transformers_tokens(served: Served) -> None:
    instance = serve_and_compare(served, min_nodes=1, engine="mlx")  # auto: torch, which runs it natively too
    assert instance["engine"] == "mlx" and len(instance["shardAssignments"]["nodeToRunner"]) == 1


def test_auto_puts_it_natively_on_torch_and_a_torch_pipeline_gives_the_same_tokens(served: Served) -> None:
    """The MLX cluster's nodes have torch too, and torch runs DeepSeek-V3 natively: auto picks it there, split
    over both nodes (engines/torch/models/deepseek_v3.py's MLA on each stage)."""
    instance = serve_and_compare(served, min_nodes=2, sharding="Pipeline")
    assert instance["engine"] == "torch" and len(instance["shardAssignments"]["nodeToRunner"]) == 2


def test_qwen3_next_as_a_torch_pipeline_gives_transformers_tokens(served: Served) -> None:
    """torch runs Qwen3-Next natively (its linear layers' per-stream states on each stage): carded native, and a
    Pipeline over the two nodes gives transformers' tokens."""
    status, added = served.mlx[0].post("/models/add", {"model_id": NEXT})
    assert status == 200 and added["torch_runtime"] == "native", added
    instance = serve_and_compare(served, NEXT, min_nodes=2, sharding="Pipeline", engine="torch")
    assert instance["engine"] == "torch" and len(instance["shardAssignments"]["nodeToRunner"]) == 2


def test_a_torch_only_node_runs_it_natively(served: Served) -> None:
    """auto puts it on torch where torch is all there is: one rank, the torch engine's own MLA layers, the same
    tokens and logprobs."""
    node = served.torch_only
    assert node.get("/state")["nodeBackends"][node.node_id] == ["torch", "torch-cpu"]
    status, added = node.post("/models/add", {"model_id": MODEL})
    assert status == 200 and added["compatible_backends"] is None, added
    placed = place(node, MODEL)
    instance = next(iter(placed["instance"].values()))
    assert instance["engine"] == "torch" and len(instance["shardAssignments"]["nodeToRunner"]) == 1
    try:
        wait_until(lambda: instance_ready(node, placed["instanceId"]), 150, "the torch engine to be ready",
                   lambda: node.log_tail(30))
        assert_same_tokens(greedy(node, MODEL), served.expected[MODEL])
    finally:
        with node.client() as client:
            assert client.delete(f"/instance/{placed['instanceId']}").status_code == 200
