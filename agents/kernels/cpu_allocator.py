"""glibc malloc set to keep freed memory for the next allocation, for the engine's CPU work.

A CPU prefill's temporaries are megabytes each. glibc serves allocations that large with fresh
mmap()s, and gives freed heap tops back to the OS, so each forward writes to new pages and pays
their page faults, several times the op's own work for a norm over a prefill's activations
(bench/RESULTS.md, 'bench/generate.py', the bf16 prefill). With the mmap threshold at glibc's maximum (32 MiB) and heap trimming off,
those allocations come from the heap and are reused, which is what tcmalloc or jemalloc
(LD_PRELOAD) would do, without a preload.

It is process-wide: memory a process has freed stays mapped for its later allocations instead of
returning to the OS (the CPU demo's peak memory was not larger with it: bench/RESULTS.md).
`keep_freed_memory()` changes nothing where the process already chose (MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_ or MALLOC_TOP_PAD_ in the environment, or an allocator in LD_PRELOAD), off
glibc, or with TOOLGYM_MALLOC_TUNING=0.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h) and the values set.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit: larger requests are still mmap()ed
TRIM_THRESHOLD = (1 << 31) - 1  # never trim
# The environment variables the same choice can be made with (for child processes).
ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def _already_chosen() -> str | None:
    if os.environ.get("TOOLGYM_MALLOC_TUNING", "1") == "0":
        return "TOOLGYM_MALLOC_TUNING=0"
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        if name in os.environ:
            return name
    preload = os.environ.get("LD_PRELOAD", "")
    if any(allocator in preload for allocator in ("tcmalloc", "jemalloc", "mimalloc")):
        return "LD_PRELOAD"
    return None


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc malloc's mmap threshold to its maximum and turn heap trimming off, once per
    process; True if this call's settings are in effect (see the module doc for when not)."""
    reason = _already_chosen()
    if reason is None and (platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"):
        reason = "not glibc"
    if reason is not None:
        logger.debug("malloc left as it is: %s", reason)
        return False
    libc = ctypes.CDLL(None)
    done = (
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )
    logger.debug("malloc keeps freed memory: %s", done)
    return done


__all__ = ["ENVIRONMENT", "keep_freed_memory"]
