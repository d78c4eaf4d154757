"""Secrets kept out of logs: a URL's password replaced before it is printed (Redis URLs, from the config,
the state sharing and the optimizer alike). Pure: imports nothing of the project."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redact_url(url: str) -> str:
    """The URL with its password replaced, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{parts.netloc.rpartition('@')[2]}"))
