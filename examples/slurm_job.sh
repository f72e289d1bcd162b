#!/bin/bash
# A Slurm batch job of 2 tasks: `sbatch examples/slurm_job.sh`, from the repository's root, with
# dataparallel installed (the `dataparallel` command on PATH). See docs/slurm.md.
#SBATCH --job-name=dp-tour
#SBATCH --ntasks=2
#SBATCH --time=00:10:00
#SBATCH --output=%x-%j.out

# No -n: `dataparallel run` starts one rank per task of the allocation (MPI by default; add
# --backend gloo to start them through srun with Gloo).
dataparallel run examples/collectives_tour.py
