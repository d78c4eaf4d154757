"""The engine's data: its configuration, a request, a request's state inside the engine, one step's
result (engine.py runs them; kv_cache.py keeps their blocks)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 256  # vLLM default
    # Token budget per step (chunked prefill). vLLM V1's default for online serving on big GPUs is 2048-8192.
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # defaults to the model's context length (capped by KV capacity)
    # Fault injection: a fraction of KV blocks held by a phantom tenant. Usage reads >= this, and the
    # blocks are really unavailable, so the engine queues and preempts as it would under real pressure.
    kv_pressure: float = 0.0
    # vLLM V1 default: full prompt blocks are shared by hash and kept (evictable) after use.
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    # Hash chain of the prompt's full KV blocks (prefix.block_hashes); empty: no prefix caching for it.
    block_hashes: tuple[int, ...] = ()


@dataclass(slots=True, eq=False)  # identity: `running.remove(seq)` must not compare every field
class SeqState:
    """A request inside the engine; returned to the driver when it finishes (for latency metrics).

    While it decodes in the engine's cohort (Engine._cohort_blocks) num_computed, num_output and last_token_time
    lag behind by the steps since `synced`; Engine.get() and every sequence the engine hands out (finished,
    failed, first tokens) are up to date."""

    request: SimRequest
    arrival: float
    num_computed: int = 0  # tokens whose KV is in cache (prompt + output), reset on preemption
    num_output: int = 0
    num_blocks: int = 0  # private blocks; shared prefix blocks are in `hashed`
    hashed: list[int] = field(default_factory=list)  # prefix-cache blocks referenced, in prompt order
    first_token_time: float | None = None
    last_token_time: float = 0.0  # when the latest token showed (inter-token latency)
    finish_time: float | None = None
    prompt_counted: bool = False
    total: int = -1  # prompt + output tokens, kept by the engine (the step loop reads it per sequence)
    # Cohort bookkeeping (Engine._cohort_blocks): member or not, the engine tick its counters are true
    # at, and its join number (members join in running order, so this orders them as `running` does).
    cohort: bool = field(default=False, init=False, repr=False)
    synced: int = field(default=0, init=False, repr=False)
    order: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.total = self.request.prompt_tokens + self.num_output

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def total_tokens(self) -> int:
        return self.total


@dataclass(slots=True)
class StepResult:
    start: float
    duration: float
    emitted: list[str] = field(default_factory=list)  # request ids that got one new token at `end`
    first_tokens: list[SeqState] = field(default_factory=list)  # requests whose first token this was
    finished: list[SeqState] = field(default_factory=list)
    # Inter-token latency of the non-first tokens this step emitted, as (gap, how many tokens had it):
    # nearly all share one gap (they decoded in the previous step too), so the metrics cost one call per
    # step rather than one per token.
    inter_token: list[tuple[float, int]] = field(default_factory=list)
    # Dropped by the engine, not finished: they no longer fit the KV cache (see Engine.set_kv_pressure).
    failed: list[SeqState] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_tokens: int = 0  # query tokens in the batch
    num_seqs: int = 0

    @property
    def end(self) -> float:
        return self.start + self.duration


class CapacityError(ValueError):
    """The request can never fit (longer than max_model_len or than the whole KV cache)."""


__all__ = ["CapacityError", "EngineConfig", "SeqState", "SimRequest", "StepResult"]
