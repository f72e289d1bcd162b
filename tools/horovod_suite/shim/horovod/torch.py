"""`horovod.torch` is `dataparallel.horovod.torch`, the same module object."""

import sys

import dataparallel.horovod.torch as _drop_in

sys.modules[__name__] = _drop_in
