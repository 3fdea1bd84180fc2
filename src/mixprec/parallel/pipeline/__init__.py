"""Pipeline parallelism: the schedule (1F1B / GPipe over torch.distributed), the per-stage
optimizer, splitting a model into stages, and stage checkpoints."""
