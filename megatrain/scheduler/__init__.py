"""Layout planning (pure), the scheduling loop, placement and reconciliation."""
