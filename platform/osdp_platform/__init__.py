"""osdp-platform: recipes in, OSDP-planned FSDP2 training on Ray out, tracked in MLflow.

The folders are the pipeline, in the order a run passes them:

    recipe/    what a user declares: the schema, the YAML loader, the pre-flight checks
    planning/  recipe -> plan, in this process or on a sample worker (the planner actor)
    runtime/   what runs in a Ray Train worker: build the model, apply the plan, train, checkpoint
    driver/    the CLI, submit, sweep, the cluster and the Jobs API: starts the rest and waits on it
    tracking/  MLflow: every run's tags, params, metrics and artifacts, and the reads for compare

The one-way rule: runtime never imports driver or tracking, so a worker loads neither MLflow nor
Ray's Jobs client; what a worker reports goes through the inbox actor (runtime/inbox.py) to the
driver, which writes MLflow (driver/pump.py). tests/platform/test_import_rule.py holds the rule.
"""

__version__ = "0.1.0"
