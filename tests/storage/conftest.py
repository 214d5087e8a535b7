"""Storage tests use `moto_s3_endpoint` and `s3_bucket_url` from tests/conftest.py."""
