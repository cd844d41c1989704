"""`ds4desk generate` and `ds4desk session` with speculation, as a user runs them: real processes,
the real embedded SmolLM2 and its tokenizer, a prompt whose answer quotes it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ds4desk.engine.loading.default_model import default_model_path

LIST = "apples, bananas, cherries, dates, elderberries, figs, grapes, kiwis, lemons, mangoes"
PROMPT = f"Repeat this list exactly: {LIST}."


def ds4desk(*args: str, home: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ds4desk", "--data-dir", str(home), *args],
        capture_output=True,
        text=True,
        timeout=600,
        input=stdin,
    )


def generate(home: Path, *extra: str) -> dict[str, Any]:
    out = ds4desk(
        "generate", "--device", "cpu", "--prompt", PROMPT, "--max-tokens", "40", "--json", *extra, home=home
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_generate_lookup_and_draft_give_the_plain_answer(ds4_home: Path) -> None:
    plain = generate(ds4_home, "--speculative", "off")
    lookup = generate(ds4_home, "--speculative", "lookup")
    # The model as its own draft: the draft path itself, loaded beside the target (auto: draft).
    drafted = generate(ds4_home, "--draft", str(default_model_path()))
    assert plain["stats"]["speculative"] == "off" and plain["stats"]["drafted_tokens"] == 0
    for answer, mode in ((lookup, "lookup"), (drafted, "draft")):
        assert answer["tokens"] == plain["tokens"], mode
        assert answer["text"] == plain["text"] and answer["finish_reason"] == plain["finish_reason"]
        stats = answer["stats"]
        assert stats["speculative"] == mode
        assert 0 < stats["accepted_tokens"] <= stats["drafted_tokens"]
        assert stats["acceptance_rate"] == stats["accepted_tokens"] / stats["drafted_tokens"]
    assert "bananas" in plain["text"]  # the answer quotes the list: what lookup predicts


def test_generate_says_what_speculation_did_and_refuses_mtp(ds4_home: Path) -> None:
    out = ds4desk(
        "generate", "--device", "cpu", "--prompt", PROMPT, "--max-tokens", "24",
        "--speculative", "lookup", home=ds4_home,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "speculative lookup:" in out.stderr and "drafted tokens accepted" in out.stderr
    mtp = ds4desk(
        "generate", "--device", "cpu", "--prompt", "Hi", "--max-tokens", "4", "--speculative", "mtp",
        "--json", home=ds4_home,
    )  # fmt: skip
    assert mtp.returncode == 1
    answer = json.loads(mtp.stdout.strip().splitlines()[-1])
    assert answer["error"]["code"] == "bad_request"
    assert "not supported for this model" in answer["error"]["detail"]


def test_session_results_carry_the_speculation_stats(ds4_home: Path) -> None:
    commands = [
        {"op": "generate", "id": "plain", "prompt": PROMPT, "max_tokens": 30, "speculative": "off"},
        {"op": "generate", "id": "default", "prompt": PROMPT, "max_tokens": 30},
        {"op": "generate", "id": "bad", "prompt": PROMPT, "max_tokens": 3, "speculative": "maybe"},
    ]  # no quit (it cancels what runs): the end of input waits for the answers
    out = ds4desk(
        "session", "--device", "cpu", "--context", "512", "--speculative", "lookup",
        home=ds4_home, stdin="".join(json.dumps(c) + "\n" for c in commands),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    results = {line["id"]: line for line in lines if line.get("event") == "result"}
    assert results["plain"]["ok"] and results["default"]["ok"]
    assert results["plain"]["stats"]["speculative"] == "off"
    # The session's --speculative is every request's default.
    stats = results["default"]["stats"]
    assert stats["speculative"] == "lookup" and 0 < stats["accepted_tokens"] <= stats["drafted_tokens"]
    assert results["default"]["tokens"] == results["plain"]["tokens"]
    [bad] = [line for line in lines if line.get("op") == "generate" and line.get("ok") is False]
    assert bad["error"]["code"] == "bad_request" and "speculative must be one of" in bad["error"]["detail"]
