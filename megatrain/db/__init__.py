"""SQLAlchemy 2.0 models, engine/session handling and the job state machine."""
