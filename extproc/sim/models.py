"""Model presets: the shape figures the roofline needs, from each model's published config.json."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.sim.gpus import lookup


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    params_b: float  # parameters, billions
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    max_model_len: int
    dtype_bytes: int = 2  # bf16/fp16 weights and KV cache
    tensor_parallel: int = 1  # default TP degree when served

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: what one cached token costs across all TP ranks."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def flops_per_token(self) -> float:
        """Dense matmul FLOPs per token (2 per parameter); attention is added per context length."""
        return 2.0 * self.params_b * 1e9

    @property
    def attn_flops_per_token_per_ctx(self) -> float:
        """QK^T and AV: 2 matmuls x 2 FLOPs x query heads x head_dim, per layer, per context token."""
        return 4.0 * self.layers * self.heads * self.head_dim


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # meta-llama/Llama-2-7b-hf config.json: 32 layers, hidden 4096, 32 heads, no GQA, 4096 ctx; 6.74B.
        ModelSpec("llama2-7b", 6.74, 32, 4096, 32, 32, 128, 4096),
        # deepseek-ai/deepseek-coder-6.7b-instruct config.json: Llama architecture, 32 layers, hidden 4096,
        # 32 heads (no GQA), 16384 ctx; 6.74B params.
        ModelSpec("deepseek-coder-7b", 6.74, 32, 4096, 32, 32, 128, 16384),
        # meta-llama/Meta-Llama-3-8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads, 8192 ctx;
        # 8.03B.
        ModelSpec("llama3-8b", 8.03, 32, 4096, 32, 8, 128, 8192),
        # mistralai/Mistral-7B-Instruct-v0.3 config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads; 7.25B.
        ModelSpec("mistral-7b", 7.25, 32, 4096, 32, 8, 128, 32768),
        # meta-llama/Meta-Llama-3-70B config.json: 80 layers, hidden 8192, 64 heads, 8 KV heads; 70.6B params.
        # 141 GB of bf16 weights: served with TP=4 on 80 GB parts by default.
        ModelSpec("llama3-70b", 70.6, 80, 8192, 64, 8, 128, 8192, tensor_parallel=4),
        # Llama 3.1 (meta-llama/Llama-3.1-8B, -70B config.json): the same weights and KV layout as Llama 3,
        # with a 131072-token context (max_position_embeddings); the KV cache still caps it per GPU.
        ModelSpec("llama3.1-8b", 8.03, 32, 4096, 32, 8, 128, 131072),
        ModelSpec("llama3.1-70b", 70.6, 80, 8192, 64, 8, 128, 131072, tensor_parallel=4),
        # Qwen/Qwen3-14B config.json: 40 layers, hidden 5120, 40 heads, 8 KV heads, head_dim 128, 40960 ctx,
        # untied embeddings (vocab 151936); 14.77B params. In data/calibration/ (GPUStack's H100/A100 runs).
        ModelSpec("qwen3-14b", 14.77, 40, 5120, 40, 8, 128, 40960),
        # Qwen/Qwen2.5-0.5B-Instruct config.json: 24 layers, hidden 896, 14 heads, 2 KV heads, head_dim 64,
        # 32768 ctx, tied embeddings; 0.494B params. In data/calibration/ (an L4 sweep): so small that the
        # per-step and per-sequence overheads, not the roofline, set its speed.
        ModelSpec("qwen2.5-0.5b", 0.494, 24, 896, 14, 2, 64, 32768),
    )
}

ALIASES: dict[str, str] = {
    "llama-2-7b": "llama2-7b",
    "meta-llama/llama-2-7b-hf": "llama2-7b",
    "meta-llama/llama-2-7b-chat-hf": "llama2-7b",
    "deepseek-coder-6.7b": "deepseek-coder-7b",
    "deepseek-ai/deepseek-coder-6.7b-instruct": "deepseek-coder-7b",
    "llama-3-8b": "llama3-8b",
    "meta-llama/meta-llama-3-8b-instruct": "llama3-8b",
    "llama-3.1-8b": "llama3.1-8b",
    "meta-llama/llama-3.1-8b": "llama3.1-8b",
    "meta-llama/llama-3.1-8b-instruct": "llama3.1-8b",
    "meta-llama/meta-llama-3.1-8b-instruct": "llama3.1-8b",  # the repository's name before a rename
    "llama-3-70b": "llama3-70b",
    "llama-3.1-70b": "llama3.1-70b",
    "meta-llama/llama-3.1-70b": "llama3.1-70b",
    "meta-llama/llama-3.1-70b-instruct": "llama3.1-70b",
    "meta-llama/meta-llama-3.1-70b-instruct": "llama3.1-70b",
    "mistral-7b-instruct-v0.3": "mistral-7b",
    "mistralai/mistral-7b-instruct-v0.3": "mistral-7b",
    "qwen/qwen3-14b": "qwen3-14b",
    "qwen/qwen2.5-0.5b-instruct": "qwen2.5-0.5b",
}


def get_model(name: str) -> ModelSpec:
    return lookup("model", name, MODELS, ALIASES)
