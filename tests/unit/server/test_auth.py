"""API keys: off by default, from a file and the environment, rotated on change, never logged."""

from __future__ import annotations

import logging
import os

import pytest

from extproc import environment
from extproc.openai import OpenAIError
from extproc.server.auth import ApiKeys


def test_no_keys_means_no_check():
    keys = ApiKeys()
    assert not keys.enabled
    keys.check(None)


def test_file_and_environment_keys_and_rotation(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text("# ops\nsk-file-1\n\n")
    keys = ApiKeys(path, environment.api_keys({"EXTPROC_API_KEYS": "sk-env-1, sk-env-2"}))
    for good in ("Bearer sk-file-1", "bearer sk-env-2", "Bearer  sk-env-1 "):
        keys.check(good)
    for bad in (None, "", "Bearer", "Bearer sk-file-2", "Basic sk-file-1", "sk-file-1"):
        with pytest.raises(OpenAIError) as err:
            keys.check(bad)
        assert err.value.status == 401 and b"sk-" not in err.value.body()
    path.write_text("sk-file-2\n")
    os.utime(path, ns=(1, 1))
    with caplog.at_level(logging.INFO):
        assert keys.reload_if_changed()
    keys.check("Bearer sk-file-2")
    keys.check("Bearer sk-env-1")  # the environment's keys stay
    with pytest.raises(OpenAIError):
        keys.check("Bearer sk-file-1")
    path.unlink()
    assert not keys.reload_if_changed()  # gone: the previous keys keep working
    keys.check("Bearer sk-file-2")
    assert "sk-file" not in caplog.text and "sk-env" not in caplog.text
