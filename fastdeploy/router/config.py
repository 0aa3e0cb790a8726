"""What ``fastdeploy router`` fronts and how it chooses: PD pairs or plain replicas."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse

from fastdeploy.config import check, check_int, is_number
from fastdeploy.entrypoints.openai.auth import resolve_api_keys

POLICIES = ("round_robin", "least_outstanding")


def check_url(name: str, url: str) -> str:
    """``url`` without a trailing slash.

    Raises:
        ValueError: not an ``http://`` or ``https://`` URL with a host (names ``name``).
    """
    parsed = urlparse(url) if isinstance(url, str) else None
    check(
        parsed is not None and parsed.scheme in ("http", "https") and bool(parsed.netloc),
        name,
        url,
        "an http:// or https:// URL with a host, e.g. http://127.0.0.1:8101",
    )
    return url.rstrip("/")


@dataclass
class RouterConfig:
    """The router's backends and policies.

    Either ``prefill`` and ``decode`` (prefill/decode disaggregation: every request goes to one
    prefill node, then to one decode node) or ``backend`` (plain replicas of mixed servers).

    Attributes:
        prefill / decode / backend: server base URLs (``http://host:port``).
        policy: ``round_robin`` or ``least_outstanding`` (fewest requests in flight through this
            router; ties go to the first).
        health_interval_s: seconds between ``GET /health`` polls of every backend (also the
            limit of one poll).
        health_failure_threshold: failed polls in a row that mark a backend unhealthy (one
            success marks it healthy again); SGLang's router has the same setting, default 3.
            A slow ``/health`` under load then does not eject a working server; a refused
            connection (a poll's or a request's) still marks it unhealthy at once.
        prefill_timeout_s: limit of the prefill leg (seconds).
        decode_timeout_s: limit between two bytes of the decode leg, or of a plain request.
        prefill_retries: further tries of the prefill leg after a connection error or a 503,
            each on the next healthy prefill node. The decode leg is never retried: a second
            decode node could race the first for the same prefill blocks.
        api_key: keys the router's own clients must send (``Authorization: Bearer``) on every
            route but ``/health`` and ``/metrics``, as ``fastdeploy serve --api-key``; empty:
            open.
        backend_api_key: the key the router sends to every backend, on every request it makes
            there (both legs, ``/v1/models``, health polls); None: none. Neither key appears in
            the repr.
        pd_secret_file: the PD nodes' shared secret (``--pd-secret-file``; None:
            ``FD_PD_SECRET``), which signs the ABORTs the router sends to prefill nodes.
    """

    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    backend: list[str] = field(default_factory=list)
    policy: str = "round_robin"
    health_interval_s: float = 2.0
    health_failure_threshold: int = 3
    prefill_timeout_s: float = 300.0
    decode_timeout_s: float = 300.0
    prefill_retries: int = 2
    api_key: list[str] = field(default_factory=list, repr=False)
    backend_api_key: str | None = field(default=None, repr=False)
    pd_secret_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "backend"):
            urls = getattr(self, name)
            check(isinstance(urls, list), name, urls, "a list of URLs")
            setattr(self, name, [check_url(name, u) for u in urls])
        pd = bool(self.prefill or self.decode)
        check(
            pd != bool(self.backend),
            "backend",
            self.backend,
            "either --prefill and --decode URLs (PD mode) or --backend URLs (plain mode), "
            "not both and not neither",
        )
        if pd:
            check(
                bool(self.prefill) and bool(self.decode),
                "prefill/decode",
                {"prefill": self.prefill, "decode": self.decode},
                "at least one prefill URL and one decode URL",
            )
        check(self.policy in POLICIES, "policy", self.policy, ", ".join(POLICIES))
        for name in ("health_interval_s", "prefill_timeout_s", "decode_timeout_s"):
            value = getattr(self, name)
            check(is_number(value) and value > 0, name, value, "a number of seconds > 0")
        check_int("health_failure_threshold", self.health_failure_threshold, minimum=1)
        check_int("prefill_retries", self.prefill_retries, minimum=0)
        self.api_key = resolve_api_keys(self.api_key, {}, "api_key")
        if self.backend_api_key is not None:
            resolve_api_keys([self.backend_api_key], {}, "backend_api_key")

    @property
    def is_pd(self) -> bool:
        """Prefill/decode mode (else plain replicas)."""
        return bool(self.prefill)
