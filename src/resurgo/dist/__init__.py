"""Coordination over torch.distributed (gather plans, barrier, broadcast); a no-op in one process."""
