"""The GPU tests write to local storage: their Ray starts without the S3 server (moto), which the
lent GPU machine does not have (bench/gpu.py carries only what a training run needs)."""

from __future__ import annotations

from pathlib import Path

import pytest

SUITE_CONFTEST = Path(__file__).resolve().parent.parent / "conftest.py"


@pytest.fixture(scope="module")
def ray_local(request):
    """The suite's shared local Ray (tests/conftest.py's), without the S3 server it waits for."""
    import ray

    if not ray.is_initialized():
        (suite,) = [p for p in request.config.pluginmanager.get_plugins() if getattr(p, "__file__", None)
                    and Path(p.__file__).resolve() == SUITE_CONFTEST]  # by file: pytest names it by its unresolved path
        suite.start_local_ray()
    yield ray
