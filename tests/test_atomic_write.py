"""atomic_write: the one writer of files a resumed run relies on (shards, job.json, summary, ETA state, the KV gate's
decision, OpenAI batch output)."""
import os
import subprocess

import pytest

from batchrun.job.atomic import atomic_write


def test_whole_new_file_or_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    atomic_write(str(path), "old")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    atomic_write(str(path), b"new")
    assert path.read_text() == "new" and len(synced) == 2   # the file, then its directory

    def half_then_fail(f):
        f.write(b"half")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        atomic_write(str(path), half_then_fail)
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["state.json"]


def test_every_resume_state_writer_goes_through_it():
    """No other module of the job package renames a temporary file into place (directory swaps aside)."""
    root = os.path.join(os.path.dirname(__file__), "..", "batchrun", "job")
    found = subprocess.run(["grep", "-rn", "--include=*.py", "os.replace(", root], capture_output=True,
                           text=True).stdout.splitlines()
    allowed = ("atomic.py", "sink.py")   # sink: the swap of the shard directory when the output is merged
    assert [line for line in found if not line.split(":")[0].endswith(allowed)] == [], found
