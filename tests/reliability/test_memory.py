"""The live gateway's memory after many large bodies levels off: once idle, its RSS after the last of
ROUNDS concurrent rounds is at most GROWTH_BOUND_MIB above its RSS after the first (under 1 MiB a body;
a 5 MiB body kept per request would add 120 MiB, one kept per round 20 MiB at least). Real processes
as `extproc bench memory --large-bodies` runs them (docs/benchmarks.md); about 30 s here. Measured:
idle after each round 134, 150, 143 MiB (allocator noise of +-8 MiB between rounds, no trend)."""

from __future__ import annotations

from extproc.perf.large_bodies import MIB, run

BODY_MIB = 5
SEQUENTIAL, CONCURRENT, ROUNDS = 4, 8, 4  # 24 bodies of 5 MiB after the reference round
GROWTH_BOUND_MIB = 24


def test_rss_levels_off_after_large_bodies():
    report = run(size=BODY_MIB * MIB, sequential=SEQUENTIAL, concurrent=CONCURRENT, rounds=ROUNDS,
                 progress=lambda _: None)
    for phase in report.phases:
        assert phase.statuses == {200: phase.requests}, (phase.name, phase.statuses)
    first, last = report.phases[1], report.phases[-1]  # after the first concurrent round: its peak met
    assert last.after_mib - first.after_mib <= GROWTH_BOUND_MIB, "\n".join(report.lines())
