"""The Qt window. Talks to the engine only through ds4desk.engine.api types and a ChatBackend."""

from ds4desk.ui.backend import ChatBackend

__all__ = ["ChatBackend"]
