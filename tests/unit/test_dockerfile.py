"""The Dockerfile, checked without a Docker engine: its install steps are the ones CI runs
(`make setup`), its build context holds everything that install needs (a wheel is built here from
exactly the files its COPY lines bring, after .dockerignore), and the image runs as non-root with
`extproc serve` as entrypoint and a gRPC health check."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def instructions(text: str) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


DOCKERFILE = instructions((ROOT / "Dockerfile").read_text())


def pip_installs(commands: list[str]) -> list[tuple[str, frozenset[str]]]:
    """Each `pip install` as (target, extras), options that do not change what is installed dropped."""
    out = []
    for command in commands:
        for part in command.split("&&"):
            words = shlex.split(part)
            if "pip" not in words or "install" not in words:
                continue
            args = [w for w in words[words.index("install") + 1 :] if w not in ("-q", "-e", "--no-cache-dir")]
            for arg in args:
                if arg == "--upgrade":
                    continue
                name, _, extras = arg.partition("[")
                out.append((name, frozenset(e for e in extras.rstrip("]").split(",") if e)))
    return out


def ci_installs() -> list[tuple[str, frozenset[str]]]:
    makefile = (ROOT / "Makefile").read_text()
    setup = makefile.split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    return pip_installs([line.replace("$(PY)", "python") for line in setup.splitlines()])


def test_install_steps_are_the_ones_ci_runs() -> None:
    docker = pip_installs([rest for word, rest in DOCKERFILE if word == "RUN"])
    ci = ci_installs()
    assert [t for t, _ in ci] == ["pip", "."]  # what `make setup` does; if it changes, change both
    assert [t for t, _ in docker] == [t for t, _ in ci]
    for (_, docker_extras), (_, ci_extras) in zip(docker, ci, strict=True):
        assert docker_extras <= ci_extras  # the image leaves out the test extra, nothing CI lacks


def test_pip_installs_parser_sees_extras() -> None:
    assert pip_installs(["python -m pip install -q -e '.[test,x]' && pip install --upgrade pip"]) == [
        (".", frozenset({"test", "x"})),
        ("pip", frozenset()),
    ]


def test_stages_user_entrypoint_healthcheck() -> None:
    froms = [rest for word, rest in DOCKERFILE if word == "FROM"]
    assert len(froms) >= 2 and " AS " in froms[0].upper()  # multi-stage: the build stage is thrown away
    base = next(rest for word, rest in DOCKERFILE if word == "ARG" and rest.startswith("PYTHON_IMAGE="))
    assert "slim" in base
    version = re.search(r"python:(\d+)\.(\d+)", base)
    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert (int(version[1]), int(version[2])) >= tuple(int(x) for x in required.lstrip(">=").split("."))
    (user,) = [rest for word, rest in DOCKERFILE if word == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    final_stage = DOCKERFILE[max(i for i, (w, _) in enumerate(DOCKERFILE) if w == "FROM") :]
    assert ("USER", user) in final_stage and not any(
        w == "RUN" and "pip install" in r for w, r in final_stage
    )
    (entrypoint,) = [json.loads(rest) for word, rest in DOCKERFILE if word == "ENTRYPOINT"]
    assert entrypoint == ["extproc", "serve"]
    (cmd,) = [json.loads(rest) for word, rest in DOCKERFILE if word == "CMD"]
    assert cmd[:2] == ["--config", "/etc/extproc/gateway.yaml"]
    (health,) = [rest for word, rest in DOCKERFILE if word == "HEALTHCHECK"]
    assert "grpc_health" in health and "HealthStub" in health


def healthcheck_code() -> str:
    (health,) = [rest for word, rest in DOCKERFILE if word == "HEALTHCHECK"]
    argv = json.loads(health[health.index("CMD") + 3 :])
    assert argv[:2] == ["python", "-c"]
    return argv[2]


def ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore's rules: a pattern matches from the context root (or at any depth after `**/`),
    and excluding a directory excludes what is under it."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        if pattern.startswith("**/"):
            bare = pattern[3:]
            if any(fnmatch.fnmatch(p, bare) for p in parts):
                return True
        elif any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes):
            return True
    return False


def test_dockerignore_rules() -> None:
    patterns = ["envoy", "**/__pycache__", "*.egg-info"]
    assert ignored("envoy/envoy.yaml", patterns) and ignored("extproc/pool/__pycache__/x.pyc", patterns)
    assert not ignored("extproc/envoy/tally.lua", patterns)
    assert ignored("extproc.egg-info/PKG-INFO", patterns)


def test_a_wheel_builds_from_exactly_the_build_context(tmp_path: Path) -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    src = tmp_path / "src"
    src.mkdir()
    build_stage = DOCKERFILE[: [i for i, (w, _) in enumerate(DOCKERFILE) if w == "FROM"][1]]
    copies = [shlex.split(rest) for word, rest in build_stage if word == "COPY"]
    assert copies
    for *sources, destination in copies:
        for source in sources:
            assert (ROOT / source).exists(), source
            assert not ignored(source, patterns), f"{source} is excluded by .dockerignore"
            files = [ROOT / source] if (ROOT / source).is_file() else sorted((ROOT / source).rglob("*"))
            for file in files:
                rel = file.relative_to(ROOT).as_posix()
                if file.is_file() and not ignored(rel, patterns):
                    target = (
                        src
                        / destination
                        / (
                            file.name
                            if (ROOT / source).is_file()
                            else file.relative_to(ROOT / source).as_posix()
                        )
                    )
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(file, target)
    assert not list(src.rglob("__pycache__"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(tmp_path / "wheels"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "wheels").glob("extproc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "extproc/envoy/tally.lua" in names and "extproc/server/app.py" in names
    assert "extproc/pool/watch.py" in names and "extproc/config/loader.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "extproc = extproc.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    # the product only: no tool's package in the image (issue 42), and its commands run without them
    tools = ("extproc/sim/", "extproc/profiling/", "extproc/fleetsim/", "extproc/perf/", "extproc/demo/",
             "extproc/localstack.py")
    assert not [n for n in names if n.startswith(tools)]
    assert "extproc/optimizer/service.py" in names and "extproc/gpu_profiles.py" in names
    unpacked = tmp_path / "image"
    zipfile.ZipFile(wheel).extractall(unpacked)
    usage = image_cli(unpacked, "--help")
    assert usage.returncode == 0, usage.stderr
    offered = set(re.search(r"\{([\w,-]+)\}", usage.stdout)[1].split(","))
    assert {"serve", "check-config", "envoy-config", "optimizer", "optimize", "score"} <= offered
    assert not offered & {"engine-sim", "fleet-sim", "benchmark", "gen-profile", "bench", "demo"}
    for command in ("serve", "optimizer"):
        run = image_cli(unpacked, command, "--help")
        assert run.returncode == 0 and "usage: extproc " + command in run.stdout, run.stderr


def image_cli(unpacked: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`extproc ARGV` with the image's wheel first on the path (what the image has of the package), and
    without this checkout's editable install (its finder would hand out the modules the image lacks)."""
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
            "if not getattr(f, '__module__', '').startswith('__editable__')]; "
            f"sys.path.insert(0, {str(unpacked)!r}); import extproc; "
            f"assert extproc.__file__.startswith({str(unpacked)!r}), extproc.__file__; "
            "from extproc.cli import main; sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60,
                          cwd=unpacked)
