"""Render a model's chat template: Jinja source shipped inside the model, so untrusted code.

It runs in Jinja's immutable sandbox configured the way transformers renders templates
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, plain `tojson`),
plus locks of our own:

- an unsafe attribute (``''.__class__``) raises instead of quietly rendering as empty, so a probing
  template is refused loudly;
- budgets on operations, `range` lengths, sequence repetition, powers and output size stop the
  obvious resource bombs early;
- a deadline: a template still rendering after RENDER_DEADLINE_S gets an exception injected into
  its thread. Loops with an empty body tick no budget, and only this catches them.

Every failure is an EngineFailure(BAD_REQUEST) for the one request; the engine keeps running.
"""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any, NoReturn

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError, safe_range

from ds4desk.engine.api import EngineFailure, ErrorCode

MAX_TEMPLATE_OPS = 5_000_000
MAX_TEMPLATE_OUTPUT_CHARS = 64 * 1024 * 1024
MAX_SEQUENCE_REPEAT = 1_000_000
RENDER_DEADLINE_S = 5.0


class TemplateTimeout(Exception):
    """Injected into a render that ran past its deadline."""


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.ops = 0
        self.globals.pop("lipsum", None)  # generates text of any requested size
        self.globals["range"] = self._range
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt))
        self.filters["tojson"] = _tojson

    def tick(self, n: int = 1) -> None:
        self.ops += n
        if self.ops > MAX_TEMPLATE_OPS:
            raise SecurityError("the template does too much work")

    def _range(self, *args: int) -> range:
        rng = safe_range(*args)
        self.tick(len(rng))  # nested loops over ranges are the cheapest way to spin
        return rng

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed")

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.tick()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        # Jinja's own signature: double underscores keep template kwargs from clashing.
        __self.tick()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.tick()
        if operator == "**" and _is_big_power(left, right):
            raise SecurityError("the template computes an enormous power")
        if operator == "*" and (_is_big_repeat(left, right) or _is_big_repeat(right, left)):
            raise SecurityError("the template builds an enormous sequence")
        return super().call_binop(context, operator, left, right)


def _is_big_power(base: Any, exponent: Any) -> bool:
    numbers = isinstance(base, int | float) and isinstance(exponent, int | float)
    return numbers and abs(exponent) > 64 and abs(base) > 1


def _is_big_repeat(seq: Any, times: Any) -> bool:
    sized = isinstance(seq, str | list | tuple) and isinstance(times, int)
    return sized and len(seq) * times > MAX_SEQUENCE_REPEAT


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(str(message))


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    # Jinja's own tojson HTML-escapes '<' and '&'; chat templates expect plain JSON, as HF renders it.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class _Deadline:
    """Raises TemplateTimeout inside the calling thread if it is still rendering after `seconds`.

    The exception is injected with CPython's PyThreadState_SetAsyncExc, which the interpreter
    delivers between bytecodes, so a template loop stops wherever it is. The lock plus `active`
    flag make sure it is only ever injected while the render runs; one injected but not yet
    delivered when the render ends is withdrawn (SetAsyncExc with NULL) before leaving.
    """

    def __init__(self, seconds: float) -> None:
        self._thread_id = threading.get_ident()
        self._lock = threading.Lock()
        self._active = True
        self.fired = False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        with self._lock:
            if self._active:
                self.fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread_id), ctypes.py_object(TemplateTimeout)
                )

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def disarm(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._active = False
            if self.fired:  # withdraw an exception that is still pending
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), None)

    def __exit__(self, *exc: object) -> None:
        self.disarm()


class ChatTemplate:
    """One compiled chat template. Rendering is serialised: the budgets live on the environment."""

    __slots__ = ("_env", "_lock", "_template", "error", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self._env = _Sandbox()
        self._lock = threading.Lock()
        self._template: Template | None = None
        self.error: str | None = None  # why it does not compile; reported on every render
        try:
            self._template = self._env.from_string(source)
        except Exception as exc:  # a syntax error in shipped Jinja
            self.error = f"{type(exc).__name__}: {exc}"

    @property
    def ok(self) -> bool:
        return self._template is not None

    def render(self, variables: Mapping[str, Any]) -> str:
        if self._template is None:
            raise EngineFailure(ErrorCode.BAD_REQUEST, f"the model's chat template is broken ({self.error})")
        with self._lock:
            self._env.ops = 0
            deadline = _Deadline(RENDER_DEADLINE_S)
            try:
                with deadline:
                    text = _collect(self._template.generate(**variables))
            except TemplateTimeout:
                raise EngineFailure(
                    ErrorCode.BAD_REQUEST,
                    f"the model's chat template ran longer than {RENDER_DEADLINE_S:g} s",
                ) from None
            except Exception as exc:
                raise EngineFailure(
                    ErrorCode.BAD_REQUEST, f"the model's chat template failed: {type(exc).__name__}: {exc}"
                ) from exc
            if deadline.fired:  # fired in the instant between the last piece and disarm
                raise EngineFailure(
                    ErrorCode.BAD_REQUEST,
                    f"the model's chat template ran longer than {RENDER_DEADLINE_S:g} s",
                )
            return text


def _collect(pieces: Iterator[str]) -> str:
    out: list[str] = []
    size = 0
    for piece in pieces:
        size += len(piece)
        if size > MAX_TEMPLATE_OUTPUT_CHARS:
            raise SecurityError("the template produces an enormous prompt")
        out.append(piece)
    return "".join(out)
