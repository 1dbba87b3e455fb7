"""Worker processes: bootstrap, the job runner, heartbeats, the local launcher, the CLI."""
