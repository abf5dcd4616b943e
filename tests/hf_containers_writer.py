"""Trainers' saves of a tiny transformers Llama (tests/trainers_writer.py's), for tests/test_export_hf_containers.py,
each with the model's HF config and the logits the trained model gives (``OUT/config.json``, ``OUT/logits.pt``):

    python tests/hf_containers_writer.py deepspeed OUT STAGE   DeepSpeed ZeRO: one CPU rank (gloo), two Adam steps,
                                                               ``engine.save_checkpoint(OUT/ckpt)``
    python tests/hf_containers_writer.py lightning OUT         a LightningModule holding the model as ``self.model``:
                                                               one step, ``trainer.save_checkpoint(OUT/model.ckpt)``

DeepSpeed and Lightning are test-only dependencies: the product never imports them."""

from __future__ import annotations

import os
import socket
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def lightning(out: Path) -> None:
    import lightning as L
    import torch
    from trainers_writer import _logits, tiny_llama

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama(False).train()

        def training_step(self, batch, _idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    module = Module()
    module.model.config.to_json_file(str(out / "config.json"))
    data = torch.utils.data.DataLoader(torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(3)),
                                       batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    trainer.save_checkpoint(str(out / "model.ckpt"))
    _logits(module.model, out / "logits.pt")


def deepspeed(out: Path, stage: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    import deepspeed.comm.torch
    import torch
    from trainers_writer import _logits, tiny_llama

    # NOTE: DeepSpeed's CPU accelerator would compile a shared-memory all-reduce op at init (make_deepspeed_fixtures)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_llama(False).train()
    model.config.to_json_file(str(out / "config.json"))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 12), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(str(out / "ckpt"))
    if stage == 3:  # ZeRO-3 partitions the module's parameters: gather them for the reference forward
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            _logits(model, out / "logits.pt")
    else:
        _logits(model, out / "logits.pt")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # NOTE: no teardown with gloo's threads alive (make_deepspeed_fixtures.train says why)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    if sys.argv[1] == "deepspeed":
        deepspeed(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        lightning(Path(sys.argv[2]))
