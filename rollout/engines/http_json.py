"""A small asyncio JSON-over-HTTP client: stdlib ``http.client`` calls run in a thread pool.

Each call opens its own connection, so long ``/generate`` calls never wait on one another
beyond the pool size.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import urllib.parse
from typing import Any

from rollout.engine import EngineError


class UnreachableError(EngineError):
    """The server could not be reached or did not answer (as opposed to an HTTP error status)."""


class JsonHttpClient:
    """``await client.request("POST", "/generate", payload)`` gives ``(status, JSON body)``."""

    def __init__(self, base_url: str, max_connections: int = 256, timeout_s: float = 3600.0):
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{base_url!r} is not an http(s) URL")
        self.base_url = base_url.rstrip("/")
        self._url = url
        self._timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_connections, thread_name_prefix="sglang-http"
        )

    async def request(
        self, method: str, path: str, payload: Any = None, timeout_s: float | None = None
    ) -> tuple[int, Any]:
        """Send ``payload`` as JSON; ``UnreachableError`` when the server cannot be reached."""
        loop = asyncio.get_running_loop()
        timeout = self._timeout_s if timeout_s is None else timeout_s
        call = lambda: self._request(method, path, payload, timeout)  # noqa: E731
        return await loop.run_in_executor(self._pool, call)

    def _request(self, method: str, path: str, payload: Any, timeout: float) -> tuple[int, Any]:
        https = self._url.scheme == "https"
        conn_cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
        conn = conn_cls(self._url.hostname, self._url.port, timeout=timeout)
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            conn.request(method, self._url.path.rstrip("/") + path, body=body, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as e:
            raise UnreachableError(f"{method} {self.base_url}{path} failed: {e}") from e
        finally:
            conn.close()
        try:
            data = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            data = raw.decode(errors="replace")
        return response.status, data

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
