"""Where a run runs and what it builds there: device, launch environment, the build plan, Megatron-Core on a CPU,
the supported releases, the device guard."""
