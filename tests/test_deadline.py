"""Deadlines: the grammar a job file's `deadline` is read with, its errors, and the verdict a running job's estimate
gives against it (on track, at risk, late, read from the estimate's band)."""
from datetime import datetime, timedelta

import pytest
import yaml

from batchrun.deadline import parse_deadline
from batchrun.job import JobError, JobSpec
from batchrun.job.eta import Eta
from batchrun.job.eta_text import deadline_verdict


def test_deadline_verdict_reads_the_band():
    deadline = datetime.now() + timedelta(hours=2)

    def eta(finish_in_min: float, low_min: float, high_min: float) -> Eta:
        finish = (deadline + timedelta(minutes=finish_in_min)).timestamp()
        left = finish - datetime.now().timestamp()
        return Eta(left, finish, 0, left + low_min * 60, left + high_min * 60)
    verdict, line = deadline_verdict(eta(-30, -10, 20), deadline, "job.yaml")
    assert verdict == "on track" and line.startswith("on track: predicted")
    verdict, line = deadline_verdict(eta(-30, -10, 40), deadline, "job.yaml")   # its p90 is 10 min past
    assert verdict == "at risk" and line.startswith("at risk: predicted") and "batchrun plan job.yaml" in line
    verdict, line = deadline_verdict(eta(40, -20, 30), deadline, "job.yaml")
    assert verdict == "late" and line.startswith("late by ~40 min") and "batchrun plan job.yaml --deadline" in line
    assert deadline_verdict(Eta(60.0, (deadline - timedelta(minutes=5)).timestamp(), 0), deadline, "j")[0] == \
        "on track"   # no band: the point decides


def test_deadline_values():
    now = datetime(2030, 1, 31, 22, 0)
    assert parse_deadline("07:00", now) == datetime(2030, 2, 1, 7, 0)      # the next 07:00
    assert parse_deadline("23:30", now) == datetime(2030, 1, 31, 23, 30)
    assert parse_deadline("2030-02-02T06:00", now) == datetime(2030, 2, 2, 6, 0)
    raw = {"input": {"path": "in.parquet"}, "output": {"path": "out"}}
    unquoted = yaml.safe_load("deadline: 2030-02-02T06:00:00")["deadline"]   # YAML's own timestamp
    assert JobSpec({**raw, "deadline": unquoted}).deadline_at == datetime(2030, 2, 2, 6, 0)


@pytest.mark.parametrize("value, message", [("tomorrow", "cannot read 'tomorrow' as a deadline"),
                                            (420, 'write the time in quotes, e.g. deadline: "07:00"'),
                                            ([7], "deadline")])
def test_a_bad_deadline_is_an_error_naming_the_field(value, message):
    raw = {"input": {"path": "in.parquet"}, "output": {"path": "out"}, "deadline": value}
    with pytest.raises(JobError, match="deadline") as info:
        JobSpec(raw)
    assert message in str(info.value)
