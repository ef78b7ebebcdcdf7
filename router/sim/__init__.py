"""A simulated inference engine, calibrated to the field note, speaking vLLM's API."""
