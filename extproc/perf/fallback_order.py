"""The endpoint-picker protocol's fallbacks, two ways, in process: asking the strategy again over the
pods left (what `Gateway.fallbacks` did for every strategy until 2026-12-06) against one scoring pass
(`Profile.ranked`). The two fallbacks of a 3-long list, per strategy and pool size.

    python extproc/perf/fallback_order.py
"""

from __future__ import annotations

import statistics
import timeit

from extproc.openai import Request
from extproc.pool import Pod
from extproc.routing import PodView, RoutingSettings, build

REQUEST = Request(model="m", path="/v1/chat/completions")
FALLBACKS = 2


def main() -> None:
    for strategy in ("load-balance", "least-request"):
        profile = build(strategy, RoutingSettings(seed=1))
        for n in (4, 16, 64, 256):
            pods = [PodView(Pod("m", f"p{i}", f"10.0.0.{i}:80"), i % 5, kv_free=0.5 + i / 100)
                    for i in range(n)]
            left = pods[1:]  # the pick is listed first already

            def repeated() -> None:
                rest, out = list(left), []
                while rest and len(out) < FALLBACKS:
                    nxt = profile.pick(REQUEST, rest, 0.0)
                    out.append(nxt)
                    rest = [v for v in rest if v is not nxt]

            def one_pass() -> None:
                assert profile.ranked(REQUEST, left, 0.0, FALLBACKS) is not None

            def us(fn) -> float:  # type: ignore[no-untyped-def]
                return statistics.median(min(timeit.repeat(fn, number=2000, repeat=5)) / 2000 * 1e6
                                         for _ in range(3))

            print(f"{strategy}, {n} pods: repeated picks {us(repeated):.1f} µs, "
                  f"one pass {us(one_pass):.1f} µs")


if __name__ == "__main__":
    main()
