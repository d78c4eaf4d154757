"""Typed gateway settings: the YAML file and the environment, read and checked once (`loader`)."""

from extproc.config.loader import load, parse
from extproc.config.schema import Config, ConfigError

__all__ = ["Config", "ConfigError", "load", "parse"]
