"""`ds4desk serve`: the loaded model behind a local OpenAI-compatible HTTP API (Starlette on uvicorn)."""

from ds4desk.server.app import build_app
from ds4desk.server.run import ServeOptions, bind_problem, run_server, serve

__all__ = ["ServeOptions", "bind_problem", "build_app", "run_server", "serve"]
