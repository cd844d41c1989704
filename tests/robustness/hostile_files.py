"""Builders for hostile model files, and the chat-template memory bombs, shared by the in-process
tests (test_hostile_files.py, test_template_bombs.py) and the bounded corpus (test_hostile_bounds.py)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path


def gguf_file(path: Path, entries: list[bytes], tensor_count: int = 0, tail: bytes = b"") -> Path:
    """A GGUF v3 file with these metadata entries (made with gguf_key + a typed value)."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensor_count, len(entries)) + b"".join(entries) + tail)
    return path


def gguf_key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def with_config(model: Path, place: Path, **changes: object) -> Path:
    """A copy of the model folder `model` in `place`, its config.json changed."""
    folder = Path(shutil.copytree(model, place))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


DOUBLING = (
    "{% set ns = namespace(s='a') %}{% for i in range(31) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}"
    "{{ ns.s }}"
)
TEMPLATE_BOMBS = {
    "double with +": DOUBLING.replace("OP", "+"),
    "double with ~": DOUBLING.replace("OP", "~"),
    "center filter": "{{ 'a'|center(3*10**9) }}",
    "center method": "{{ 'a'.center(3*10**9) }}",
    "ljust method": "{{ 'a'.ljust(2**31) }}",
    "indent filter": "{{ ('a\\n' * 100000)|indent(100000) }}",
    "replace filter": "{% set s = 'a' * 100000 %}{{ s|replace('a', s) }}",
    "replace method": "{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}",
    "percent width": "{{ '%999999999s' % 'x' }}",
    "format filter": "{{ '%*s'|format(10**9, 'x') }}",
    "format method": "{{ '{:>999999999}'.format('x') }}",
    "format nested width": "{{ '{:>{w}}'.format('x', w=10**9) }}",
    "join": "{% set s = 'a' * 1000000 %}{{ ([s] * 70)|join }}",
    "expandtabs": "{{ ('\\t' * 1000).expandtabs(10**7) }}",
}


def dispatching_template(bombs: dict[str, str]) -> str:
    """One chat template holding every bomb: the last message's text picks which one goes off;
    any other text gets an ordinary prompt. So one loaded model serves the whole corpus."""
    branches = "".join(
        f"{{%- {'if' if n == 0 else 'elif'} messages[-1]['content'] == {json.dumps(name)} -%}}{source}"
        for n, (name, source) in enumerate(bombs.items())
    )
    plain = "{%- for m in messages -%}{{ m['role'] }}: {{ m['content'] }}\n{% endfor -%}assistant:"
    return f"{branches}{{%- else -%}}{plain}{{%- endif -%}}"
