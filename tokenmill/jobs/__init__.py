"""Job spec, runner, checkpoint manifest, CLI and submit() (the job runner issue)."""
