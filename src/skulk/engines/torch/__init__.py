"""The PyTorch engine: a small Llama-family decoder with a slot KV cache and continuous batching."""
