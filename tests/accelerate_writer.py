"""Write an accelerate FSDP2 SHARDED_STATE_DICT checkpoint with accelerate's own writer, on 2 CPU processes.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/accelerate_writer.py OUT_DIR

accelerate enables FSDP only on accelerators: on CPU, ``Accelerator(cpu=True, fsdp_plugin=...)`` resolves to
``MULTI_CPU`` (gloo) and drops the plugin, so ``prepare`` would wrap the model in DDP and ``save_state`` would
write ``model.safetensors`` + ``optimizer.bin``. The narrowest honest route: a real Accelerator (it starts the
gloo process group), the model sharded with FSDP2's ``fully_shard`` per decoder layer and at the root (what
accelerate's ``fsdp2_prepare_model`` does for a transformers model), then the three calls ``save_state`` makes
for FSDP, with the real plugin: ``save_fsdp_model``, ``save_fsdp_optimizer``, ``save_accelerator_state``.

Writes OUT_DIR/checkpoint (``pytorch_model_fsdp_0/``, ``optimizer_0/``, ``random_states_N.pkl``),
OUT_DIR/config.json and OUT_DIR/reference.pt (the full model state dict, gathered, from rank 0).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

VOCAB = 97


def tiny_llama_config():
    """A Llama small enough to train a step on CPU in well under a second (no download: built from a config)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def main(out: Path) -> None:
    from accelerate import Accelerator
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    warnings.filterwarnings("ignore")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    # NOTE: if a future accelerate honours FSDP on CPU, this fails and the writer should use prepare/save_state.
    assert accelerator.distributed_type == DistributedType.MULTI_CPU and accelerator.num_processes == 2

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, VOCAB, (2, 12))
    for _ in range(2):
        accelerator.backward(model(ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()

    ckpt = out / "checkpoint"
    save_fsdp_model(plugin, accelerator, model, str(ckpt), 0)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(ckpt), 0)
    save_accelerator_state(str(ckpt), [], [], [], [], accelerator.process_index, accelerator.step)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if accelerator.is_main_process:
        torch.save(full, out / "reference.pt")
        model.config.to_json_file(out / "config.json")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
