"""tokenmill inside other systems' pipelines: Ray Data (``ray_data``)."""
