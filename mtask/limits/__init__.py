"""Flow control's rules, pure: cluster-wide limits per name, group and shared resource,
their slots, back-off holds, snoozes and batch handlers. Their writes live in ``mtask.store``;
the claim-time decisions in ``mtask.worker.claiming``."""
