"""Backends of the router: health, requests in flight, and the choice of one."""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import httpx

logger = logging.getLogger(__name__)


class NoHealthyBackendError(RuntimeError):
    """Every backend of a pool failed its last health check (or a request to it)."""


@dataclass
class Endpoint:
    """One server behind the router.

    Attributes:
        url: base URL, no trailing slash.
        role: ``prefill``, ``decode`` or ``backend``.
        healthy: False once ``health_failure_threshold`` polls in a row failed (or a request
            could not connect); True again after a successful poll. True at start.
        outstanding: requests in flight through this router.
        failed_polls: health polls failed in a row.
    """

    url: str
    role: str
    healthy: bool = True
    outstanding: int = 0
    failed_polls: int = 0


class EndpointPool:
    """The servers of one role, and the policy that picks one per request.

    Args:
        role: ``prefill``, ``decode`` or ``backend``.
        urls: base URLs.
        policy: ``round_robin`` or ``least_outstanding``.
    """

    def __init__(self, role: str, urls: list[str], policy: str) -> None:
        self.role = role
        self.endpoints = [Endpoint(u, role) for u in urls]
        self.policy = policy
        self._turn = itertools.count()

    def pick(self, exclude: tuple[Endpoint, ...] = ()) -> Endpoint:
        """A healthy endpoint not in ``exclude`` (falling back to excluded healthy ones when
        nothing else is left), chosen by the policy; its ``outstanding`` count is raised (call
        :meth:`release` when the request ends).

        Raises:
            NoHealthyBackendError: no endpoint of this role is healthy.
        """
        healthy = [e for e in self.endpoints if e.healthy]
        if not healthy:
            raise NoHealthyBackendError(
                f"no healthy {self.role} server among {[e.url for e in self.endpoints]}"
            )
        candidates = [e for e in healthy if e not in exclude] or healthy
        if self.policy == "least_outstanding":
            chosen = min(candidates, key=lambda e: e.outstanding)
        else:
            chosen = candidates[next(self._turn) % len(candidates)]
        chosen.outstanding += 1
        return chosen

    @staticmethod
    def release(endpoint: Endpoint) -> None:
        """The request that :meth:`pick` counted has ended."""
        endpoint.outstanding -= 1

    @property
    def any_healthy(self) -> bool:
        return any(e.healthy for e in self.endpoints)


async def poll_health(
    pools: list[EndpointPool],
    client: httpx.AsyncClient,
    interval_s: float,
    failure_threshold: int = 1,
) -> None:
    """Forever: ``GET /health`` on every endpoint each ``interval_s`` seconds; 200 marks it
    healthy, anything else (or no answer within the interval) counts as a failed poll, and
    ``failure_threshold`` failed polls in a row mark it unhealthy; a refused connection marks it
    unhealthy at once (nothing listens there: the server is down, not slow). Cancel the task to
    stop.
    """
    while True:
        endpoints = [e for pool in pools for e in pool.endpoints]
        results = await asyncio.gather(
            *(client.get(e.url + "/health", timeout=interval_s) for e in endpoints),
            return_exceptions=True,
        )
        for endpoint, result in zip(endpoints, results):
            ok = isinstance(result, httpx.Response) and result.status_code == 200
            endpoint.failed_polls = 0 if ok else endpoint.failed_polls + 1
            if isinstance(result, httpx.ConnectError):  # nothing listens: down, not slow
                endpoint.failed_polls = max(endpoint.failed_polls, failure_threshold)
            if not ok and endpoint.healthy and endpoint.failed_polls < failure_threshold:
                logger.info(
                    "%s server %s failed a health poll (%s), %d of %d before it is unhealthy",
                    endpoint.role,
                    endpoint.url,
                    _describe(result),
                    endpoint.failed_polls,
                    failure_threshold,
                )
                continue
            if ok != endpoint.healthy:
                logger.warning(
                    "%s server %s is now %s",
                    endpoint.role,
                    endpoint.url,
                    "healthy" if ok else f"unhealthy ({_describe(result)})",
                )
            endpoint.healthy = ok
        await asyncio.sleep(interval_s)


def _describe(result: object) -> str:
    if isinstance(result, httpx.Response):
        return f"HTTP {result.status_code}"
    return type(result).__name__
