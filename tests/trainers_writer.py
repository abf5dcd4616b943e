"""The writers behind tests/test_export_trainers.py, each run as a subprocess: a Lightning
``Trainer(strategy="ddp")`` checkpoint file, a Lightning Fabric ``fabric.save`` (FSDP2 on 2 CPU processes)
whose model and optimizer carry the user's own names, and a torchtitan-style Llama state written by
``dcp.save`` from 2 gloo ranks with ``fully_shard``; and a tiny transformers Llama, tied and untied, as
``save_pretrained`` writes it, as a torch DCP recipe save of the module with its optimizer, and as a
``transformers.Trainer`` run of 2 steps writes its checkpoints (with the logits each model gives).

``python tests/trainers_writer.py trainer_ddp|fabric|titan|transformers OUT``.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).parent
VOCAB = 101
# torchtitan's Llama names -> Hugging Face's (what a user passes as --rename rules, in order)
TITAN_TO_HF = [r"^tok_embeddings\.=model.embed_tokens.", r"^norm\.=model.norm.", r"^output\.=lm_head.",
               r"^layers\.=model.layers.", r"\.attention\.wq\.=.self_attn.q_proj.",
               r"\.attention\.wk\.=.self_attn.k_proj.", r"\.attention\.wv\.=.self_attn.v_proj.",
               r"\.attention\.wo\.=.self_attn.o_proj.", r"\.feed_forward\.w1\.=.mlp.gate_proj.",
               r"\.feed_forward\.w2\.=.mlp.down_proj.", r"\.feed_forward\.w3\.=.mlp.up_proj.",
               r"\.attention_norm\.=.input_layernorm.", r"\.ffn_norm\.=.post_attention_layernorm."]


# ------------------------------------------------------------------ writers (run as subprocesses)
def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def write_trainer_ddp(out: Path) -> None:
    """Lightning Trainer, DDP on 2 CPU processes: ``save_checkpoint`` writes one torch file."""
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = _mlp()

        def training_step(self, batch, _idx):
            return self.body(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(out))
    model = Net()
    trainer.fit(model, data)
    trainer.save_checkpoint(out / "ddp.ckpt")
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.body.state_dict().items()}, out / "ddp_reference.pt")


def write_fabric(out: Path) -> None:
    """Lightning Fabric, ModelParallelStrategy (FSDP2) on 2 CPU processes: ``fabric.save`` of the user's own
    names, ``{"net": model, "opt": optimizer, ...}`` (a DCP folder plus ``meta.pt``)."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    def parallelize(model: nn.Module, mesh) -> nn.Module:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(parallelize))
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=False):
        model = _mlp()
    model = fabric.setup(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    fabric.backward(model(torch.randn(4, 8)).pow(2).mean())
    opt.step()
    fabric.save(out / "fabric", {"net": model, "opt": opt, "iteration": 7, "hparams": {"lr": 0.01}})
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if fabric.global_rank == 0:
        torch.save(full, out / "fabric_reference.pt")


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


class _Names(nn.Module):
    """Holds given modules under given names (torchtitan's module tree over the HF model's own parameters)."""

    def __init__(self, **mods: nn.Module) -> None:
        super().__init__()
        for name, mod in mods.items():
            self.add_module(name, mod)


def _titan_tree(hf: nn.Module) -> nn.Module:
    def block(layer: nn.Module) -> nn.Module:
        a, m = layer.self_attn, layer.mlp
        return _Names(attention=_Names(wq=a.q_proj, wk=a.k_proj, wv=a.v_proj, wo=a.o_proj),
                      feed_forward=_Names(w1=m.gate_proj, w2=m.down_proj, w3=m.up_proj),
                      attention_norm=layer.input_layernorm, ffn_norm=layer.post_attention_layernorm)

    return _Names(tok_embeddings=hf.model.embed_tokens,
                  layers=nn.ModuleDict({str(i): block(x) for i, x in enumerate(hf.model.layers)}),
                  norm=hf.model.norm, output=hf.lm_head)


def write_titan_rank(out: Path, rank: int) -> None:
    """One of 2 gloo ranks: a Llama under torchtitan's names, FSDP2 ``fully_shard`` per block, and the state
    torchtitan checkpoints (model keys at the top level, optimizer, lr_scheduler, dataloader, train_state)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(llama_config()).eval()
    if rank == 0:
        llama_config().save_pretrained(out / "cfg")
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.save({"ids": ids, "logits": hf(ids).logits}, out / "logits.pt")
    model = _titan_tree(hf)
    for b in model.layers.values():
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # the moments move, the weights (and logits) stay
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = {**get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt),
             "lr_scheduler": {"lr_scheduler_0": {"last_epoch": 12, "base_lrs": [0.0]}},
             "dataloader": {"world_size": 2, f"dp_rank_{rank}": b"position=%d" % rank},
             # older torchtitan kept a BytesIO here; DCP pickles it and dcp_to_torch_save gives it back
             "train_state": {"step": torch.tensor(12), "global_avg_losses": io.BytesIO(b"\x00" * 8)}}
    dcp.save(state, checkpoint_id=str(out / "titan"))
    dist.destroy_process_group()


def write_titan(out: Path) -> None:
    ranks = [subprocess.Popen([sys.executable, __file__, "titan_rank", str(out), str(r)]) for r in range(2)]
    sys.exit(max(p.wait(600) for p in ranks))


def tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=tied)).eval()


def _logits(model: nn.Module, out: Path) -> None:
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.save({"ids": ids, "logits": model.eval()(ids).logits}, out)


def write_transformers(out: Path) -> None:
    """``llama_{tied,untied}/`` (save_pretrained), ``dcp_{tied,untied}/`` (``dcp.save({"model": ...,
    "optimizer": ...})`` of the module), ``trainer/checkpoint-{1,2}/`` (an untied model's Trainer run), each with
    ``<name>.logits.pt``."""
    import torch.distributed.checkpoint as dcp
    from transformers import Trainer, TrainingArguments

    for name, tied in (("tied", True), ("untied", False)):
        model = tiny_llama(tied)
        model.save_pretrained(out / f"llama_{name}")
        _logits(model, out / f"llama_{name}.logits.pt")
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # the moments move, the weights stay
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                 checkpoint_id=str(out / f"dcp_{name}"), no_dist=True)
    model = tiny_llama(False).train()
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (8, 12),
                                                                        generator=torch.Generator().manual_seed(2))]
    args = TrainingArguments(output_dir=str(out / "trainer"), max_steps=2, save_steps=1, per_device_train_batch_size=4,
                             learning_rate=1e-2, report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data).train()
    _logits(model, out / "trainer.logits.pt")


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    what, where = sys.argv[1], Path(sys.argv[2])
    if what == "titan_rank":
        write_titan_rank(where, int(sys.argv[3]))
    else:
        {"trainer_ddp": write_trainer_ddp, "fabric": write_fabric, "titan": write_titan,
         "transformers": write_transformers}[what](where)
    # NOTE: no destructors at exit: freeing a DDP model after its gloo group is gone can hang for ever with
    # torch 2.13 (~Reducer -> ~ProcessGroupGloo joins a thread that waits for the GIL; see make_fixtures.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

