"""Write a real Megatron-Core ``torch_dist`` save dir with Megatron-Core's own ``dist_checkpointing.save`` on CPU:
two gloo ranks, tensor-parallel 2, three iterations, as Megatron-LM's ``save_checkpoint`` lays them out.

    python tests/make_megatron_fixtures.py ROOT               ROOT/run/ (what the tests run)
    torchrun --standalone --nproc_per_node 2 tests/make_megatron_fixtures.py --save SAVE_DIR

``ROOT/run/`` holds ``iter_0000100/``, ``iter_0000200/``, ``iter_0000300/`` (each ``metadata.json``, ``common.pt``,
``.metadata``, ``__0_0.distcp``, ``__1_0.distcp``) and ``latest_checkpointed_iteration.txt`` naming 300. The state
dict is Megatron's shape of one: the model's ShardedTensors under their Megatron keys (the vocab-parallel embedding
and column-parallel ``linear_fc1`` split on their first dimension, the row-parallel ``linear_fc2`` on their second,
the layers stacked on a prepended axis as TransformerBlock does, the final norm replicated), the optimizer's
``exp_avg``/``exp_avg_sq`` sharded alike, its param groups, ``args`` (an argparse.Namespace holding Megatron's enums,
a torch dtype and a signal), ``iteration``, ``checkpoint_version``, the scheduler state, and each rank's RNG state as a
ShardedObject (random, numpy and torch states). Everything not sharded is Megatron's ``common.pt``.

Two things make Megatron-Core 0.16.1's save run on a CPU-only torch, and they are worked around here, not in
Megatron: (1) its FileSystemWriterAsync starts a ``multiprocessing`` Manager with the *spawn* start method, which
re-imports the ``__main__`` script: a script without a ``__main__`` guard runs again in that process (a second
``init_process_group`` that waits forever: the hang an earlier trial saw after ``common.pt``), and the Manager,
never shut down, keeps the output pipes open after the ranks exit (so it is shut down before exit); (2) the save
path calls ``torch.cuda.synchronize()`` (preload_tensors, non_blocking) and ``torch.cuda.current_device()`` (the
finalize's failure broadcast), which a CPU build refuses: both are replaced by CPU no-ops on such a build.
megatron-core is a test-only dependency: the product never imports it.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

ITERATIONS = (100, 200, 300)
TP = 2
LAYERS, HIDDEN, FFN, VOCAB = 2, 8, 16, 16
RUN_TIMEOUT = 300
# every tensor of the save: Megatron key -> (global shape, the axis tensor parallelism splits (None: replicated))
TENSORS = {
    "embedding.word_embeddings.weight": ((VOCAB, HIDDEN), 0),
    "decoder.layers.mlp.linear_fc1.weight": ((LAYERS, FFN, HIDDEN), 1),
    "decoder.layers.mlp.linear_fc2.weight": ((LAYERS, HIDDEN, FFN), 2),
    "decoder.final_layernorm.weight": ((HIDDEN,), None),
}
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")


def stored_key(key: str, state: str = "") -> str:
    """The name a tensor has in the checkpoint: the model's key, or ``optimizer.state.<state>.<key>``."""
    return f"optimizer.state.{state}.{key}" if state else key


def full_tensor(key: str, iteration: int, state: str = ""):
    """The full (unsharded) value of model tensor ``key`` (or its optimizer ``state``) at ``iteration``: what every
    rank's shard is cut from."""
    import zlib

    import torch

    g = torch.Generator().manual_seed(zlib.crc32(stored_key(key, state).encode()))
    return torch.randn(TENSORS[key][0], generator=g) + iteration / 100


def _sharded(key: str, state: str, value, rank: int) -> dict:
    """The ShardedTensors rank ``rank`` gives for the full ``value`` of model tensor ``key`` (or its optimizer
    ``state``): one per layer when the layers are stacked."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    _, axis = TENSORS[key]
    stacked = key.startswith("decoder.layers.")
    out = {}
    for layer in range(LAYERS if stacked else 1):
        part = value[layer] if stacked else value
        offsets = [(0, layer, LAYERS)] if stacked else []
        if axis is None:
            local = part.clone()
            replica_id = (0, rank, 0)  # replicated: rank 0 holds the main copy
        else:
            local = part.chunk(TP, axis - 1 if stacked else axis)[rank].clone()
            offsets.append((axis, rank, TP))
            replica_id = (0, 0, 0)
        out[f"{key}.{layer}" if stacked else key] = ShardedTensor.from_rank_offsets(
            stored_key(key, state), local, *offsets, replica_id=replica_id, prepend_axis_num=1 if stacked else 0)
    return out


def state_dict(iteration: int, rank: int) -> dict:
    """Megatron-LM's ``generate_state_dict`` for a GPT model with Adam, as one tensor-parallel rank gives it."""
    import argparse
    import random
    import signal

    import numpy as np
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    model = {}
    optimizer_state: dict[str, dict] = {state: {} for state in OPTIMIZER_STATES}
    for key in TENSORS:
        model.update(_sharded(key, "", full_tensor(key, iteration), rank))
        for state in OPTIMIZER_STATES:
            optimizer_state[state].update(_sharded(key, state, full_tensor(key, iteration, state), rank))
    args = argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, padded_vocab_size=VOCAB,
        tensor_model_parallel_size=TP, pipeline_model_parallel_size=1, lr=3e-4, min_lr=3e-5, seed=1234,
        micro_batch_size=2, global_batch_size=8, train_iters=1000, save="/runs/gpt-tiny", ckpt_format="torch_dist",
        params_dtype=torch.float32, model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto,
        exit_signal=signal.SIGTERM, data_path=["/data/tiny_text_document"], iteration=iteration)
    random.seed(iteration + rank)
    np.random.seed(iteration + rank)
    torch.manual_seed(iteration + rank)
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None, "rng_tracker_states": {}}]
    return {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model,
        "optimizer": {"state": optimizer_state,
                      "param_groups": [{"lr": 3e-4, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8,
                                        "wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False,
                                        "params": list(range(len(TENSORS)))}]},
        "opt_param_scheduler": {"max_lr": 3e-4, "min_lr": 3e-5, "lr_warmup_steps": 10, "num_steps": iteration * 8,
                                "lr_decay_style": "cosine", "lr_decay_steps": 8000},
        "rng_state": ShardedObject("rng_state", rng, (1, TP), (0, rank), replica_id=0),
        "num_floating_point_operations_so_far": 1.5e12 * iteration,
    }


def save(save_dir: str) -> None:
    """One rank (under torchrun): every iteration saved with Megatron-Core's own dist_checkpointing.save, and the
    tracker file written after each, as Megatron-LM's save_checkpoint does."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if not torch.cuda.is_available():  # see the module's docstring, (2)
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    rank = dist.get_rank()
    for iteration in ITERATIONS:
        folder = os.path.join(save_dir, f"iter_{iteration:07d}")
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
        dist.barrier()
        strategy = get_default_save_sharded_strategy("torch_dist")
        dist_checkpointing.save(state_dict(iteration, rank), folder, strategy)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))
        dist.barrier()
    queue = filesystem_async._results_queue  # see the module's docstring, (1)
    if queue is not None:
        queue._manager.shutdown()
    # NOTE: no teardown: a rank's exit with gloo's threads alive aborted now and then (make_fixtures._worker)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make(run: Path) -> Path:
    """The save dir from an empty folder."""
    from gloo_retry import RunFailed, run_ok

    run.mkdir(parents=True, exist_ok=True)
    try:
        run_ok([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={TP}",
                str(Path(__file__).resolve()), "--save", str(run)], timeout=RUN_TIMEOUT)
    except RunFailed as exc:  # say why (the retry reports only the exit code)
        print(exc.proc.stdout[-2000:], exc.proc.stderr[-6000:], sep="\n", file=sys.stderr)
        raise
    return run


def empty(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def make_all(root: Path) -> Path:
    """``root/run``, made once (a ``.run.done`` marker lets a kept root be reused)."""
    from gloo_retry import retry_gloo

    marker = root / ".run.done"
    if not marker.exists():
        retry_gloo(lambda: empty(root / "run"), make, name="make_megatron_fixtures")
        marker.write_text("ok")
    return root / "run"


if __name__ == "__main__":  # NOTE: the guard matters: Megatron's spawned Manager re-imports this script
    if sys.argv[1] == "--save":
        save(sys.argv[2])
    else:
        make_all(Path(sys.argv[1]))
