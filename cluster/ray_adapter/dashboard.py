"""The dashboard of a Ray cluster and Ray's HTTP clients of it (Jobs API, state API).

- The dashboard address of the Ray this process is connected to (Ray has no public getter):
  :func:`dashboard_url`.
- Ray's ``JobSubmissionClient`` and ``StateApiClient`` take ``RAY_API_SERVER_ADDRESS`` or
  ``RAY_ADDRESS`` from the environment over the address they are given
  (``ray.dashboard.utils.get_address_for_submission_client``). The service joins its own Ray
  through ``RAY_ADDRESS`` and sends jobs to another cluster's dashboard, so a client built
  plainly would send every job to the service's own cluster. :func:`dashboard_client` builds them
  with those two variables out of sight; the client keeps the address it resolved at construction.
"""

from __future__ import annotations

import os
import threading

ADDRESS_VARIABLES = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
_env_lock = threading.Lock()


def dashboard_url() -> str:
    """The Jobs API address of the Ray this process is connected to."""
    from ray._private.worker import get_dashboard_url

    url = get_dashboard_url()
    return url if url.startswith("http") else f"http://{url}"


def dashboard_client(cls, url: str, headers: dict[str, str] | None = None):
    """``cls(url, headers=...)`` for one of Ray's dashboard clients, talking to ``url``."""
    with _env_lock:
        hidden = {k: os.environ.pop(k) for k in ADDRESS_VARIABLES if k in os.environ}
        try:
            return cls(url, headers=headers or None)
        finally:
            os.environ.update(hidden)
