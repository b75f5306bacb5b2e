"""Why a task is where it is: the derived states and their one-sentence reasons, the words
they use, and tracebacks kept short. Pure functions of documents; ``mtask.store.cluster`` reads
for them."""
