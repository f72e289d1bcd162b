#!/usr/bin/env bash
# The GPU verification of docs/gpu.md as one script, for a machine with an NVIDIA GPU.
#
# Run from the repository root with a Python that has a CUDA build of torch and CuPy:
#   PYTHON=python3 tools/gpu_verify.sh
# Wheels in .whl/ (optree, mpi4py, mpich, ... for that Python) are installed first, offline.
# Steps run in order of importance until BUDGET seconds (default 450) have passed; each is cut at
# its own limit; ONLY (a bash regex) runs the steps whose names match it. Everything goes to
# $OUT/verify.log (or gpu-logs/), one line a step to summary.txt.
set -u
LOG=${OUT:-gpu-logs}
mkdir -p "$LOG"
PY=${PYTHON:-python3}
DEADLINE=$(($(date +%s) + ${BUDGET:-450}))
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false MPIEXEC_TIMEOUT=240

step() {  # step NAME LIMIT COMMAND...: run COMMAND, cut at LIMIT or at the deadline
    local name=$1 limit=$2 left start rc
    shift 2
    if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then return; fi
    left=$((DEADLINE - $(date +%s)))
    if [ "$left" -lt 20 ]; then
        echo "$name: not run (budget spent)" | tee -a "$LOG/summary.txt"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "===== $name (limit ${limit}s): $*" >>"$LOG/verify.log"
    start=$(date +%s)
    timeout -k 5 "$limit" "$@" >>"$LOG/verify.log" 2>&1
    rc=$?
    echo "$name: rc=$rc in $(($(date +%s) - start))s" | tee -a "$LOG/summary.txt"
}

step environment 60 bash -c "nvidia-smi -L; nproc --all; lscpu | grep -i 'model name'; $PY - <<'EOF'
import sys, torch
print(sys.version)
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())
try:
    import cupy
    from cupy.cuda import nccl
    print('cupy', cupy.__version__, cupy.cuda.runtime.getDeviceCount(), 'nccl', nccl.get_version())
except Exception as e:
    print('cupy/nccl:', type(e).__name__, e)
try:
    import jax
    print('jax', jax.__version__, jax.devices())
except Exception as e:
    print('jax:', type(e).__name__, e)
EOF"
if ls .whl/*.whl >/dev/null 2>&1; then
    step wheels 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --force-reinstall .whl/*.whl
fi
MPIEXEC=$("$PY" -c 'import pathlib, sys; print(pathlib.Path(sys.executable).with_name("mpiexec"))')
step nccl-reason 30 "$PY" -c "
from mpi4py import MPI
print(MPI.Get_library_version().splitlines()[0])
from dataparallel.backends import nccl, mpi
print('nccl unavailable because:', nccl.unavailable_reason())
print('cuda-aware MPI:', mpi.detect_cuda_aware(MPI))"

# --matrix=full: every case of the `matrix` tests in each world (the suite samples them outside
# MPI at 2 ranks), so the device families meet every dtype and op here. A world of one runs under
# pytest-xdist where the image has it (8 workers sharing the GPU).
GPU_TESTS=(tests/test_cuda.py tests/test_nccl.py tests/test_cuda_training.py)
XDIST=()
# pytest-benchmark (in some images) warns under xdist, an error under the suite's -W error.
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8 -p no:benchmark)
step one-rank 150 "$PY" -m pytest -q -rs "${XDIST[@]}" --matrix=full "${GPU_TESTS[@]}" tests/test_collectives.py tests/test_world.py
step mpi-2-training 90 "$MPIEXEC" -n 2 "$PY" -m pytest -q -rs --matrix=full tests/test_cuda_training.py
step gloo-2 120 "$PY" -m dataparallel run -n 2 --backend gloo --timeout 110 \
    -m pytest -q -rs --matrix=full tests/test_cuda.py tests/test_cuda_training.py
step mpi-2 150 "$MPIEXEC" -n 2 "$PY" -m pytest -q -rs --matrix=full tests/test_cuda.py tests/test_nccl.py tests/test_collectives.py
# Scaling on the CPU cores (docs/performance.md): the transformer step at SCALING_RANKS ranks, one
# torch thread each, dp (MPI) beside DDP (Gloo) in the same processes; the GPU hidden so that no
# rank makes a CUDA context. d=256 at 12 ranks took 78 s on an H200 machine's 16 cores.
# (`nproc --all`: plain nproc honours OMP_NUM_THREADS.)
step scaling 300 bash -c "for n in ${SCALING_RANKS:-2 4 8 12}; do \
    [ \$n -le \$(nproc --all) ] || continue; echo \"=== \$n ranks\"; \
    CUDA_VISIBLE_DEVICES= timeout 100 $MPIEXEC -n \$n $PY benchmarks/train_step.py \
    --models transformer --d ${SCALING_D:-256} --rounds ${SCALING_ROUNDS:-5}; done"
step jax-gpu-one-rank 90 "$PY" -m pytest -q -rs "${XDIST[@]}" --matrix=full tests/test_collectives_trees.py tests/test_optax.py tests/test_optax_sharded.py
step bench-mpi-2 150 "$MPIEXEC" -n 2 "$PY" benchmarks/gpu.py --d 512,1024 --rounds 6
step bench-nccl-1 60 "$PY" benchmarks/gpu.py --backend nccl --no-step
