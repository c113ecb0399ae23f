"""Which engines run a family (models/families.py): the torch engine its native list, the MLX engine what
mlx-lm's own registry loads (read by the MLX probe's child interpreter). Published configs of the families people
pool machines for, written down as the few keys the decision reads (no download); the cards built from them;
the refusal that names the engines; and placement that keeps an MLX-only card off torch-only nodes."""

from __future__ import annotations

from typing import Any

import pytest

from skulk.engines import mlx as mlx_engine
from skulk.engines.torch.models import SUPPORTED_MODEL_TYPES
from skulk.master.placement import preview_placements
from skulk.models.catalog import UnsupportedArchitecture, card_from_config
from skulk.models.families import MlxRegistry, attention_shape, engines_running, refusal
from skulk.types.backends import INSTALL, BackendTag, allows, backends_for
from skulk.types.instances import InstanceMeta, MlxRingInstance, Sharding
from skulk.types.placement import EngineUnavailable
from tests.unit.test_engine_choice import LINUX, LINUX_MLX, MAC, cluster, do_place
from tests.unit.test_placement import card

DEEPSEEK_V3: dict[str, Any] = {  # deepseek-ai/DeepSeek-V3's config.json (the keys read here)
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61,
    "hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "vocab_size": 129280,
    "max_position_embeddings": 163840, "torch_dtype": "bfloat16", "num_nextn_predict_layers": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
PUBLISHED: dict[str, dict[str, Any]] = {
    "MiniMaxAI/MiniMax-M2": {"model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"]},
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": {"model_type": "llama4",
                                                  "architectures": ["Llama4ForConditionalGeneration"]},
    "mistralai/Mixtral-8x7B-v0.1": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]},
    "nvidia/Nemotron-H-8B-Base-8K": {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"]},
}
"""Each family's published model_type and architectures: every one is run by the MLX engine only. (DeepSeek V3's
family, Kimi K2's kimi_k2 among it, runs natively on torch too, its FP8 blocks held at 8 bits:
test_a_deepseek_v3_fp8_card_is_open_to_torch_and_its_attention_is_not_llama_shaped. gpt-oss runs natively on
torch, its MXFP4 experts dequantized while loading: GPT_OSS_20B. Qwen3-Next and Qwen3.5 run natively on torch
too: models/qwen3_next.py, models/qwen3_5.py.)"""
GPT_OSS_20B: dict[str, Any] = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
                               "quantization_config": {"quant_method": "mxfp4"}}
MLX_ONLY: list[BackendTag] = ["mlx", "mlx-metal", "mlx-cpu"]
PER_TENSOR_FP8 = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}
"""An FP8 layout without block scales (one scale a tensor): the torch engine reads DeepSeek's blocks only."""
TOY = MlxRegistry(version="0.0", modules=frozenset({"llama", "deepseek_v3", "minimax", "bailing_moe_v3"}),
                  remapping={"mistral": "llama", "kimi_k2": "deepseek_v3", "minimax_m2": "minimax"},
                  architecture_remapping={("bailing_hybrid", "BailingMoeV3ForCausalLM"): "bailing_moe_v3"})


@pytest.fixture(scope="module")
def registry() -> MlxRegistry:
    """mlx-lm's own registry, as the node reads it: from the MLX probe's child interpreter."""
    pytest.importorskip("mlx_lm")
    found = mlx_engine.model_registry()
    assert found is not None, mlx_engine.probe()
    return found


def test_mlx_lm_s_registry_decides_with_its_own_remapping() -> None:
    """mlx-lm's lookup order: an architecture remapping, then the model-type remapping, then the type itself."""
    assert TOY.module_for("kimi_k2") == "deepseek_v3" and TOY.runs("kimi_k2")
    assert TOY.module_for("bailing_hybrid", ["BailingMoeV3ForCausalLM"]) == "bailing_moe_v3"
    assert not TOY.runs("bailing_hybrid") and not TOY.runs("") and not TOY.runs("cache")
    assert engines_running({"model_type": "mistral"}, SUPPORTED_MODEL_TYPES, TOY) == ("torch", "mlx")
    assert engines_running({"model_type": "minimax_m2"}, SUPPORTED_MODEL_TYPES, TOY) == ("mlx",)
    assert engines_running({"model_type": "minimax_m2"}, SUPPORTED_MODEL_TYPES, None) == ()
    assert MlxRegistry.from_json({"version": "0.0", "modules": sorted(TOY.modules),
                                         "remapping": dict(TOY.remapping),
                                         "architecture_remapping": [["bailing_hybrid", "BailingMoeV3ForCausalLM",
                                                                     "bailing_moe_v3"]]}) == TOY


@pytest.mark.parametrize("model_id", sorted(PUBLISHED))
def test_the_families_that_need_a_cluster_run_on_the_mlx_engine(registry: MlxRegistry, model_id: str) -> None:
    assert engines_running(PUBLISHED[model_id], SUPPORTED_MODEL_TYPES, registry) == ("mlx",), registry.version


def test_the_torch_engine_s_own_families_run_everywhere(registry: MlxRegistry) -> None:
    """Each native family: both engines (mlx-lm loads every one; gpt-oss in the layouts its loader reads, here
    the MXFP4 one), and its card stays open to any backend."""
    for model_type in SUPPORTED_MODEL_TYPES:
        config = {"model_type": model_type, "quantization_config": {"quant_method": "mxfp4"}} \
            if model_type == "gpt_oss" else {"model_type": model_type}
        assert engines_running(config, SUPPORTED_MODEL_TYPES, registry) == ("torch", "mlx")
    assert engines_running(GPT_OSS_20B, SUPPORTED_MODEL_TYPES, registry) == ("torch", "mlx")  # MXFP4 as shipped
    qwen3 = {"model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128}
    made = card_from_config("Qwen/Qwen3-0.6B", qwen3, 1)
    assert made.compatible_backends is None and (made.num_key_value_heads, made.head_dim) == (8, 128)


def test_a_deepseek_v3_fp8_card_is_open_to_torch_and_its_attention_is_not_llama_shaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MLA: every query head has its own expanded key (nope + rope = 192 wide), not grouped KV heads. The torch
    engine runs the family natively (models/deepseek_v3.py) and holds the checkpoint's block-scaled FP8 weights at
    8 bits (engines/torch/fp8.py), so the published card is open to every engine; a per-tensor FP8
    layout (no weight_block_size) it does not read leaves the card MLX's alone."""
    monkeypatch.setattr(mlx_engine, "model_registry", lambda: TOY)
    made = card_from_config("deepseek-ai/DeepSeek-V3", DEEPSEEK_V3, 688_000_000_000)
    assert made.compatible_backends is None and made.family == "deepseek_v3" and made.n_layers == 61
    assert (made.num_key_value_heads, made.head_dim) == (128, 192) == attention_shape(DEEPSEEK_V3)
    assert made.model_dump(by_alias=True).get("compatibleBackends") is None
    per_tensor = card_from_config("x/deepseek-v3-fp8-per-tensor", {**DEEPSEEK_V3, **PER_TENSOR_FP8}, 1)
    assert per_tensor.compatible_backends == MLX_ONLY


def test_a_family_no_engine_runs_is_refused_naming_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    unknown = {"model_type": "made_up", "architectures": ["MadeUpForCausalLM"], "num_hidden_layers": 2,
               "hidden_size": 8, "num_attention_heads": 2}
    monkeypatch.setattr(mlx_engine, "model_registry", lambda: TOY)
    with pytest.raises(UnsupportedArchitecture) as caught:
        card_from_config("x/made-up", unknown, 1)
    said = str(caught.value)
    assert "made_up" in said and "the torch engine runs llama, qwen2, qwen3" in said
    assert "the MLX engine (mlx-lm)" in said and "mlx-lm 0.0 has no model module 'made_up'" in said
    monkeypatch.setattr(mlx_engine, "model_registry", lambda: None)  # mlx-lm is not installed on this node
    with pytest.raises(UnsupportedArchitecture) as caught:
        card_from_config("deepseek-ai/DeepSeek-V3", {**DEEPSEEK_V3, **PER_TENSOR_FP8}, 1)
    assert "the MLX engine (mlx-lm) runs the families mlx-lm loads" in str(caught.value)
    assert INSTALL["mlx"] in str(caught.value)
    mlx4 = {**unknown, "model_type": "qwen3", "quantization": {"bits": 3, "group_size": 64}}
    assert "the torch engine cannot load it" in refusal("x/q", mlx4, SUPPORTED_MODEL_TYPES, TOY, "the torch "
                                                        "engine cannot load it: 3-bit")


def test_a_quantization_torch_cannot_read_leaves_the_family_to_mlx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mlx_engine, "model_registry", lambda: TOY)
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
              "quantization": {"bits": 3, "group_size": 64}}
    assert card_from_config("x/llama-3bit", config, 1).compatible_backends == MLX_ONLY


def test_backend_tags_of_engines() -> None:
    assert backends_for(("torch", "mlx")) is None and backends_for(("mlx",)) == MLX_ONLY
    assert backends_for(("torch",)) == ["torch", "torch-cpu", "torch-cuda"]
    assert allows(None, "torch") and allows(MLX_ONLY, "mlx") and not allows(MLX_ONLY, "torch")


def test_an_mlx_only_card_is_placed_only_where_mlx_runs() -> None:
    """Placement puts its ranks on MLX nodes (auto picks MLX even on Linux, where torch comes first), and a
    cluster without the MLX engine is refused naming it and what to install, never suggesting torch."""
    deepseek = card(family="deepseek_v3", compatible_backends=MLX_ONLY)
    placed = do_place(cluster(a=LINUX, b=LINUX_MLX), c=deepseek)
    assert isinstance(placed, MlxRingInstance) and placed.engines() == {"b": "mlx"}
    on_a_mac = do_place(cluster(a=MAC), c=deepseek)
    assert not isinstance(on_a_mac, EngineUnavailable)
    refused = do_place(cluster(a=LINUX), c=deepseek)
    assert isinstance(refused, EngineUnavailable) and refused.engine == "mlx" and refused.http_status == 400
    said = refused.describe()
    assert "cannot run the mlx engine" in said and INSTALL["mlx"] in said and "engine torch" not in said
    explicit = do_place(cluster(a=LINUX_MLX), "torch", c=deepseek)
    assert isinstance(explicit, EngineUnavailable) and "compatible only with mlx, mlx-metal, mlx-cpu" in (
        explicit.describe())


def test_a_module_s_source_says_how_it_splits() -> None:
    """mlx-lm's sharded models define `shard(self, group)` on Model; its pipeline models build their stack on
    PipelineMixin. A module-level helper named shard_* or a mixin merely imported says neither."""
    from skulk.engines.mlx.registry import splits_of

    sharded = "class Model(nn.Module):\n    def shard(self, group: Optional[mx.distributed.Group] = None):\n"
    piped = "from .pipeline import PipelineMixin\nclass Qwen3NextModel(PipelineMixin, nn.Module):\n"
    helper = "from .pipeline import PipelineMixin\ndef shard_experts_inplace(x):\n    def shard_heads(w):\n"
    assert splits_of(sharded) == {"tensor": True, "pipeline": False}
    assert splits_of(piped) == {"tensor": False, "pipeline": True}
    assert splits_of(helper) == {"tensor": False, "pipeline": False}


def test_splits_follow_the_module_mlx_lm_loads() -> None:
    """Remapped types take their module's splits (mistral -> llama); a plain stack is cut only when every layer
    is alike; a pipeline model is cut whatever its layers; a family the registry lacks gets none."""
    toy = MlxRegistry(version="0.0", modules=frozenset({"llama", "qwen3_next", "gpt_oss"}),
                      remapping={"mistral": "llama"}, tensor=frozenset({"llama", "gpt_oss"}),
                      pipeline=frozenset({"qwen3_next"}))
    assert toy.splits("mistral", (), uniform=True) == ["Pipeline", "Tensor"]
    assert toy.splits("gpt_oss", (), uniform=False) == ["Tensor"]
    assert toy.splits("qwen3_next", (), uniform=False) == ["Pipeline"]
    assert toy.splits("gemma3", (), uniform=True) == []
    same = MlxRegistry.from_json({"version": "0.0", "modules": ["llama"], "tensor": ["llama"], "pipeline": []})
    assert same.tensor == {"llama"} and same.pipeline == frozenset()


@pytest.mark.parametrize(("config", "splits"), [
    ("DEEPSEEK_V3", ["Pipeline", "Tensor"]),  # a PipelineMixin stack with shard()
    ("QWEN3_NEXT_80B", ["Pipeline"]),  # DeltaNet and attention mixed, but a PipelineMixin: it re-indexes itself
    ("GPT_OSS_120B", ["Tensor"]),  # alternate windows, its cache list read from layer_types: not cut
    ("NEMOTRON_H_8B", []),  # Mamba, attention and MLP layers in a plain stack, no shard()
    ("LLAMA4_SCOUT", []),  # chunked and NoPE layers; its decoder's numbers read from text_config
    ("GEMMA3_27B", []),
    ("MIXTRAL_8X7B", ["Pipeline"]),
])
def test_the_flagships_splits_are_read_from_mlx_lm(registry: MlxRegistry, config: str, splits: list[str]) -> None:
    from tests.unit import flagship_configs

    assert card_from_config(config, getattr(flagship_configs, config), 1).mlx_splits == splits


def test_transformers_5_config_names_are_given_to_mlx_lm_as_published(tmp_path: Any) -> None:
    """transformers 5 saves rope_theta inside rope_parameters; mlx-lm's Qwen3-Next reads it at the top level."""
    import json

    pytest.importorskip("mlx_lm")
    from skulk.engines.mlx.engine import published_fields

    (tmp_path / "config.json").write_text(json.dumps(
        {"rope_theta": 5.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                 "partial_rotary_factor": 0.25}}))
    assert published_fields(tmp_path) == {"partial_rotary_factor": 0.25, "rope_scaling": None}  # theta stays
    (tmp_path / "config.json").write_text("{not json")
    assert published_fields(tmp_path) == {}


UNQUANTIZED_V3 = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}
"""DeepSeek-V3's shape as a bf16 checkpoint (the published one is FP8): what the torch engine runs natively."""
MINIMAX_M2: dict[str, Any] = {  # MiniMaxAI/MiniMax-M2's config.json (the keys read here), less its FP8
    "model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"], "num_hidden_layers": 62,
    "hidden_size": 3072, "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
    "num_local_experts": 256, "num_experts_per_tok": 8, "vocab_size": 200064, "torch_dtype": "bfloat16",
}
"""A family the torch engine runs only through transformers' modeling."""
FP8 = {"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                               "weight_block_size": [128, 128]}}


def test_the_torch_engine_runs_other_families_through_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family transformers builds as a causal LM, saved from that class and unquantized, is accepted on torch
    too (its card open to every engine, labelled transformers); with MLX absent it is torch's alone."""
    from skulk.engines.torch.fallback_types import causal_lm_classes

    assert causal_lm_classes()["minimax_m2"] == "MiniMaxM2ForCausalLM"
    monkeypatch.setattr(mlx_engine, "model_registry", lambda: TOY)
    made = card_from_config("x/minimax-m2-bf16", MINIMAX_M2, 1)
    assert made.compatible_backends is None and made.torch_runtime == "transformers" and made.fallback_splits
    assert made.model_dump(by_alias=True)["torchRuntime"] == "transformers"
    monkeypatch.setattr(mlx_engine, "model_registry", lambda: None)
    nemotron = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "num_hidden_layers": 4,
                "hidden_size": 64, "num_attention_heads": 4}
    alone = card_from_config("x/nemotron-h", nemotron, 1)
    assert alone.compatible_backends == ["torch", "torch-cpu", "torch-cuda"] and alone.torch_runtime == "transformers"
    native = card_from_config("Qwen/Qwen3-0.6B", {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 8,
                                                  "num_attention_heads": 2}, 1)
    assert native.torch_runtime == "native" and native.fallback_splits is None
    gemma4 = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
              "text_config": {"model_type": "gemma4_text", "num_hidden_layers": 4, "hidden_size": 64,
                              "num_attention_heads": 4, "hidden_size_per_layer_input": 256}}
    from skulk.models.families import fallback_splits
    assert not fallback_splits(gemma4) and fallback_splits(MINIMAX_M2)  # per-layer inputs read the ids
    shared = {**gemma4, "text_config": {**gemma4["text_config"], "hidden_size_per_layer_input": 0,
                                        "num_kv_shared_layers": 2}}
    assert not fallback_splits(shared), "a layer reading another's keys and values stays with it"
    assert card_from_config("x/deepseek-v3-bf16", UNQUANTIZED_V3, 1).torch_runtime == "native"  # no longer fallback


@pytest.mark.parametrize(("config", "why"), [
    ({**MINIMAX_M2, **FP8}, "its weights are fp8, and the transformers fallback runs unquantized checkpoints only"),
    ({**MINIMAX_M2, "architectures": ["MiniMaxM2ForConditionalGeneration"]},
     "its architectures (MiniMaxM2ForConditionalGeneration) are not a causal LM transformers builds"),
    ({**MINIMAX_M2, "model_type": "made_up"}, "transformers has no causal LM for 'made_up'"),
])
def test_the_fallback_refuses_what_transformers_cannot_read_here(
    monkeypatch: pytest.MonkeyPatch, config: dict[str, Any], why: str
) -> None:
    monkeypatch.setattr(mlx_engine, "model_registry", lambda: None)
    with pytest.raises(UnsupportedArchitecture) as caught:
        card_from_config("x/m", config, 1)
    assert why in str(caught.value) and "through transformers' modeling" in str(caught.value)


def test_a_fallback_family_splits_as_a_pipeline_of_torch_nodes_and_never_as_tensor() -> None:
    """transformers' modeling splits by decoder layers: two torch nodes take a Pipeline of it; a Tensor split is
    refused with the way out, as is a Pipeline of a family whose layers read the ids (per-layer inputs) or of a
    card from before the split; auto prefers mlx-lm's own model where a node has MLX; a ring of MLX nodes splits it."""
    from skulk.master.placement import place
    from skulk.types.ids import InstanceId

    from .test_engine_choice import runner_ids

    fallback = card(family="minimax_m2", compatible_backends=None, torch_runtime="transformers", fallback_splits=True)
    one = do_place(cluster(a=LINUX), c=fallback)
    assert isinstance(one, MlxRingInstance) and one.engines() == {"a": "torch"}
    split_torch = do_place(cluster(a=LINUX, b=LINUX), c=fallback, min_nodes=2)
    assert isinstance(split_torch, MlxRingInstance) and split_torch.engines() == {"a": "torch", "b": "torch"}
    tensor = place(cluster(a=LINUX, b=LINUX), fallback, Sharding.Tensor, InstanceMeta.MlxRing,
                   instance_id=InstanceId("i"), new_runner_id=runner_ids(), rendezvous_port=29500, min_nodes=2)
    assert isinstance(tensor, EngineUnavailable) and tensor.http_status == 400
    assert "splits by layers (Pipeline), not Tensor" in tensor.describe()
    assert "with sharding Pipeline" in tensor.describe()
    for splits, why in [(False, "its layers read the token ids"), (None, "this card predates splitting it")]:
        refused = do_place(cluster(a=LINUX, b=LINUX), c=fallback.model_copy(update={"fallback_splits": splits}),
                           min_nodes=2)
        assert isinstance(refused, EngineUnavailable) and refused.http_status == 400
        assert why in refused.describe() and "place it on one node" in refused.describe()
    assert do_place(cluster(a=LINUX_MLX), c=fallback).engines() == {"a": "mlx"}  # type: ignore[union-attr]
    split = do_place(cluster(a=LINUX_MLX, b=LINUX_MLX), c=fallback, min_nodes=2)
    assert isinstance(split, MlxRingInstance) and set(split.engines().values()) == {"mlx"}
    previews = preview_placements(cluster(a=LINUX, b=LINUX_MLX), fallback, Sharding.Pipeline, InstanceMeta.MlxRing)
    assert {p.node_ids[0]: p.nodes[0].modeling for p in previews if len(p.node_ids) == 1} == {
        "a": "transformers", "b": "native"}  # a runs it on torch, b on MLX


@pytest.mark.parametrize(("config", "tensors", "mlx"), [
    ({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}, None, True),  # as OpenAI ships it
    ({"model_type": "gpt_oss", "quantization": {"group_size": 32, "bits": 4}}, None, True),  # mlx-community's
    ({"model_type": "gpt_oss"}, ["model.layers.0.mlp.experts.gate_proj.weight"], True),  # converted, in float
    ({"model_type": "gpt_oss"}, ["model.layers.0.mlp.experts.gate_up_proj"], False),  # transformers' float layout
    ({"model_type": "gpt_oss"}, None, False),
    ({"model_type": "llama4_text", "num_local_experts": 4}, None, False),  # experts: mlx-lm's module is dense
    ({"model_type": "llama4_text", "num_local_experts": 0}, None, True),
    ({"model_type": "llama4", "text_config": {"num_local_experts": 16}}, None, True),  # the published layout
    ({"model_type": "deepseek_v3"}, None, True),
])
def test_mlx_is_claimed_only_for_layouts_its_module_reads(config: dict[str, Any], tensors: list[str] | None,
                                                         mlx: bool) -> None:
    """mlx-lm's registry has gpt_oss and llama4_text, but its gpt-oss loader reads the experts as OpenAI ships
    them or as mlx-lm converts them, and its llama4_text is the dense model: a float gpt-oss (a bf16 re-upload)
    or a text-only Llama 4 with experts is not claimed for MLX, so placement never puts it on an MLX rank
    (test_mlx_family_nodes found both failing to load there)."""
    from skulk.models.families import mlx_layout_refusal

    assert (mlx_layout_refusal(config, tensors) is None) == mlx


def test_a_float_gpt_oss_card_offers_torch_only() -> None:
    """Through card_from_config: the torch engine runs the float checkpoint natively, MLX is not offered."""
    from tests.unit import family_checkpoints

    config = {**family_checkpoints.COMMON, **family_checkpoints.MORE["gpt_oss"][2], "model_type": "gpt_oss"}
    card = card_from_config("org/float-gpt-oss", config, 1 << 20)
    assert card.compatible_backends is not None and all(not t.startswith("mlx") for t in card.compatible_backends)
    mxfp4 = card_from_config("org/gpt-oss", {**config, "quantization_config": {"quant_method": "mxfp4"}}, 1 << 20)
    assert mxfp4.compatible_backends is None
