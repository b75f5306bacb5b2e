"""How mtask connects: pymongo clients made from a URI, with a workaround for a socket
pymongo leaks on a cancelled connect."""
