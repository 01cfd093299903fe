"""Capacity planning: GPU catalog, step-time cost model, simulation over the real scheduler, the plan table."""
