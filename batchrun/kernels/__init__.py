"""Paged-attention kernels, imported as `batchrun.kernels`; reference.py is the pure-torch path."""
