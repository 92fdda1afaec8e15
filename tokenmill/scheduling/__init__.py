"""Step scheduling (continuous batching); later the dataset planner and replica dispatch."""
