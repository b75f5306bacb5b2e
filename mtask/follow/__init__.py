"""Following what happens: the events of the tasks collection, change streams with resume
tokens, waiting for a task's outcome, and a run's streamed output."""
