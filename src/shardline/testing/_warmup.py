"""Imported by the test harness's forkserver only: pays torch's one-time lazy initialization once.

The first forward/backward and the first optimizer step in a fresh process import and
register a lot lazily (about 0.6 s on a 2-core machine). Doing it in the forkserver means
every rank forked from it starts warm. Nothing here runs in a normal import of shardline.
"""

import torch
import torch.nn.functional as F


def _warm_up() -> None:
    # One thread: an OpenMP pool started here could not be reused safely by forked children.
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Embedding(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logits = model(torch.zeros(2, dtype=torch.long))
    F.cross_entropy(F.gelu(logits), torch.zeros(2, dtype=torch.long)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


_warm_up()
