"""The Ray internals cluster/ray_adapter/kv.py relies on are still where it reaches for them.

These run against the installed (pinned) Ray without starting it: an upgrade that moves or
changes one fails here, by name, before a job meets it.
"""

from __future__ import annotations


def test_the_kv_store_functions_exist():
    from ray.experimental import internal_kv

    for name in ("_internal_kv_get", "_internal_kv_put", "_internal_kv_exists", "_internal_kv_del"):
        assert callable(getattr(internal_kv, name)), name
