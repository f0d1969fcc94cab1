"""Byte-level MoE language model and the standard-library corpus used by ``train_moe.py``.

Shape legend: B batch, S sequence, D model width, T = B * S tokens, E experts.

The MoE layer class is injected (``deepspeed.moe.layer.MoE`` or ``ds_cobalt.MoE``, which share one
constructor and both return ``(output, l_aux, exp_counts)``), so the same model runs on either.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # bytes


# ----------------------------------------------------------------------------------------------- corpus
def stdlib_files() -> list[Path]:
    """Python's own standard-library ``.py`` files in a fixed (sorted, relative-path) order.

    Every machine with this Python version has the same files; ``site-packages`` is left out because it
    differs from machine to machine.
    """
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(max_bytes: int = 8 << 20) -> np.ndarray:
    """The standard library's source read as bytes, concatenated in file order, capped at ``max_bytes``.

    Returns ``[N]`` uint8.
    """
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_files():
        try:
            data = path.read_bytes()
        except OSError:  # unreadable file: skip, the order of the others is unchanged
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    if corpus.size < 1 << 16:
        raise RuntimeError(f"standard-library corpus too small ({corpus.size} bytes) under {sys.prefix}")
    return corpus


def batch_for_rank(
    corpus: np.ndarray, *, seed: int, step: int, rank: int, world_size: int, micro_batch: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets for one rank at one step, both ``[B, S]`` int64.

    The global batch (``world_size * micro_batch`` random windows) depends only on ``(seed, step)``;
    rank r takes rows ``[r * B, (r + 1) * B)``, so ranks see different shards and two runs with the
    same seed and world size see the same data whatever the MoE implementation.
    """
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, corpus.size - seq_len - 1, size=world_size * micro_batch)
    mine = starts[rank * micro_batch : (rank + 1) * micro_batch]
    idx = mine[:, None] + np.arange(seq_len + 1)[None, :]
    window = torch.from_numpy(corpus[idx].astype(np.int64))
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


# ------------------------------------------------------------------------------------------------ model
@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 128
    seq_len: int = 128
    moe_every: int = 1  # layer i is MoE when i % moe_every == moe_every - 1
    num_experts: int = 8
    ep_size: int = 4
    k: int = 2
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    min_capacity: int = 4
    drop_tokens: bool = True
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True


def make_expert(d_model: int, d_ff: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_cls: type[nn.Module] | None) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.is_moe = moe_cls is not None
        if moe_cls is not None:
            self.ffn = moe_cls(
                hidden_size=cfg.d_model,
                expert=make_expert(cfg.d_model, cfg.d_ff),
                num_experts=cfg.num_experts,
                ep_size=cfg.ep_size,
                k=cfg.k,
                capacity_factor=cfg.capacity_factor,
                eval_capacity_factor=cfg.eval_capacity_factor,
                min_capacity=cfg.min_capacity,
                drop_tokens=cfg.drop_tokens,
                use_rts=cfg.use_rts,
                top2_2nd_expert_sampling=cfg.top2_2nd_expert_sampling,
            )
        else:
            self.ffn = make_expert(cfg.d_model, cfg.d_ff)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(self.ln1(x_BSD)).split(D, dim=-1)
        q, k, v = (t.view(B, S, self.n_heads, D // self.n_heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BSD = x_BSD + self.proj(att.transpose(1, 2).reshape(B, S, D))
        h_BSD = self.ln2(x_BSD)
        if self.is_moe:
            out_BSD, l_aux, exp_counts = self.ffn(h_BSD)
            return x_BSD + out_BSD, l_aux, exp_counts
        return x_BSD + self.ffn(h_BSD), None, None


class MoELM(nn.Module):
    """Decoder-only byte LM; every ``moe_every``-th block has an MoE FFN."""

    def __init__(self, cfg: ModelConfig, moe_cls: type[nn.Module]) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(cfg, moe_cls if i % cfg.moe_every == cfg.moe_every - 1 else None)
            for i in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)

    def forward(
        self, ids_BS: torch.Tensor, targets_BS: torch.Tensor, aux_loss_coef: float = 0.01
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Returns ``(loss, lm_loss, exp_counts per MoE layer)``; loss = lm_loss + coef * sum(l_aux)."""
        S = ids_BS.shape[1]
        x = self.embed(ids_BS) + self.pos(torch.arange(S, device=ids_BS.device))[None]
        aux = x.new_zeros(())
        counts: list[torch.Tensor] = []
        for block in self.blocks:
            x, l_aux, exp_counts = block(x)
            if l_aux is not None:
                aux = aux + l_aux
                counts.append(exp_counts)
        logits = self.head(self.ln_f(x))
        lm_loss = F.cross_entropy(logits.view(-1, VOCAB), targets_BS.reshape(-1))
        return lm_loss + aux_loss_coef * aux, lm_loss, counts


def add_model_arguments(p: Any, *, n_layers: int = 2, d_ff: int = 128, num_experts: int = 8, top_k: int = 2) -> None:
    """The model flags the benchmarks share (benchmarks/paired_steps.py, benchmarks/replan_overhead.py)."""
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=n_layers)
    p.add_argument("--d-ff", type=int, default=d_ff)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--num-experts", type=int, default=num_experts)
    p.add_argument("--top-k", type=int, default=top_k)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--no-drop-tokens", action="store_true")


def model_config_from(args: Any, ep_size: int) -> ModelConfig:
    """The `ModelConfig` of `add_model_arguments`' flags (4 heads, every FFN an MoE, min capacity 4)."""
    return ModelConfig(d_model=args.d_model, n_heads=4, n_layers=args.n_layers, d_ff=args.d_ff, seq_len=args.seq_len,
                       moe_every=1, num_experts=args.num_experts, ep_size=ep_size, k=args.top_k,
                       capacity_factor=args.capacity_factor, min_capacity=4, drop_tokens=not args.no_drop_tokens)


def set_threads_from_env() -> None:
    """One intra-op thread per rank unless OMP_NUM_THREADS says otherwise (2 cores, 4 ranks here)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
