"""Every Ray internal this project touches, one file per kind of dependency, checked against the pinned Ray.

- kv.py               Ray's GCS key-value store (stop requests, heartbeats, placement-group records)
- local.py            start, join and stop a local Ray; its address record, temp folder, loopback knobs
- cluster_view.py     Ray Train's view of the nodes (refresh it now), the autoscaler's reported maximum
- dashboard.py        the dashboard's address; Ray's Jobs/state API clients, pointed where we say
- logs.py             the driver's printer of worker output, the autoscaler-event filter
- serve.py            the request headers that change Ray Serve's proxy behaviour for one request
- tune.py             what Tune's variant generator evaluates, a trial's actor, Tune's checkpoint knob
- train_torch.py      the lean TorchTrainer and torch backend, the controller's knobs, Ctrl-C chaining
- train_callbacks.py  Ray Train callbacks left out and added (placement groups, preemption, resize)
- train_worker.py     a worker's threads, context, environment and storage filesystem

It lives in cluster/, the lowest layer, so trainers/, service/ and cluster/ share it. Nothing
else in those packages may import Ray's private modules (``ray._private``, ``ray._raylet``,
``ray.experimental.internal_kv``, ``ray.train.v2._internal``, ``ray.serve._private``, any
``_``-named module or name of Ray), reach Ray's internal attributes, or name an environment
knob of Ray (``RAY_*``, ``TUNE_*``): tests/unit/test_ray_adapter.py reads the code for that,
and tests/unit/test_ray_adapter_*.py fail loudly when Ray moves or changes what each file uses.
Import each name from the file that defines it; this package re-exports nothing.
"""
