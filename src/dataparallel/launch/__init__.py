"""What the `dataparallel` command runs: the MPI and Gloo launchers, the per-rank runner, `info`.

Nothing is imported here, so `python -m dataparallel.launch.runner` loads only what a rank needs.
"""
