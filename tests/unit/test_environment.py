"""The one table of environment variables, and the config pipeline that reads them for `serve`."""

from __future__ import annotations

import re
from pathlib import Path

from extproc import environment
from extproc.config import parse
from extproc.config.describe import describe
from extproc.config.schema import SECTION_KEYS
from extproc.routing.settings import env_variables

CONFIG = {"models": {"m": {"pods": [{"name": "p0", "address": "10.0.0.1:8000"}]}}}
PACKAGE = Path(environment.__file__).parent


def test_the_table_names_every_variable_once_and_each_override_a_real_key():
    names = [v.name for v in environment.VARIABLES]
    assert len(names) == len(set(names))
    assert sorted(v.name for v in environment.ROUTING_KNOBS) == sorted(env_variables())
    for var in environment.CONFIG_OVERRIDES:
        section, key = var.sets.split(".")
        assert section == "routing" or key in SECTION_KEYS[section], var


def test_only_the_table_module_reads_variables_by_name():
    """A variable read anywhere else would be one check-config does not show."""
    reads = re.compile(r"environ\.get\(|environ\[|getenv\(")
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if p.name != "environment.py" and reads.search(p.read_text())]
    assert offenders == []


def test_the_loader_folds_in_every_rule():
    env = {"REDIS_HOST": "10.0.0.9", "REDIS_PASSWORD": "pw", "POD_NAME": "gw-1", "EXTPROC_API_KEYS": "a, b",
           "AIBRIX_GPU_OPTIMIZER_TRACING_FLAG": "true", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    config = parse(CONFIG, env)
    assert config.redis_url == "redis://:pw@10.0.0.9:6379/0" and config.redis_instance == "gw-1"
    assert config.api_keys == ("a", "b") and config.tracing and config.discovery.in_cluster
    assert "pw" not in repr(config) and "'a'" not in repr(config)  # secrets stay out of logs
    bare = parse(CONFIG, {})
    assert (bare.redis_url, bare.redis_instance, bare.api_keys, bare.tracing) == (None, None, (), False)


def test_check_config_reports_what_serve_reads_from_the_config():
    lines = describe(parse(CONFIG, {"REDIS_HOST": "r", "REDIS_PASSWORD": "s3cret", "EXTPROC_API_KEYS": "k",
                                    "AIBRIX_GPU_OPTIMIZER_TRACING_FLAG": "1"}))
    text = "\n".join(lines)
    assert "Redis: on (redis://:***@r:6379/0; sync every 0.1 s, heartbeat 1 s, timeout 0.5 s, " \
           "AIBrix rows off)" in text and "s3cret" not in text
    assert "API keys: on (1 from EXTPROC_API_KEYS); request traces: on" in text
    assert "API keys: off; request traces: off" in "\n".join(describe(parse(CONFIG, {})))
