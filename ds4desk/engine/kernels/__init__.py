"""Every Triton kernel of the engine, by the model family that uses it (dense/, deepseek_v4/) or the
weight format it reads (quant/). launch.py states the convention each kernel module follows (its
torch reference, its custom op and fake, its switch) and holds the switch API."""
