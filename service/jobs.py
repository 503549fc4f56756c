"""Jobs and sweeps as Ray Jobs: the service's parts over one shared context (service.context).

- service.submit: check a spec (role, limits, quota), store it, submit each attempt; resume
- service.reconcile: follow Ray's view of each record, resubmit a lost job; stop gracefully
- service.views: what a tenant is shown of its records and of what their jobs wrote
"""

from __future__ import annotations

from service.context import JobsContext
from service.reconcile import Reconciler
from service.settings import ServiceSettings
from service.submit import Submitter
from service.views import Views


class JobManager:
    """One of each part, wired: the reconciler resubmits through the submitter and reads summaries
    through the views."""

    def __init__(self, settings: ServiceSettings, client=None):
        self.context = context = JobsContext.open(settings, client)
        self.settings, self.store, self.client = context.settings, context.store, context.client
        self.views = Views(context)
        self.submitter = Submitter(context)
        self.reconciler = Reconciler(context, self.submitter, self.views)
