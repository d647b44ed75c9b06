"""MLflow: what a run records (runs), writes kept on disk while the server is away (pending), runs side by
side (compare) and the plan's explanation as tables and charts (report)."""
