"""`BackgroundLoop`: one daemon thread running an asyncio event loop, on which synchronous code
awaits coroutines (async tools, MCP connections, OpenEnv clients) whether or not its caller is
inside an event loop of its own. Each user keeps one module-level instance."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any


class BackgroundLoop:
    """The loop starts on first use (and again if it was closed); its thread is named `name`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name=self.name, daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float | None) -> Any:
        """Run `coroutine` on the loop and wait for it from another thread: TimeoutError (the
        coroutine cancelled) after `timeout` seconds; RuntimeError from the loop's own thread,
        which would wait on itself."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError(f"a coroutine was run on {self.name} from that loop's own thread")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.get())
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError from None


__all__ = ["BackgroundLoop"]
