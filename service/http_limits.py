"""What one HTTP client may cost the service: how long a body may take, how many requests are
served and queued at once, how often a sign-in may fail, how much one answer may carry.

`etrain serve` fills these from its flags (``--body-deadline-s`` ...); the deployment gets them
with its settings. The defaults let a few hundred slow or idle connections sit beside normal
traffic without taking its place: a body must arrive within ``body_deadline_s`` (408 after
that), a request ends after ``request_timeout_s`` whatever it does (Ray Serve's proxy), and
past ``max_ongoing_requests`` at once up to ``max_queued_requests`` wait, the rest get 503.
Serve's proxy counts a request as queued from its arrival until a replica takes it, free slots
or not, so ``max_queued_requests`` is also the largest burst of new connections admitted at once
(a burst of 220 sign-ins on a busy machine overflowed a queue of 200 with 780 slots free).
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class HttpLimits(BaseModel):
    """The front door's limits; one model, validated once when the service starts."""

    body_deadline_s: float = Field(10.0, gt=0, description="a whole request body must arrive within this (else 408)")
    request_timeout_s: float = Field(
        600.0, gt=0, description="Ray Serve ends any request after this (a followed log stream too: follow again)")
    max_ongoing_requests: int = Field(
        1000, ge=1, description="requests the replica serves at once (a slow client holds one while its body trickles)")
    max_queued_requests: int = Field(
        1000, ge=1, description="requests waiting for a replica to take them (a burst of new ones too); more get 503")
    login_failures: int = Field(10, ge=1, description="failed sign-ins per client address per login_window_s, then 429")
    login_window_s: float = Field(60.0, gt=0)
    login_addresses: int = Field(
        10000, ge=1, description="client addresses whose failures are remembered (the oldest are forgotten first)")
    max_metrics_points: int = Field(
        2000, ge=2, description="most rows one metrics answer or chart carries (first and last kept, evenly spaced)")
    jobs_page_rows: int = Field(50, ge=1, description="jobs per page of the web list")
    follow_streams_per_tenant: int = Field(
        4, ge=1, description="logs one tenant may follow at once (each holds a request slot until it ends); more: 429")
    read_cache_s: float = Field(
        2.0, ge=0, description="a record's Ray log and metrics are read at most once per this, however many ask")
