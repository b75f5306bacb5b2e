"""One relay for every worker of a tasks collection, on any host (``--stream shared``).

The relay's side: ``relay`` (its lease, its one stream, its subscribers), ``dispatch`` and
``credit`` (one subscriber a due task, by credit), ``host_queue`` (the claim queue of every
subscriber), ``channels``, ``mailbox`` and ``wire`` (what goes through MongoDB, and what it
says). Every worker's side: ``subscriber``.
"""
