"""What runs beside the loop (trainers/worker_services.py): Ray Train's resize request and its answer."""

from __future__ import annotations


def test_a_resize_request_waits_for_the_loops_answer_and_gives_up_at_its_timeout():
    import threading
    import time

    from trainers.worker_services import ResizeRequest

    request, answers = ResizeRequest(), []
    asker = threading.Thread(target=lambda: answers.append(request.ask(30.0)))
    asker.start()
    deadline = time.monotonic() + 5
    while not request.asked.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert request.asked.is_set() and asker.is_alive(), "asked, and waiting for the checkpoint"
    request.saved(120)
    asker.join(timeout=5)
    assert answers == [120] and not request.asked.is_set(), "answered; training that goes on is not asked again"
    started = time.monotonic()
    assert request.ask(0.2) is None and time.monotonic() - started < 5, "a later request waits for its own answer"
    assert request.asked.is_set()
