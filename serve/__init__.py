"""Online stage: the inference engine, adapter pool, orchestrator and the RPyC service."""
