"""What the job service's parts (submit, reconcile, views) share: its settings, the storage root,
the records, Ray's Jobs client, the lock that serialises changes to records, and their back-off."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from cluster.ray_adapter.dashboard import dashboard_client
from cluster.storage import StorageRoot, open_root
from service.ray_failures import Failures
from service.settings import ServiceSettings, jobs_headers
from service.store import Store


@dataclass
class JobsContext:
    settings: ServiceSettings
    root: StorageRoot
    store: Store
    client: Any  # Ray's JobSubmissionClient (tests give a fake one at this edge)
    lock: threading.RLock
    failures: Failures

    @classmethod
    def open(cls, settings: ServiceSettings, client=None) -> JobsContext:
        """The storage root and the records as the settings say; Ray's client for the jobs cluster unless given."""
        from ray.job_submission import JobSubmissionClient

        root, store, lock = open_root(settings.storage_root), Store(settings.state_dir), threading.RLock()
        client = client or dashboard_client(JobSubmissionClient, settings.ray_dashboard_url, jobs_headers(settings))
        return cls(settings, root, store, client, lock, Failures(store, lock, settings.reconcile_interval_s))

    def tenant_root(self, tenant: str) -> StorageRoot:
        return self.root.sub("tenants", tenant)

    def specs_root(self, tenant: str) -> StorageRoot:
        """Where a tenant's checked specs are stored: beside its prefix, not in it (its keys write there),
        and each attempt checks the digest besides."""
        return self.root.sub("checked-specs", tenant)
