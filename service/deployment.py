"""The service as a Ray Serve deployment: one replica runs the app (service.app) with the
front door's limits, and Serve's proxy ends any request past its timeout."""

from __future__ import annotations

import sys

from ray import serve

from cluster.log_lines import send_to
from service.app import app, configure
from service.auth import TokenEntry, Tokens
from service.http_limits import HttpLimits
from service.settings import ServiceSettings

DEFAULT_LIMITS = HttpLimits()


@serve.deployment(num_replicas=1, max_ongoing_requests=DEFAULT_LIMITS.max_ongoing_requests,
                  max_queued_requests=DEFAULT_LIMITS.max_queued_requests, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class JobService:
    """One replica holds the records in memory and writes them through to storage."""

    def __init__(self, settings: dict, tokens: list[dict], http: dict | None = None):
        send_to(sys.stderr)  # the replica's own lines ([etrain-service] ...) beside Serve's, in its log
        self._stop = configure(ServiceSettings.model_validate(settings),
                               Tokens([TokenEntry.model_validate(t) for t in tokens]),
                               http=HttpLimits.model_validate(http or {}))

    def __del__(self):
        self._stop.set()


def application(settings: dict, tokens: list[dict], http: HttpLimits):
    """The deployment with the front door's limits: its own (slots, queue) and the replica's."""
    return JobService.options(max_ongoing_requests=http.max_ongoing_requests,
                              max_queued_requests=http.max_queued_requests).bind(settings, tokens, http.model_dump())


def http_options(host: str, port: int, http: HttpLimits) -> dict:
    """Serve's proxy options: where it listens, and the timeout after which it ends any request."""
    return {"host": host, "port": port, "request_timeout_s": http.request_timeout_s}
