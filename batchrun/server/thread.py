"""Running uvicorn: in the main thread for `batchrun serve`, in a daemon thread beside a job (`submit --serve`)
or a test. The socket is bound before the thread starts, so port 0 picks a free port without a race."""
from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn


def parse_host_port(value: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """'127.0.0.1:8000', ':8000' or '8000' -> (host, port); raises ValueError naming the value."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or default_host
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"--serve: expected HOST:PORT such as 127.0.0.1:8000, got {value!r}") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"--serve: port must be in [0, 65535], got {number}")
    return host, number


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """uvicorn serving `app` on host:port from a daemon thread; `.port` is the bound port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="batchrun-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.host}:{self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


class ServeBesideJob:
    """The endpoint on a job's LLM (`batchrun submit JOB --serve HOST:PORT`): a context manager around the job's
    loop. When the job's rows are done the runner calls `finishing()`: new requests get 503 and the loop keeps
    stepping until the interactive requests already admitted have finished."""

    def __init__(self, llm, address: str, api_key: str | None = None, model_name: str | None = None, **app_options):
        from batchrun.server.app import create_app
        host, port = parse_host_port(address)
        self.llm, self.accepting = llm, True
        app = create_app(llm, api_key=api_key, model_name=model_name, ready=lambda: self.accepting, **app_options)
        self.thread = ServerThread(app, host, port)

    @property
    def url(self) -> str:
        return self.thread.url

    def __enter__(self) -> "ServeBesideJob":
        self.thread.start()
        logging.getLogger("batchrun.job").info("serving the OpenAI-compatible endpoint on %s/v1 (interactive lane)",
                                               self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.accepting = False
        self.thread.stop()

    def finishing(self) -> bool:
        """Stop admitting; True while submitted requests are still in the engine (keep stepping)."""
        self.accepting = False
        return self.llm.has_unfinished()
