"""Log-probabilities of a decode step, for the OpenAI API's `logprobs` / `top_logprobs`: the chosen
token's and the most likely alternatives'.

They are of the model's own distribution (the raw logits, before temperature or top-p), as the
logprob the sampler already reports (sampling.sample), and as vLLM reports them by default.
"""

from __future__ import annotations

import torch

MAX_TOP_N = 20  # OpenAI's limit for top_logprobs


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """(log p(token), [(id, log p(id)) of the `top_n` most likely ids, most likely first]).

    `logits`: one row [V] on any device, any float dtype. log_softmax runs in float32 whatever the
    model's dtype: a bfloat16 log_softmax loses the small differences between close alternatives.
    Ties among the top ids come out in ascending id order, so the answer does not depend on the
    device's sort. One host transfer for everything.
    """
    if logits.ndim != 1:
        raise ValueError(f"logits must be one row [V], got shape {tuple(logits.shape)}")
    vocab = logits.shape[0]
    if not 0 <= token < vocab:
        raise ValueError(f"token {token} is outside the vocabulary (0..{vocab - 1})")
    if not 0 <= top_n <= MAX_TOP_N:
        raise ValueError(f"top_n must be in 0..{MAX_TOP_N}, got {top_n}")
    logp = torch.log_softmax(logits.float(), dim=0)
    n = min(top_n, vocab)
    if n == 0:
        return float(logp[token].item()), []
    # topk's order among equal values is unspecified: take the candidates, then order them by
    # (-logprob, id) on the host, where both are exact.
    values, ids = torch.topk(logp, n)
    cut = values[-1]
    tied = torch.nonzero(logp == cut).flatten()  # every id equal to the smallest kept value
    picked = torch.cat((ids[values > cut], tied))
    packed = torch.cat((logp[token].reshape(1).double(), picked.double(), logp[picked].double()))
    host = packed.tolist()
    count = picked.numel()
    chosen = host[0]
    pairs = sorted(zip(host[1 : 1 + count], host[1 + count :], strict=True), key=lambda p: (-p[1], p[0]))
    return chosen, [(int(i), lp) for i, lp in pairs[:n]]
