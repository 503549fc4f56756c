"""The headers with which a client tells Ray Serve's proxy its own request timeout or asks to be
served after it hangs up (``ray.serve._private.constants``): the service refuses a request that
carries one (:func:`serve_client_override_headers`)."""

from __future__ import annotations


def serve_client_override_headers() -> tuple[str, ...]:
    """The request headers that let a client lift Ray Serve's request timeout for itself, or be served
    after it disconnects: a service that bounds what one client may cost refuses them."""
    from ray.serve._private import constants

    return (constants.SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER, constants.SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER)
