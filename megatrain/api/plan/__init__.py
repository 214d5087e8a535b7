"""/v1/plan: the layout planner (megatrain.plan.planner) behind the API, creating nothing."""
