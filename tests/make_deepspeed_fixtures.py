"""Write real DeepSpeed ZeRO checkpoints with DeepSpeed's own ``engine.save_checkpoint`` on CPU (gloo), and
DeepSpeed's own consolidation of each as the reference the parser is tested against.

    python tests/make_deepspeed_fixtures.py ROOT            every variant under ROOT/<name>/ (what the tests run)
    torchrun --standalone --nproc_per_node N tests/make_deepspeed_fixtures.py --train SAVE_DIR STAGE DTYPE
    python tests/make_deepspeed_fixtures.py --reference VARIANT_DIR

A variant folder holds ``ckpt/`` (the save dir: ``latest`` and ``global_step2/``) and ``reference.pt``: what
``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` returns (``fp32``), and the same
reconstruction (DeepSpeed's own code) run over each optimizer state instead of the fp32 master weights
(``exp_avg``, ``exp_avg_sq``), plus the model file's ``module`` dicts (ZeRO-1 saves no frozen fragments: its
frozen parameters are only there). DeepSpeed is a test-only dependency: the product never imports it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

# name -> (ZeRO stage, dtype, ranks): the padding rules differ by stage and world size, the files by dtype; the
# 3-rank saves have two param groups
VARIANTS = {
    "z1-fp32-2r": (1, "fp32", 2),
    "z2-bf16-2r": (2, "bf16", 2),
    "z3-fp32-2r": (3, "fp32", 2),
    "z3-bf16-3r": (3, "bf16", 3),
    "z2-fp32-3r": (2, "fp32", 3),
}
TAG = "global_step2"  # DeepSpeed names a save by its global step: two steps are trained
RUN_TIMEOUT = 300


def _model():
    import torch
    from torch import nn

    class TinyDS(nn.Module):
        """Odd numels (13x7, 7x5, 5) so partitions need padding; a frozen layer; a persistent float and int
        buffer and a non-persistent one; the head tied to the embedding (one Parameter in two modules)."""

        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(13, 7)
            self.proj = nn.Linear(7, 5)
            self.norm = nn.LayerNorm(5)
            self.frozen = nn.Linear(5, 3)
            self.frozen.requires_grad_(False)
            self.up = nn.Linear(3, 7)
            self.head = nn.Linear(7, 13, bias=False)
            self.head.weight = self.emb.weight
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 7))
            self.register_buffer("seen", torch.tensor([3, 1, 4], dtype=torch.int64))
            self.register_buffer("scratch", torch.zeros(2), persistent=False)

        def forward(self, idx):
            x = self.emb(idx) * self.scale.to(self.emb.weight.dtype)
            h = self.up(self.frozen(self.norm(self.proj(x))))
            return self.head(x + h)

    return TinyDS()


def train(save_dir: str, stage: int, dtype: str) -> None:
    """One rank (under torchrun): two Adam steps of the tiny model, then DeepSpeed's own save_checkpoint."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.torch
    import torch

    # NOTE: on the CPU accelerator DeepSpeed compiles a shared-memory all-reduce op (C++, seconds, needs a
    # compiler) at init; gloo does the collectives here, so the op is not built
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = _model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        # torch's own Adam: DeepSpeed's FusedAdam/CPUAdam are compiled ops, not built here (DS_BUILD_OPS=0)
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if world == 3:  # two param groups, as trainers make them (no weight decay on biases and norms)
        groups = [{"params": [p for n, p in trained if n.endswith("weight") and not n.startswith("norm")]},
                  {"params": [p for n, p in trained if n.endswith("bias") or n.startswith("norm")],
                   "weight_decay": 0.0}]
    else:
        groups = [p for _, p in trained]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):
        idx = torch.randint(0, 13, (2, 6), generator=g)
        logits = engine(idx)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(save_dir)  # tag global_step2 and the `latest` file
    torch.distributed.barrier()
    # NOTE: no teardown: a rank's exit with DeepSpeed's engine and gloo's threads alive aborted ("terminate called
    # without an active exception", 1 run in 3), as make_fixtures._worker explains for DDP; leave at once
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _reconstruct(ds_dir: str, groups_of) -> dict:
    """DeepSpeed's own zero_to_fp32 reconstruction, its flat fp32 groups replaced by ``groups_of(optim state
    dict, fp32 groups)`` (an optimizer state laid out like them): which elements belong to which parameter is
    then decided by DeepSpeed's code, not ours."""
    from deepspeed.utils import zero_to_fp32 as z

    original = z.parse_optim_states

    def parse(files, directory):
        import torch

        stage, world, fp32_groups, paddings = original(files, directory)
        states = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]
        return stage, world, [groups_of(sd, fp32) for sd, fp32 in zip(states, fp32_groups)], paddings

    z.parse_optim_states = parse
    try:
        return z.to_torch_tensor(z._get_fp32_state_dict_from_zero_checkpoint(ds_dir, False))
    finally:
        z.parse_optim_states = original


def _optimizer_groups(key: str):
    """The optimizer state ``key`` of each flat group, cut to that group's fp32 partition: ZeRO-1/2 keep
    torch's state_dict of the partition (padded) under ``base_optimizer_state``; ZeRO-3 under a nested
    ``optimizer_state_dict``, one torch parameter per flat sub-group, numbered in order."""

    def groups(sd: dict, fp32: list) -> list:
        base = sd.get("base_optimizer_state") or sd["optimizer_state_dict"]
        if isinstance(base, list):  # elastic: one lean dict per group
            return [g[key] for g in base]
        return [base["state"][i][key][:p.numel()] for i, p in enumerate(fp32)]

    return groups


def reference(variant: Path) -> None:
    """DeepSpeed's own view of the save, as plain tensors in ``reference.pt`` (a trusted file: we write it)."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = variant / "ckpt"
    ds_dir = str(ckpt / TAG)
    out = {"fp32": get_fp32_state_dict_from_zero_checkpoint(str(ckpt)),
           "exp_avg": _reconstruct(ds_dir, _optimizer_groups("exp_avg")),
           "exp_avg_sq": _reconstruct(ds_dir, _optimizer_groups("exp_avg_sq")),
           "module": {}}
    for f in sorted((ckpt / TAG).glob("*model_states.pt")):
        sd = torch.load(f, map_location="cpu", weights_only=False)
        out["module"][f.name] = {k: v for k, v in sd["module"].items() if isinstance(v, torch.Tensor)}
    torch.save(out, variant / "reference.pt")


def make(name: str, variant: Path) -> Path:
    """One variant from an empty folder: the torchrun save, then the reference in a fresh process."""
    from gloo_retry import RunFailed, run_ok

    stage, dtype, world = VARIANTS[name]
    variant.mkdir(parents=True, exist_ok=True)
    script = str(Path(__file__).resolve())
    try:
        run_ok([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", script,
                "--train", str(variant / "ckpt"), str(stage), dtype], timeout=RUN_TIMEOUT)
        run_ok([sys.executable, script, "--reference", str(variant)], timeout=RUN_TIMEOUT)
    except RunFailed as exc:  # say why (the retry reports only the exit code)
        print(exc.proc.stdout[-2000:], exc.proc.stderr[-6000:], sep="\n", file=sys.stderr)
        raise
    return variant


def empty(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def make_all(root: Path) -> dict[str, Path]:
    """Every variant under ``root``, each made once (a ``.NAME.done`` marker lets a kept root be reused)."""
    from gloo_retry import retry_gloo

    paths = {}
    for name in VARIANTS:
        target = root / name
        marker = root / f".{name}.done"
        if not marker.exists():
            retry_gloo(lambda target=target: empty(target), lambda out, name=name: make(name, out),
                       name=f"make_deepspeed_fixtures: {name}")
            marker.write_text("ok")
        paths[name] = target
    return paths


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if sys.argv[1] == "--train":
        train(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "--reference":
        reference(Path(sys.argv[2]))
    else:
        try:
            make_all(Path(sys.argv[1]))
        except subprocess.CalledProcessError as exc:
            sys.exit(f"failed: {exc}")
