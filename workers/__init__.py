"""Worker processes: bootstrap, the job runner, health checks, the scaler, the launcher, the CLI."""
