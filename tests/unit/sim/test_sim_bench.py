"""The benchmark's SSE reader: every event counted once and the id read whole, however reads split."""

from __future__ import annotations

from extproc.sim.bench import Trace
from extproc.sim.protocol import DONE, ChunkFormatter


def test_feed_counts_events_and_reads_the_id_at_every_split() -> None:
    fmt = ChunkFormatter(False, "cmpl-0123456789abcdef", "m", 0)
    stream = fmt.tokens(0, 3, 2, "length") + DONE
    for cut in range(1, len(stream)):
        for second_cut in (cut, min(len(stream), cut + 5)):
            t = Trace()
            for i, (a, b) in enumerate(((0, cut), (cut, second_cut), (second_cut, len(stream)))):
                t.feed(stream[a:b], float(i))
            assert len(t.times) == 3, cut
            assert t.request_id == "cmpl-0123456789abcdef", cut
            assert t.done, cut


def test_feed_is_not_done_before_the_done_event() -> None:
    t = Trace()
    t.feed(ChunkFormatter(True, "chatcmpl-x", "m", 0).tokens(0, 2, 5, "length"), 0.0)
    assert not t.done and t.request_id == "chatcmpl-x" and len(t.times) == 3  # role event + 2 tokens
