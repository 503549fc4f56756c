"""The spot watcher against a local IMDSv2 server (the only fake: the cloud's endpoint)."""

from __future__ import annotations

import json
import os
import threading
from datetime import datetime, timedelta, timezone

import pytest

from cluster.rehearsal.imds import FakeIMDS
from cluster.spot import IMDS, Notice, OwnNodeError, decide, parse_instance_action, pick_own_node, watch

NOW = datetime(2026, 11, 30, 10, 0, 0, tzinfo=timezone.utc)


@pytest.fixture
def imds():
    fake = FakeIMDS()
    yield fake
    fake.close()


def action(seconds_from_now: int) -> str:
    when = (NOW + timedelta(seconds=seconds_from_now)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return json.dumps({"action": "terminate", "time": when})


@pytest.mark.parametrize("body,expected", [
    (action(120), 120), (action(-5), 0), ("not json", None), ('{"action": "stop"}', None),
])
def test_parse_instance_action(body, expected):
    notice = parse_instance_action(body, NOW)
    assert (notice.deadline_s if notice else None) == expected


@pytest.mark.parametrize("notice,policy,expected", [
    (None, "drain", None),
    (Notice("spot-interruption", 90, "x"), "ignore", 90),
    (Notice("rebalance", 0, "x"), "drain", 120),
    (Notice("rebalance", 0, "x"), "ignore", None),
])
def test_decide(notice, policy, expected):
    out = decide(notice, policy, 120)
    assert (out.deadline_s if out else None) == expected


def test_no_notice_means_no_drain(imds):
    drained = []
    assert watch(IMDS(imds.url), drained.append, interval_s=0.01, max_polls=3, clock=lambda: NOW) is None
    assert drained == [] and imds.token_requests == 1, "the token is reused across polls"


def test_interruption_notice_drains_with_its_deadline(imds):
    imds.documents["/latest/meta-data/spot/instance-action"] = action(110)
    drained = []
    notice = watch(IMDS(imds.url), lambda n: drained.append(n) or True, interval_s=0.01, max_polls=3,
                   clock=lambda: NOW)
    assert notice.kind == "spot-interruption" and notice.deadline_s == 110 and drained == [notice]


def test_rebalance_recommendation_drains_early(imds):
    imds.documents["/latest/meta-data/events/recommendations/rebalance"] = '{"noticeTime": "2026-11-30T10:00:00Z"}'
    notice = watch(IMDS(imds.url), lambda n: True, interval_s=0.01, max_polls=2, clock=lambda: NOW,
                   rebalance_deadline_s=300)
    assert notice.kind == "rebalance" and notice.deadline_s == 300


def test_failed_drain_is_retried(imds, said):
    imds.documents["/latest/meta-data/spot/instance-action"] = action(60)
    results = iter([False, True])
    notice = watch(IMDS(imds.url), lambda n: next(results), interval_s=0.01, max_polls=5, clock=lambda: NOW)
    assert notice is not None and any("drain failed" in m for m in said)


def test_unreachable_metadata_service_is_survived(said):
    assert watch(IMDS("http://127.0.0.1:9", timeout_s=0.2), lambda n: True, interval_s=0.01, max_polls=2) is None
    assert len(said) == 2 and "unreachable" in said[0]


def test_sigterm_drains_too(imds):
    threading.Timer(0.2, lambda: os.kill(os.getpid(), 15)).start()
    notice = watch(IMDS(imds.url), lambda n: True, interval_s=0.05, max_polls=100, sigterm_deadline_s=20)
    assert notice.kind == "sigterm" and notice.deadline_s == 20


def _node(node_id: str, ip: str, alive: bool = True) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": alive}


@pytest.mark.parametrize("nodes,ip,attached,expected", [
    ([_node("h", "10.77.0.11"), _node("w1", "10.77.0.12"), _node("w2", "10.77.0.13")], "10.77.0.13", None, "w2"),
    # a dead node that had this address before (a restarted raylet) is not this node
    ([_node("old", "10.77.0.12", alive=False), _node("new", "10.77.0.12")], "10.77.0.12", None, "new"),
    # several raylets on one address (a one-box test cluster): the one this process attached to
    ([_node("a", "127.0.0.1"), _node("b", "127.0.0.1")], "127.0.0.1", "b", "b"),
])
def test_pick_own_node(nodes, ip, attached, expected):
    assert pick_own_node(nodes, ip, attached) == expected


@pytest.mark.parametrize("nodes,ip,attached,message", [
    ([_node("h", "10.77.0.11")], "10.77.0.12", None,
     "no alive Ray node has this machine's address 10.77.0.12 (nodes at: 10.77.0.11)"),
    ([_node("a", "127.0.0.1"), _node("b", "127.0.0.1")], "127.0.0.1", None,
     "2 Ray nodes share this machine's address 127.0.0.1: pass --node-id"),
])
def test_own_node_errors_say_what_to_do(nodes, ip, attached, message):
    with pytest.raises(OwnNodeError) as info:
        pick_own_node(nodes, ip, attached)
    assert message in str(info.value)


def test_a_second_spot_watch_on_a_node_leaves_the_first_be(tmp_path):
    import fcntl
    import subprocess
    import sys

    lock = open(tmp_path / "etrain-spot-watch.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a first watcher holds the node
    proc = subprocess.run([sys.executable, "-m", "trainers.cli", "spot-watch", "--node-id", "ab" * 28],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0 and "another spot-watch runs on this node" in proc.stderr
