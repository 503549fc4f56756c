"""A small causal Transformer language model over real text already on the machine.

The text is the docstrings of Python's own standard library (read with ``ast``, nothing is
downloaded), split into paragraphs of varying length and byte-tokenised, so sequence
lengths vary widely: that is what dynamic batching and gradient checkpointing are for.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from cluster.storage import StorageRoot
from trainers.config.job import JobSpec
from trainers.data import ParquetFiles, TokenSource
from trainers.workloads.datasets import prepare_data

VOCAB = 257  # 256 byte values and one padding id
PAD_ID = 256


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        drop = self.dropout if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, d_model: int, n_layers: int, n_heads: int, max_seq_len: int, dropout: float,
                 gradient_checkpointing: bool = False):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.gradient_checkpointing = gradient_checkpointing

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)  # recompute activations in backward
            else:
                x = block(x)
        return self.head(self.ln(x))


class LanguageModel:
    def prepare(self, spec: JobSpec, root: StorageRoot) -> str:
        return prepare_data(spec, root)

    def dataset(self, spec: JobSpec, data_uri: str) -> TokenSource:
        return TokenSource(ParquetFiles(data_uri), spec.data.columns.tokens, pad_id=PAD_ID, max_len=spec.model.max_seq_len)

    def build_model(self, spec: JobSpec) -> nn.Module:
        m = spec.model
        return TinyGPT(m.d_model, m.n_layers, m.n_heads, m.max_seq_len, m.dropout,
                       gradient_checkpointing=spec.training.gradient_checkpointing)

    def loss_sum(self, model: nn.Module, batch) -> tuple[torch.Tensor, int, int]:
        """Sum over sequences of each sequence's mean next-token loss (padding excluded)."""
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1]).float()
        target = tokens[:, 1:]
        per_token = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1),
                                    ignore_index=PAD_ID, reduction="none").view(target.shape)
        mask = (target != PAD_ID).float()
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        return per_seq.sum(), tokens.shape[0], batch["num_tokens"]


def flops_per_token(params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token of a decoder: 6 per parameter (forward + backward) plus attention's
    12 * layers * d_model * context (the PaLM paper's appendix B accounting). For MFU."""
    return 6.0 * params + 12.0 * n_layers * d_model * seq_len
