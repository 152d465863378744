"""The layers the decoder families share: their parameters' helpers and logical names (common.py),
the norms, attention (with RoPE, packed documents and the KV cache) and the MLP. Each takes the
decoder's config section and `model.impl` settings and names its dimensions, nothing else."""
