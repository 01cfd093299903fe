"""Command line: jobs (submit, generate, validate, status, plan, kvcheck, schema) and the server."""
from __future__ import annotations

import json
import logging
import signal
import sys
import threading

import click

from batchrun.cli_options import SET, fail
from batchrun.cli_plan import plan
from batchrun.cli_types import NON_NEGATIVE, PORT, POSITIVE_INT
from batchrun.config import EngineConfig
from batchrun.job.errors import EXIT_CODES
from batchrun.job.sections import JOB_SAMPLING_DEFAULTS


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log engine details (KV pool size, model conversion).")
def main(verbose: bool) -> None:
    """batchrun: offline LLM batch inference."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(message)s")


_EXIT_HELP = "Exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items()) + "."


def _serve_beside(address: str, api_key: str | None, model_name: str):
    """`submit --serve`: a factory the job runner calls with its LLM once the model is loaded."""
    import functools
    try:
        from batchrun.server.thread import ServeBesideJob, parse_host_port
    except ImportError as exc:
        raise click.UsageError(f"--serve needs the serve extra: pip install 'batchrun[serve]' ({exc})")
    try:
        parse_host_port(address)
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix("--serve: "), param_hint="--serve") from exc
    return functools.partial(ServeBesideJob, address=address, api_key=api_key, model_name=model_name)


_PROGRESS = click.option("--progress", type=click.Choice(["auto", "bar", "log"]), default="auto", show_default=True,
                         help="auto: a bar on a terminal, log lines otherwise.")
_RESTART = click.option("--restart", is_flag=True,
                        help="Discard the results of a different job in the output directory.")


@main.command(help="Run JOB (a YAML job file) to completion, or resume it where it stopped.\n\n" + _EXIT_HELP)
@click.argument("job", type=click.Path(dir_okay=False))
@SET
@_RESTART
@_PROGRESS
@click.option("--serve", "serve_address", metavar="HOST:PORT",
              help="While the job runs, serve an OpenAI-compatible endpoint on its engine (interactive lane), "
                   "e.g. 127.0.0.1:8000. Needs the serve extra.")
@click.option("--api-key", envvar="BATCHRUN_API_KEY", help="With --serve: require 'Authorization: Bearer KEY' "
              "(also read from BATCHRUN_API_KEY).")
@click.option("--executor", type=click.Choice(["local", "ray"]), help="Sets executor.kind: run here, or on a pool "
              "of engine replicas on Ray (needs the ray extra).")
@click.option("--replicas", metavar="N|[MIN,MAX]", help="Sets executor.replicas (Ray engine replicas).")
@click.option("--address", metavar="ADDRESS", help="Sets executor.address: auto, ray://HOST:10001 or HOST:6379 "
              "(default: start a local Ray on 127.0.0.1).")
@click.option("--force", is_flag=True, help="Run on an object store where batchrun cannot take the job's lock (no "
              "conditional PUT: any scheme but s3://); make sure no other submit of the job runs.")
@click.option("--tp", "tensor_parallel_size", type=POSITIVE_INT, help="Sets engine.tensor_parallel_size: split "
              "the model over N ranks (GPUs, or CPU processes).")
def submit(job, overrides, restart, progress, serve_address, api_key, executor, replicas, address, force,
           tensor_parallel_size) -> None:
    from batchrun.job import Job, JobError
    flags = {"kind": executor, "replicas": replicas, "address": address}
    overrides = [*overrides, *(f"executor.{key}={value}" for key, value in flags.items() if value is not None)]
    if tensor_parallel_size is not None:
        overrides.append(f"engine.tensor_parallel_size={tensor_parallel_size}")
    try:
        job_ = Job.from_yaml(job, overrides)
    except JobError as exc:
        fail(exc)
    _run_job(job_, restart, progress,
             _serve_beside(serve_address, api_key, job_.spec.model) if serve_address else None, force=force)


# generate's flags and the job fields they set (an error names the field and the flag)
_GENERATE_FLAGS = {("input", "limit"): "--limit", ("input", "prompt_column"): "--prompt-column",
                   ("input", "id_column"): "--id-column", ("sampling", "max_tokens"): "--max-tokens",
                   ("sampling", "temperature"): "--temperature", ("engine", "kv_cache_memory"): "--kv-cache-memory",
                   ("engine", "kv_cache_dtype"): "--kv-cache-dtype", ("engine", "max_num_seqs"): "--max-num-seqs",
                   ("engine", "quantization"): "--quantization",
                   ("engine", "max_num_batched_tokens"): "--max-num-batched-tokens", ("model",): "--model",
                   ("output", "path"): "--output"}


@main.command(help="Generate a completion for every row of PARQUET (columns: id, prompt, optional max_tokens): "
                   "a job made from these flags, with the job's output columns, resume and progress. Run the same "
                   "command again to resume.\n\n" + _EXIT_HELP)
@click.argument("parquet", type=click.Path(dir_okay=False))
@click.option("--model", default=EngineConfig.model, show_default=True)
@click.option("--output", "-o", type=click.Path(file_okay=False),
              help="Output directory, as a job's output.path  [default: batchrun-out/PARQUET's name]")
@click.option("--limit", type=POSITIVE_INT, help="Only the first N rows.")
@click.option("--prompt-column", default="prompt", show_default=True)
@click.option("--id-column", default="id", show_default=True)
@click.option("--max-tokens", type=POSITIVE_INT, default=JOB_SAMPLING_DEFAULTS["max_tokens"], show_default=True,
              help="Used where the file has no max_tokens column.")
@click.option("--temperature", type=NON_NEGATIVE, default=JOB_SAMPLING_DEFAULTS["temperature"], show_default=True)
@click.option("--chat/--no-chat", default=False, help="Wrap each prompt as a user message in the chat template.")
@click.option("--kv-cache-memory", help="KV pool size  [default: 2GiB on CPU, profiled on CUDA]")
@click.option("--kv-cache-dtype", default=EngineConfig.kv_cache_dtype, show_default=True)
@click.option("--quantization", default=EngineConfig.quantization, show_default=True,
              help="Weights: none, int8 (W8A8), int8-w8a16, fp8, int4 or auto; a quantized checkpoint runs as it is.")
@click.option("--max-num-seqs", type=POSITIVE_INT, default=EngineConfig.max_num_seqs, show_default=True)
@click.option("--max-num-batched-tokens", type=POSITIVE_INT, default=EngineConfig.max_num_batched_tokens,
              show_default=True)
@_RESTART
@_PROGRESS
def generate(parquet, model, output, limit, prompt_column, id_column, max_tokens, temperature, chat,
             kv_cache_memory, kv_cache_dtype, quantization, max_num_seqs, max_num_batched_tokens, restart,
             progress) -> None:
    import os

    import pyarrow.parquet as pq

    from batchrun.job import Job, JobError, JobSpec
    try:
        has_max_tokens = "max_tokens" in pq.read_schema(parquet).names
    except (OSError, ValueError):   # the job's own input check names the problem
        has_max_tokens = False
    stem = os.path.splitext(os.path.basename(parquet))[0]
    raw = {"name": stem, "model": model,
           "input": {"path": os.path.abspath(parquet), "id_column": id_column, "prompt_column": prompt_column,
                     "chat": chat, "limit": limit, "max_tokens_column": "max_tokens" if has_max_tokens else None},
           "sampling": {"max_tokens": max_tokens, "temperature": temperature},
           "engine": {"kv_cache_memory": kv_cache_memory, "kv_cache_dtype": kv_cache_dtype,
                      "quantization": quantization, "max_num_seqs": max_num_seqs,
                      "max_num_batched_tokens": max_num_batched_tokens},
           "output": {"path": os.path.abspath(output or os.path.join("batchrun-out", stem))}}
    try:
        job_ = Job(JobSpec(raw, "batchrun generate", dict(_GENERATE_FLAGS)))
    except JobError as exc:
        fail(exc)
    _run_job(job_, restart, progress, preview=5)


def _absorb_signals() -> None:
    """From here the process only reports and winds down (threads, interpreter teardown), with every row already
    saved: a further Ctrl-C or SIGTERM is ignored, so the exit code stays the job's (not 130). Ignored, not handled:
    Python resets its own handlers to the default (die by the signal) late in its teardown, but leaves SIG_IGN."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _run_job(job_, restart: bool, progress: str, serve=None, preview: int = 0, force: bool = False) -> None:
    """Run or resume the job, print its first `preview` results and a summary line, exit with its code."""
    from batchrun.job import JobError
    from batchrun.job.errors import EXIT_INTERRUPTED
    try:
        result = job_.run(restart=restart, progress=progress, serve=serve, force=force)
    except JobError as exc:
        fail(exc)
    except KeyboardInterrupt:
        _absorb_signals()
        click.echo("batchrun: interrupted; finished rows are saved, submit again to resume", err=True)
        sys.exit(EXIT_INTERRUPTED)
    _absorb_signals()
    if preview:
        for r in result.table().slice(0, preview).to_pylist():
            click.echo(f"[{r['id']}] {r['text'] if r['status'] == 'ok' else r['error']!r} ({r['finish_reason']})")
    s = result.summary
    click.echo(json.dumps({k: s.get(k) for k in ("status", "rows_ok", "rows_failed", "rows_remaining",
                                                 "output_tokens_per_s", "wall_s")} | {"output": result.output_dir}))
    sys.exit(result.exit_code)


@main.command(help="Check JOB's spec and input and print what would run, without loading the model.")
@click.argument("job", type=click.Path(dir_okay=False))
@SET
def validate(job, overrides) -> None:
    from batchrun.job import Job, JobError
    try:
        report = Job.from_yaml(job, list(overrides)).validate()
    except JobError as exc:
        fail(exc)
    click.echo(json.dumps(report, indent=2))


@main.command(help="Compare N of JOB's prompts, greedy, with unquantized KV and weights and with the job's 8-bit "
                   "KV dtype and/or quantized weights.")
@click.argument("job", type=click.Path(dir_okay=False))
@SET
@click.option("--sample", "sample", type=POSITIVE_INT, default=32, show_default=True,
              help="How many of the job's prompts.")
@click.option("--dtype", "kv_dtype", type=click.Choice(["auto", "int8", "fp8"]),
              help="KV dtype. Default: the job's kv_cache_dtype.")
@click.option("--quantization", help="Weights (none, int8, int8-w8a16, fp8, int4). Default: the job's "
              "engine.quantization.")
def kvcheck(job, overrides, sample, kv_dtype, quantization) -> None:
    from batchrun.job import Job, JobError
    from batchrun.job.kv_gate import kvcheck as run
    try:
        report = run(Job.from_yaml(job, list(overrides)).spec, sample, kv_dtype, quantization)
    except JobError as exc:
        fail(exc)
    except ValueError as exc:
        fail(JobError(f"{job}: engine: {exc}"))
    click.echo(report.summary())
    click.echo(json.dumps(report.as_dict(), indent=2))


@main.command(help="Show JOB's progress from its output directory: done, failed, remaining.")
@click.argument("job", type=click.Path(dir_okay=False))
@SET
def status(job, overrides) -> None:
    from batchrun.job import Job, JobError
    try:
        click.echo(json.dumps(Job.from_yaml(job, list(overrides)).status(), indent=2))
    except JobError as exc:
        fail(exc)


@main.command(help="Print the job file's JSON Schema, for editors with a YAML language server: "
                    "batchrun schema > job.schema.json, then '# yaml-language-server: $schema=job.schema.json' "
                    "as the job file's first line.")
def schema() -> None:
    from batchrun.job.sections import json_schema
    click.echo(json.dumps(json_schema(), indent=2))


def _engine_overrides(items) -> dict:
    """--engine KEY=VALUE (repeatable) -> engine options, values parsed as YAML scalars (1GiB, 32, true)."""
    import yaml
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--engine")
        options[key.strip().replace("-", "_")] = yaml.safe_load(value)
    return options


@main.command()
@click.option("--model", default=EngineConfig.model, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on; the default is loopback only.")
@click.option("--port", type=PORT, default=8000, show_default=True)
@click.option("--api-key", envvar="BATCHRUN_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/* "
              "(also read from BATCHRUN_API_KEY).")
@click.option("--served-model-name", help="The model id clients send and /v1/models lists (default: --model).")
@click.option("--max-prompt-tokens", type=POSITIVE_INT,
              help="Refuse longer prompts with 400 (default: the context - 1).")
@click.option("--max-tokens-limit", type=POSITIVE_INT,
              help="Refuse a larger max_tokens with 400 (default: the context).")
@click.option("--max-pending", type=POSITIVE_INT, default=64, show_default=True,
              help="Requests in flight before new ones get 429.")
@click.option("--max-body-bytes", type=POSITIVE_INT, default=4 << 20, show_default=True,
              help="Larger request bodies get 413 before they are read.")
@click.option("--kv-cache-memory", help="KV pool size  [default: 2GiB on CPU, profiled on CUDA]")
@click.option("--kv-cache-dtype", default=EngineConfig.kv_cache_dtype, show_default=True)
@click.option("--quantization", default=EngineConfig.quantization, show_default=True,
              help="Weights: none, int8 (W8A8), int8-w8a16, fp8, int4 or auto; a quantized checkpoint runs as it is.")
@click.option("--max-num-seqs", type=POSITIVE_INT, default=EngineConfig.max_num_seqs, show_default=True)
@click.option("--max-num-batched-tokens", type=POSITIVE_INT, default=EngineConfig.max_num_batched_tokens,
              show_default=True)
@click.option("--max-model-len", type=POSITIVE_INT)
@click.option("--deterministic/--no-deterministic", default=EngineConfig.deterministic, show_default=True,
              help="A request's output does not depend on what else the server runs at the same time (at a cost "
                   "in throughput; README, deterministic mode).")
@click.option("--engine", "engine_items", multiple=True, metavar="KEY=VALUE",
              help="Any other engine option (see batchrun/config.py), e.g. --engine block_size=32 (repeatable).")
@click.option("--adapter", "adapter_items", multiple=True, metavar="NAME=PATH",
              help="A LoRA adapter (PEFT directory) that requests select with model: NAME (repeatable).")
def serve(model, host, port, api_key, served_model_name, max_prompt_tokens, max_tokens_limit, max_pending,
          max_body_bytes, kv_cache_memory, kv_cache_dtype, quantization, max_num_seqs, max_num_batched_tokens,
          max_model_len, deterministic, engine_items, adapter_items) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP endpoint (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics); requests go to the engine's interactive lane. Needs the serve extra (fastapi, uvicorn)."""
    try:
        import uvicorn

        from batchrun.server import create_app
    except ImportError as exc:
        raise click.UsageError(f"batchrun serve needs the serve extra: pip install 'batchrun[serve]' ({exc})")
    from batchrun import LLM

    options = dict(kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                   max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                   deterministic=deterministic)
    options.update(_engine_overrides(engine_items))
    for item in adapter_items:
        name, sep, path = item.partition("=")
        if not (sep and name.strip() and path.strip()):
            raise click.BadParameter(f"{item!r}: expected NAME=PATH", param_hint="--adapter")
        options["adapters"] = {**(options.get("adapters") or {}), name.strip(): path.strip()}
    if max_pending <= 0:
        raise click.BadParameter("must be a positive integer", param_hint="--max-pending")
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo(f"batchrun: warning: listening on {host} without --api-key: anyone who can reach it can use it",
                   err=True)
    try:
        llm = LLM(model=model, **options)
        app = create_app(llm, api_key=api_key, model_name=served_model_name or model,
                         max_prompt_tokens=max_prompt_tokens, max_tokens_limit=max_tokens_limit,
                         max_body_bytes=max_body_bytes)
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc)) from exc
    llm.max_pending_submits = max_pending
    llm.start_background()
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        llm.stop_background()


main.add_command(plan)

if __name__ == "__main__":
    main()
