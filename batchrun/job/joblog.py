"""job.log in the output directory: appended to as a file on a local path; on an object store (no append) kept in
memory and written whole, as one object, after each record (records come every output.log_every_s, so that is a
PUT every half minute or so). A resumed run starts from the log the last run left."""
from __future__ import annotations

import io
import logging
import sys

from batchrun.job.storage import Storage

NAME = "job.log"


class ObjectLogHandler(logging.StreamHandler):
    def __init__(self, out: Storage):
        super().__init__(io.StringIO())
        self.out = out
        self.stream.write(out.read_text(NAME) or "")

    def flush(self) -> None:
        try:
            self.out.write(NAME, self.stream.getvalue())
        except OSError as exc:   # the log is not the checkpoint: say so on stderr and go on
            print(f"batchrun: cannot write {self.out.join(NAME)} ({exc})", file=sys.stderr)


def handler(out: Storage) -> logging.Handler:
    return logging.FileHandler(out.join(NAME)) if out.local else ObjectLogHandler(out)
