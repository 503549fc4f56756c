"""The Ray internals cluster/ray_adapter/serve.py relies on are still where it reaches for them.

These run against the installed (pinned) Ray without starting it: an upgrade that moves or
changes one fails here, by name, before a job meets it.
"""

from __future__ import annotations


def test_serve_reads_exactly_these_client_override_headers():
    """Every header with which a client sets Ray Serve's proxy behaviour for its own request is one
    the service refuses: a Ray that adds one fails here."""
    from ray.serve._private import constants

    from cluster.ray_adapter.serve import serve_client_override_headers

    headers = {k: v for k, v in vars(constants).items() if "HEADER" in k}
    assert headers == {  # a new one: decide whether a client may send it, and refuse it here if not
        "SERVE_HTTP_REQUEST_ID_HEADER": "x-request-id",  # a label for the request's log lines only
        "SERVE_INGRESS_ROUTER_HEADER_PREFIX": "x-serve-router-",  # custom request routers' (we use none)
        "RAY_SERVE_INGRESS_REQUEST_ROUTER_OPT_HEADERS_FIELD": "request_headers",
        "SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER": "x-request-timeout-seconds",
        "SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER": "x-request-disconnect-disabled"}, headers
    assert serve_client_override_headers() == ("x-request-timeout-seconds", "x-request-disconnect-disabled")
