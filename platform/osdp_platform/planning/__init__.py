"""Recipe -> plan: `local` plans in this process (the `plan` command, the GPU check); `sample_worker`
runs the same planner in an actor placed like one training worker, so profiling sees its hardware."""
