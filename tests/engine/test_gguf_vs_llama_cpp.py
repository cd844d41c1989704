"""ds4desk running a GGUF on its packed weights, scored by llama.cpp on the same file.

ds4desk greedy-decodes from a chat prompt; llama.cpp (llama-cpp-python, CPU) reads the same
prompt + continuation teacher-forced and gives its log-probabilities at every generated position.
Three figures say how close the two are:

- top-1 agreement: how often llama.cpp's own argmax is the token ds4desk chose;
- mean |Δ log-prob| of the chosen tokens between the two;
- the largest llama.cpp margin (its top-1 minus its top-2 log-prob) at any position where the two
  disagree: a disagreement is only acceptable where llama.cpp itself had a near-tie.

llama.cpp is not an exact reference: its CPU kernels round the activations to 8-bit blocks before
multiplying them with 4-bit weights. The bar therefore is the exact float32 computation on the
dequantized weights, measured against llama.cpp the same way on SmolLM2-135M-Instruct Q4_1 (the
issue's reference): 96.7 % agreement, mean |Δ| 0.035 nats, every disagreement at a llama.cpp
margin <= 0.5 nats. Packed weights hold exactly the dequantized values, so ds4desk should land on
those figures up to summation order; the asserted bounds (AGREEMENT_MIN etc.) add the noise one
changed greedy path brings on a few hundred tokens.

The figures are printed (run with -s) and written to <pytest tmp>/gguf_vs_llama_cpp/<model>.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.loading.gguf_header import read_gguf_header
from ds4desk.engine.loading.gguf_tokenizer import build_tokenizer
from tests.real_models import gemma3_gguf, smollm2_gguf

pytestmark = pytest.mark.slow

N_THREADS = 2  # the machine's share; llama.cpp would otherwise take every core


@dataclass(slots=True, frozen=True)
class Bar:
    # The float32-on-dequantized-weights reference (SmolLM2: 96.7 %, 0.035, 0.5) with room
    # for the noise of a greedy path: on ~240 tokens one more disagreement is 0.4 points, so 95 %
    # allows four more than the reference had; the mean |Δ| may grow by a third, and a disagreement
    # may sit at a llama.cpp margin up to 0.6 nats (near-ties are what decides the path, and one
    # more of them on a changed path must not fail the test, while a real error moves the margin
    # to whole nats).
    agreement_min: float = 0.95
    mean_abs_dlogprob_max: float = 0.047
    disagreement_margin_max: float = 0.6


@dataclass(slots=True, frozen=True)
class ModelCase:
    name: str
    prompts: tuple[str, ...]
    tokens_per_prompt: int
    # The model's chat format, filled with one user message (the file's own template renders the
    # same text; spelling it out keeps this test independent of ds4desk's template code).
    chat: str
    stop: tuple[str, ...]


SMOLLM2 = ModelCase(
    "smollm2-135m-instruct-q4_1",
    (
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how photosynthesis works, step by step.",
        "Give me a detailed packing list for a week-long hiking trip in the mountains.",
        "Describe the history of the printing press and why it mattered.",
    ),
    60,
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n",
    ("<|im_end|>", "<|endoftext|>"),
)
# The pretrained (not instruction-tuned) Gemma-3-270M: its file has no chat template and its replies
# to a turn prompt are rambling, so its distributions are flat; the comparison is numerical, and
# flat distributions make it stricter (more near-ties to land on the same side of).
GEMMA3 = ModelCase(
    "gemma-3-270m-q4_k_m",
    (
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how photosynthesis works, step by step.",
        "Give me a detailed packing list for a week-long hiking trip in the mountains.",
    ),
    40,
    "<bos><start_of_turn>user\n{message}<end_of_turn>\n<start_of_turn>model\n",
    ("<end_of_turn>", "<eos>"),
)


@dataclass(slots=True)
class Figures:
    model: str
    tokens: int
    agreement: float
    mean_abs_dlogprob: float
    max_abs_dlogprob: float
    disagreements: int
    # llama.cpp's top-1 minus top-2 at the worst disagreement (0 when there is none), and its top-1
    # minus the log-prob of ds4desk's token there (>= the first; equal when ours was its runner-up).
    max_margin_at_disagreement: float
    max_gap_to_our_token_at_disagreement: float
    packed_modules: int


def _packed_modules(model: torch.nn.Module) -> int:
    """How many weights the loaded model keeps in a GGUF block type (uint8 storage)."""
    return sum(1 for _, p in model.named_parameters() if p.dtype == torch.uint8)


def _ds4desk_greedy(
    path: Path, case: ModelCase
) -> tuple[tuple[list[tuple[list[int], list[int]]], list[list[float]]], int]:
    """Per prompt: (prompt ids, greedy continuation) and ds4desk's log-prob of each chosen token; and
    how many packed weights the model had."""
    meta = read_gguf_header(path).metadata
    tokenizer = build_tokenizer(meta).tokenizer
    stops = {i for t in case.stop if (i := tokenizer.token_to_id(t)) is not None}
    source = read_source(path)
    loaded = load_model(source, torch.device("cpu"), torch.float32)
    model = loaded.model
    threads = torch.get_num_threads()
    torch.set_num_threads(N_THREADS)
    try:
        return _greedy_runs(model, tokenizer, case, stops), _packed_modules(model)
    finally:
        torch.set_num_threads(threads)


def _greedy_runs(
    model: torch.nn.Module, tokenizer: Tokenizer, case: ModelCase, stops: set[int]
) -> tuple[list[tuple[list[int], list[int]]], list[list[float]]]:
    runs: list[tuple[list[int], list[int]]] = []
    logprobs: list[list[float]] = []
    with torch.inference_mode():
        for prompt in case.prompts:
            ids = tokenizer.encode(case.chat.format(message=prompt), add_special_tokens=False).ids
            model.allocate_cache(len(ids) + case.tokens_per_prompt + 8)
            logits = model.forward(torch.tensor(ids), 0, logits="last")
            chosen: list[int] = []
            chosen_lp: list[float] = []
            while len(chosen) < case.tokens_per_prompt:
                lp = torch.log_softmax(logits.float(), dim=-1)
                token = int(lp.argmax())
                chosen.append(token)
                chosen_lp.append(float(lp[token]))
                if token in stops:
                    break
                logits = model.forward(torch.tensor([token]), len(ids) + len(chosen) - 1, logits="last")
            runs.append((ids, chosen))
            logprobs.append(chosen_lp)
    return runs, logprobs


def _llama_cpp_logprobs(path: Path, runs: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
    """llama.cpp's log-probabilities [len(continuation), V] at each continuation position."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not importable")
    n_ctx = max(len(p) + len(c) for p, c in runs) + 8
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=N_THREADS, verbose=False
    )
    out = []
    for prompt, continuation in runs:
        llm.reset()
        llm.eval(prompt + continuation)
        # Row i holds the logits after token i, i.e. the prediction of token i + 1.
        rows = np.asarray(llm.scores[len(prompt) - 1 : len(prompt) + len(continuation) - 1], dtype=np.float64)
        rows -= rows.max(axis=1, keepdims=True)
        out.append(rows - np.log(np.exp(rows).sum(axis=1, keepdims=True)))
    llm.close()
    return out


def _figures(
    name: str,
    runs: list[tuple[list[int], list[int]]],
    ours: list[list[float]],
    theirs: list[np.ndarray],
    packed: int,
) -> Figures:
    agree, gaps, margins, to_ours = 0, [], [], []
    for (_, continuation), our_lp, lcpp in zip(runs, ours, theirs, strict=True):
        for i, token in enumerate(continuation):
            row = lcpp[i]
            top2 = np.partition(row, -2)[-2:]
            gaps.append(abs(our_lp[i] - row[token]))
            if int(row.argmax()) == token:
                agree += 1
            else:
                margins.append(float(top2[1] - top2[0]))
                to_ours.append(float(row.max() - row[token]))
    n = len(gaps)
    return Figures(
        model=name,
        tokens=n,
        agreement=agree / n,
        mean_abs_dlogprob=float(np.mean(gaps)),
        max_abs_dlogprob=float(np.max(gaps)),
        disagreements=n - agree,
        max_margin_at_disagreement=max(margins, default=0.0),
        max_gap_to_our_token_at_disagreement=max(to_ours, default=0.0),
        packed_modules=packed,
    )


def _measure(path: Path, case: ModelCase, tmp_path_factory: pytest.TempPathFactory) -> Figures:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not importable")
    (runs, ours), packed = _ds4desk_greedy(path, case)
    figures = _figures(case.name, runs, ours, _llama_cpp_logprobs(path, runs), packed)
    out = tmp_path_factory.getbasetemp() / "gguf_vs_llama_cpp"
    out.mkdir(exist_ok=True)
    (out / f"{case.name}.json").write_text(json.dumps(asdict(figures), indent=2) + "\n")
    print(f"\nds4desk vs llama.cpp, {case.name}: {json.dumps(asdict(figures))} -> {out / case.name}.json")
    return figures


def _check(figures: Figures, bar: Bar) -> None:
    assert all(math.isfinite(v) for v in (figures.mean_abs_dlogprob, figures.max_abs_dlogprob))
    # The test is about the packed path: a model dequantized at load would pass it for another reason.
    assert figures.packed_modules > 0, "the GGUF's quantized weights were not kept packed"
    assert figures.agreement >= bar.agreement_min, figures
    assert figures.mean_abs_dlogprob <= bar.mean_abs_dlogprob_max, figures
    assert figures.max_margin_at_disagreement <= bar.disagreement_margin_max, figures


def test_smollm2_q4_1_is_as_close_to_llama_cpp_as_float32(tmp_path_factory: pytest.TempPathFactory) -> None:
    _check(_measure(smollm2_gguf(), SMOLLM2, tmp_path_factory), Bar())


def test_gemma3_q4_k_m_is_as_close_to_llama_cpp_as_float32(tmp_path_factory: pytest.TempPathFactory) -> None:
    # No float32 reference figures exist for Gemma yet; the SmolLM2 bar is applied unchanged.
    _check(_measure(gemma3_gguf(), GEMMA3, tmp_path_factory), Bar())
