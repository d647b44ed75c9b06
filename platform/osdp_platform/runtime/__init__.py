"""What runs in a Ray Train worker: build the model (models, meta_init), apply the plan (apply), train
(step, worker), checkpoint (checkpoint) and report to the driver (inbox). Imports neither the driver nor
tracking: a worker never loads MLflow."""
