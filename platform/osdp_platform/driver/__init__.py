"""The driver: the `osdp-platform` command, submit and sweep, the connection to Ray (cluster, remote),
resume from an MLflow run, and the pump that moves the workers' reports into MLflow."""
