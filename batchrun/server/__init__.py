"""OpenAI-compatible HTTP endpoint over the engine's interactive lane (optional extra: pip install batchrun[serve])."""
from batchrun.server.app import create_app
from batchrun.server.thread import ServerThread, parse_host_port

__all__ = ["create_app", "ServerThread", "parse_host_port"]
