"""Remote engines: a model served by another program over the OpenAI API (ds4desk serve, vLLM,
SGLang, llama.cpp's server, Ollama) as the model of a chat. No Qt here but connect_dialog.py, and
no torch anywhere: the dialog and the window may import this package."""

from ds4desk.remote.config import NOT_AVAILABLE, RemoteConfig, base_url, is_remote
from ds4desk.remote.engine import RemoteEngine
from ds4desk.remote.protocol import RemoteModel

__all__ = ["NOT_AVAILABLE", "RemoteConfig", "RemoteEngine", "RemoteModel", "base_url", "is_remote"]
