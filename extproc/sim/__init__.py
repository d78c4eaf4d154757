"""Engine simulator: per-GPU performance models of vLLM-style engines, live (HTTP) and in virtual time.

Modules, functional core first:
  gpus.py      GpuSpec presets from spec sheets (memory, bandwidth, dense bf16 TFLOPs, $/h) + overrides
  models.py    ModelSpec presets (layers, heads, KV heads, ...) -> weight bytes, KV bytes per token
  perf.py      PerfModel: roofline step time, KV capacity; PerfParams: efficiency factors
  prefix.py    PrefixCache: automatic prefix caching (hash-chained full blocks, LRU-evictable)
  engine.py    Engine: continuous batching, chunked prefill, paged KV, recompute preemption (pure)
  driver.py    EngineDriver.advance_to(t): the virtual-time interface for fleet simulations
  virtual.py   closed-/open-loop load drivers in virtual time (validation, experiments)
  replica.py   ReplicaSpec: one replica's presets, overrides, faults -> Engine
  faults.py    FaultConfig and per-request fault decisions
  protocol.py  OpenAI request parsing and SSE/JSON bodies
  metrics.py   /metrics with vLLM or SGLang names
Imperative shell:
  server.py    ReplicaServer: one replica's aiohttp server, its open streams, listener and lifecycle
  pacer.py     Pacer: the engine loop on a scaled wall clock (one timer per step)
  openai_http.py  the OpenAI endpoints, /health and /metrics
  admin.py     /sim/info, /sim/timeline, /sim/faults and the outages they start
  streams.py   token delivery to responders (the direct socket sink), failures, lateness
  fleet.py     fleet YAML -> several ReplicaServers in one process
  cli.py       `extproc engine-sim`
  bench.py     `python -m extproc.sim.bench`: per-token timing under 500 streams
  validate.py  `python -m extproc.sim.validate`: simulated vs published figures

Virtual time, in short::

    engine = build_engine("A100-80GB", "llama2-7b")        # extproc.sim.replica
    driver = EngineDriver(engine)                           # extproc.sim.driver
    driver.add(SimRequest("r1", prompt_tokens=512, max_tokens=128), now=0.0)
    while (t := driver.next_event_time()) is not None:
        for step in driver.advance_to(t):                   # StepResult: emitted ids, finished SeqStates
            ...
"""
