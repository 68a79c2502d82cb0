"""Test oracles: models of what the engine's state should be, checked against the real one."""
