"""The HTTP control plane: `megatrain.api.app.create_app`, organised by domain (jobs, checkpoints,
keys, spec, health), each with a thin router, schemas and service."""
