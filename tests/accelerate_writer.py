"""Write accelerate SHARDED_STATE_DICT checkpoints with accelerate's own writer, on 2 CPU processes.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/accelerate_writer.py OUT_DIR

accelerate enables FSDP only on accelerators: on CPU, ``Accelerator(cpu=True, fsdp_plugin=...)`` resolves to
``MULTI_CPU`` (gloo) and drops the plugin, so ``prepare`` would wrap the model in DDP and ``save_state`` would
write ``model.safetensors`` + ``optimizer.bin``. The narrowest honest route: a real Accelerator (it starts the
gloo process group), the model wrapped the way accelerate's ``prepare`` wraps it for FSDP (per decoder layer and
at the root; compiled last), then the three calls ``save_state`` makes for FSDP, with a real plugin:
``save_fsdp_model``, ``save_fsdp_optimizer``, ``save_accelerator_state``. Two runs:

- OUT_DIR/fsdp2: FSDP2 (``fully_shard``), what accelerate's ``fsdp2_prepare_model`` does;
- OUT_DIR/fsdp1_compiled: FSDP1 with ``torch.compile`` (accelerate compiles after wrapping, so the model
  keys it saves read ``model._orig_mod.*``).

Each holds checkpoint/ (``pytorch_model_fsdp_0/``, ``optimizer_0/``, ``random_states_N.pkl``) and
reference.pt (the full model state dict, gathered, from rank 0); OUT_DIR/config.json is the model's config.
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


def _train_and_save(accelerator, plugin, model, out: Path, forward=None) -> None:
    """Two AdamW steps (through ``forward``, default ``model``), then what ``Accelerator.save_state`` writes
    for FSDP, and the gathered reference."""
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        accelerator.backward((forward or model)(ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    ckpt = out / "checkpoint"
    save_fsdp_model(plugin, accelerator, model, str(ckpt), 0)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(ckpt), 0)
    save_accelerator_state(str(ckpt), [], [], [], [], accelerator.process_index, accelerator.step)
    # NOTE: cpu_offload=True segfaults in torch 2.13's FSDP1 full-state-dict hook on a CPU device; the
    # tensors are on the CPU already.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if accelerator.is_main_process:
        torch.save(full, out / "reference.pt")
    accelerator.wait_for_everyone()


def main(out: Path) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    warnings.filterwarnings("ignore")
    fsdp2 = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=True, fsdp_plugin=fsdp2)
    # NOTE: if a future accelerate honours FSDP on CPU, this fails and the writer should use prepare/save_state.
    assert accelerator.distributed_type == DistributedType.MULTI_CPU and accelerator.num_processes == 2

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    _train_and_save(accelerator, fsdp2, model, out / "fsdp2")

    torch.manual_seed(1)
    fsdp1 = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type="SHARDED_STATE_DICT")
    wrapped = FullyShardedDataParallel(LlamaForCausalLM(tiny_llama_config()), device_id=torch.device("cpu"),
                                       use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))
    # NOTE: the steps run through the FSDP1 module and the save through its compiled wrapper (what accelerate
    # holds): compiling the forward changes no saved byte and costs ~15 s of tracing on a busy 2-core machine.
    _train_and_save(accelerator, fsdp1, torch.compile(wrapped, backend="eager"), out / "fsdp1_compiled", wrapped)
    if accelerator.is_main_process:
        model.config.to_json_file(out / "config.json")
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
