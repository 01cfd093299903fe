"""`batchrun plan`: the capacity plan for a job (GPU types, KV and weight formats, deadline, cost), or a calibration
pilot on this machine."""
from __future__ import annotations

import json
import sys

import click

from batchrun.cli_options import SET, fail
from batchrun.cli_types import NON_NEGATIVE, POSITIVE, POSITIVE_INT, SHARE
from batchrun.stepmodel.costmodel import PLANNED_FORMATS


@click.command(help="Plan GPUs for JOB: per GPU type x KV dtype, KV capacity, predicted makespan (the real scheduler "
                    "over a cost model), GPUs to meet --deadline, GPU-hours and cost; or --calibrate on this machine.")
@click.argument("job", type=click.Path(dir_okay=False))
@SET
@click.option("--gpu", "gpus", multiple=True, help="GPU type from the catalog (repeatable; default: all), e.g. H100.")
@click.option("--kv-dtype", "kv_dtypes", multiple=True, help="KV dtype to compare (repeatable; default: float16, "
              "int8, fp8).")
@click.option("--weights", "weight_formats", multiple=True, type=click.Choice(PLANNED_FORMATS),
              help="Weight format to compare (repeatable; default: the job's engine.quantization, else the "
              "checkpoint's own). A 16-bit checkpoint's weights are quantized at load; +head: its LM head too "
              "(engine.quantization_lm_head).")
@click.option("--deadline", help="Finish within this time: 6h, 90m, 1h30m, 2d, a clock time 07:00 or a date-time "
              "2030-01-31T06:00 (default: the job file's deadline:).")
@click.option("--price", "prices", multiple=True, metavar="GPU=USD", help="$/GPU-hour override (repeatable).")
@click.option("--catalog", type=click.Path(dir_okay=False), help="YAML file adding or overriding GPU entries.")
@click.option("--model-config", help="Size for this model (directory, hub id or config.json) instead of the "
              "job's model; prompts are still measured with the job's tokenizer.")
@click.option("--utilization", type=SHARE, default=0.9, show_default=True, help="Share of GPU memory used.")
@click.option("--max-num-seqs", type=POSITIVE_INT, help="Seats per GPU (default: the job's engine.max_num_seqs).")
@click.option("--calibrate", is_flag=True, help="Run a pilot of the job here, fit the step-time model and predict "
              "the whole job on this machine.")
@click.option("--pilot-fraction", type=SHARE, default=0.2, show_default=True, help="Share of rows in the pilot.")
@click.option("--interactive-rate", type=POSITIVE, help="Interactive requests/s served next to the job: adds the "
              "mixed-SLA comparison (one shared pool with lanes vs a latency pool + a throughput pool); needs "
              "--deadline.")
@click.option("--interactive-prompt-tokens", type=POSITIVE_INT, default=512, show_default=True)
@click.option("--interactive-output-tokens", type=POSITIVE_INT, default=128, show_default=True)
@click.option("--ttft-p95", default="1s", show_default=True, help="Interactive p95 time-to-first-token target.")
@click.option("--tpot-p95", default="100ms", show_default=True, help="Interactive p95 time-per-output-token target.")
@click.option("--headroom", type=NON_NEGATIVE, default=0.2, show_default=True, help="The latency pool is sized for the "
              "interactive rate x (1 + headroom).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Draw throughput vs concurrency per KV "
              "dtype (memory limits marked) and the job's predicted progress to this PNG (needs matplotlib: "
              "pip install 'batchrun[plot]').")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(job, overrides, gpus, kv_dtypes, weight_formats, deadline, prices, catalog, model_config, utilization,
         max_num_seqs, calibrate, pilot_fraction, interactive_rate, interactive_prompt_tokens,
         interactive_output_tokens, ttft_p95, tpot_p95, headroom, plot_path, as_json) -> None:
    from batchrun.job import JobError
    from batchrun.job.spec import JobSpec
    from batchrun.planner import api as planner_api, mixed
    from batchrun.stepmodel import catalog as cat
    from batchrun.planner.plan import format_table
    try:
        traffic = None if interactive_rate is None else mixed.Traffic(
            interactive_rate, interactive_prompt_tokens, interactive_output_tokens,
            mixed.parse_latency(ttft_p95, "--ttft-p95"), mixed.parse_latency(tpot_p95, "--tpot-p95"), headroom)
        if plot_path and calibrate:
            raise ValueError("--plot: draws a plan; it does not apply to --calibrate")
        if plot_path:
            from batchrun.planner.plot import require_matplotlib
            require_matplotlib()
        spec = JobSpec.from_yaml(job, list(overrides))
        chosen = cat.select(cat.load_catalog(catalog), list(gpus), cat.parse_prices(prices))
        the_planner = planner_api.make_planner(spec, None if calibrate else deadline, model_config, utilization,
                                               max_num_seqs)
        if traffic and the_planner.deadline is None:
            raise ValueError("--deadline: mixed-SLA planning (--interactive-rate) needs the batch job's deadline "
                             "(--deadline, or deadline: in the job file)")
        if calibrate:
            from batchrun.planner.calibrate import calibrate as run_calibration
            report = run_calibration(spec, the_planner.work, pilot_fraction)
        else:
            report = planner_api.run_plan(the_planner, chosen, kv_dtypes, traffic, weight_formats)
            if plot_path:
                from batchrun.planner.plot import draw
                draw(the_planner, report, chosen, plot_path)
    except JobError as exc:
        fail(exc)
    except ValueError as exc:
        click.echo(f"batchrun: {exc}", err=True)
        sys.exit(2)
    if as_json or calibrate:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(format_table(report))
