"""The batching rule (trainers.config.batching): what each worker does follows from the global batch."""

from __future__ import annotations

import pytest

from trainers.config.batching import batching_summary


@pytest.mark.parametrize("world,micro,accum,expected", [
    (2, None, None, (128, 128, 1)),
    (4, None, None, (64, 64, 1)),
    (3, None, None, (86, 86, 1)),
    (2, 32, None, (128, 32, 4)),
    (1, 32, None, (256, 32, 8)),
    (2, None, 4, (128, 32, 4)),
    (8, 64, None, (32, 32, 1)),
])
def test_batching_follows_from_global_batch(world, micro, accum, expected):
    assert batching_summary(256, world, micro, accum) == expected
