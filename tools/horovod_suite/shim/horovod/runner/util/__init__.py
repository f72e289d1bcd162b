"""The parts of `horovod.runner.util` that Horovod's test helpers import."""
