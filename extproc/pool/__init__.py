from extproc.pool.pod import Pod
from extproc.pool.pool import Pool

__all__ = ["Pod", "Pool"]
