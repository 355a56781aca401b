"""Model architectures by name, built with random weights: to measure pass costs of models we cannot
download on the machine that runs them (a rented GPU), and tiny ones for fast CPU tests.

The Qwen2.5 entries are the real architectures (hidden size, layers, heads, KV heads, MLP width, vocabulary,
tied embeddings) of the published Qwen2.5 base/instruct models; only the weights are random.
"""

from __future__ import annotations

from typing import Optional

from .errors import SettingsError

# name -> (hidden, layers, heads, kv_heads, intermediate, vocab, tied embeddings)
SHAPES = {
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-3b": (2048, 36, 16, 2, 11008, 151936, True),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False),
    "qwen2.5-14b": (5120, 48, 40, 8, 13824, 152064, False),
    "qwen2.5-32b": (5120, 64, 40, 8, 27648, 152064, False),
    "qwen2.5-72b": (8192, 80, 64, 8, 29568, 152064, False),
    # for tests and --smoke runs on a CPU: same structure (GQA, biases on q/k/v), a few MB
    "tiny": (64, 2, 4, 2, 128, 512, True),
    "tiny-draft": (32, 1, 2, 1, 64, 512, True),
}


def qwen2_config(shape: str, max_positions: int = 32768):
    """A transformers Qwen2Config of the named shape."""
    from transformers import Qwen2Config

    if shape not in SHAPES:
        raise SettingsError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    hidden, layers, heads, kv, inter, vocab, tied = SHAPES[shape]
    return Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                       tie_word_embeddings=tied, max_position_embeddings=max_positions, rope_theta=1_000_000.0,
                       rms_norm_eps=1e-6, use_sliding_window=False)


def n_params(shape: str) -> int:
    """Parameter count of a shape (for memory checks before building it)."""
    hidden, layers, heads, kv, inter, vocab, tied = SHAPES[shape]
    d = hidden // heads
    attn = hidden * heads * d + 2 * hidden * kv * d + heads * d * hidden + (heads + 2 * kv) * d
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden


def random_model(shape: str, *, dtype=None, device: str = "cpu", seed: int = 0, std: float = 0.02,
                 max_positions: int = 32768, vocab: Optional[int] = None):
    """A Qwen2ForCausalLM of the named shape with random weights (normal(0, std), norms 1), built on the device
    directly (a 32B model never passes through host memory). vocab: another vocabulary size (a draft padded
    to its target's, as transformers' assisted generation wants)."""
    import torch
    from transformers import Qwen2ForCausalLM

    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    cfg = qwen2_config(shape, max_positions)
    cfg.initializer_range = std
    if vocab:
        cfg.vocab_size = vocab
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(dtype)  # in the final dtype before any memory exists (32B: 65 GB in bf16)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    # buffers are not parameters: rebuild the rotary embedding that to_empty left undefined
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg).to(device)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def random_backend(shape: str, *, static: bool = True, rows: Optional[int] = None, graphs: Optional[bool] = None,
                   n_ctx: int = 4096, kernels: Optional[str] = None, **kwargs):
    """A backend over random weights of the named shape: StaticTorchBackend (static=True) or TorchBackend."""
    from .backends.torch import TorchBackend
    from .backends.torch_static import StaticTorchBackend

    model = random_model(shape, **kwargs)
    if static:
        return StaticTorchBackend(model, name=shape, n_ctx=n_ctx, rows=rows, graphs=graphs, kernels=kernels)
    return TorchBackend(model, name=shape, n_ctx=n_ctx)
