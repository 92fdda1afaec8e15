"""Environment for a bench's moto S3 server on 127.0.0.1: dummy credentials and region, and
no EC2 metadata lookups (botocore would otherwise wait on a metadata endpoint for real
ones). Never real credentials: these benches talk to 127.0.0.1 only."""

MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
