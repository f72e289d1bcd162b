"""Horovod's API over dataparallel: change one import line and keep the script.

`import dataparallel.horovod.torch as hvd` gives Horovod 0.28's public PyTorch API by name and
meaning (`docs/horovod.md` lists what differs). It is a thin layer: every call hands over to
dataparallel's own API (`dp.allreduce`, `dp.DistributedOptimizer`, `dp.new_group`, `dp.join`,
...), so a Horovod script gains what dataparallel does (pip install, a failing rank ends the job,
mismatch errors that name ranks and leaves) without a line of it written twice.
"""
