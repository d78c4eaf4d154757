"""AIBrix profile JSON: AIBrix's own files parse, round-trip, and bad ones fail naming the key."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from extproc.gpu_profiles import (
    BUDGET_MARGIN,
    GpuProfile,
    ProfileError,
    dump_profile,
    load_profile,
    nearest_index,
    parse_profile,
)
from extproc.tracing.window import bucket
from tests.support.shared_data import A40_PROFILE

A40 = A40_PROFILE


def small(**over) -> dict:
    data = {
        "gpu": "llama-a10",
        "cost": 1.5,
        "tputs": [[4.0, 2.0], [2.0, 0.0]],
        "indexes": [[64, 128], [256, 512]],
        "created": 10.0,
        "e2e": [[1.0, 1.5], [1.8, 3.0]],
        "slos": {"percentile": 99, "e2e": 2.0},
    }
    data.update(over)
    return data


def test_aibrix_older_file_parses() -> None:
    p = load_profile(A40)
    assert p.gpu == "simulator-llama2-7b-a40" and p.cost == 0.3
    assert p.outputs == (4, 8, 16, 32, 64, 128, 256, 512) and p.inputs == (128, 256, 512, 1024, 2048)
    assert len(p.tputs) == 8 and all(len(r) == 5 for r in p.tputs)
    assert p.e2e is None and p.ttft is None and p.slos == {}
    assert p.created == pytest.approx(1732598726.235767)
    assert p.tputs[0][0] == pytest.approx(53.46768813782049)


def test_cell_on_a40_matches_the_spec_example() -> None:
    p = load_profile(A40)
    assert p.cell(128, 8) == (1, 0)
    assert p.cell(100_000, 100_000) == (7, 4)  # clamped at the far edges
    assert p.cell(0, 0) == (0, 0)  # and the near ones
    assert p.cell(180, 6) == (1, 0)  # log2 space: 6 is nearer 8 than 4; 180 nearer 128 than 256
    assert p.cell(182, 5) == (0, 1)  # log2(182) > 7.5 -> 256; 5 nearer 4
    assert p.tput(128, 8) == p.tputs[1][0]


def test_round_trip_keeps_every_key() -> None:
    data = small(ttft=[[0.1, 0.2], [0.1, 0.3]], tpot=[[0.01, 0.02], [0.01, 0.03]])
    p = parse_profile(data)
    assert (
        p.e2e == ((1.0, 1.5), (1.8, 3.0)) and p.ttft is not None and p.slos == {"percentile": 99, "e2e": 2.0}
    )
    assert dump_profile(p) == {k: v for k, v in data.items()}
    assert parse_profile(dump_profile(p)) == p


def test_older_shape_dumps_without_optional_keys() -> None:
    p = load_profile(A40)
    out = dump_profile(p)
    assert set(out) == {"gpu", "cost", "tputs", "indexes", "created"}
    assert out == json.loads(A40.read_text())


def test_profile_is_frozen() -> None:
    p = parse_profile(small())
    assert isinstance(p, GpuProfile)
    with pytest.raises(AttributeError):
        p.cost = 2.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"gpu": ""}, "gpu"),
        ({"cost": -1}, "cost"),
        ({"cost": "cheap"}, "cost"),
        ({"tputs": [[4.0, 2.0]]}, "tputs"),
        ({"tputs": [[4.0, 2.0], [2.0]]}, "tputs[1]"),
        ({"tputs": [[4.0, -2.0], [2.0, 0.0]]}, "tputs[0][1]"),
        ({"indexes": [[64, 128]]}, "indexes"),
        ({"indexes": [[128, 64], [256, 512]]}, "indexes[0]"),
        ({"indexes": [[64, 128], [0, 512]]}, "indexes[1][0]"),
        ({"e2e": [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]}, "e2e[0]"),
        ({"slos": {"e2e": "fast"}}, "slos.e2e"),
        ({"created": True}, "created"),
    ],
)
def test_bad_profiles_name_the_key(change: dict, key: str) -> None:
    with pytest.raises(ProfileError) as e:
        parse_profile(small(**change))
    assert str(e.value).startswith(key)


@pytest.mark.parametrize("missing", ["gpu", "cost", "tputs", "indexes"])
def test_missing_required_key(missing: str) -> None:
    data = small()
    del data[missing]
    with pytest.raises(ProfileError, match=f"^{missing}: missing"):
        parse_profile(data)


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="p.json"):
        load_profile(bad)
    bad.write_text(json.dumps(small(cost=None)))
    with pytest.raises(ProfileError, match="p.json: cost"):
        load_profile(bad)


def test_halfway_between_ticks_maps_to_the_larger_cell() -> None:
    """Trace buckets 25, 35, ..., 105 (precision 10) sit exactly halfway between powers of two in log2:
    they map up, so the plan never counts them as the cheaper shape."""
    ticks = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    for b in range(25, 106, 10):
        tokens = 2 ** (b / 10)
        k = nearest_index(ticks, tokens)
        assert ticks[k] == 2 ** ((b + 5) // 10), b
    assert nearest_index(ticks, 2 ** 2.49) == 0 and nearest_index(ticks, 2 ** 2.51) == 1
    assert bucket(round(2 ** 4.5)) == 45  # 23 tokens: a real trace bucket on the edge


def test_aibrix_nan_statistics_read_as_unknown(tmp_path: Path) -> None:
    """gen_profile writes NaN for a null statistic (Python's json writes it bare): the file loads, a
    throughput nobody measured serves nothing, a latency nobody measured is unknown."""
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(small(tputs=[[4.0, float("nan")], [2.0, 0.0]],
                                     e2e=[[1.0, float("nan")], [1.8, 3.0]])))
    assert "NaN" in path.read_text()
    p = load_profile(path)
    assert p.tputs[0][1] == 0.0 and p.tputs[0][0] == 4.0
    assert p.e2e is not None and p.e2e[0][1] != p.e2e[0][1] and p.e2e[1][1] == 3.0  # NaN, kept unknown
    with pytest.raises(ProfileError, match=r"^e2e\[0\]\[1\]"):
        parse_profile(small(e2e=[[1.0, -1.0], [1.8, 3.0]]))  # a negative latency is still refused


def test_admitted_throughput_round_trips_and_is_what_routed_replicas_serve() -> None:
    data = small(tputs_admitted=[[5.0, 2.5], [2.0, 0.4]])
    p = parse_profile(data)
    assert p.tputs_admitted == ((5.0, 2.5), (2.0, 0.4))
    assert p.served is p.tputs_admitted and p.tput(512, 128) == 0.4  # tputs says 0 there
    assert dump_profile(p) == data and parse_profile(dump_profile(p)) == p
    older = parse_profile(small())
    assert older.tputs_admitted is None and older.served is older.tputs
    assert "tputs_admitted" not in dump_profile(older)
    with pytest.raises(ProfileError, match=r"^tputs_admitted\[1\]"):
        parse_profile(small(tputs_admitted=[[5.0, 2.5], [2.0]]))


def test_admitted_budget_round_trips_and_falls_back_to_littles_law() -> None:
    data = small(tputs_admitted=[[5.0, 2.5], [2.0, 0.4]], concurrency_admitted=[[6.0, 3.0], [2.0, 1.0]],
                 budget_margin=1.5)
    p = parse_profile(data)
    assert p.budget(0, 0) == 6 and p.budget(1, 1) == 1 and p.budget_margin == 1.5
    assert dump_profile(p) == data and parse_profile(dump_profile(p)) == p
    older = parse_profile(small(e2e=[[1.5, 2.0], [0.25, 3.0]]))
    assert older.concurrency_admitted is None and "concurrency_admitted" not in dump_profile(older)
    assert older.budget(0, 0) == max(1, math.floor(older.tputs[0][0] * 1.5))
    assert older.budget(1, 0) == 1  # tput x e2e < 1: a whole pod each
    with pytest.raises(ProfileError, match=r"^concurrency_admitted\[0\]"):
        parse_profile(small(concurrency_admitted=[[1.0], [1.0, 1.0]]))


def test_a_profile_without_a_budget_margin_reads_the_default_and_a_bad_one_is_refused() -> None:
    assert parse_profile(small()).budget_margin == BUDGET_MARGIN == 2.0
    for bad in (0.5, -1, "2", None, math.inf):
        with pytest.raises(ProfileError, match="^budget_margin"):
            parse_profile(small(budget_margin=bad))


def test_the_rate_at_the_largest_passing_budget_round_trips() -> None:
    data = small(tputs_admitted=[[5.0, 2.5], [2.0, 0.4]], concurrency_admitted=[[6.0, 3.0], [2.0, 1.0]],
                 tputs_admitted_max=[[8.0, 2.5], [3.0, 0.4]])
    p = parse_profile(data)
    assert p.tputs_admitted_max == ((8.0, 2.5), (3.0, 0.4))
    assert dump_profile(p) == data
    assert "tputs_admitted_max" not in dump_profile(parse_profile(small()))
    with pytest.raises(ProfileError, match=r"^tputs_admitted_max\[1\]"):
        parse_profile(small(tputs_admitted_max=[[5.0, 2.5], [2.0]]))

