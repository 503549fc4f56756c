"""Ray's GCS key-value store (``ray.experimental.internal_kv``, no public API): a job's stop request
and heartbeat, and the placement group a run's workers hold, live there; they outlive the
workers, not the cluster."""

from __future__ import annotations


def kv_get(key: bytes) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key)


def kv_put(key: bytes, value: bytes | str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value)


def kv_exists(key: bytes) -> bool:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_exists(key)


def kv_del(key: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key)
