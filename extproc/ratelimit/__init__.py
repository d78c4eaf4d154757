"""Per-key request and token limits (docs/rate-limits.md): settings, the token-bucket math, the
in-process and Redis stores, and the limiter the ext_proc stream consults before routing."""

from extproc.ratelimit.limiter import Admission, Budget, RateLimiter
from extproc.ratelimit.settings import Limits, RateLimitSettings, parse_rate_limits

__all__ = ["Admission", "Budget", "Limits", "RateLimitSettings", "RateLimiter", "parse_rate_limits"]
