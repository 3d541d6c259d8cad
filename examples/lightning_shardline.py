"""Train a LightningModule with shardline's ``ShardlineStrategy`` (``pip install 'shardline[lightning]'``).

    python examples/lightning_shardline.py --devices 2            # Lightning starts the second process
    python examples/lightning_shardline.py --devices 2 --resume   # continue from the newest checkpoint

The model's blocks are shardline units (FULL_SHARD), ``gradient_clip_val`` clips by the global
norm (logged as ``grad_norm``), and ``ModelCheckpoint`` writes shardline checkpoints: one
directory per checkpoint with a SHA-256 manifest, chained in ``CKPT_DIR/lineage.sqlite``
(``shardline verify`` / ``shardline lineage`` check them). Resuming works at any ``--devices``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from shardline.lightning import ShardlineStrategy


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Regressor(pl.LightningModule):
    def __init__(self, dim: int = 32, depth: int = 4, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(depth)))
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def data(n: int = 2048) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :1] * x[:, 1:2]).sin() + 0.5 * x[:, 2:3]
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default="lightning_runs", help="checkpoints go to OUT/checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT")
    args = parser.parse_args()
    pl.seed_everything(0)
    ckpt_dir = Path(args.out) / "checkpoints"
    newest = max(ckpt_dir.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, default=None) if args.resume else None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=ShardlineStrategy(auto_wrap_policy=[Block]),
        max_epochs=args.epochs,
        gradient_clip_val=1.0,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)],
        default_root_dir=args.out,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), data(), ckpt_path=str(newest) if newest else None)
    if trainer.is_global_zero:
        print(f"final loss {float(trainer.callback_metrics['loss']):.4f}; checkpoints in {ckpt_dir}")


if __name__ == "__main__":
    main()
