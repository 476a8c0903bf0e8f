"""The worker threads that step envs whose `step` waits on something outside the process.

An env whose `step_waits` hook is true (envs/core/text_env.py: a ToolEnv with a tool that waits
on a sandbox or a server) is stepped in one of ENV_STEP_THREADS threads, shared by every episode
of every runner in the process, so a slow tool call does not hold up the other episodes' turns.
The pool starts on first use.
"""

from __future__ import annotations

import concurrent.futures
import threading

ENV_STEP_THREADS = 64  # worker threads for envs whose step waits, shared by all runners
_step_pool: concurrent.futures.ThreadPoolExecutor | None = None
_step_pool_lock = threading.Lock()


def env_step_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's one pool of env-step threads (started on first use)."""
    global _step_pool
    with _step_pool_lock:
        if _step_pool is None:
            _step_pool = concurrent.futures.ThreadPoolExecutor(ENV_STEP_THREADS, "toolgym-env-step")
        return _step_pool
