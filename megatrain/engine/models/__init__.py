"""Plain single-device model definitions; parallelism is applied to them from outside."""
