"""Which architectures ds4desk runs: torch-free, so detection and `check` can ask cheaply."""

# Architecture (as config.json names it) -> the family name the engine uses.
ARCHITECTURE_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}

# The families models/llama.py implements (the rest of the table has its own module).
DENSE_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
