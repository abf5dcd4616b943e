"""Train a tiny model with a real Lightning Trainer (1 CPU process) logging with Lightning's CSVLogger where
Lightning puts it (RUN/lightning_logs/version_0/metrics.csv) and checkpointing every 2 steps into
RUN/checkpoints, as a user's script does.

    python tests/lightning_csv_run.py RUN
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch import nn


def main(run: Path) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    warnings.filterwarnings("ignore")

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 2)

        def training_step(self, batch, _idx):
            loss = self.body(batch[0]).pow(2).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 4)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, log_every_n_steps=1, logger=CSVLogger(str(run)),
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(run),
                        callbacks=[ModelCheckpoint(dirpath=str(run / "checkpoints"), every_n_train_steps=2,
                                                   save_top_k=-1)])
    trainer.fit(Net(), data)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
