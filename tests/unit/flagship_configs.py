"""The published config.json keys of the flagship families placement counts (issue 40): public dimensions written
down, no download. Only the keys the memory arithmetic reads."""

from __future__ import annotations

from typing import Any

BF16: dict[str, Any] = {"torch_dtype": "bfloat16"}

DEEPSEEK_V3: dict[str, Any] = {  # deepseek-ai/DeepSeek-V3 (671B, 37B active)
    **BF16, "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
    "num_key_value_heads": 128, "vocab_size": 129280, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "num_nextn_predict_layers": 1, "topk_method": "noaux_tc", "tie_word_embeddings": False,
    "max_position_embeddings": 163840,
}
KIMI_K2: dict[str, Any] = {  # moonshotai/Kimi-K2-Instruct (1T, DeepSeek V3's architecture)
    **DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
    "vocab_size": 163840, "n_routed_experts": 384, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0,
    "max_position_embeddings": 131072,
}
GLM_45: dict[str, Any] = {  # zai-org/GLM-4.5 (355B, 32B active)
    **BF16, "model_type": "glm4_moe", "num_hidden_layers": 92, "hidden_size": 5120, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151552, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "n_routed_experts": 160, "n_shared_experts": 1, "first_k_dense_replace": 3,
    "attention_bias": True, "use_qk_norm": True, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
}
GPT_OSS_120B: dict[str, Any] = {  # openai/gpt-oss-120b (116.8B, MXFP4 experts)
    **BF16, "model_type": "gpt_oss", "num_hidden_layers": 36, "hidden_size": 2880, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "intermediate_size": 2880,
    "num_local_experts": 128, "attention_bias": True, "sliding_window": 128, "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                              "model.layers.*.mlp.router",
                                                                              "model.embed_tokens", "lm_head"]},
}
QWEN3_235B: dict[str, Any] = {  # Qwen/Qwen3-235B-A22B
    **BF16, "model_type": "qwen3_moe", "num_hidden_layers": 94, "hidden_size": 4096, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_experts": 128, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "tie_word_embeddings": False, "max_position_embeddings": 40960,
}
QWEN3_NEXT_80B: dict[str, Any] = {  # Qwen/Qwen3-Next-80B-A3B-Instruct
    **BF16, "model_type": "qwen3_next", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 151936, "intermediate_size": 5120,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 512,
    "decoder_sparse_step": 1, "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": False, "max_position_embeddings": 262144,
}
LLAMA4_SCOUT: dict[str, Any] = {  # meta-llama/Llama-4-Scout-17B-16E (text_config of the multimodal config)
    **BF16, "model_type": "llama4", "tie_word_embeddings": False, "text_config": {
        "model_type": "llama4_text", "num_hidden_layers": 48, "hidden_size": 5120, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 202048, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "num_local_experts": 16, "interleave_moe_layer_step": 1,
        "attention_chunk_size": 8192, "use_qk_norm": True, "max_position_embeddings": 10485760,
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)]}}
LLAMA4_MAVERICK: dict[str, Any] = {  # meta-llama/Llama-4-Maverick-17B-128E: every other layer MoE
    **LLAMA4_SCOUT, "text_config": {**LLAMA4_SCOUT["text_config"], "num_local_experts": 128,
                                    "interleave_moe_layer_step": 2, "max_position_embeddings": 1048576}}
GEMMA3_27B: dict[str, Any] = {  # google/gemma-3-27b-it (text_config)
    **BF16, "model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32,
        "num_key_value_heads": 16, "head_dim": 128, "vocab_size": 262208, "intermediate_size": 21504,
        "sliding_window": 1024, "sliding_window_pattern": 6, "tie_word_embeddings": True,
        "max_position_embeddings": 131072}}
MINIMAX_M2: dict[str, Any] = {  # MiniMaxAI/MiniMax-M2 (230B, 10B active)
    **BF16, "model_type": "minimax_m2", "num_hidden_layers": 62, "hidden_size": 3072, "num_attention_heads": 48,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 200064, "intermediate_size": 1536,
    "num_local_experts": 256, "use_qk_norm": True, "tie_word_embeddings": False, "max_position_embeddings": 196608,
}
MIXTRAL_8X7B: dict[str, Any] = {  # mistralai/Mixtral-8x7B-v0.1 (46.7B)
    **BF16, "model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 32000, "intermediate_size": 14336, "num_local_experts": 8,
    "tie_word_embeddings": False, "max_position_embeddings": 32768,
}
NEMOTRON_H_8B: dict[str, Any] = {  # nvidia/Nemotron-H-8B-Base-8K: 24 Mamba 2, 4 attention, 24 MLP blocks
    **BF16, "model_type": "nemotron_h", "num_hidden_layers": 52, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072, "intermediate_size": 21504,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-M-M-M-M-",
    "tie_word_embeddings": False, "max_position_embeddings": 8192,
}
