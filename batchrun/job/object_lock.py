"""The job's lock on S3 (or an S3-compatible store): the object OUT/.lock, created with a conditional PUT
(If-None-Match: *), so of two submits exactly one creates it; the other exits 4.

The holder renews its lease every lease/3 seconds (a PUT with If-Match: the ETag it last wrote). A lock whose lease
has run out, by the store's own clock (the response's Date minus the object's Last-Modified, so host clocks do not
matter), is taken over with If-Match on its ETag: of two submits taking over at once, one wins. A lock held by a
process of this host that no longer exists is taken over at once, so a kill -9 and a resubmit need not wait out the
lease. A holder that finds its lock taken (its renewal refused) stops the job as a signal would.

The conditional PUT goes through botocore (pyarrow's S3 client cannot send If-None-Match); a store that ignores the
header is detected (a second conditional PUT of a probe object must be refused) and refused, as is any other
scheme: run those only with --force, and only one submit at a time.
"""
from __future__ import annotations

import email.utils
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable

from batchrun.job.errors import EXIT_LOCKED, JobError
from batchrun.job.storage import Storage, scheme

log = logging.getLogger("batchrun.job")
LOCK = ".lock"


class NoConditionalPut(Exception):
    """The output's store cannot take batchrun's lock; the message says why."""


def _client(out: Storage):
    try:
        import botocore.config
        import botocore.session
    except ImportError:
        raise NoConditionalPut("the lock on s3:// needs botocore (pip install 'batchrun[s3]')") from None
    session = botocore.session.get_session()
    options = out.options
    endpoint = options.get("endpoint_override")
    if endpoint and "://" not in endpoint:
        endpoint = f"{options.get('scheme', 'https')}://{endpoint}"
    style = "virtual" if options.get("force_virtual_addressing") else "auto"
    client = session.create_client("s3", region_name=options.get("region"), endpoint_url=endpoint,
                                   config=botocore.config.Config(s3={"addressing_style": style},
                                                                 retries={"max_attempts": 3}))
    if "IfNoneMatch" not in client.meta.service_model.operation_model("PutObject").input_shape.members:
        raise NoConditionalPut("this botocore cannot send If-None-Match; upgrade it (pip install -U botocore)")
    return client


def _start_ticks(pid: int) -> str | None:
    """The process's start time (so a reused pid is not taken for the holder), or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
            return ""
        except ProcessLookupError:
            return None


class Held:
    """The lock object as read: its record, ETag and age by the store's clock."""

    def __init__(self, response: dict):
        self.record = json.loads(response["Body"].read() or b"{}")
        self.etag = response["ETag"]
        now = email.utils.parsedate_to_datetime(response["ResponseMetadata"]["HTTPHeaders"]["date"])
        self.age_s = (now - response["LastModified"]).total_seconds()

    @property
    def expired(self) -> bool:
        return self.age_s > float(self.record.get("lease_s", 0))

    @property
    def dead_here(self) -> bool:
        """Held by a process of this host that has gone."""
        r = self.record
        return (r.get("host") == socket.gethostname() and isinstance(r.get("pid"), int)
                and _start_ticks(r["pid"]) != r.get("pid_start"))

    def describe(self) -> str:
        r = self.record
        return (f"pid {r.get('pid')} on {r.get('host')}, lease renewed {self.age_s:.0f} s ago, "
                f"{max(0.0, float(r.get('lease_s', 0)) - self.age_s):.0f} s left")


class ObjectLock:
    def __init__(self, out: Storage, lease_s: float, on_lost: Callable[[str], None] | None = None):
        if scheme(out.root) != "s3":
            raise NoConditionalPut(f"batchrun takes its lock by conditional PUT on s3:// only, not "
                                   f"{scheme(out.root)}://")
        self.out, self.lease_s, self.on_lost = out, lease_s, on_lost
        self.client = _client(out)
        self.bucket, _, self.key = out.fs_path(LOCK).partition("/")
        self.uri = out.join(LOCK)
        self.etag: str | None = None
        self.took_over: str | None = None   # what the lock was taken from, for the job's log
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def _record(self) -> bytes:
        pid = os.getpid()
        return json.dumps({"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": pid,
                           "pid_start": _start_ticks(pid), "lease_s": self.lease_s}).encode()

    def _put(self, key: str | None = None, **condition) -> str:
        return self.client.put_object(Bucket=self.bucket, Key=key or self.key, Body=self._record(),
                                      **condition)["ETag"]

    def _refused(self, exc) -> bool:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
        return code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")

    def _read(self) -> Held | None:
        try:
            return Held(self.client.get_object(Bucket=self.bucket, Key=self.key))
        except self.client.exceptions.NoSuchKey:
            return None

    def check_conditional_put(self) -> None:
        """A store that ignores If-None-Match would let two submits both 'create' the lock: refuse it."""
        probe = f"{self.key}-probe-{uuid.uuid4().hex[:8]}"
        self._put(probe, IfNoneMatch="*")
        try:
            self._put(probe, IfNoneMatch="*")
        except Exception as exc:   # noqa: BLE001  (botocore's ClientError)
            if not self._refused(exc):
                raise
        else:
            raise NoConditionalPut(f"the store ignores If-None-Match (a second conditional PUT of {probe} was "
                                   f"accepted), so it cannot hold batchrun's lock")
        finally:
            self.client.delete_object(Bucket=self.bucket, Key=probe)

    def acquire(self) -> None:
        for _ in range(5):
            try:
                self.etag = self._put(IfNoneMatch="*")
                return
            except Exception as exc:   # noqa: BLE001
                if not self._refused(exc):
                    raise
            held = self._read()
            if held is None:
                continue   # released between the two requests: try to create it again
            if not (held.expired or held.dead_here):
                raise JobError(f"{self.uri}: the job is already running ({held.describe()}); this submit exits",
                               EXIT_LOCKED)
            try:
                self.etag = self._put(IfMatch=held.etag)
                self.took_over = (f"{self.uri}: took over the lock of {held.describe()} "
                                  f"({'its process is gone' if held.dead_here else 'its lease ran out'})")
                return
            except Exception as exc:   # noqa: BLE001
                if not self._refused(exc):
                    raise
        raise JobError(f"{self.uri}: another submit keeps taking the lock; this submit exits", EXIT_LOCKED)

    def _renew(self) -> None:
        renewed = time.monotonic()
        while not self.stop.wait(self.lease_s / 3):
            try:
                self.etag = self._put(IfMatch=self.etag)
                renewed = time.monotonic()
            except Exception as exc:   # noqa: BLE001
                if self._refused(exc):
                    return self._lose("another submit took over the lock")
                if time.monotonic() - renewed > self.lease_s:
                    return self._lose(f"the lease could not be renewed for {self.lease_s:g} s ({exc})")
                log.warning("%s: renewing the lease failed (%s); retrying", self.uri, exc)

    def _lose(self, why: str) -> None:
        self.etag = None
        log.error("%s: %s; stopping", self.uri, why)
        if self.on_lost is not None:
            self.on_lost(f"a lost lock on {self.uri} ({why})")

    def __enter__(self) -> "ObjectLock":
        self.acquire()
        self.thread = threading.Thread(target=self._renew, name="batchrun-lock-lease", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        if self.etag is not None:
            held = self._read()
            if held is not None and held.etag == self.etag:
                self.client.delete_object(Bucket=self.bucket, Key=self.key)

    @staticmethod
    def held(out: Storage) -> bool:
        """Whether a submit holds the job's lock now: the object exists and its lease has not run out, by this
        host's clock (for `status`: read through pyarrow, so it needs no botocore client)."""
        import pyarrow.fs as pafs
        info = out.fs.get_file_info(out.fs_path(LOCK))
        if info.type == pafs.FileType.NotFound:
            return False
        try:
            record = json.loads(out.read_bytes(LOCK) or b"{}")
        except (FileNotFoundError, ValueError):   # released (or being written) meanwhile
            return False
        return time.time() - info.mtime.timestamp() <= float(record.get("lease_s", 0))
