"""Rollout server: gRPC service, generation engines (JAX, SGLang), workflows, weight intake."""
