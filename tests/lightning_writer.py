"""Write a sharded checkpoint with a real Lightning Trainer on 2 CPU processes (ModelParallelStrategy:
FSDP2 ``fully_shard`` over gloo; FSDP1's FSDPStrategy refuses to run without an accelerator).

    python tests/lightning_writer.py OUT_DIR

Lightning re-runs this script for rank 1. Writes OUT_DIR/ckpt (``state_dict.*``, ``optimizer_0.*``,
``meta.pt``) and OUT_DIR/reference.pt (the full model state dict, gathered, from rank 0).
"""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

import torch
from gloo_retry import RunFailed, retry_gloo, run_ok
from torch import nn


def main(out: Path) -> None:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

        def configure_model(self) -> None:
            for layer in self.body:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh)
            fully_shard(self.body, mesh=self.device_mesh)

        def training_step(self, batch, _idx):
            return self.body(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(out))
    model = Net()
    trainer.fit(model, data)
    trainer.save_checkpoint(out / "ckpt")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.global_rank == 0:
        torch.save(full, out / "reference.pt")


def write(out: Path, attempts: int = 3) -> None:
    """Run this script as the tests do (Lightning starts rank 1 itself), from an empty folder each try: Lightning
    rendezvouses on a TCP port it picked free a moment before, which another process on a busy machine may take
    in between. Fails with the last try's output."""
    def empty() -> Path:
        shutil.rmtree(out / "ckpt", ignore_errors=True)
        (out / "reference.pt").unlink(missing_ok=True)
        return out

    try:
        retry_gloo(empty, lambda folder: run_ok([sys.executable, __file__, str(folder)], timeout=600), attempts)
    except RunFailed as e:
        last = e.proc.stderr[-3000:]
        raise AssertionError(f"tests/lightning_writer.py failed {attempts} times; the last:\n{last}") from None


if __name__ == "__main__":
    main(Path(sys.argv[1]))
