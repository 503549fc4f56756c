"""`etrain storage init` against a real S3 wire protocol (moto server on loopback)."""

from __future__ import annotations

import boto3
import pytest

from cluster.storage import StorageInitError, init_s3, open_root
from trainers.cli import main


def test_init_sets_encryption_versioning_lifecycle(s3_server, capsys):
    assert main(["storage", "init", "s3://etrain-init/runs"]) == 0
    s3 = boto3.client("s3")
    enc = s3.get_bucket_encryption(Bucket="etrain-init")["ServerSideEncryptionConfiguration"]["Rules"][0]
    assert enc["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    assert s3.get_bucket_versioning(Bucket="etrain-init")["Status"] == "Enabled"
    rule = s3.get_bucket_lifecycle_configuration(Bucket="etrain-init")["Rules"][0]
    assert rule["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] == 1
    assert "created bucket etrain-init" in capsys.readouterr().out
    # Twice is fine: it checks and re-applies.
    assert main(["storage", "init", "s3://etrain-init"]) == 0
    assert "bucket etrain-init exists" in capsys.readouterr().out


def test_init_with_kms_key(s3_server):
    init_s3("s3://etrain-kms", kms_key_id="alias/etrain")
    rule = boto3.client("s3").get_bucket_encryption(Bucket="etrain-kms")["ServerSideEncryptionConfiguration"]["Rules"][0]
    assert rule["ApplyServerSideEncryptionByDefault"] == {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": "alias/etrain"}


def test_missing_bucket_without_create_is_clear(s3_server, capsys):
    assert main(["storage", "init", "s3://etrain-absent", "--no-create"]) == 1
    err = capsys.readouterr().err
    assert "bucket etrain-absent does not exist" in err and "--no-create" in err


def test_wrong_region_is_named(s3_server):
    boto3.client("s3", region_name="eu-west-1").create_bucket(
        Bucket="etrain-eu", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    with pytest.raises(StorageInitError, match="region eu-west-1 .* set AWS_REGION=eu-west-1"):
        init_s3("s3://etrain-eu", client=boto3.client("s3", region_name="us-east-1"))


@pytest.mark.parametrize("uri,message", [("/tmp/local", "not an s3:// URI"), ("s3://ab", "at least 3 characters")])
def test_not_an_s3_uri(uri, message):
    with pytest.raises(StorageInitError, match=message):
        init_s3(uri)


def test_checkpoint_files_roundtrip_through_s3(s3_server):
    init_s3("s3://etrain-rt")
    root = open_root("s3://etrain-rt/prefix")
    root.write_json({"step": 3}, "job", "summary.json")
    assert root.read_json("job", "summary.json") == {"step": 3}
    assert root.uri_of("job") == "s3://etrain-rt/prefix/job"
