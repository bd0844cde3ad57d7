"""Execution of a compiled loss: the chunked row-kernel driver and the autograd
``Function`` (``chunked``), and the staged schedules and their choice (``staged``)."""
