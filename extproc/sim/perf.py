"""Step-time model: how long one engine step takes on a GPU, and how much KV cache fits.

A step is one forward pass over a batch: chunks of prompts being prefilled plus one decode token per
running sequence (chunked prefill: vLLM puts both in one step). A transformer layer runs its linear
layers and then attention, one kernel after the other, so a step costs the sum of

* linear layers: max(weights streamed once / weight bandwidth, 2 FLOPs per parameter per query token /
  tensor throughput). *Why max*: in a GEMM weight loads and tensor-core math overlap, so it is bound by
  the slower (the roofline); small batches are memory bound, a prefill chunk compute bound;
* attention: max(KV bytes of every scheduled sequence's context / KV bandwidth, QK^T and AV FLOPs /
  tensor throughput): decode attention reads the whole KV cache of the batch every step, which is what
  makes a step slower as the batch and its contexts grow;
* a per-step overhead (scheduling, input preparation, kernel launches: CPU work the GPU waits for) and a
  per-sequence overhead (sampling, detokenisation, per-request bookkeeping);
* with tensor parallelism, two all-reduces per layer.

Bandwidths and throughput are the datasheet peaks (gpus.py) times the fitted efficiencies (efficiency.py);
the overheads are fitted with them (`extproc engine-sim calibrate --fit`, docs/fleet-simulation.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from extproc.sim.efficiency import Efficiency, efficiency_for
from extproc.sim.gpus import GpuSpec
from extproc.sim.models import ModelSpec


@dataclass(frozen=True, slots=True)
class PerfParams:
    # Fractions of datasheet peak (efficiency.py); None: the GPU's fitted value, or its class's.
    mem_efficiency: float | None = None  # weight streaming in the linear layers
    kv_efficiency: float | None = None  # attention's KV-cache reads
    compute_efficiency: float | None = None  # tensor MFU (linear layers and prefill attention)
    # Fixed cost per step the GPU waits for: scheduling, input preparation, launches (CUDA graphs keep it
    # small in vLLM V1). Fitted with the efficiencies (`extproc engine-sim calibrate --fit`).
    step_overhead_s: float = 0.000815
    # Per-sequence cost per step: sampling, detokenisation, the request's bookkeeping. Fitted likewise.
    per_seq_overhead_s: float = 0.0000198
    # Tensor parallel: two all-reduces per layer per step, each a latency-bound NCCL call at decode sizes.
    allreduce_latency_s: float = 0.000012
    # Memory vLLM keeps back for activations and CUDA graphs, per GPU, besides weights and KV cache.
    activation_reserve_gb: float = 1.5

    def efficiency(self, gpu: str) -> Efficiency:
        """This GPU's efficiencies with any explicit override applied."""
        fitted = efficiency_for(gpu)
        return Efficiency(
            weights=fitted.weights if self.mem_efficiency is None else self.mem_efficiency,
            kv=fitted.kv if self.kv_efficiency is None else self.kv_efficiency,
            compute=fitted.compute if self.compute_efficiency is None else self.compute_efficiency,
        )


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
        return self.step_timer()(num_tokens, num_seqs, kv_tokens_read, attn_pairs)

    def step_timer(self) -> Callable[[int, int, int, float], float]:
        """`step_time` with this model's constants looked up once: the engine calls it every step."""
        p, m, tp = self.params, self.model, self.tensor_parallel
        eff = p.efficiency(self.gpu.name)
        peak_bw, peak_flops = self.gpu.bandwidth_bytes_per_s, self.gpu.flops_per_s
        # Per-GPU shares of each term: TP splits weights, KV heads and FLOPs evenly over the ranks.
        t_weights = m.weight_bytes / tp / (peak_bw * eff.weights)
        s_kv = m.kv_bytes_per_token / tp / (peak_bw * eff.kv)  # seconds per cached token read
        s_linear = m.flops_per_token / tp / (peak_flops * eff.compute)  # seconds per query token
        s_attn = m.attn_flops_per_token_per_ctx / tp / (peak_flops * eff.compute)  # per (query, ctx) pair
        fixed = p.step_overhead_s + (2 * m.layers * p.allreduce_latency_s if tp > 1 else 0.0)
        per_seq = p.per_seq_overhead_s

        def step_time(num_tokens: int, num_seqs: int, kv_tokens_read: int, attn_pairs: float) -> float:
            if num_tokens <= 0:
                return 0.0
            linear = s_linear * num_tokens
            if linear < t_weights:
                linear = t_weights
            attention = s_kv * kv_tokens_read
            flops = s_attn * attn_pairs
            if flops > attention:
                attention = flops
            return fixed + per_seq * num_seqs + linear + attention

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
