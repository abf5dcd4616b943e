"""Write tiny Megatron-Core GPT models with Megatron-Core itself, on CPU over gloo, and the logits of its own forward:
the reference the Hugging Face export is proven against (tests/test_export_hf_megatron.py).

    python tests/megatron_gpt_writer.py ROOT                     every TP size in TP_SIZES, one torchrun each
    torchrun --standalone --nproc_per_node N tests/megatron_gpt_writer.py --save ROOT/tp<N>

For each TP size and each variant in VARIANTS, ``ROOT/tp<N>/<variant>/`` holds ``run/iter_0000010/`` (saved with
Megatron-Core's own ``dist_checkpointing.save`` in ``torch_dist`` format: the model's sharded state dict, and in
``common.pt`` what Megatron-LM's ``save_checkpoint`` puts beside it: ``args`` (an argparse.Namespace of the model's
arguments as Megatron-LM records them), ``iteration``, ``checkpoint_version``),
``run/latest_checkpointed_iteration.txt``, ``tokens.safetensors`` (fixed ids) and ``logits.safetensors``
(``GPTModel.forward(ids, positions, causal mask)`` in fp32, over the padded vocabulary).

The models: ``GPTModel`` with the local layer spec, swiglu, RMSNorm, rotary embeddings, GQA (query groups < heads),
a vocabulary padded past the tokenizer's (``make_vocab_size_divisible_by``); ``llama``: no bias, untied output
layer, head_dim = hidden/heads; ``qwen2``: q/k/v biases, tied output layer, head_dim != hidden/heads;
``interleaved``: rotary embeddings on adjacent pairs (``rotary_interleaved``), as many query groups as heads;
``biased``: a bias on every linear layer (``add_bias_linear``).
Megatron-Core's CPU workarounds are make_megatron_fixtures.py's (its docstring says why).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

TP_SIZES = (1, 2)
ITERATION = 10
LAYERS, HIDDEN, FFN, SEQ = 2, 64, 96, 12
VOCAB_BEFORE_EOD = 99  # --vocab-size of Megatron's NullTokenizer, whose vocabulary is this plus its EOD token
VOCAB = VOCAB_BEFORE_EOD + 1
DIVISIBLE_BY = 32  # --make-vocab-size-divisible-by: padded to a multiple of this times TP (128 for TP 1 and 2)
ROPE_BASE, NORM_EPS = 10000, 1e-5
VARIANTS = {"llama": {"heads": 4, "groups": 2, "kv_channels": 16, "qkv_bias": False, "tied": False},
            "qwen2": {"heads": 8, "groups": 2, "kv_channels": 12, "qkv_bias": True, "tied": True},
            "interleaved": {"heads": 4, "groups": 4, "kv_channels": 16, "qkv_bias": False, "tied": False,
                            "rotary_interleaved": True},
            "biased": {"heads": 4, "groups": 2, "kv_channels": 16, "qkv_bias": True, "tied": False,
                       "bias_linear": True}}
RUN_TIMEOUT = 300


def padded_vocab(tp: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``."""
    multiple = DIVISIBLE_BY * tp
    return -(-VOCAB // multiple) * multiple


def megatron_args(variant: dict, tp: int):
    """The ``args`` Megatron-LM's ``save_checkpoint`` records in ``common.pt`` for this model (after its
    ``validate_args``), with the types Megatron's own hold (a torch dtype, enums)."""
    import argparse

    import torch
    from megatron.core.enums import ModelType

    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=variant["heads"],
        group_query_attention=True, num_query_groups=variant["groups"], kv_channels=variant["kv_channels"],
        max_position_embeddings=64, seq_length=SEQ, position_embedding_type="rope", rotary_percent=1.0,
        rotary_base=ROPE_BASE, rotary_interleaved=variant.get("rotary_interleaved", False), use_rope_scaling=False,
        normalization="RMSNorm", norm_epsilon=NORM_EPS, swiglu=True,
        untie_embeddings_and_output_weights=not variant["tied"],
        add_bias_linear=variant.get("bias_linear", False), add_qkv_bias=variant["qkv_bias"], qk_layernorm=False,
        num_experts=None,
        multi_latent_attention=False, apply_layernorm_1p=False, tokenizer_type="NullTokenizer",
        vocab_size=VOCAB_BEFORE_EOD, make_vocab_size_divisible_by=DIVISIBLE_BY, padded_vocab_size=padded_vocab(tp),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, transformer_impl="local",
        params_dtype=torch.float32, model_type=ModelType.encoder_or_decoder, ckpt_format="torch_dist",
        iteration=ITERATION, seed=1234, lr=3e-4)


def build(variant: dict, tp: int):
    """The GPTModel of ``variant`` (every rank builds the same global weights; norms and biases made non-trivial)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=variant["heads"],
        num_query_groups=variant["groups"], kv_channels=variant["kv_channels"], normalization="RMSNorm",
        layernorm_epsilon=NORM_EPS, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=variant.get("bias_linear", False),
        add_qkv_bias=variant["qkv_bias"], tensor_model_parallel_size=tp, use_cpu_initialization=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, init_method_std=0.2,
        rotary_interleaved=variant.get("rotary_interleaved", False))
    torch.manual_seed(7)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), padded_vocab(tp), 64,
                     parallel_output=False, share_embeddings_and_output_weights=variant["tied"],
                     position_embedding_type="rope", rotary_base=ROPE_BASE)
    rank = torch.distributed.get_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                # a tensor-parallel shard differs per rank; a replicated one is the same on every rank
                seed = 1000 + len(name) + (rank if getattr(p, "tensor_model_parallel", False) else 0)
                g = torch.Generator().manual_seed(seed)
                p.copy_(torch.rand(p.shape, generator=g) + 0.5 if name.endswith("weight")
                        else torch.randn(p.shape, generator=g))
    return model.eval()


def forward(model):
    """(ids, fp32 logits over the padded vocabulary) of Megatron's own forward on fixed ids."""
    import torch

    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]  # True: masked out
    with torch.no_grad():
        logits = model(ids, positions, mask)
    return ids, logits.float().contiguous()


def save(root: str) -> None:
    """One rank (under torchrun): every variant built, run and saved with Megatron-Core's dist_checkpointing."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if not torch.cuda.is_available():  # make_megatron_fixtures.py's docstring, (2)
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from safetensors.torch import save_file

    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    if not torch.cuda.is_available():  # the attention's dropout forks the CUDA RNG (dropout is 0 here): a no-op
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    rank = dist.get_rank()
    for name, variant in VARIANTS.items():
        out = os.path.join(root, name)
        folder = os.path.join(out, "run", f"iter_{ITERATION:07d}")
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
        dist.barrier()
        model = build(variant, tp)
        ids, logits = forward(model)
        state = {"args": megatron_args(variant, tp), "checkpoint_version": 3.0, "iteration": ITERATION,
                 "model": model.sharded_state_dict()}
        dist_checkpointing.save(state, folder, get_default_save_sharded_strategy("torch_dist"))
        dist.barrier()
        if rank == 0:
            with open(os.path.join(out, "run", "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(ITERATION))
            save_file({"tokens": ids}, os.path.join(out, "tokens.safetensors"))
            save_file({"logits": logits}, os.path.join(out, "logits.safetensors"))
        dist.barrier()
    queue = filesystem_async._results_queue  # make_megatron_fixtures.py's docstring, (1)
    if queue is not None:
        queue._manager.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # NOTE: no teardown, as make_megatron_fixtures.save (gloo's threads alive at exit)


def make_all(root: Path) -> Path:
    """``root/tp<N>`` for every TP size, one torchrun each, retried from an empty folder as every gloo writer is."""
    import shutil

    from gloo_retry import RunFailed, retry_gloo, run_ok

    def empty(folder: Path) -> Path:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return folder

    for tp in TP_SIZES:
        def run(folder: Path, tp: int = tp) -> None:
            try:
                run_ok([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}",
                        str(Path(__file__).resolve()), "--save", str(folder)], timeout=RUN_TIMEOUT)
            except RunFailed as exc:
                print(exc.proc.stdout[-2000:], exc.proc.stderr[-6000:], sep="\n", file=sys.stderr)
                raise
        retry_gloo(lambda tp=tp: empty(root / f"tp{tp}"), run, name=f"megatron_gpt_writer tp{tp}")
    return root


if __name__ == "__main__":  # NOTE: the guard matters: Megatron's spawned Manager re-imports this script
    if sys.argv[1] == "--save":
        save(sys.argv[2])
    else:
        make_all(Path(sys.argv[1]))
