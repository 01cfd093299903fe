"""What a step costs and how a job's steps unfold, below both the job runner (its ETA) and the planner: the GPU
catalog, the step-time models (roofline and fitted) and the simulator that runs the real scheduler over them."""
