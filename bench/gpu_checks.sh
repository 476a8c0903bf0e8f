#!/usr/bin/env bash
# The GPU checks bench/RESULTS.md still lacks, each under its own time limit, so that a short lease
# of one GPU measures them in one or two calls of at most ten minutes.
#
# On the GPU machine, from the repository root. Its image has CUDA torch but not msgspec or
# gymnasium: bring them as wheels in .whl (ignored by git), fetched where pip reaches PyPI:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl msgspec gymnasium farama-notifications
# Then `bash bench/gpu_checks.sh [CHECK ...]` (default: lora mfu compile, about 8.5 minutes at most;
# then `full recompute`). The log goes to $OUT/gpu_checks.log, or runs/gpu_checks/.
#
#   lora       RL steps of a Qwen3-4B-shaped model with LoRA rank 8, engine and trainer on the GPU:
#              fit, step and sync time (bench/gpu_rl_step.py).
#   mfu        trainer MFU at Qwen2.5-0.5B's shape, bf16: the fused head against whole logits, and
#              one step's top kernels (bench/train.py --profile).
#   compile    the same, fused head, with torch.compile'd decoder blocks.
#   full       the largest Qwen3 shape that trains in full, with activation checkpointing.
#   recompute  MFU with activation checkpointing and twice the micro-batch.
set -u
out=${OUT:-runs/gpu_checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site || exit 1
fi
# The image's torch is not the pinned CPU wheel: install toolgym without resolving its pins.
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1

check() {
    local limit=$1
    shift
    echo "== $* (limit ${limit} s), $(date -u +%H:%M:%S)"
    timeout "$limit" "$@"
    echo "== rc $?"
}

mfu=(python3 bench/train.py --device cuda --models qwen2.5-0.5b --precisions bf16 --procs 1 --seq-len 1024
    --episodes 64)
[ $# -gt 0 ] || set -- lora mfu compile
{
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    git log -1 --format='commit %h %cd' 2>/dev/null
    for name in "$@"; do
        case $name in
            lora) check 240 python3 bench/gpu_rl_step.py --rows qwen3-4b:8 --steps 2 --out "$out/lora" ;;
            mfu) check 150 "${mfu[@]}" --micro-batch-tokens 16384 --heads fused,logits --profile ;;
            compile) check 120 "${mfu[@]}" --micro-batch-tokens 16384 --compile on ;;
            full) check 300 python3 bench/gpu_rl_step.py --rows --full-fit --steps 1 --out "$out/full" \
                --set trainer.activation_checkpointing=true ;;
            recompute) check 150 "${mfu[@]}" --micro-batch-tokens 32768 --recompute off,on ;;
            *) echo "unknown check $name (lora, mfu, compile, full, recompute)" ;;
        esac
    done
} 2>&1 | tee "$out/gpu_checks.log"
