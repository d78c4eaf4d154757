"""Roofline step-time model: how long one engine step takes on a GPU, and how much KV cache fits.

A step is one forward pass over a batch: some prefill tokens (possibly a chunk of a long prompt) plus one
decode token per running sequence. Its cost has two floors:

* memory: every step streams all weights once, plus the KV cache of every scheduled sequence;
* compute: 2 FLOPs per parameter per token, plus attention (proportional to context length).

Step time = max(memory time, compute time) + fixed overheads. *Why max and not sum*: in a fused forward
pass weight streaming and tensor-core math overlap, so a step is bound by the slower of the two (the
roofline). Real mixed steps land a little above the max near the ridge point; the efficiency factors
absorb most of that, and the validation table in docs/benchmarks.md states the remaining error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from extproc.sim.gpus import GpuSpec
from extproc.sim.models import ModelSpec


@dataclass(frozen=True, slots=True)
class PerfParams:
    # Achieved fraction of peak HBM bandwidth in decode. calibration.md: vLLM on A100 reaches ~77 % of the
    # bandwidth ceiling at concurrency 1; 0.80 here plus the per-step overheads lands on that.
    mem_efficiency: float = 0.80
    # Achieved fraction of dense tensor peak in prefill GEMMs (MFU). 0.7 fits the published sweeps best
    # (python -m extproc.sim.validate); large-GEMM MFU on A100/H100 is typically 0.6-0.8.
    compute_efficiency: float = 0.70
    # Fixed cost per step not hidden by the GPU: scheduling, sampling, kernel launches (CUDA graphs keep
    # it small in vLLM V1).
    step_overhead_s: float = 0.0003
    # Per-sequence cost per step: input preparation, sampling, detokenisation. Makes large batches a little
    # slower than pure bytes/bandwidth (the RTX 4090 sweep in calibration.md flattens faster than bytes).
    per_seq_overhead_s: float = 0.00005
    # Tensor parallel: two all-reduces per layer per step, each a latency-bound NCCL call at decode sizes.
    allreduce_latency_s: float = 0.000012
    # Memory vLLM keeps back for activations and CUDA graphs, per GPU, besides weights and KV cache.
    activation_reserve_gb: float = 1.5


@dataclass(frozen=True, slots=True)
class PerfModel:
    gpu: GpuSpec
    model: ModelSpec
    tensor_parallel: int = 1
    params: PerfParams = PerfParams()

    # --- memory -------------------------------------------------------------------------------------
    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """Tokens of KV cache that fit: (memory x utilisation - weights - activations) / bytes per token."""
        tp = self.tensor_parallel
        free = (self.gpu.memory_bytes * gpu_memory_utilization - self.params.activation_reserve_gb * 1e9) * tp
        free -= self.model.weight_bytes
        return max(0, int(free // self.model.kv_bytes_per_token))

    def kv_blocks(self, block_size: int = 16, gpu_memory_utilization: float = 0.9) -> int:
        return self.kv_capacity_tokens(gpu_memory_utilization) // block_size

    # --- time ---------------------------------------------------------------------------------------
    def step_time(self, num_tokens: int, num_seqs: int, kv_tokens_read: int, attn_pairs: float) -> float:
        """Seconds for one forward pass.

        num_tokens: query tokens in the batch (prefill chunk tokens + one per decoding sequence);
        num_seqs: sequences scheduled; kv_tokens_read: cached tokens whose K/V are read (sum of contexts);
        attn_pairs: sum over query tokens of the context each attends to (attention FLOPs scale with it).
        """
        if num_tokens <= 0:
            return 0.0
        p, m, tp = self.params, self.model, self.tensor_parallel
        mem_bytes = (m.weight_bytes + kv_tokens_read * m.kv_bytes_per_token) / tp
        t_mem = mem_bytes / (self.gpu.bandwidth_bytes_per_s * p.mem_efficiency)
        flops = (m.flops_per_token * num_tokens + m.attn_flops_per_token_per_ctx * attn_pairs) / tp
        t_compute = flops / (self.gpu.flops_per_s * p.compute_efficiency)
        t_comm = 2 * m.layers * p.allreduce_latency_s if tp > 1 else 0.0
        return max(t_mem, t_compute) + t_comm + p.step_overhead_s + p.per_seq_overhead_s * num_seqs

    def step_timer(self) -> Callable[[int, int, int, float], float]:
        """`step_time` with this model's constants looked up once: the engine calls it every step.

        The same arithmetic in the same order, so the same floats."""
        p, m, tp = self.params, self.model, self.tensor_parallel
        weight, kv_bytes = m.weight_bytes, m.kv_bytes_per_token
        bandwidth = self.gpu.bandwidth_bytes_per_s * p.mem_efficiency
        flops_token, flops_ctx = m.flops_per_token, m.attn_flops_per_token_per_ctx
        compute = self.gpu.flops_per_s * p.compute_efficiency
        t_comm = 2 * m.layers * p.allreduce_latency_s if tp > 1 else 0.0
        overhead, per_seq = p.step_overhead_s, p.per_seq_overhead_s

        def step_time(num_tokens: int, num_seqs: int, kv_tokens_read: int, attn_pairs: float) -> float:
            if num_tokens <= 0:
                return 0.0
            t_mem = (weight + kv_tokens_read * kv_bytes) / tp / bandwidth
            t_compute = (flops_token * num_tokens + flops_ctx * attn_pairs) / tp / compute
            return max(t_mem, t_compute) + t_comm + overhead + per_seq * num_seqs

        return step_time

    def decode_step_time(self, batch: int, context: int) -> float:
        """Convenience: a pure decode step of `batch` sequences each with `context` cached tokens."""
        return self.step_time(batch, batch, batch * (context + 1), batch * (context + 1))

    def prefill_time(self, prompt_tokens: int, chunk: int = 1 << 30) -> float:
        """Convenience: an idle engine prefilling one prompt in chunks of at most `chunk` tokens."""
        total, done = 0.0, 0
        while done < prompt_tokens:
            n = min(chunk, prompt_tokens - done)
            total += self.step_time(n, 1, done + n, n * done + n * (n + 1) / 2)
            done += n
        return total


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) if tokens > 0 else 0
