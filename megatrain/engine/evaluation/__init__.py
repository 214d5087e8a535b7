"""Evaluation of what we train: lm-evaluation-harness tasks over the engine (lm.EngineLM)."""
