"""Speculative decoding: drafters propose a few tokens, the target scores them in one forward and
keeps the longest prefix it agrees with (exactly its own output, greedy or sampled).

- `mode.py`      which drafter a request gets (off, lookup, draft, mtp; auto chooses)
- `lookup.py`    prompt lookup: the tokens that followed the latest match of the context's tail
- `draft_model.py` a small dense model with the target's vocabulary, with its own rolled-back cache
- `mtp.py`       the model's own MTP block (DeepSeek-V4), following the target's hidden state
- `adaptive.py`  how many tokens to draft, from the running acceptance rate
- `accept.py`    the acceptance rules: greedy agreement, rejection sampling and its residual
- `rollback.py`  what a model's cache needs to forget the positions a rejection left behind
- `decode.py`    the decode loop that ties them together (Runtime.generate calls it)
"""
