"""Which errors of Ray's Jobs API mean "not now" (send the same submission again) and which mean "no";
a failed step said on the record, in the log and on the counter, then backed off."""

from __future__ import annotations

import pytest

from service.ray_failures import submission_retryable


@pytest.mark.parametrize("exc,retryable", [
    (RuntimeError("Request failed with status code 500: No available agent to submit job, please try again later."),
     True),
    (RuntimeError("Request failed with status code 503: Service Unavailable"), True),
    (RuntimeError("Request failed with status code 502: Bad Gateway"), True),
    (ConnectionError("connection refused"), True),
    (RuntimeError("Request failed with status code 500: Traceback ... ValueError"), False),
    (RuntimeError("Request failed with status code 400: bad runtime_env"), False),
    (ValueError("not a Ray answer"), False),
])
def test_which_submission_errors_are_sent_again(exc, retryable):
    assert submission_retryable(exc) is retryable


def test_a_failed_step_is_on_the_record_in_the_log_and_on_the_counter_then_backs_off(tmp_path, caplog):
    import threading
    import time

    from service.ray_failures import Failures
    from service.store import Record, Store

    store = Store(str(tmp_path))
    store.save(Record(id="j-1", kind="job", tenant="a", name="n", spec={}, spec_uri="x", storage="y",
                      created_at=0.0, updated_at=0.0))
    failures, counted = Failures(store, threading.RLock(), base_s=5.0), []
    failures.on_error = counted.append
    with caplog.at_level("WARNING", logger="service.ray_failures"):
        failures.failed("j-1", "status", "Ray did not answer")
        failures.failed("j-1", "status", "Ray did not answer")
    assert "j-1: Ray did not answer (failure 2 in a row; next try in 10s)" in caplog.text
    assert store.get("j-1").error == "Ray did not answer (failure 2 in a row; next try in 10s)"
    assert counted == ["status", "status"] and failures.retry_at("j-1") > time.monotonic() + 9
    failures.recovered(store.get("j-1"))
    assert store.get("j-1").error is None and failures.retry_at("j-1") == 0
