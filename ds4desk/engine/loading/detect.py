"""Work out what a path the user dropped is, and check it enough to give a clear error up front.

Accepted: a Hugging Face model folder (config.json + safetensors + tokenizer files), a file inside
one (config.json, a .safetensors shard), or a single .gguf file, read in place (gguf_source.py).
What comes back is a ModelSource: the config (in one spelling, whatever the
checkpoint used), every tensor's header entry and the tokenizer files. Tensor shapes are checked
against the architecture later, on the meta model (`loader.plan_load`, `preflight.check_model`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loading import deepseek_v4_names
from ds4desk.engine.loading.gguf_header import GGUF_MAGIC
from ds4desk.engine.loading.gguf_source import gguf_source
from ds4desk.engine.loading.safetensors_header import read_safetensors_header
from ds4desk.engine.loading.source import ModelSource, TensorEntry
from ds4desk.engine.models.registry import ARCHITECTURES

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Files of a HF folder that a user may drop instead of the folder itself.
FOLDER_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "chat_template.json",
    }
)
MAX_CONFIG_BYTES = 16 * 1024 * 1024
MAX_TEMPLATE_BYTES = 4 * 1024 * 1024
# Upper bounds on the config sizes that decide how much is built or allocated, each far above any
# published model: everything per layer, per head or per expert is sized from these before memory
# is checked, so a config that lies (10^9 layers) is refused here, before anything is built.
MAX_CONFIG_SIZES: dict[str, int] = {
    "num_hidden_layers": 1024,
    "hidden_size": 2**17,
    "intermediate_size": 2**20,
    "moe_intermediate_size": 2**20,
    "vocab_size": 2**23,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "head_dim": 4096,
    "n_routed_experts": 4096,
    "num_experts_per_tok": 4096,
    "n_shared_experts": 64,
    "q_lora_rank": 2**17,
    "o_lora_rank": 2**17,
    "o_groups": 4096,
    "index_n_heads": 4096,
    "index_head_dim": 4096,
    "index_topk": 2**20,
    "hc_mult": 64,
    "hc_sinkhorn_iters": 10_000,
    "sliding_window": 2**22,
    "sliding_window_pattern": 1024,
    "max_window_layers": 1024,
}


def _fail(message: str) -> EngineFailure:
    return EngineFailure(ErrorCode.LOAD_FAILED, message)


def is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_source(path: Path) -> ModelSource:
    """What `path` is, as a loadable folder; LOAD_FAILED with a human message for anything else."""
    path = Path(path).expanduser()
    try:
        path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise _fail(f"{path} is a symbolic link to something that does not exist") from None
        raise _fail(f"{path} does not exist") from None
    except OSError as exc:  # ELOOP: a symbolic link loop; EACCES: a folder above it is closed to us
        raise _fail(f"cannot look at {path}: {exc.strerror or exc}") from None
    source = _read_source(path)
    check_config_sizes(source.config, path)
    return source


def _read_source(path: Path) -> ModelSource:
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError as exc:
        raise _fail(f"cannot look at {path}: {exc.strerror or exc}") from None
    if is_dir:
        try:
            next(path.iterdir(), None)
        except OSError as exc:
            raise _fail(f"cannot open the folder {path}: {exc.strerror or exc}") from None
        return inspect_folder(path)
    if not is_file:
        raise _fail(f"{path} is not a model: expected a folder with config.json or a .gguf file")
    if is_gguf(path):
        return gguf_source(path)
    if path.suffix == ".safetensors" or path.name in FOLDER_FILES:
        return inspect_folder(path.parent)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise _fail(
            f"{path.name} is a PyTorch pickle file; ds4desk does not load pickle files because opening "
            "one can run arbitrary code. Use the model's safetensors or GGUF version instead"
        )
    raise _fail(f"{path.name} is not a model: expected a folder with config.json or a .gguf file")


def check_config_sizes(config: dict[str, Any], path: Path) -> None:
    """LOAD_FAILED when a size in the config (or in its text_config) is past MAX_CONFIG_SIZES."""
    parts = [config]
    if isinstance(config.get("text_config"), dict):
        parts.append(config["text_config"])
    for part in parts:
        for key, most in MAX_CONFIG_SIZES.items():
            value = part.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > most:
                raise _fail(f"{path.name}: config '{key}' is {value}, more than ds4desk allows ({most})")
        layer_lists = [part.get(k) for k in ("layer_types", "mlp_layer_types", "compress_ratios")]
        if any(
            isinstance(v, list) and len(v) > 2 * MAX_CONFIG_SIZES["num_hidden_layers"] for v in layer_lists
        ):
            raise _fail(f"{path.name}: config lists more layer types than ds4desk allows layers")


def inspect_folder(folder: Path) -> ModelSource:
    config = read_config(folder)
    architecture = config["architectures"][0]
    tensors = read_weight_headers(folder)
    if architecture in ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration") and any(
        name.endswith(".mlp.experts.gate_up_proj") for name in tensors
    ):
        # Experts stored stacked (the published checkpoints' layout, where save_pretrained writes one
        # weight an expert): the model names its parameters so (models/qwen3_5/config.py's
        # STACKED_EXPERTS_KEY; loading/ does not import a family, hence the literal).
        config = {**config, "ds4desk_stacked_experts": True}
    layout = None
    if architecture == deepseek_v4_names.ARCHITECTURE:
        # Official, save_pretrained's or transformers' module names: entries under our names, and
        # the MTP blocks the checkpoint holds in the config (the model builds those).
        found, tensors = deepseek_v4_names.layout_tensors(tensors)
        config = deepseek_v4_names.with_mtp(deepseek_v4_names.normalize_config(config), tensors)
        layout = deepseek_v4_names.name_layout(found)
    tokenizer = folder / "tokenizer.json"
    return ModelSource(
        folder=folder,
        origin=folder,
        config=config,
        architecture=architecture,
        tensors=tensors,
        tokenizer_file=tokenizer if tokenizer.is_file() else None,
        chat_template=find_chat_template(folder),
        layout=layout,
    )


def _read_json_object(path: Path, what: str) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise _fail(f"{path} is implausibly large for {what}")
        data = json.loads(path.read_text(encoding="utf-8"))
    except EngineFailure:
        raise
    except OSError as exc:
        raise _fail(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise _fail(f"{path} is not text, so it is not valid JSON") from None
    except (ValueError, RecursionError) as exc:
        raise _fail(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise _fail(f"{path} does not hold a JSON object")
    return data


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        hint = ""
        ggufs = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
        if ggufs:
            hint = f"; it holds {ggufs[0].name}: open that file instead"
        raise _fail(f"no config.json in {folder}: not a Hugging Face model folder{hint}")
    config = _read_json_object(path, "a model config")
    if deepseek_v4_names.is_model_args_config(config):
        # DeepSeek's reference-code config (inference/config.json style).
        config = deepseek_v4_names.model_args_to_hf(config)
    check_config_sizes(config, path)  # before anything builds a per-layer list from it
    if "architectures" not in config and config.get("model_type") == "deepseek_v4":
        # Some DeepSeek config.json files name only the model type.
        config["architectures"] = [deepseek_v4_names.ARCHITECTURE]
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise _fail(f"{path} names no architecture (its 'architectures' list is missing or empty)")
    if archs[0] not in ARCHITECTURES:
        raise _fail(f"unknown architecture '{archs[0]}'; ds4desk runs: {', '.join(ARCHITECTURES)}")
    return config


def read_weight_headers(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor of the folder's safetensors files, from their (checked) headers."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return _read_sharded(folder, index)
    single = folder / "model.safetensors"
    if single.is_file():
        tensors = read_safetensors_header(single)
    else:
        files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
        if not files:
            pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
            if pickles:
                raise _fail(
                    f"{folder} has only PyTorch pickle weights ({pickles[0]}); ds4desk refuses .bin/.pt "
                    "files because loading pickle can run arbitrary code. Use a safetensors version"
                )
            raise _fail(f"no .safetensors weights in {folder}")
        tensors = {}
        for file in files:
            for name, entry in read_safetensors_header(file).items():
                if name in tensors:
                    raise _fail(f"tensor '{name}' is in both {tensors[name].file.name} and {file.name}")
                tensors[name] = entry
    if not tensors:
        raise _fail(f"the safetensors files in {folder} hold no tensors")
    return tensors


def _read_sharded(folder: Path, index: Path) -> dict[str, TensorEntry]:
    weight_map = _read_json_object(index, "a shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise _fail(f"{index} has no 'weight_map'")
    headers: dict[str, dict[str, TensorEntry]] = {}
    tensors: dict[str, TensorEntry] = {}
    for name, file in weight_map.items():
        # Shards sit beside the index; a path elsewhere would let a model folder read any file.
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise _fail(f"{index.name} maps '{name}' to {file!r}, which is not a file name in {folder}")
        if file not in headers:
            shard = folder / file
            if not shard.is_file():
                raise _fail(f"{index.name} lists {file}, which is missing from {folder}")
            headers[file] = read_safetensors_header(shard)
        entry = headers[file].get(name)
        if entry is None:
            raise _fail(f"{index.name} puts tensor '{name}' in {file}, but {file} does not contain it")
        tensors[name] = entry
    return tensors


def _read_template_file(path: Path) -> str:
    try:
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise _fail(f"{path} is implausibly large for a chat template")
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise _fail(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise _fail(f"{path} is not UTF-8 text") from None


def _template_value(value: object) -> str | None:
    if isinstance(value, str) and value.strip():
        return value
    # Some tokenizer_configs hold several named templates; the plain chat one is "default".
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default", next(iter(named.values()), None))
        return chosen if isinstance(chosen, str) and chosen.strip() else None
    return None


def find_chat_template(folder: Path) -> str | None:
    """The chat template, looked up where transformers writes it (newest convention first)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        text = _read_template_file(jinja)
        return text if text.strip() else None
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = folder / name
        if path.is_file():
            template = _template_value(_read_json_object(path, "tokenizer settings").get("chat_template"))
            if template is not None:
                return template
    return None


__all__ = [
    "check_config_sizes",
    "inspect_folder",
    "is_gguf",
    "read_config",
    "read_source",
]
