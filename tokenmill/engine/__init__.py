"""The inference engine. Kept import-free so pure-Python parts load without torch."""
