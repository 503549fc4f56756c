"""What the HTTP API takes and returns (these models are also its OpenAPI schema)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from service.states import JobState

# The names as a Literal, so the OpenAPI schema lists them inline (an Enum would become a component of its own).
State = Literal[tuple(s.value for s in JobState)]


class Problem(BaseModel):
    """Every error: what went wrong, and for an invalid spec one line per problem."""

    detail: str | list[Any]
    problems: list[str] | None = None


class TransitionOut(BaseModel):
    state: State
    at: float
    reason: str


class RecordOut(BaseModel):
    id: str
    kind: Literal["job", "sweep"]
    tenant: str
    name: str
    state: State
    history: list[TransitionOut]
    spec: dict[str, Any]
    spec_uri: str
    storage: str
    submissions: list[str]
    created_at: float
    updated_at: float
    summary: dict[str, Any] | None
    error: str | None
    progress: dict[str, Any]


class RecordList(BaseModel):
    items: list[RecordOut]
    total: int
    offset: int
    limit: int


class CheckpointOut(BaseModel):
    step: int
    uri: str
    complete: bool
    size_bytes: int
    metrics: dict[str, Any]
    trial: str | None = None


class MetricsOut(BaseModel):
    id: str
    rows: list[dict[str, Any]]


class Health(BaseModel):
    status: Literal["ok"]
