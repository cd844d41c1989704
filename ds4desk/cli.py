"""`ds4desk` opens the window; `ds4desk VERB` runs headless (generate, check)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ds4desk.paths import DataDirs, resolve_data_dirs

if TYPE_CHECKING:
    from ds4desk.engine.api import LoadRequest
    from ds4desk.remote import RemoteEngine

VERBS = ("gui", "generate", "check", "session", "serve", "make-tiny")
DEVICE_HELP = "auto, cpu, cuda or cuda:N (default: auto, the first GPU when there is one, else the CPU)"


def _common(parser: argparse.ArgumentParser, top_level: bool = False) -> None:
    # Sub-parsers must not overwrite a --data-dir given before the verb with their own default.
    parser.add_argument(
        "--data-dir",
        default=None if top_level else argparse.SUPPRESS,
        metavar="DIR",
        help="keep settings, history, caches and the crash log in DIR (default: $DS4DESK_HOME or the "
        "platform's user directories)",
    )


def _parse_token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def _parse_devices(text: str) -> tuple[str, ...]:
    from ds4desk.engine.api import EngineFailure
    from ds4desk.engine.split import parse_devices

    try:
        return parse_devices(text)
    except EngineFailure as failure:
        raise argparse.ArgumentTypeError(failure.error.detail) from None


def _parse_layer_split(text: str) -> tuple[int, ...]:
    from ds4desk.engine.api import EngineFailure
    from ds4desk.engine.split import parse_layer_split

    try:
        return parse_layer_split(text)
    except EngineFailure as failure:
        raise argparse.ArgumentTypeError(failure.error.detail) from None


def _split_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--devices", type=_parse_devices, metavar="cuda:0,cuda:1",
        help="split the layers over these devices (one shard each, in order); overrides --device",
    )  # fmt: skip
    parser.add_argument(
        "--layer-split", type=_parse_layer_split, metavar="22,21",
        help="layers per device for --devices (default: planned from each device's free memory)",
    )  # fmt: skip


def _weights_argument(parser: argparse.ArgumentParser) -> None:
    from ds4desk.engine.api import WEIGHT_MODES

    parser.add_argument(
        "--weights", choices=WEIGHT_MODES, default="as-stored",
        help="as-stored (the default), or quantize a 16-bit model's linear weights while loading: "
        "q8 (8-bit, Q8_0) or q4 (4-bit, Q4_K), to fit a smaller GPU",
    )  # fmt: skip


def _cpu_prefill_argument(parser: argparse.ArgumentParser) -> None:
    from ds4desk.engine.api import CPU_PREFILL_MODES

    parser.add_argument(
        "--cpu-prefill", choices=CPU_PREFILL_MODES, default="float32",
        help="how a prompt on the CPU multiplies GGUF weights: float32 (the default, exact) or bfloat16 "
        "(about 1.4-2x faster on CPUs with AVX-512 BF16, logits rounded slightly differently)",
    )  # fmt: skip


def _speculative_arguments(parser: argparse.ArgumentParser) -> None:
    from ds4desk.engine.api import SPECULATIVE_MODES

    parser.add_argument(
        "--draft", metavar="PATH",
        help="a small draft model (folder or .gguf) with the same vocabulary, for speculative decoding",
    )  # fmt: skip
    parser.add_argument(
        "--speculative", choices=SPECULATIVE_MODES, default="auto",
        help="speculative decoding: auto (the default: the draft model when one is loaded, else the "
        "model's own MTP block when it has one (DeepSeek-V4), else prompt lookup), draft, mtp, lookup, off",
    )  # fmt: skip


def _warm_up_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-warm-up", dest="warm_up", action="store_false",
        help="skip the load's warm-up stage (by default the load runs what the first request would "
        "otherwise pay for: graph capture, kernel compilation, first calls)",
    )  # fmt: skip


class _VersionAction(argparse.Action):
    """--version, reading the installed metadata only when asked (importlib.metadata costs an import
    and a scan of the environment's distributions on every start otherwise)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(
            option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show the version and exit"
        )

    def __call__(self, parser: argparse.ArgumentParser, *_args: object, **_kwargs: object) -> None:
        from importlib.metadata import version

        print(f"ds4desk {version('ds4desk')}")  # on stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ds4desk",
        description="A desktop chat for local models. With no verb, opens the window.",
    )
    _common(parser, top_level=True)
    parser.add_argument("--version", action=_VersionAction)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", title="verbs")

    gui = verbs.add_parser("gui", help="open the chat window (the default)")
    _common(gui)
    gui.add_argument("model", nargs="?", help="model folder or .gguf (default: the last one, else SmolLM2)")
    gui.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: Settings > Device, auto at first)")

    gen = verbs.add_parser("generate", help="generate text headless and print it")
    _common(gen)
    gen.add_argument("model", nargs="?", help="model folder or .gguf (default: the embedded SmolLM2)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="one user message, rendered with the model's chat template")
    prompt.add_argument("--raw", help="text tokenized as-is")
    prompt.add_argument("--prompt-tokens", type=_parse_token_ids, metavar="1,2,3", help="token ids")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--chunk", type=int, default=0, help="prefill chunk size in tokens (0: automatic)")
    gen.add_argument("--context", type=int, default=4096, help="context size in tokens")
    gen.add_argument("--device", default="auto", help=DEVICE_HELP)
    gen.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    _weights_argument(gen)
    _cpu_prefill_argument(gen)
    _split_arguments(gen)
    _speculative_arguments(gen)
    _warm_up_argument(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    remote = gen.add_argument_group("a model on a server (ds4desk serve, vLLM, SGLang, llama.cpp, Ollama)")
    remote.add_argument(
        "--remote", metavar="URL", help="answer with the model of this OpenAI-compatible server"
    )
    remote.add_argument(
        "--api-key", default=os.environ.get("DS4DESK_API_KEY"), help="its key (default: $DS4DESK_API_KEY)"
    )
    remote.add_argument(
        "--model", dest="remote_model", metavar="NAME", help="its model (default: the first listed)"
    )

    session = verbs.add_parser("session", help="drive the engine with JSON lines on stdin and stdout")
    _common(session)
    session.add_argument("model", nargs="?", help="model folder or .gguf (default: the embedded SmolLM2)")
    session.add_argument("--device", default="auto", help=DEVICE_HELP)
    session.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    session.add_argument("--chunk", type=int, default=0, help="prefill chunk size in tokens (0: automatic)")
    session.add_argument("--context", type=int, default=4096, help="context size in tokens")
    _weights_argument(session)
    _cpu_prefill_argument(session)
    _speculative_arguments(session)
    _warm_up_argument(session)

    serve = verbs.add_parser("serve", help="serve the model to other programs over the OpenAI API")
    _common(serve)
    serve.add_argument("model", nargs="?", help="model folder or .gguf (default: the embedded SmolLM2)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free one)")
    serve.add_argument(
        "--api-key", default=os.environ.get("DS4DESK_API_KEY"),
        help="the key clients must send (default: $DS4DESK_API_KEY); needed for any host but loopback",
    )  # fmt: skip
    serve.add_argument("--device", default="auto", help=DEVICE_HELP)
    serve.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    serve.add_argument("--chunk", type=int, default=0, help="prefill chunk size in tokens (0: automatic)")
    serve.add_argument("--context", type=int, default=4096, help="context size in tokens")
    serve.add_argument(
        "--slot-dir",
        help="the folder of slot files for POST /slots/{id}?action=save|restore "
        "(default: the data directory's snapshots folder)",
    )
    _weights_argument(serve)
    _cpu_prefill_argument(serve)
    _warm_up_argument(serve)

    check = verbs.add_parser("check", help="say what a model path is, or why it cannot be loaded")
    _common(check)
    check.add_argument("path")
    _split_arguments(check)
    check.add_argument("--device", default="auto", help="the device the memory figure is for (default: auto)")
    check.add_argument(
        "--context", type=int, default=4096, help="context the memory figure and split plan size caches for"
    )
    check.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))

    tiny = verbs.add_parser("make-tiny", help="write a tiny random model folder (for tests and demos)")
    _common(tiny)
    tiny.add_argument("family", choices=("deepseek_v4",))
    tiny.add_argument("out", help="folder to write (created if missing)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--format", dest="layout", choices=("hf", "official"), default="hf",
        help="hf: transformers' names (default); official: DeepSeek's own names, sharded",
    )  # fmt: skip
    tiny.add_argument("--fp8", action="store_true", help="official layout only: FP8 weights, FP4 experts")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    # `ds4desk PATH` and `ds4desk --device cuda` mean the window, like `ds4desk gui ...`.
    if not any(word in VERBS for word in args_list) and not {"-h", "--help", "--version"} & set(args_list):
        args_list.insert(0, "gui")
    args = build_parser().parse_args(args_list)
    dirs = resolve_data_dirs(args.data_dir).create()
    # Libraries' own caches live with ours, not in $TMPDIR or ~: `import torch` alone makes
    # $TMPDIR/torchinductor_$USER, and Triton compiles into ~/.triton unless told otherwise.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(dirs.cache / "torchinductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(dirs.cache / "triton"))
    if args.verb == "gui":
        from ds4desk.app import run_app

        return run_app(dirs, model_path=args.model, device=args.device)
    _quiet_logging()
    try:
        return _headless(args, dirs)
    except KeyboardInterrupt:  # Ctrl+C outside a verb's own handling (during imports, say)
        return 130
    except BrokenPipeError:  # whoever read our output has gone: nothing left to tell them
        _drop_stdout()
        return 1
    finally:
        if argv is None:  # the real command line: the process ends when this returns
            _cheap_exit()


def _cheap_exit() -> None:
    """The interpreter's exit collects garbage over every object alive, and after `import torch`
    that walk alone costs about 0.4 s (`python -c "import torch"`: 2.29 s with it, 1.81 s with
    gc.freeze() first, medians of 7). Nothing left when a headless verb ends needs collecting
    before the process does, so the collector is told to leave it be; atexit handlers and stream
    flushes still run. Tests that call main(argv) in their own process keep their collector, and
    the window's exit (Qt objects) is left as it was."""
    gc.freeze()


def _headless(args: argparse.Namespace, dirs: DataDirs) -> int:
    if args.verb == "generate":
        return _generate(args, dirs)
    if args.verb == "check":
        return _check(args, dirs)
    if args.verb == "serve":
        from ds4desk.server import ServeOptions, serve

        slot_dir = Path(args.slot_dir).expanduser() if args.slot_dir else dirs.data / "snapshots"
        return serve(
            load_request_of(args), ServeOptions(args.host, args.port, args.api_key, slot_dir=slot_dir)
        )
    if args.verb == "session":
        from ds4desk.session import run_session

        code = run_session(load_request_of(args), snapshot_dir=dirs.data / "snapshots")
        with contextlib.suppress(BrokenPipeError, ValueError, OSError):
            sys.stdout.flush()
            return code
        _drop_stdout()
        return code
    return _make_tiny(args)


class _OneLine(logging.Formatter):
    """Headless verbs report their errors in their answer; the log adds one line, not a traceback
    (DS4DESK_DEBUG=1 brings tracebacks back)."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and not os.environ.get("DS4DESK_DEBUG"):
            exc = record.exc_info[1]
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
            if exc is not None:
                record.msg = f"{record.getMessage()}: {type(exc).__name__}: {exc}"
                record.args = None
        return super().format(record)


def _quiet_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_OneLine("ds4desk: %(levelname)s: %(message)s"))
        handler.setLevel(logging.WARNING)
        root.addHandler(handler)


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush does not fail a second time."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def load_request_of(args: argparse.Namespace) -> LoadRequest:
    """The LoadRequest a `generate` or `session` command line asks for (session has no split)."""
    from ds4desk.engine import LoadRequest

    return LoadRequest(
        path=args.model,
        device=args.device,
        dtype=args.dtype,
        context=args.context,
        chunk=args.chunk,
        devices=getattr(args, "devices", None),
        layer_split=getattr(args, "layer_split", None),
        weights=args.weights,
        cpu_prefill=args.cpu_prefill,
        draft=getattr(args, "draft", None),
        speculative=getattr(args, "speculative", "auto"),
        warm_up=getattr(args, "warm_up", True),
    )


def _generate(args: argparse.Namespace, dirs: DataDirs) -> int:
    from ds4desk.engine import Engine, GenerateRequest, SamplingParams

    if args.seed is not None and not 0 <= args.seed < 2**63:
        print(f"error: --seed must be in 0..{2**63 - 1}", file=sys.stderr)
        return 2
    if args.max_tokens < 1:
        print("error: --max-tokens must be at least 1", file=sys.stderr)
        return 2
    if args.remote and args.model:
        print("error: with --remote, name the server's model with --model NAME", file=sys.stderr)
        return 2
    engine: Engine | RemoteEngine
    if args.remote:
        from ds4desk.engine import LoadRequest
        from ds4desk.remote import RemoteConfig, RemoteEngine

        engine = RemoteEngine(RemoteConfig(args.remote, api_key=args.api_key, model=args.remote_model))
        load = LoadRequest()  # connects: lists the server's models and takes --model
    else:
        engine = Engine()
        load = load_request_of(args)
    request: GenerateRequest | None = None
    try:
        loaded = engine.load(load)
        if not loaded.ok:
            assert loaded.error is not None
            return _fail(args.json, loaded.error.to_json())
        request = GenerateRequest(
            prompt_tokens=args.prompt_tokens,
            messages=[{"role": "user", "content": args.prompt}] if args.prompt is not None else None,
            raw_text=args.raw,
            sampling=SamplingParams(
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
            ),
            max_new_tokens=args.max_tokens,
        )

        def stream(_token: int | None, text: str) -> None:
            with contextlib.suppress(BrokenPipeError):  # the reader left: the answer still ends cleanly
                sys.stdout.write(text)
                sys.stdout.flush()

        result = engine.generate(request, None if args.json else stream)
    except KeyboardInterrupt:
        # Cancelled, not abandoned: the engine thread stops at its next step, so close() is prompt.
        engine.cancel_load()
        if request is not None:
            engine.cancel(request.request_id)
        engine.close()
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        engine.close()
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False))
    else:
        print()
        stats = result.stats
        print(
            f"[{result.finish_reason}] {stats.prompt_tokens} prompt tokens, "
            f"{stats.generated_tokens} generated; first token {stats.time_to_first_token_s * 1000:.0f} ms, "
            f"prefill {stats.prefill_tok_s:.1f} tok/s, decode {stats.decode_tok_s:.1f} tok/s",
            file=sys.stderr,
        )
        if stats.speculative != "off":
            print(
                f"speculative {stats.speculative}: {stats.accepted_tokens} of {stats.drafted_tokens} drafted "
                f"tokens accepted ({stats.acceptance_rate:.0%})",
                file=sys.stderr,
            )
        if result.error:
            print(f"error: {result.error}", file=sys.stderr)
        print(_load_line(loaded.seconds, loaded.warm_up_seconds), file=sys.stderr)
    return 0 if result.ok else 1


def _load_line(seconds: float, warm_up_seconds: float) -> str:
    """The load's time as the answer's first token did not pay it: the warm-up is inside it."""
    if warm_up_seconds > 0:
        return f"load {seconds:.2f} s, of which warm-up {warm_up_seconds:.2f} s"
    return f"load {seconds:.2f} s"


def _fail(as_json: bool, error: dict[str, str]) -> int:
    if as_json:
        print(
            json.dumps({"tokens": [], "logprobs": [], "text": "", "finish_reason": "error", "error": error})
        )
    print(f"error: {error['code']}: {error['detail']}", file=sys.stderr)
    return 1


def _check(args: argparse.Namespace, dirs: DataDirs) -> int:
    from ds4desk.engine.api import EngineFailure
    from ds4desk.engine.preflight import check_model

    try:
        report = check_model(Path(args.path), args.device, args.dtype, args.context)
        split = _check_split(args, dirs) if args.devices is not None or args.layer_split is not None else None
    except EngineFailure as failure:
        print(f"cannot load {args.path}: {failure.error.detail}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or folder the checks above did not reach (permissions, say)
        print(f"cannot load {args.path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(report.describe())
    if split is not None:
        print(split)
    return 0


def _check_split(args: argparse.Namespace, dirs: DataDirs) -> str:
    """The layer split `--devices` / `--layer-split` would load, with what each device takes: the
    engine's own load plan, stopped before any memory is taken."""
    import torch

    from ds4desk.engine.api import EngineFailure, ErrorCode
    from ds4desk.engine.devices import free_memory_bytes, resolve_device, resolve_dtype
    from ds4desk.engine.loader import plan_load
    from ds4desk.engine.loading.detect import read_source

    if args.devices is None:
        raise EngineFailure(ErrorCode.BAD_REQUEST, "--layer-split needs --devices")
    source = read_source(Path(args.path))
    first = torch.device(args.devices[0])
    # An explicit split is checked anywhere; an automatic one reads the devices' free memory.
    plan = plan_load(
        source,
        first,
        resolve_dtype(args.dtype, first),
        args.context,
        args.devices,
        args.layer_split,
        lambda d: free_memory_bytes(resolve_device(d)),
    )
    assert plan.split is not None
    sizes = ", ".join(f"{device} {size / 2**30:.2f} GiB" for device, size in plan.needs.items())
    return f"layer split ({plan.context}-token cache): {plan.split.describe()}; needs {sizes}"


def _make_tiny(args: argparse.Namespace) -> int:
    from ds4desk.engine.make_tiny import make_tiny

    try:
        make_tiny(args.family, Path(args.out), seed=args.seed, layout=args.layout, fp8=args.fp8)
    except (ValueError, OSError) as exc:
        print(f"make-tiny: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a tiny {args.family} model ({args.layout}{', fp8' if args.fp8 else ''}) to {args.out}")
    return 0
