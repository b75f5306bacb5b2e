"""How mtask connects: pymongo clients made from a URI, with workarounds for a socket pymongo
leaks on a cancelled connect and for a lock its cancelled condition waits can leave held on
Python 3.11."""
