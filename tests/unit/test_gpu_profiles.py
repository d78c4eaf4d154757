"""AIBrix profile JSON: AIBrix's own files parse, round-trip, and bad ones fail naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.gpu_profiles import GpuProfile, ProfileError, dump_profile, load_profile, parse_profile
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
    data = small(ttft=[[0.1, 0.2], [0.1, 0.3]])
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
        ({"tputs": [[4.0, float("nan")], [2.0, 0.0]]}, "tputs[0][1]"),
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
