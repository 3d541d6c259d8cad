"""Train a small transformer with shardline's fully_shard, on as many processes as torchrun starts.

    torchrun --standalone --nproc-per-node 2 examples/train_fully_shard.py

Also runs as a plain single process (``python examples/train_fully_shard.py``). The task is
learnable in a few dozen steps: continue sequences that count up by a per-sequence stride.
Shows the whole API surface: wrap with a layer policy, gradient accumulation with no_sync,
global gradient clipping, collective accounting, and a full state dict at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardline

VOCAB = 32


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 4, seq: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied: lives in the root unit
        self.logit_scale = dim**-0.5

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        x = self.tok(tokens) + self.pos(torch.arange(n))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x)) * self.logit_scale


def make_batch(step: int, size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    seqs = (start + stride * torch.arange(seq + 1)) % VOCAB
    return seqs[:, :-1], seqs[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=32, help="global batch size (split across ranks)")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step (no_sync accumulation)")
    parser.add_argument("--strategy", default="full_shard", help="full_shard | shard_grad_op | no_shard")
    parser.add_argument("--seq", type=int, default=16, help="sequence length")
    args = parser.parse_args()

    info = shardline.init_distributed(timeout=120)
    torch.manual_seed(0)  # same initial model on every rank
    model = shardline.wrap(TinyLM(seq=args.seq), shardline.layer_policy(Block), strategy=args.strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    local = args.batch // info.world_size
    if info.rank == 0:
        units = shardline.engine.subtree_units(model)
        print(f"world size {info.world_size}, {len(units)} units, strategy {args.strategy}, "
              f"{sum(p.numel() for p in model.parameters())} parameters on this rank")  # fmt: skip

    shardline.reset_comm_stats(model)
    start = time.perf_counter()
    for step in range(args.steps):
        tokens, targets = make_batch(step, args.batch, args.seq)
        tokens = tokens[info.rank * local : (info.rank + 1) * local]
        targets = targets[info.rank * local : (info.rank + 1) * local]
        total = torch.zeros(())
        for i, (t, y) in enumerate(zip(tokens.chunk(args.accum), targets.chunk(args.accum), strict=True)):
            last = i == args.accum - 1
            ctx = contextlib.nullcontext() if last else model.no_sync()
            with ctx:
                loss = F.cross_entropy(model(t).flatten(0, 1), y.flatten()) / args.accum
                loss.backward()
            total += loss.detach()
        norm = model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        if info.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {total.item():.4f}  grad norm {norm.item():.3f}")
    elapsed = time.perf_counter() - start

    stats = shardline.comm_stats(model)
    state = shardline.full_state_dict(model, rank0_only=True)
    if info.rank == 0:
        per_step = {k.value: f"{v / args.steps:.0f}" for k, v in stats.counts.items()}
        mib = stats.total_bytes / args.steps / 2**20
        print(f"{args.steps} steps in {elapsed:.1f}s; collectives per step: {per_step}, {mib:.2f} MiB per step")
        print(f"full state dict: {len(state)} tensors, {sum(t.numel() for t in state.values())} elements")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
