"""Render a model's chat template: Jinja source shipped inside the model, so untrusted code.

It runs in Jinja's immutable sandbox configured the way transformers renders templates
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, plain `tojson`),
plus locks of our own:

- an unsafe attribute (``''.__class__``) raises instead of quietly rendering as empty, so a probing
  template is refused loudly;
- budgets on operations, `range` lengths, sequence repetition, powers and output size stop the
  obvious resource bombs early;
- a budget on the characters of every string the template builds (`+`, `~`, `*`, `%`, the
  padding and replacing filters and str methods), charged BEFORE each one is built: a deadline
  cannot interrupt one C-level allocation, so doubling a string 31 times or `center(3*10**9)`
  would take gigabytes before it fired;
- a deadline: a template still rendering after RENDER_DEADLINE_S gets an exception injected into
  its thread. Loops with an empty body tick no budget, and only this catches them.

Every failure is an EngineFailure(BAD_REQUEST) for the one request; the engine keeps running.
"""

from __future__ import annotations

import ctypes
import json
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any, NoReturn

from jinja2 import Template, TemplateError, pass_environment, pass_eval_context
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import loopcontrols
from jinja2.filters import do_center, do_format, do_indent, do_join, do_replace, do_wordwrap
from jinja2.nodes import Concat
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError, safe_range

from ds4desk.engine.api import EngineFailure, ErrorCode, ThinkingFormat

MAX_TEMPLATE_OPS = 5_000_000
MAX_TEMPLATE_OUTPUT_CHARS = 64 * 1024 * 1024
MAX_SEQUENCE_REPEAT = 1_000_000
# Every string built during one render, all together: real templates build a few times their
# output; one that adds each message to a namespace string is quadratic, and a 4M-character chat
# built that way still fits.
MAX_TEMPLATE_BUILT_CHARS = 256 * 1024 * 1024
# str methods whose result can be far larger than their inputs.
_GROWING_STR_METHODS = frozenset(
    {"center", "ljust", "rjust", "zfill", "replace", "join", "expandtabs", "format", "format_map"}
)
_NUMBER = re.compile(r"\d+")
RENDER_DEADLINE_S = 5.0


class TemplateTimeout(Exception):
    """Injected into a render that ran past its deadline."""


class _GuardedConcat(CodeGenerator):
    """`a ~ b` compiles to a join the environment charges for, instead of Jinja's own str_join."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.guarded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _GuardedConcat

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.ops = 0
        self.built = 0
        self.globals.pop("lipsum", None)  # generates text of any requested size
        self.globals["range"] = self._range
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt))
        self.filters["tojson"] = _tojson
        self.filters["center"] = self._center
        self.filters["indent"] = self._indent
        self.filters["replace"] = self._replace
        self.filters["join"] = self._join
        self.filters["wordwrap"] = self._wordwrap
        self.filters["format"] = self._format

    def tick(self, n: int = 1) -> None:
        self.ops += n
        if self.ops > MAX_TEMPLATE_OPS:
            raise SecurityError("the template does too much work")

    def charge(self, chars: int) -> None:
        """Called with a string's size before it is built."""
        if chars > MAX_TEMPLATE_OUTPUT_CHARS:
            raise SecurityError("the template builds an enormous string")
        self.built += max(0, chars)
        if self.built > MAX_TEMPLATE_BUILT_CHARS:
            raise SecurityError("the template builds enormous strings")

    def guarded_join(self, pieces: tuple[Any, ...]) -> str:
        texts = [str(p) for p in pieces]
        self.charge(sum(len(t) for t in texts))
        return "".join(texts)

    # ---- filters that can grow a string far past their inputs --------------------------------

    def _center(self, value: Any, width: int = 80) -> str:
        self.charge(max(len(str(value)), _int_or_zero(width)))
        return do_center(value, width)

    def _indent(self, value: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
        text = str(value)
        pad = _int_or_zero(width) if not isinstance(width, str) else len(width)
        self.charge(len(text) + pad * (text.count("\n") + 1))
        return do_indent(text, width, first, blank)

    @pass_eval_context
    def _replace(self, eval_ctx: Any, value: Any, old: Any, new: Any, count: int | None = None) -> Any:
        text, old_text, new_text = str(value), str(old), str(new)
        hits = text.count(old_text) if old_text else len(text) + 1
        if count is not None:
            hits = min(hits, max(0, _int_or_zero(count)))
        self.charge(len(text) + hits * max(0, len(new_text) - len(old_text)))
        return do_replace(eval_ctx, value, old, new, count)

    @pass_eval_context
    def _join(self, eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
        if isinstance(value, list | tuple):
            self.charge(sum(len(str(v)) for v in value) + len(str(d)) * len(value))
        return do_join(eval_ctx, value, d, attribute)

    @pass_environment
    def _wordwrap(self, environment: Any, s: str, *args: Any, **kwargs: Any) -> str:
        self.charge(2 * len(str(s)))
        return do_wordwrap(environment, s, *args, **kwargs)

    def _format(self, value: str, *args: Any, **kwargs: Any) -> str:
        self.charge(_format_size(str(value), args, kwargs))
        return do_format(value, *args, **kwargs)

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
        # str.format arrives wrapped by the sandbox; the bound method is its __wrapped__.
        target = getattr(__obj, "__wrapped__", __obj)
        owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
        if isinstance(owner, str) and name in _GROWING_STR_METHODS:
            __self.charge(_str_method_size(owner, name, args, kwargs))
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.tick()
        if operator == "**" and _is_big_power(left, right):
            raise SecurityError("the template computes an enormous power")
        if operator == "*":
            if _is_big_repeat(left, right) or _is_big_repeat(right, left):
                raise SecurityError("the template builds an enormous sequence")
            sized, times = (left, right) if isinstance(left, str | list | tuple) else (right, left)
            if isinstance(sized, str | list | tuple) and isinstance(times, int):
                self.charge(len(sized) * times)
        elif (
            operator == "+" and isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple)
        ):
            self.charge(len(left) + len(right))
        elif operator == "%" and isinstance(left, str):
            self.charge(_format_size(left, right if isinstance(right, tuple) else (right,), {}))
        return super().call_binop(context, operator, left, right)


def _int_or_zero(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _format_size(template: str, args: Any, kwargs: Mapping[str, Any]) -> int:
    """An upper bound on what `template % args` or `template.format(...)` builds: its text, its
    arguments' text, and every field padded to the largest width it names or is given."""
    values = list(args.values()) if isinstance(args, Mapping) else list(args)
    values += list(kwargs.values())
    widths = [int(n) for n in _NUMBER.findall(template) if len(n) < 30]
    widths += [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    fields = template.count("%") + template.count("{") + 1
    text = sum(len(v) for v in values if isinstance(v, str))
    return len(template) + text + fields * max([0, *(abs(w) for w in widths)])


def _str_method_size(text: str, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    first = args[0] if args else next(iter(kwargs.values()), None)
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(text), _int_or_zero(first))
    if name == "expandtabs":
        return len(text) + text.count("\t") * _int_or_zero(first if first is not None else 8)
    if name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        hits = text.count(old) if old else len(text) + 1
        return len(text) + hits * max(0, len(new) - len(old))
    if name == "join" and isinstance(first, list | tuple):
        return sum(len(str(v)) for v in first) + len(text) * len(first)
    if name == "format":
        return _format_size(text, args, kwargs)
    if name == "format_map" and isinstance(first, Mapping):
        return _format_size(text, (), first)
    return len(text)


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
            self._env.built = 0
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


# A one-question conversation: enough for a template to show whether it has a thinking mode.
_PROBE = [{"role": "user", "content": "Hello"}]
THINK_OPEN = "<think>"

# (messages, variables) -> the prompt text with the generation prompt, as the engine renders it.
ChatRenderer = Callable[[list[dict[str, Any]], Mapping[str, Any]], str]


def probe_thinking(render: ChatRenderer) -> ThinkingFormat:
    """What a chat format does with thinking, learned by rendering one question both ways rather
    than by reading the template: Jinja spells a thinking switch in many ways, and only the
    rendered prompt says for certain whether the switch changes anything. A format that cannot
    render the probe has no thinking the window can rely on."""
    try:
        on = render(_PROBE, {"thinking": True, "enable_thinking": True})
        off = render(_PROBE, {"thinking": False, "enable_thinking": False})
    except EngineFailure:
        return ThinkingFormat()
    return ThinkingFormat(
        switch=on != off,
        opened_when_on=on.rstrip().endswith(THINK_OPEN),
        opened_when_off=off.rstrip().endswith(THINK_OPEN),
    )
