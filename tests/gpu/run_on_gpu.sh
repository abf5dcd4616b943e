#!/bin/bash
# The GPU check, run on a lent CUDA machine from the repository root (CI never has a GPU):
#   device run: bash tests/gpu/run_on_gpu.sh   (carry .whl holding the project's wheel)
# 1. `shardscope train --device cuda` (nccl) with FSDP2 and DDP, stopped and resumed; report()'s CUDA memory
# 2. an FSDP1 checkpoint (dcp.save of FULL sharded state) inspected, verified, exported and compared
set -u
export PYTHONUNBUFFERED=1
W=${OUT:-/tmp}/gpu; mkdir -p $W
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/shardscope-*.whl || exit 3
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name())"
S="python3 -m shardscope.app.cli"
step() { echo; echo "### $*"; }
step train FSDP2 on cuda, 1 rank, nccl
$S train --device cuda --nproc 1 --steps 20 --checkpoint-every 10 --run-dir /tmp/r1 2>&1 | tail -4; echo rc=${PIPESTATUS[0]}
step the run record: last metrics line of rank 0
tail -1 /tmp/r1/metrics/rank_0.jsonl
$S runs 2>&1 | tail -3
step resume from step 10 on cuda
$S train --device cuda --nproc 1 --steps 20 --resume /tmp/r1/checkpoints/step_000010 --run-dir /tmp/r2 2>&1 | tail -3; echo rc=${PIPESTATUS[0]}
step train DDP on cuda
$S train --device cuda --strategy ddp --nproc 1 --steps 10 --checkpoint-every 10 --run-dir /tmp/r3 2>&1 | tail -2; echo rc=${PIPESTATUS[0]}
tail -1 /tmp/r3/metrics/rank_0.jsonl
step inspect, verify, export, diff the cuda-written FSDP2 checkpoint
$S inspect /tmp/r1/checkpoints/step_000020 2>&1 | head -8
$S verify --deep /tmp/r1/checkpoints/step_000020 2>&1 | tail -2; echo rc=$?
$S export /tmp/r1/checkpoints/step_000020 /tmp/r1/m.pt --format torch 2>&1 | tail -2
$S diff /tmp/r1/checkpoints/step_000020 /tmp/r1/m.pt 2>&1 | tail -2; echo diff rc=${PIPESTATUS[0]}
step FSDP1 checkpoint on cuda with nccl
mkdir -p /tmp/f1
torchrun --standalone --nproc-per-node 1 tests/gpu/fsdp1_save.py /tmp/f1 2>&1 | grep -v Warning | tail -5
tail -1 /tmp/f1/report_run/metrics/rank_0.jsonl
$S inspect /tmp/f1/ckpt 2>&1 | head -8
$S verify --deep /tmp/f1/ckpt 2>&1 | tail -2
$S export /tmp/f1/ckpt /tmp/f1/model.safetensors --only model --strip-prefix model. 2>&1 | tail -2
python3 tests/gpu/compare_export.py /tmp/f1; echo compare rc=$?
$S diff /tmp/f1/ckpt /tmp/f1/torch_ref.pt 2>&1 | tail -2; echo diff rc=${PIPESTATUS[0]}
echo done1
step FSDP1 sharded over 2 ranks on the one GPU '(gloo)'
mkdir -p /tmp/f2
FSDP1_BACKEND=gloo torchrun --standalone --nproc-per-node 2 tests/gpu/fsdp1_save.py /tmp/f2 2>&1 | grep -E "^(fsdp1|report|Traceback|[A-Za-z]*Error)" | head -8
$S inspect /tmp/f2/ckpt 2>&1 | sed -n '6,12p'
$S verify --deep /tmp/f2/ckpt 2>&1 | tail -2
$S export /tmp/f2/ckpt /tmp/f2/model.safetensors --only model --strip-prefix model. 2>&1 | tail -1
python3 tests/gpu/compare_export.py /tmp/f2; echo compare rc=$?
$S diff /tmp/f2/ckpt /tmp/f2/torch_ref.pt 2>&1 | tail -1; echo diff rc=${PIPESTATUS[0]}
echo done2
step a .pt saved from CUDA tensors: listed without torch.load, exported and imported
mkdir -p /tmp/c && python3 tests/gpu/cuda_pt.py /tmp/c 2>&1 | grep -v "Warning\|return func"; echo cuda_pt rc=${PIPESTATUS[0]}
echo done3
