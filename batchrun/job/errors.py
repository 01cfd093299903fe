"""Exit codes of `batchrun submit` and the error that carries one."""
from __future__ import annotations

EXIT_OK = 0            # every row done, status "ok"
EXIT_ERROR = 1         # an unexpected failure (a traceback follows)
EXIT_INVALID = 2       # invalid spec or input, unwritable output, changed spec: nothing ran
EXIT_FAILED_ROWS = 3   # done, but some rows have status "error"
EXIT_LOCKED = 4        # another submit of the same job holds the lock
EXIT_INTERRUPTED = 5   # stopped by SIGTERM/SIGINT; finished rows are saved, submit again to resume
EXIT_GATE_FAILED = 6   # the KV quality gate failed and the spec says stop: nothing ran

EXIT_CODES = {EXIT_OK: "done", EXIT_FAILED_ROWS: "done with failed rows",
              EXIT_INVALID: "invalid spec or input (nothing ran)", EXIT_LOCKED: "locked by another submit",
              EXIT_INTERRUPTED: "interrupted (submit again to resume)",
              EXIT_GATE_FAILED: "KV quality gate failed with on_fail: stop (nothing ran)",
              EXIT_ERROR: "unexpected error"}


class JobError(Exception):
    """A failure the user can fix; the message names the field, file, column or line."""

    def __init__(self, message: str, exit_code: int = EXIT_INVALID):
        super().__init__(message)
        self.exit_code = exit_code
