"""Where a job's files are: a local path, or a URI (s3://, gs://, hdfs://, or any scheme fsspec knows: hf://,
abfs://, ...) opened through pyarrow.fs, fsspec as the fallback. One small interface, so the job reads and writes
both the same way.

Local paths keep their own code (atomic_write: temporary name, fsync, rename). An object store has no rename: an
object is written by one PUT (or a completed multipart upload) under its final name, so a reader sees all of it or
nothing. Credentials and endpoints come the standard way (for S3: the AWS_* environment variables including
AWS_ENDPOINT_URL, profiles, instance metadata); the job file's storage.options gives what the environment cannot
(a region, virtual addressing, an fsspec option) and may not carry a secret. Nothing here writes an option or an
environment value anywhere.
"""
from __future__ import annotations

import fnmatch
import functools
import glob
import json
import os
import re
import uuid
from typing import IO, Callable, Iterator

import pyarrow.fs as pafs

from batchrun.job.atomic import atomic_write

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# keys that hold a secret in pyarrow's or fsspec's filesystems: credentials come from the environment only
SECRET_OPTIONS = ("access_key", "secret_key", "session_token", "key", "secret", "token", "password",
                  "account_key", "sas_token", "credential", "credentials", "client_secret")
# what decides which credentials pyarrow and fsspec pick up (a filesystem is cached per value of these; the cache
# key lives in this process's memory only)
_ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION",
             "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "GOOGLE_APPLICATION_CREDENTIALS")


class StorageError(Exception):
    """A path or URI that cannot be used; the message names it."""


def is_uri(path: str) -> bool:
    """A URI with a scheme other than file:// (file:///x is the local path /x)."""
    match = _SCHEME.match(path)
    return bool(match) and match.group(1).lower() != "file"


def local(path: str) -> str:
    return path[len("file://"):] if path.lower().startswith("file://") else path


def scheme(uri: str) -> str:
    return _SCHEME.match(uri).group(1).lower()


def check_uri(uri: str) -> None:
    """Refuse credentials written into a URI (s3://KEY:SECRET@bucket): they would land in job.json and logs."""
    authority = uri[len(scheme(uri)) + 3:].split("/", 1)[0]
    if "@" in authority:
        raise StorageError(f"{scheme(uri)}://***@{authority.rsplit('@', 1)[1]}/...: credentials in a URI are not "
                           f"accepted; give them through the environment (e.g. AWS_ACCESS_KEY_ID and "
                           f"AWS_SECRET_ACCESS_KEY)")


def check_options(options: dict) -> None:
    secret = [k for k in options if k.lower() in SECRET_OPTIONS]
    if secret:
        raise StorageError(f"storage.options.{secret[0]}: credentials are not accepted in the job file; give them "
                           f"through the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ...)")


def filesystem(uri: str, options: dict | None = None) -> tuple[pafs.FileSystem, str, str]:
    """(filesystem, the path in it, the URI prefix that turns such a path back into a URI)."""
    check_uri(uri)
    name = scheme(uri)
    authority = "" if name in ("s3", "gs", "gcs") else uri.split("/", 3)[2]   # a bucket needs no filesystem of its own
    try:
        fs, strip = _cached(name, authority, json.dumps(options or {}, sort_keys=True),
                            tuple(os.environ.get(k) for k in _ENV_KEYS))
    except StorageError as exc:
        raise StorageError(f"{uri}: {exc}") from None
    path = strip(uri)
    return fs, path, uri[:len(uri) - len(path)] if uri.endswith(path) else f"{name}://"


@functools.lru_cache(maxsize=16)
def _cached(name: str, authority: str, options: str, env: tuple) -> tuple:
    """One filesystem per scheme and host (any bucket), options and credential environment."""
    return _open(f"{name}://{authority}/", name, json.loads(options))


def _open(uri: str, name: str, options: dict) -> tuple[pafs.FileSystem, Callable[[str], str]]:
    try:
        return _construct(uri, name, options)
    except (TypeError, ValueError) as exc:   # an option the filesystem does not take, or a bad value
        raise StorageError(f"storage.options: {exc}") from None


def _construct(uri: str, name: str, options: dict) -> tuple[pafs.FileSystem, Callable[[str], str]]:
    after_scheme = lambda u: u[len(name) + 3:].rstrip("/")   # noqa: E731
    if name == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and "endpoint_override" not in options:   # pyarrow's constructor does not read it itself
            options["endpoint_override"] = endpoint
        return pafs.S3FileSystem(**options), after_scheme
    if name in ("gs", "gcs"):
        return pafs.GcsFileSystem(**options), after_scheme
    if not options:
        try:
            fs, _ = pafs.FileSystem.from_uri(uri)
            return fs, lambda u: pafs.FileSystem.from_uri(u)[1]
        except (ValueError, NotImplementedError, OSError):   # pyarrow does not know the scheme or cannot open it
            pass
    try:
        import fsspec
        cls = fsspec.get_filesystem_class(name)
    except ImportError as exc:
        raise StorageError(f"the {name}:// filesystem needs a package that is not installed ({exc})") from None
    except ValueError:
        raise StorageError(f"unknown scheme {name}:// (neither pyarrow nor fsspec opens it)") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(cls(**options))), lambda u: cls._strip_protocol(u).rstrip("/")


def _error(path: str, exc: Exception) -> StorageError:
    return StorageError(f"{path}: {exc}")


def open_input(path: str, options: dict | None = None):
    """What pq.ParquetFile and the JSONL reader open: a local path as it is, or a random-access file of a URI."""
    if not is_uri(path):
        return local(path)
    fs, p, _ = filesystem(path, options)
    try:
        return fs.open_input_file(p)
    except OSError as exc:
        raise _error(path, exc) from None


def iter_lines(path: str, options: dict | None = None) -> Iterator[bytes]:
    """The file's lines (with their newline), streamed: a local file as open() gives them, a URI's in 1 MiB reads."""
    if not is_uri(path):
        with open(local(path), "rb") as f:
            yield from f
        return
    fs, p, _ = filesystem(path, options)
    with fs.open_input_stream(p) as f:
        rest = b""
        while chunk := f.read(1 << 20):
            *lines, rest = (rest + chunk).split(b"\n")
            yield from (line + b"\n" for line in lines)
        if rest:
            yield rest


def readable(path: str, options: dict | None = None) -> bool:
    """A file this process can read (a URI: one that exists)."""
    if not is_uri(path):
        return os.access(local(path), os.R_OK) and not os.path.isdir(local(path))
    fs, p, _ = filesystem(path, options)
    return fs.get_file_info(p).type == pafs.FileType.File


def read_bytes(path: str, options: dict | None = None) -> bytes:
    """The whole file (FileNotFoundError when it does not exist)."""
    if not is_uri(path):
        with open(local(path), "rb") as f:
            return f.read()
    fs, p, _ = filesystem(path, options)
    if fs.get_file_info(p).type == pafs.FileType.NotFound:
        raise FileNotFoundError(2, "No such file or directory", path)
    with fs.open_input_stream(p) as f:
        return f.read()


def fingerprint(path: str, options: dict | None = None) -> tuple[str, int, int]:
    """(absolute path or URI, size, modification time in ns): what the job's identity records of an input file."""
    if not is_uri(path):
        return os.path.abspath(path), os.path.getsize(path), os.stat(path).st_mtime_ns
    fs, p, _ = filesystem(path, options)
    info = fs.get_file_info(p)
    return path, info.size, info.mtime_ns or 0


def find_files(path: str, ext: str, options: dict | None = None) -> list[str]:
    """The input files at path: a file, a directory or prefix (its *ext files, sorted, at any depth) or a glob."""
    if not is_uri(path):
        if os.path.isdir(path):
            return sorted(glob.glob(os.path.join(path, "**", f"*{ext}"), recursive=True))
        if glob.has_magic(path):
            return sorted(glob.glob(path, recursive=True))
        return [path] if os.path.exists(path) else []
    fs, p, prefix = filesystem(path, options)
    try:
        if glob.has_magic(p):
            base = p[:re.search(r"[*?\[]", p).start()].rsplit("/", 1)[0]
            return sorted(prefix + i.path for i in _walk(fs, base) if fnmatch.fnmatchcase(i.path, p))
        info = fs.get_file_info(p)
        if info.type == pafs.FileType.File:
            return [path]
        if info.type == pafs.FileType.Directory:
            return sorted(prefix + i.path for i in _walk(fs, p) if i.path.endswith(ext))
        return []
    except OSError as exc:
        raise _error(path, exc) from None


def _walk(fs: pafs.FileSystem, base: str) -> list[pafs.FileInfo]:
    return [i for i in fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
            if i.type == pafs.FileType.File]


class Storage:
    """The files under one directory or prefix (a job's output directory), local or behind a URI."""

    def __init__(self, root: str, options: dict | None = None):
        self.root = root if is_uri(root) else local(root)
        self.options = dict(options or {})
        self.local = not is_uri(root)
        self._fs: pafs.FileSystem | None = None

    def __getstate__(self) -> dict:   # a Ray replica rebuilds the filesystem from the environment it finds
        return {"root": self.root, "options": self.options}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"], state["options"])

    def __str__(self) -> str:
        return self.root

    @property
    def fs(self) -> pafs.FileSystem:
        if self._fs is None:
            self._fs, self._base, _ = filesystem(self.root, self.options)
        return self._fs

    def join(self, *names: str) -> str:
        return os.path.join(self.root, *names) if self.local else "/".join([self.root.rstrip("/"), *names])

    def fs_path(self, name: str) -> str:
        """The file's path inside the filesystem (what pyarrow.dataset takes with filesystem=)."""
        self.fs   # noqa: B018  (opening the filesystem sets _base)
        return "/".join([self._base, name]) if name else self._base

    def read_bytes(self, name: str) -> bytes:
        """FileNotFoundError when missing."""
        return read_bytes(self.join(name), self.options)

    def read_text(self, name: str) -> str | None:
        """The file's text, or None when it does not exist."""
        if self.local:
            try:
                with open(self.join(name)) as f:
                    return f.read()
            except FileNotFoundError:
                return None
        try:
            return self.read_bytes(name).decode()
        except FileNotFoundError:
            return None

    def write(self, name: str, data: str | bytes | Callable[[IO[bytes]], None]) -> None:
        """Whole or not at all: atomic_write here, one PUT (or a completed multipart upload) on an object store."""
        if self.local:
            atomic_write(self.join(name), data)
            return
        path = self.fs_path(name)
        if not isinstance(self.fs, (pafs.S3FileSystem, pafs.GcsFileSystem)):
            self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with self.fs.open_output_stream(path) as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)

    def exists(self, name: str) -> bool:
        if self.local:
            return os.path.exists(self.join(name))
        return self.fs.get_file_info(self.fs_path(name)).type != pafs.FileType.NotFound

    def remove(self, name: str) -> None:
        """A file, missing or not."""
        if self.local:
            if os.path.exists(self.join(name)):
                os.remove(self.join(name))
            return
        try:
            self.fs.delete_file(self.fs_path(name))
        except FileNotFoundError:
            pass

    def remove_all(self, prefix: str) -> None:
        """Every file under prefix (objects one by one: a bucket has no directories to remove)."""
        for info in self.list(prefix):
            self.fs.delete_file(info.path)

    def list(self, prefix: str = "") -> list[pafs.FileInfo]:
        """Every file under prefix, at any depth, in one listing (paths as the filesystem gives them)."""
        return _walk(self.fs, self.fs_path(prefix))

    def name_of(self, info: pafs.FileInfo) -> str:
        """A listed file's name relative to the root."""
        return info.path[len(self._base) + 1:]

    def open_input(self, name: str):
        return self.fs.open_input_file(self.fs_path(name))

    def check_writable(self) -> None:
        """Before any work: credentials, the bucket, and a probe written and deleted, each failure naming the
        path. (A local directory is created and probed by prepare.output_dir.)"""
        name = scheme(self.root)
        if name == "s3" and not self.options.get("anonymous") and _no_s3_credentials():
            raise StorageError(f"{self.root}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                               f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and AWS_ENDPOINT_URL for an S3-compatible "
                               f"store")
        try:
            if name in ("s3", "gs", "gcs"):
                bucket = self.fs_path("").split("/", 1)[0]
                if self.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                    raise StorageError(f"{self.root}: the bucket {bucket!r} does not exist (or these credentials "
                                       f"cannot see it); create it or fix output.path")
            probe = f".write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.write(probe, b"ok")
            self.remove(probe)
        except OSError as exc:
            raise StorageError(f"cannot write to {self.root} ({exc})") from None


def _no_s3_credentials() -> bool:
    """True when the AWS credential chain (environment, profiles, container and instance metadata) finds none.
    Without botocore the chain cannot be asked here: pyarrow's own request then fails, naming the path."""
    try:
        import botocore.session
    except ImportError:
        return False
    return botocore.session.get_session().get_credentials() is None


def as_storage(out) -> Storage:
    """A Storage for an output directory given as one or as a path or URI (default options)."""
    return out if isinstance(out, Storage) else Storage(str(out))
