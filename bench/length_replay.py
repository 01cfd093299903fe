"""The ETA's output-length forecast (job/output_lengths.py) replayed on real lengths, without the engine's timing:
how far the output tokens it expects to be left are from the truth as a bucketed job runs.

    python bench/length_replay.py [--lengths OUT_DIR] [--rows 1000]

Natural lengths: each prompt of the sample job's input run greedy to 256 tokens (bf16; --lengths reuses the output
directory of such a run). The job: --rows rows cycled from the 240 prompts with max_tokens 16-256 by the pattern
bench/eta_accuracy.py --rows uses (the input's own max_tokens when --rows is 240), admitted in the feed's bucketed
order with its pilot, 32 rows at a time, one token a row per step. Every 5 % of the output tokens it prints the
forecast's error (forecast / truth - 1) in both orders.
"""
from __future__ import annotations

import argparse
import glob
import os
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.admission_order import window_order
from batchrun.job import Job, JobSpec
from batchrun.job.output_lengths import OutputLengths
from eta_accuracy import cycled_max_tokens   # bench/ is on the path when this script runs

JOB, RUNNING = "jobs/demo.yaml", 32


def natural_lengths(out_dir: str | None) -> dict[int, tuple[int, int | None]]:
    """row index -> (prompt tokens, natural output length; None where 256 tokens did not end it)."""
    if out_dir is None:
        scratch = tempfile.mkdtemp()
        spec = JobSpec.from_yaml(JOB)
        table = pq.read_table(spec.resolve(spec.input.path))
        table = table.set_column(table.schema.get_field_index("max_tokens"), "max_tokens",
                                 pa.array([256] * table.num_rows, pa.int32()))
        pq.write_table(table, os.path.join(scratch, "input.parquet"))
        out_dir = os.path.join(scratch, "run")
        Job.from_yaml(JOB, [f"input.path={scratch}/input.parquet", f"output.path={out_dir}",
                            "engine.dtype=bfloat16"]).run(progress="log")
    rows = pa.concat_tables([pq.read_table(f) for f in sorted(glob.glob(f"{out_dir}/data/*.parquet"))]).to_pylist()
    return {r["row_index"]: (r["prompt_tokens"], r["completion_tokens"] if r["finish_reason"] == "stop" else None)
            for r in rows}


def replay(rows: list[tuple[int, int, int]], longest_first: bool) -> list[float]:
    """rows: (prompt tokens, max_tokens, output tokens). The forecast's error every 5 % of the output tokens."""
    order = window_order([p for p, _, _ in rows], longest_first, 0.1)
    total = sum(o for _, _, o in rows)
    queue, running, finished, done, errors, mark = list(order), [], [], 0, [], 0.05
    while queue or running:
        while queue and len(running) < RUNNING:
            running.append([queue.pop(0), 0])
        for request in running:
            request[1] += 1
        done += len(running)
        still = []
        for j, generated in running:
            prompt, most, out = rows[j]
            if generated >= out:
                finished.append((prompt, generated, generated >= most))
            else:
                still.append([j, generated])
        running = still
        if done >= mark * total and mark < 0.9:
            mark += 0.05
            lengths = OutputLengths(finished)
            lengths.fit([(rows[j][0], g) for j, g in running])
            forecast = sum(lengths.expected(g, rows[j][1], rows[j][0]) - g for j, g in running)
            forecast += sum(lengths.expected(0, rows[j][1], rows[j][0]) for j in queue)
            errors.append(100 * (forecast / (total - done) - 1))
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", help="output directory of a max_tokens=256 run of the sample input")
    parser.add_argument("--rows", type=int, default=1000)
    args = parser.parse_args()
    natural = natural_lengths(args.lengths)
    own = pq.read_table(JobSpec.from_yaml(JOB).resolve(JobSpec.from_yaml(JOB).input.path)).column("max_tokens")
    rows = []
    for i in range(args.rows):
        prompt, length = natural[i % len(natural)]
        most = own[i].as_py() if args.rows == len(natural) else cycled_max_tokens(i)
        rows.append((prompt, most, most if length is None else min(length, most)))
    for longest_first in (False, True):
        errors = replay(rows, longest_first)
        print(f"{'longest' if longest_first else 'shortest'} first: worst from 25 % {max(map(abs, errors[4:])):.1f} %,"
              f" every 5 % from 5 %: " + " ".join(f"{e:+.0f}" for e in errors))


if __name__ == "__main__":
    main()
