"""Readers, writers, fsspec storage and atomic commit (the job runner issue)."""
