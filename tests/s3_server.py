"""A real S3 endpoint on 127.0.0.1 (moto's server), and a filesystem that counts what is read through it."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.ray_env import free_port


class S3Server:
    """A real S3 endpoint on 127.0.0.1: moto's server mode, an HTTP S3 API that pyarrow's S3 client (and
    so Ray Train's checkpoint upload) talks to as it talks to AWS. `env` is what a process needs to reach it
    (endpoint, any credentials, a region); `bucket` exists."""

    def __init__(self, bucket: str = "raylora-test"):
        import atexit
        import socket
        import subprocess
        import time

        port = free_port()
        moto = Path(sys.executable).parent / "moto_server"
        self.process = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.bucket = bucket
        self.env = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "raylora",
            "AWS_SECRET_ACCESS_KEY": "raylora",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        atexit.register(self.stop)  # a script that ends by an error leaves no server behind
        self.fs().create_dir(bucket)  # pyarrow creates a bucket for a top-level folder

    def fs(self):
        """pyarrow's S3 client, pointed at this server."""
        import pyarrow.fs

        return pyarrow.fs.S3FileSystem(
            endpoint_override=self.env["AWS_ENDPOINT_URL"],
            access_key=self.env["AWS_ACCESS_KEY_ID"],
            secret_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region=self.env["AWS_DEFAULT_REGION"],
            allow_bucket_creation=True,
        )

    def uri(self, *parts: str) -> str:
        return "s3://" + "/".join([self.bucket, *parts])

    def upload(self, local: str | Path, *parts: str) -> str:
        """Copy a local file to `s3://bucket/parts...`; returns its URI."""
        key = "/".join([self.bucket, *parts])
        with self.fs().open_output_stream(key) as f:
            f.write(Path(local).read_bytes())
        return "s3://" + key

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


class CountingFileSystem:
    """A pyarrow filesystem seen through a counter of what is written: every output stream opened and
    every byte written to one (on an object store, one upload each and the bytes uploaded)."""

    def __init__(self, fs):
        self.fs, self.streams, self.bytes = fs, 0, 0

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def open_output_stream(self, path, *args, **kwargs):
        self.streams += 1
        return _CountedStream(self, self.fs.open_output_stream(path, *args, **kwargs))


class _CountedStream:
    def __init__(self, owner: CountingFileSystem, stream):
        self.owner, self.stream = owner, stream

    def write(self, data) -> int:
        self.owner.bytes += len(data)
        return self.stream.write(data)

    def close(self) -> None:
        self.stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
