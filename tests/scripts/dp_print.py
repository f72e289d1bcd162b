"""dp.print one line from every rank."""

import dataparallel as dp

dp.initialize()
dp.print("hello from", dp.rank())
dp.finalize()
