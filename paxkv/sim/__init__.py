"""Host-only research tools: request traces, model-free engine simulation, the memory
planner and the tiny model's held-out evaluation windows. None of them imports JAX."""
