"""Pieces the command line's modules share: the job-override flag and how a job error ends the process."""
from __future__ import annotations

import sys

import click

SET = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                   help="Override a field of the job file, e.g. --set input.limit=20 (repeatable).")


def fail(exc) -> None:
    click.echo(f"batchrun: {exc}", err=True)
    sys.exit(exc.exit_code)
