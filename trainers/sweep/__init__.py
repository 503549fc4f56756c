"""Hyperparameter sweeps: Ray Tune searches a space of job specs, and every trial is a full job.

A sweep file is a job spec with a ``sweep`` section (or a ``sweep`` section whose ``base``
names a job spec file). Each trial is that spec with the trial's values set, run by the same
``run_job`` as a single job: elastic, spot-tolerant, checkpointed, with the job's global
batch semantics. Ray Train reports to Tune through ``TuneReportCallback`` at checkpoints: a
trial reports every one (``checkpoint.report_interval_s`` 0 unless the sweep file sets it), since
the scheduler decides at reports.

Layout under the storage root::

    <root>/sweeps/<name>/tune/            Ray Tune's experiment state (what --resume reads)
    <root>/sweeps/<name>/jobs/<trial>/    each trial's job folder: checkpoints, summary.json
    <root>/sweeps/<name>/results.json     every trial: values, status, metrics
    <root>/sweeps/<name>/best.yaml        the best trial's job spec, ready for `etrain run`

Run it: ``python -m trainers.sweep SPEC`` or ``etrain sweep SPEC [--resume]``.

- ``spec``: the sweep section, its search space and every check of it, before anything starts.
- ``trials``: one trial as Tune runs it (its values, its job), and the removal of a stopped
  trial's placement group.
- ``tune_run``: the Tune wiring and the driver: space, searcher, scheduler, state, ``run_sweep``.
- ``report``: the trials' rows, the best one, and the results table.
- ``cli``: ``etrain sweep`` and ``python -m trainers.sweep`` (``__main__`` only calls it).
"""
