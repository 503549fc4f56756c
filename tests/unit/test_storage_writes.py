"""What a write to S3 costs in requests (a real S3 wire protocol: moto server on loopback).

A checkpoint writes several small files (manifest, history part, cost record, TensorBoard
events); each request is billed by S3, counts against its per-prefix rate limit, and on this
machine takes CPU from training. A small file must be one PUT, with no folder markers.
"""

from __future__ import annotations

import boto3
import pytest

from cluster.storage import init_s3, open_root


def test_a_small_write_is_one_put_and_leaves_no_folder_markers(s3_server):
    init_s3("s3://etrain-writes")
    root = open_root("s3://etrain-writes/runs")
    root.write_json({"step": 3}, "job", "checkpoints", "checkpoint_000000003", "manifest.json")
    root.write_bytes(b"x" * 2_000_000, "job", "tensorboard", "events.out")

    s3 = boto3.client("s3")
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="etrain-writes")["Contents"])
    assert keys == ["runs/job/checkpoints/checkpoint_000000003/manifest.json", "runs/job/tensorboard/events.out"]
    for key in keys:  # a multipart upload's ETag ends in -<parts>: three requests instead of one
        assert "-" not in s3.head_object(Bucket="etrain-writes", Key=key)["ETag"].strip('"'), key
    # folders are still seen through their keys' prefixes
    assert root.list_dirs("job") == ["checkpoints", "tensorboard"]
    assert root.exists("job", "checkpoints") and root.read_json("job", "checkpoints", "checkpoint_000000003",
                                                              "manifest.json") == {"step": 3}


def test_a_write_to_a_missing_bucket_still_fails_when_it_is_made(s3_server):
    root = open_root("s3://etrain-no-such-bucket/runs")
    with pytest.raises(OSError, match="etrain-no-such-bucket|NoSuchBucket|bucket"):
        root.write_json({"step": 3}, "job", "summary.json")
