"""What the test process itself holds."""
from __future__ import annotations


def vm_rss_mb() -> float:
    """The process's resident memory, MiB (Linux's /proc)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
