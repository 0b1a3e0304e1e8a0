"""Harnesses that run the library on several local processes and compare with one process: used by the
test suite and by ``dsv3 bench ep``. Not needed to train or serve."""
