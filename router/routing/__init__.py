"""Who sent a request and where it is served best: classification, clients, policy."""
