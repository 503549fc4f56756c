"""Where `code` tenants may run: the decision, table-driven, and the jobs cluster's token file."""

from __future__ import annotations

import pytest

from service.isolation import code_tenants_problem, same_address
from service.settings import ServiceSettings, jobs_headers

URL = "http://10.0.0.5:8265"


@pytest.mark.parametrize("tenants,own,nodes,expected", [
    ([], "n1", ["n1"], None),  # no code tenant: any cluster will do
    (["crew"], "n1", ["n2", "n3"], None),  # a jobs cluster apart
    (["crew"], "n1", ["n2", "n1"], "is the service's own Ray"),
    (["crew", "crew", "b"], "n1", ["n1"], "tenant(s) b, crew have role 'code'"),
    (["crew"], "n1", None, "did not list its nodes"),
])
def test_code_tenants_need_a_jobs_cluster_apart(tenants, own, nodes, expected):
    problem = code_tenants_problem(tenants, own, nodes, URL)
    if expected is None:
        assert problem is None
    else:
        assert expected in problem and URL in problem
        assert "jobs_token_file" in problem and "role 'user'" in problem  # the fix is named


def test_the_jobs_token_file_gives_the_header_and_its_errors_name_the_field(tmp_path):
    base = {"storage_root": str(tmp_path / "root"), "state_dir": str(tmp_path / "state"), "ray_dashboard_url": URL}
    assert jobs_headers(ServiceSettings(**base)) == {}
    token = tmp_path / "jobs_token"
    token.write_text("abc123\n")
    assert jobs_headers(ServiceSettings(**base, jobs_token_file=str(token))) == {"Authorization": "Bearer abc123"}
    with pytest.raises(ValueError, match=r"jobs_token_file .*missing.*cannot read it.*ray get-auth-token"):
        jobs_headers(ServiceSettings(**base, jobs_token_file=str(tmp_path / "missing")))
    token.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        jobs_headers(ServiceSettings(**base, jobs_token_file=str(token)))


@pytest.mark.parametrize("a,b,same", [
    ("http://127.0.0.1:8265", "127.0.0.1:8265/", True),
    ("http://localhost:8265", "http://127.0.0.1:8265", True),
    ("http://127.0.0.1:8265", "http://127.0.0.1:8266", False),
    ("http://10.0.0.5:8265", "http://10.0.0.6:8265", False),
])
def test_dashboard_addresses_compare_by_host_and_port(a, b, same):
    assert same_address(a, b) is same
