"""The engine model: vLLM-style continuous batching, paged KV cache and recompute preemption.

Pure and clock-injected: nothing here reads a clock or sleeps. A driver owns time:

    engine.add(SimRequest("r1", prompt_tokens=512, max_tokens=128), now)
    while engine.has_work():
        res = engine.step(now)          # plans and applies one forward pass starting at `now`
        now = res.end                   # its tokens become visible at res.end
        deliver(res.emitted, res.finished)

`step` must not be called again before the previous result's `end` (the GPU is busy). The live server
sleeps until `end` on a scaled wall clock; a discrete-event simulation jumps to it. Requests added while
a step runs join the next step, as in vLLM.
"""

from __future__ import annotations

from collections import deque

from extproc.sim.kv_cache import KvCache
from extproc.sim.perf import PerfModel
from extproc.sim.sequences import CapacityError, EngineConfig, SeqState, SimRequest, StepResult

RECENT_WINDOW_S = 10.0  # how much step history utilization() and generation_throughput() can see


def _join_order(seq: SeqState) -> int:
    return seq.order


class Engine:
    def __init__(self, perf: PerfModel, config: EngineConfig = EngineConfig()) -> None:
        self.perf = perf
        self._step_time = perf.step_timer()
        self.config = config
        total_blocks = perf.kv_blocks(config.block_size, config.gpu_memory_utilization)
        if total_blocks <= 0:
            raise ValueError(f"{perf.model.name} does not fit on {perf.tensor_parallel}x {perf.gpu.name}")
        self.kv = KvCache(total_blocks, config.block_size, config.enable_prefix_caching)
        self.running: list[SeqState] = []
        self.waiting: deque[SeqState] = deque()
        self._by_id: dict[str, SeqState] = {}
        self._failed: list[SeqState] = []  # dropped since the last step; reported by the next one
        self.set_kv_pressure(config.kv_pressure)
        # Multiplies step time; the shell raises it during a slow-start fault.
        self.slowdown = 1.0
        # Counters (monotonic, vLLM semantics).
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.preemptions_total = 0
        self.prefix_queries_total = 0  # prompt tokens looked up in the prefix cache (vLLM V1 counters)
        self.prefix_hits_total = 0
        self.requests_finished_total = 0
        self.requests_failed_total = 0
        self.busy_seconds_total = 0.0
        self.steps_total = 0
        self._busy_until = float("-inf")
        self._recent_steps: deque[tuple[float, float, int]] = deque()  # (start, end, tokens emitted)
        # The decode cohort (see _cohort_blocks): running[:_cohort_n], their ids in that order, the sum of
        # their computed tokens, and by tick the members due a new block or finishing.
        self._tick = 0  # steps run so far that gave the cohort a token
        self._cohort_n = 0
        self._cohort_ids: list[str] = []
        self._cohort_ctx = 0
        self._joins = 0
        self._block_due: dict[int, list[SeqState]] = {}
        self._finish_due: dict[int, list[SeqState]] = {}

    # --- configuration -----------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        limit = self.config.max_model_len or self.perf.model.max_model_len
        return max(1, min(limit, self.kv.usable_tokens))

    def set_kv_pressure(self, fraction: float) -> None:
        self.kv.set_pressure(fraction)
        # A request admitted under lower pressure may no longer fit even in an otherwise empty cache. Left
        # in place it would hold the head of the FCFS queue forever (or preempt itself in a loop), so it is
        # failed now, as `add` would reject it today; the next step reports it in StepResult.failed.
        # Capping the phantom tenant instead would make usage read below the pressure asked for, and that
        # reading is what the fault exists to show a gateway.
        limit = self.max_model_len
        for seq in [*self.running, *self.waiting]:
            if seq.request.prompt_tokens + seq.request.max_tokens > limit:
                self._drop(seq)
                self._failed.append(seq)

    # --- requests ----------------------------------------------------------------------------------
    def add(self, request: SimRequest, now: float) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.prompt_tokens < 1 or request.max_tokens < 1:
            raise CapacityError("prompt and max_tokens must be at least 1 token")
        if request.prompt_tokens + request.max_tokens > self.max_model_len:
            raise CapacityError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{request.prompt_tokens + request.max_tokens} tokens "
                f"({request.prompt_tokens} in the messages, "
                f"{request.max_tokens} in the completion)."
            )
        seq = SeqState(request, now)
        self._by_id[request.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request (client went away). Returns whether it was still in the engine."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return False
        self._drop(seq)
        return True

    def _drop(self, seq: SeqState) -> None:
        del self._by_id[seq.request_id]
        if seq.cohort:
            self._sync(seq)  # the caller may read what it produced (a lost replica's partial stream)
            self._leave(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self.kv.release(seq)

    def get(self, request_id: str) -> SeqState | None:
        seq = self._by_id.get(request_id)
        if seq is not None and seq.cohort:
            self._sync(seq)
        return seq

    # --- observable state (vLLM semantics) ---------------------------------------------------------
    def has_work(self) -> bool:
        # Failed requests still to report count: the next step() hands them over.
        return bool(self.running or self.waiting or self._failed)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        # Preempted requests go back to waiting, as in vLLM's num_requests_waiting.
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction 0..1 of KV blocks in use (vllm:kv_cache_usage_perc is a fraction despite its name)."""
        return self.kv.usage

    def busy_until(self) -> float:
        return self._busy_until

    def utilization(self, now: float, window: float = 1.0) -> float:
        """Busy fraction of [now - window, now]: the "GPU utilization" a DCGM exporter would report.

        `window` is at most RECENT_WINDOW_S (older steps are forgotten)."""
        lo = now - window
        busy = 0.0
        for start, end, _ in self._recent_steps:
            busy += max(0.0, min(end, now) - max(start, lo))
        return min(1.0, busy / window) if window > 0 else 0.0

    def generation_throughput(self, now: float, window: float = 1.0) -> float:
        """Output tokens per second over the last `window` (SGLang's gen_throughput)."""
        lo = now - window
        tokens = sum(n for _, end, n in self._recent_steps if lo < end <= now)
        return tokens / window if window > 0 else 0.0

    # --- the step ----------------------------------------------------------------------------------
    def step(self, now: float) -> StepResult | None:
        """Schedule and apply one forward pass starting at `now`; None when there is nothing to run.

        A result may have zero duration and only `failed` requests to report (nothing else could run)."""
        if not self.has_work():
            return None
        start = max(now, self._busy_until)
        res = StepResult(start, 0.0)
        if self._failed:
            res.failed, self._failed = self._failed, []
            self.requests_failed_total += len(res.failed)
        members = self._cohort_blocks()  # cohort members decoding this step: running[:members]
        scheduled = self._schedule(res, members)
        if not members and not scheduled:
            return res if res.failed else None
        # Each member reads its context plus the new token and attends over the same; sums of integers,
        # so adding them in another order than per sequence gives the same float.
        num_tokens = members
        kv_read = attn_pairs = self._cohort_ctx + members
        caching, bs = self.config.enable_prefix_caching, self.config.block_size
        emitting: list[SeqState] = []  # sequences whose whole context is computed after this step
        for seq, n in scheduled:
            before = seq.num_computed
            num_tokens += n
            kv_read += before + n
            attn_pairs += n * before + n * (n + 1) // 2
            seq.num_computed = computed = before + n
            if computed >= seq.total:
                emitting.append(seq)
                if n == 1 and seq.prompt_counted:
                    continue  # steady decode: its prompt blocks are registered already
            request = seq.request
            if caching and request.block_hashes and len(seq.hashed) * bs < request.prompt_tokens:
                self.kv.register_prefix(seq)
        num_seqs = members + len(scheduled)
        duration = self._step_time(num_tokens, num_seqs, kv_read, float(attn_pairs)) * self.slowdown
        res.duration = duration
        res.num_tokens, res.num_seqs = num_tokens, num_seqs
        end = start + duration
        prev_end = self._busy_until  # the previous token of a sequence decoding without a break
        self._busy_until = end
        tick = self._tick
        self._tick = tick + 1
        self._cohort_ctx += members
        emitted, finished = res.emitted, res.finished
        if members:
            emitted.extend(self._cohort_ids)
            self._cohort_finish(tick, end, finished)
        steady = members  # every member decoded in the previous step too
        for seq in emitting:
            request = seq.request
            if not seq.prompt_counted:
                seq.prompt_counted = True
                self.prompt_tokens_total += request.prompt_tokens
            seq.num_output = out = seq.num_output + 1
            seq.total += 1
            emitted.append(request.request_id)
            if seq.first_token_time is None:
                seq.first_token_time = end
                res.first_tokens.append(seq)
            elif seq.last_token_time == prev_end:
                steady += 1
            else:  # resumed after a preemption (or a skipped step): its own, longer gap
                res.inter_token.append((end - seq.last_token_time, 1))
            seq.last_token_time = end
            if out >= request.max_tokens:
                seq.finish_time = end
                finished.append(seq)
        self.generation_tokens_total += members + len(emitting)
        for seq in finished:
            self.running.remove(seq)
            del self._by_id[seq.request_id]
            self.kv.release(seq)
        if steady:
            res.inter_token.append((end - prev_end, steady))
        self.requests_finished_total += len(finished)
        self.busy_seconds_total += duration
        self.steps_total += 1
        recent = self._recent_steps
        recent.append((start, end, len(emitted)))
        while recent[0][1] < end - RECENT_WINDOW_S:  # bounded memory in long virtual-time runs
            recent.popleft()
        self._cohort_join(end)
        return res

    def _schedule(self, res: StepResult, members: int = 0) -> list[tuple[SeqState, int]]:
        """vLLM V1 order: running sequences first (decode or next prefill chunk), then admit waiting ones.

        When a running sequence cannot get a block, the newest running sequence is preempted (its blocks
        freed, its progress dropped for recompute) and goes to the front of the waiting queue. The first
        `members` running sequences are the cohort's, scheduled already (one token each, blocks in hand):
        preemption never reaches them, as it takes the newest first and stops at the sequence asking.
        """
        budget = self.config.max_num_batched_tokens - members
        scheduled: list[tuple[SeqState, int]] = []
        i = members
        running, bs = self.running, self.config.block_size
        while i < len(running) and budget > 0:
            seq = running[i]
            n = seq.total - seq.num_computed
            if n > budget:
                n = budget
            if seq.num_computed + n <= (seq.num_blocks + len(seq.hashed)) * bs:
                scheduled.append((seq, n))  # fits the blocks it holds (a decode step, mostly)
                budget -= n
                i += 1
                continue
            while not self.kv.allocate(seq, seq.num_computed + n):
                victim = self.running.pop()
                self._preempt(victim, res)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # the sequence itself was preempted: nothing after it in `running` remains
        if res.preempted:
            return scheduled  # as vLLM: no admissions in a step that had to preempt
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.kv.reuse_prefix(seq)
            n = min(seq.total - seq.num_computed, budget)
            if not self.kv.allocate(seq, seq.num_computed + n):
                self.kv.release(seq)  # give the shared blocks back; it waits with nothing computed
                seq.num_computed = 0
                break
            self._count_prefix(seq, hits)
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    # --- the decode cohort -------------------------------------------------------------------------
    # Most of a busy engine's running sequences are decoding in lockstep: each step gives every one of
    # them one token, and only every block_size tokens a new KV block. The cohort is that leading run
    # of `running` (running[:_cohort_n]); its members' counters advance lazily (SeqState.synced against
    # _tick), so a step costs O(1) for them plus the members that need a block or finish now, found by
    # tick in _block_due / _finish_due. When a step could break the lockstep (not every member fits the
    # token budget, or their new blocks might not), the cohort dissolves and the step runs every
    # sequence through _schedule, which is the model; the cohort re-forms after the step.

    def _cohort_blocks(self) -> int:
        """Give the members due a block theirs; returns how many members decode this step (0: dissolved)."""
        members = self._cohort_n
        if not members:
            return 0
        due = self._block_due.pop(self._tick, None)
        if members > self.config.max_num_batched_tokens:
            self._dissolve()
            return 0
        if due:
            due = [s for s in due if s.cohort]
            if len(due) > self.kv.available():
                self._dissolve()  # someone may have to be preempted: the full model decides who
                return 0
            self._grant(due)
        return members

    def _grant(self, due: list[SeqState]) -> None:
        """One block to each of `due` (decoding members at a block boundary; there is room for all).

        Their blocks come from the KV cache at once (KvCache.grant); then their next boundary."""
        self.kv.grant(due)
        # A member's next boundary is block_size tokens on, i.e. block_size steps.
        later = self._tick + self.config.block_size
        queued = self._block_due.get(later)
        if queued is None:
            self._block_due[later] = due
        else:
            queued.extend(due)

    def _cohort_finish(self, tick: int, end: float, finished: list[SeqState]) -> None:
        due = self._finish_due.pop(tick, None)
        if not due:
            return
        for seq in sorted((s for s in due if s.cohort), key=_join_order):  # running order
            self._sync(seq)  # _tick and _busy_until include this step: its last token is at `end`
            seq.finish_time = end
            self._leave(seq)
            finished.append(seq)

    def _cohort_join(self, end: float) -> None:
        """Running sequences right after the cohort that got a token this step decode from the next."""
        running, i, tick = self.running, self._cohort_n, self._tick
        while i < len(running):
            seq = running[i]
            if seq.last_token_time != end or seq.num_computed != seq.total - 1:
                break
            seq.cohort, seq.synced, seq.order = True, tick, self._joins
            self._joins += 1
            self._cohort_ids.append(seq.request.request_id)
            self._cohort_ctx += seq.num_computed
            self._plan_block(seq)
            self._finish_due.setdefault(tick + seq.request.max_tokens - seq.num_output - 1, []).append(seq)
            i += 1
        self._cohort_n = i

    def _plan_block(self, seq: SeqState) -> None:
        """The tick of the step whose token no longer fits the blocks `seq` holds (it is synced)."""
        held = (seq.num_blocks + len(seq.hashed)) * self.config.block_size
        self._block_due.setdefault(self._tick + held - seq.num_computed, []).append(seq)

    def _sync(self, seq: SeqState) -> None:
        """Bring a member's counters up to date (every step since it was last synced gave it a token)."""
        d = self._tick - seq.synced
        if d:
            seq.num_computed += d
            seq.num_output += d
            seq.total += d
            seq.last_token_time = self._busy_until
            seq.synced = self._tick

    def _leave(self, seq: SeqState) -> None:
        seq.cohort = False
        self._cohort_n -= 1
        self._cohort_ctx -= seq.num_computed
        self._cohort_ids.remove(seq.request.request_id)

    def _dissolve(self) -> None:
        for seq in self.running[:self._cohort_n]:
            self._sync(seq)
            seq.cohort = False
        self._cohort_n = self._cohort_ctx = 0
        self._cohort_ids = []
        self._block_due.clear()  # entries of former members would be stale after a rejoin
        self._finish_due.clear()

    def _count_prefix(self, seq: SeqState, hit_tokens: int) -> None:
        if seq.request.block_hashes and self.config.enable_prefix_caching:
            self.prefix_queries_total += seq.request.prompt_tokens
            self.prefix_hits_total += hit_tokens

    def _preempt(self, seq: SeqState, res: StepResult) -> None:
        self.kv.release(seq)
        seq.num_computed = 0
        self.preemptions_total += 1
        self.waiting.appendleft(seq)
        res.preempted.append(seq.request_id)
