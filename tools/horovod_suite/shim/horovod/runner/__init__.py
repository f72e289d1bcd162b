"""The parts of `horovod.runner` that Horovod's test helpers import."""
