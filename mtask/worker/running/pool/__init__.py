"""The process pool for isolated handlers: the pool in the worker, the child's side, and the
pipe between them (each message named once, in ``pipe``)."""
