"""The slo* strategies are registered by importing extproc.strategies (as the gateway does), not by
importing the slo package's parts: every test here may build them by name."""

import extproc.strategies  # noqa: F401
