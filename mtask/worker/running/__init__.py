"""Running a claimed task, from its claimed document to its recorded outcome (River's executor
and completer).

The claim side sees this wing through one protocol (``protocols.RunStarter``); its parts are
made by ``mtask.worker.assembly``. ``docs/architecture.md`` follows one run through it.
"""
