"""Ray's HTTP clients (Jobs API, state API) pointed at the cluster we name, whatever this process joined.

Ray's ``JobSubmissionClient`` and ``StateApiClient`` take ``RAY_API_SERVER_ADDRESS`` or
``RAY_ADDRESS`` from the environment over the address they are given
(``ray.dashboard.utils.get_address_for_submission_client``). The service joins its own Ray
through ``RAY_ADDRESS`` and sends jobs to another cluster's dashboard, so a client built
plainly would send every job to the service's own cluster. These are built with those two
variables out of sight; the client keeps the address it resolved at construction.
"""

from __future__ import annotations

import os
import threading

ADDRESS_VARIABLES = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
_env_lock = threading.Lock()


def dashboard_client(cls, url: str, headers: dict[str, str] | None = None):
    """``cls(url, headers=...)`` for one of Ray's dashboard clients, talking to ``url``."""
    with _env_lock:
        hidden = {k: os.environ.pop(k) for k in ADDRESS_VARIABLES if k in os.environ}
        try:
            return cls(url, headers=headers or None)
        finally:
            os.environ.update(hidden)
