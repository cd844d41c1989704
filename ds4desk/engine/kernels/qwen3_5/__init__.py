"""Triton kernels of Qwen3.5's linear-attention (Gated DeltaNet) layers: decode step, gated norm."""
