"""What the `dataparallel` command runs: `cli`, the launchers (`mpi`, `spawn`, `slurm`), `runner`.

Nothing is imported here, so `python -m dataparallel.launch.runner` loads only what a rank needs.
"""
